"""stencild from another language: a Node.js client (@grpc/grpc-js, the
repository's protos loaded at run time by @grpc/proto-loader) drives every
service of `stencild serve` as the README's grpcurl examples do, and reads
the errors' machine-readable details. `make setup` installs the two packages
from npm; without node or them the test is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .helpers import REPO_ROOT, ServeProcess

NODE_MODULES = REPO_ROOT / ".tools" / "node_modules"
CLIENT = Path(__file__).parent / "node" / "client.js"


def _google_protos() -> str:
    """The directory that holds google/rpc/status.proto (googleapis-common-protos ships it)."""
    import google.rpc.status_pb2 as status

    return str(Path(status.__file__).parents[2])


@pytest.mark.slow
def test_a_node_client_drives_every_service() -> None:
    node = shutil.which("node")
    if node is None or not (NODE_MODULES / "@grpc" / "grpc-js").is_dir() \
            or not (NODE_MODULES / "@grpc" / "proto-loader").is_dir():
        pytest.skip("node or its gRPC packages are missing (`make setup` installs them from npm)")
    # What `make serve` serves: the demo model, the embedding model and the demo speech pair.
    server = ServeProcess("--metrics-port", "0")
    try:
        protos = REPO_ROOT / "protos"
        env = {**os.environ, "NODE_PATH": str(NODE_MODULES), "STENCILD_ADDR": f"127.0.0.1:{server.port}",
               "STENCILD_PROTO_PATH": os.pathsep.join(
                   [str(protos), str(protos / "vllm"), str(CLIENT.parent), _google_protos()])}
        run = subprocess.run([node, str(CLIENT)], env=env, capture_output=True, text=True, timeout=300)
        report = run.stdout + run.stderr
        assert run.returncode == 0, report + "\nserver log:\n" + "".join(server.log[-40:])
        assert "all 12 checks passed" in report, report
    finally:
        server.kill()
