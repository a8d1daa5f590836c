"""Helpers for end-to-end tests: servers on a background event loop, stream helpers.

Servers are real (loopback ports, generated stubs), run in this process.

Tests talk to them with the generated stubs over real sockets; they look at the
engine only through `EngineLoop.call`, which runs on the engine thread between
steps, so what they see is consistent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from engine import EngineConfig, EngineCore
from engine.presets import ensure_preset
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.server import StencilServer

# Generous: the CI machine has 2 shared cores.
TIMEOUT = 60.0


class LoopThread:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = TIMEOUT) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class SlowModel:
    """Delegates to the real model, sleeping before each forward pass, so a
    request lasts long enough to be cancelled mid-stream on any machine."""

    def __init__(self, real: Any, delay_s: float):
        self._real = real
        self._delay_s = delay_s

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay_s)
        return self._real.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def engine_factory(preset: str = "tiny-llama", slow_s: float = 0.0, **config: Any) -> Callable[[], EngineCore]:
    path = ensure_preset(preset)
    config.setdefault("kv_cache_gib", 0.05)
    wrap = (lambda real: SlowModel(real, slow_s)) if slow_s else None
    return lambda: EngineCore(EngineConfig(model=str(path), **config), wrap_model=wrap)


class ServerHandle:
    """A StencilServer under test plus a client channel to it."""

    def __init__(self, runner: LoopThread, server: StencilServer):
        self.runner = runner
        self.server = server
        self.port: int = runner.run(server.start())
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def wait_ready(self) -> None:
        assert self.runner.run(self.server.wait_ready()), f"model failed to load: {self.server.load_error}"

    def engine_call(self, fn: Callable[[EngineCore], Any]) -> Any:
        loop = self.server.engine_loop
        assert loop is not None
        return self.runner.run(loop.call(fn))

    def pages_in_use(self) -> tuple[int, int]:
        """(pages referenced, requests holding pages), read on the engine thread."""
        return self.engine_call(lambda e: (e.allocator.num_used, e.kv_manager.num_active))

    def wait_no_pages(self, timeout: float = TIMEOUT) -> tuple[int, int]:
        """Poll until no page is referenced and no request holds pages."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.pages_in_use()
            if state == (0, 0) or time.monotonic() > deadline:
                return state
            time.sleep(0.02)

    def wait_pending(self, n: int, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.server.engine_loop.num_pending != n:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "requests never settled"
            time.sleep(0.02)

    @property
    def finished(self) -> dict[str, int]:
        return dict(self.server.engine_loop.stats.finished)  # type: ignore[union-attr]

    def drain(self, grace_s: float | None = None) -> Any:
        """Start a drain; returns a concurrent future that completes when stopped."""
        async def go() -> None:
            await self.server.drain(grace_s)
        return asyncio.run_coroutine_threadsafe(go(), self.runner.loop)

    def stop(self) -> None:
        self.channel.close()
        self.runner.run(self.server.stop())


def generate(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest,
             timeout: float = TIMEOUT) -> tuple[str, list[int], pb.GenerateComplete, list[pb.GenerateChunk]]:
    """Run a stream to its end: (text, token ids, the complete message, the chunks)."""
    chunks: list[pb.GenerateChunk] = []
    complete = None
    for msg in stub.Generate(req, timeout=timeout):
        assert complete is None, "nothing may follow the complete message"
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
        else:
            complete = msg.complete
    assert complete is not None, "the stream ended without a complete message"
    return ("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], complete, chunks)


def greedy(text: str | None = None, max_new_tokens: int = 16, **fields: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(**fields)
    if text is not None:
        req.text = text
    req.sampling.temperature = 0.0
    req.stopping.max_new_tokens = max_new_tokens
    return req
