"""A `stencild serve` subprocess for benchmarks that go through gRPC."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`stencild serve <serve_args>` on a free port, for the duration of a benchmark
    (`module`: what `python -m` runs, taking the same arguments)."""

    def __init__(self, serve_args: Sequence[str], module: str = "service.cli"):
        cmd = [sys.executable, "-m", module, "serve", "--port", "0", *serve_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.port: int | None = None
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if self.port is None and (m := re.search(r"listening on [^ ]+:(\d+)", line)):
                    self.port = int(m.group(1))
                    found.set()
                elif "ERROR" in line or "Traceback" in line:
                    sys.stderr.write("[server] " + line)

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(120):
            self.stop()
            raise SystemExit("the server did not start")

    def wait_serving(self, address: str, service: str = "", timeout: float = 300.0) -> None:
        """Block until health reports SERVING for `service` ("" = the whole server)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout
            check = health_pb2.HealthCheckRequest(service=service)
            while health.Check(check).status != health_pb2.HealthCheckResponse.SERVING:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("the server never became SERVING")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
