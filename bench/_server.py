"""A `stencild serve` subprocess for benchmarks that go through gRPC, and its engine's step metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`stencild serve <serve_args>` on a free port, for the duration of a benchmark
    (`module`: what `python -m` runs, taking the same arguments)."""

    live: set[ServerProcess] = set()  # started and not yet stopped (stop_all)

    def __init__(self, serve_args: Sequence[str], module: str = "service.cli", start_timeout: float = 120.0):
        cmd = [sys.executable, "-m", module, "serve", "--port", "0", *serve_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        ServerProcess.live.add(self)
        self.port: int | None = None
        self.tail: deque[str] = deque(maxlen=40)  # its last lines, for a server that fails to start
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.tail.append(line)
                if self.port is None and (m := re.search(r"listening on [^ ]+:(\d+)", line)):
                    self.port = int(m.group(1))
                    found.set()
                elif "error" in line.lower() or "Traceback" in line:
                    sys.stderr.write("[server] " + line)

        threading.Thread(target=pump, daemon=True).start()
        # A server that exits (a bad flag, a crash at start-up) is reported at
        # once, with its last lines, not after the whole wait.
        deadline = time.monotonic() + start_timeout
        while not found.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                exited = self.proc.poll()
                self.stop()
                time.sleep(0.2)  # the pump's last lines
                why = f"exited with status {exited}" if exited is not None else \
                    f"did not listen within {start_timeout:g} s"
                raise SystemExit(f"the server {why}; its last lines:\n" + "".join(self.tail))

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
        ServerProcess.live.discard(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @classmethod
    def kill_all(cls) -> None:
        """Kill every server still running (a benchmark cut short)."""
        for server in list(cls.live):
            cls.live.discard(server)
            if server.proc.poll() is None:
                server.proc.kill()


def free_port() -> int:
    """A TCP port nothing listens on now (for a server's metrics endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class EngineSteps:
    """The server's engine steps so far, and its threads' CPU seconds, from its Prometheus metrics."""

    steps: float
    seconds: float
    requests: float  # summed over steps: requests per step x steps
    cpu: dict[str, float] = field(default_factory=dict)  # by thread: event_loop, engine_0, ...

    def since(self, earlier: EngineSteps) -> EngineSteps:
        return EngineSteps(self.steps - earlier.steps, self.seconds - earlier.seconds,
                           self.requests - earlier.requests,
                           {k: v - earlier.cpu.get(k, 0.0) for k, v in self.cpu.items()})

    def cpu_ms_per_step(self) -> dict[str, float]:
        return {k: round(1e3 * v / self.steps, 3) for k, v in self.cpu.items()} if self.steps else {}

    def describe(self) -> str:
        if not self.steps:
            return "no engine steps"
        text = (f"{self.steps:.0f} engine steps, {1e3 * self.seconds / self.steps:.2f} ms a step, "
                f"{self.requests / self.steps:.1f} requests a step")
        if self.cpu:
            text += "; CPU ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in self.cpu_ms_per_step().items())
        return text


def engine_steps(metrics_port: int) -> EngineSteps:
    """Read `stencil_engine_step_seconds` and `stencil_engine_batch_size` (summed
    over the server's engines) and `stencil_thread_cpu_seconds` (by thread) from
    http://127.0.0.1:PORT/metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("stencil_engine_step_seconds_count", "stencil_engine_step_seconds_sum",
                               "stencil_engine_batch_size_sum"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
            elif sample.name == "stencil_thread_cpu_seconds_total":
                cpu[sample.labels["thread"]] = sample.value
    return EngineSteps(values.get("stencil_engine_step_seconds_count", 0.0),
                       values.get("stencil_engine_step_seconds_sum", 0.0),
                       values.get("stencil_engine_batch_size_sum", 0.0), cpu)
