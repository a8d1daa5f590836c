"""deploy/: every manifest parses, and its ports, probes, flags and grace period
agree with what `stencild serve` actually does; the Dockerfile is read, not built."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.api.embeddings import SERVICE_NAME as EMBEDDINGS_SERVICE
from service.api.generation import SERVICE_NAME as GENERATION_SERVICE
from service.api.speech import SERVICE_NAME as SPEECH_SERVICE
from service.cli import build_parser
from service.ops.health import OVERALL_HEALTH

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
HEALTH_SERVICES = {OVERALL_HEALTH, GENERATION_SERVICE, EMBEDDINGS_SERVICE, SPEECH_SERVICE}


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def _one(kind: str) -> dict[str, Any]:
    [doc] = [d for d in _docs() if d["kind"] == kind]
    return doc


def _serve_args(container: dict[str, Any]) -> Any:
    """The container's arguments as `stencild serve` parses them (unknown flags fail)."""
    return build_parser().parse_args(["serve", *container.get("args", [])])


def _container() -> dict[str, Any]:
    [container] = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_parses_and_kustomize_lists_it() -> None:
    files = sorted(p.name for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    kinds = {d["kind"] for d in _docs()}
    assert {"Deployment", "Service", "InferencePool", "Kustomization"} <= kinds
    listed = _one("Kustomization")["resources"]
    assert sorted(listed) == [f for f in files if f != "kustomization.yaml"]


def test_deployment_ports_and_probes_match_the_cli() -> None:
    container = _container()
    args = _serve_args(container)
    defaults = build_parser().parse_args(["serve"])
    assert (args.port, args.metrics_port) == (defaults.port, defaults.metrics_port) == (50051, 9090)
    assert args.host == "0.0.0.0", "reachable from outside the pod"
    assert args.metrics_host is None, "metrics bind --host too"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        grpc_probe = container[probe]["grpc"]
        assert grpc_probe["port"] == args.port, probe
        assert grpc_probe.get("service", "") in HEALTH_SERVICES, probe
    assert container["readinessProbe"]["grpc"]["service"] == GENERATION_SERVICE
    annotations = _one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_sigterm_grace_outlasts_the_drain() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]
    args = _serve_args(_container())
    assert pod["terminationGracePeriodSeconds"] > args.grace_period + 5


def test_resources_and_non_root() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]
    container = _container()
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/home/stencild/.cache" in mounts, "the cache (kernels, demo models) is writable"


def test_service_and_inference_pool_select_the_pods() -> None:
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")["spec"]
    assert service["selector"].items() <= labels.items()
    by_name = {p["name"]: p for p in service["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert by_name["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    for name, port in by_name.items():
        assert port["targetPort"] in container_ports and port["port"] == container_ports[name]
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [container_ports["grpc"]]
    assert pool["spec"]["endpointPickerRef"]["name"]


def _dockerfile(name: str = "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile(name: str) -> None:
    steps = _dockerfile(name)
    assert steps[0][0] == "FROM" and "python:3.11" in steps[0][1]
    users = [arg for word, arg in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    entry = yaml.safe_load([arg for word, arg in steps if word == "ENTRYPOINT"][-1])
    assert entry[:2] == ["stencild", "serve"]
    cmd = yaml.safe_load([arg for word, arg in steps if word == "CMD"][-1])
    args = build_parser().parse_args(["serve", *entry[2:], *cmd])
    # The serving flags survive arguments given to `docker run` (they replace CMD).
    user = build_parser().parse_args(["serve", *entry[2:], "--model", "/models/m"])
    assert (user.host, user.port, user.device) == ("0.0.0.0", args.port, args.device)
    exposed = {int(p) for word, arg in steps if word == "EXPOSE" for p in arg.split()}
    assert exposed == {args.port, args.metrics_port}
    if name == "Dockerfile.cuda":
        assert args.device == "cuda" and args.gpu_memory_utilization
        install = " ".join(arg for word, arg in steps if word == "RUN")
        assert "--index-url https://pypi.org/simple" in install, "the CUDA build of torch, from PyPI"
    else:
        install = " ".join(arg for word, arg in steps if word == "RUN")
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install, "torch's CPU build"
    # What `make setup` installs: the Makefile's torch pin first, then the project.
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH\s*:=\s*(\S+)", makefile, re.M)
    assert pin is not None
    assert f"ARG TORCH={pin.group(1)}" in {f"{w} {a}" for w, a in steps}
    runs = " ".join(arg for word, arg in steps if word == "RUN")
    assert runs.index('"$TORCH"') < runs.index("-e \".[otel]\"")
    assert "g++" in shlex.split(runs), "the CPU kernels compile on first use"
    copied = {arg.split()[0] for word, arg in steps if word == "COPY"}
    assert {"engine", "grammar", "service", "pyproject.toml"} <= copied


@pytest.mark.parametrize("name", ["deployment.yaml", "service.yaml", "inferencepool.yaml"])
def test_manifests_name_their_api(name: str) -> None:
    for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()):
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]
