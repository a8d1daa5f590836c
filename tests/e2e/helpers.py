"""Helpers for end-to-end tests: servers on a background event loop, stream helpers.

Servers are real (loopback ports, generated stubs), run in this process.

Tests talk to them with the generated stubs over real sockets; they look at the
engine only through `EngineLoop.call`, which runs on the engine thread between
steps, so what they see is consistent.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np

from engine import EngineConfig, EngineCore
from engine.executor import StepExecutor
from engine.presets import ensure_preset
from service.address import host_port
from service.api.speech import SpeechEngineFactory
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.gen.stencil.v1 import speech_pb2, speech_pb2_grpc
from service.server import StencilServer

# Generous: the CI machine has 2 shared cores.
TIMEOUT = 60.0
REPO_ROOT = Path(__file__).resolve().parents[2]


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
    request lasts long enough to be cancelled mid-stream on any machine.
    `delay_s` may be changed while the engine runs (0: no sleep)."""

    def __init__(self, real: Any, delay_s: float):
        self._real = real
        self.delay_s = delay_s

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self._real.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def pages_held(engine: EngineCore) -> tuple[int, int]:
    """(pages referenced, requests holding pages): module-level, so that an
    engine in an engine process can be asked too (a call's function is pickled)."""
    return engine.allocator.num_used, engine.kv_manager.num_active


def slow_forward() -> None:
    """An engine process's setup: every forward pass sleeps 20 ms first, so a
    request lasts long enough to be cancelled, or its engine killed, mid-stream."""
    from engine.models.llama import LlamaFamilyModel

    forward = LlamaFamilyModel.forward

    def slow(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return forward(self, *args, **kwargs)

    LlamaFamilyModel.forward = slow  # type: ignore[method-assign]


def unpicklable_answer(engine: EngineCore) -> Any:
    """An engine call whose answer cannot be pickled back to the server."""
    return threading.Lock()


def answer_only_the_engine_process_can_read(engine: EngineCore) -> Any:
    """An engine call whose answer is of a class only the engine process has
    (the server cannot unpickle it)."""
    module = types.ModuleType("stencild_engine_process_only")
    exec("class Thing:\n    pass\n", module.__dict__)  # noqa: S102 - a fixed class body
    sys.modules[module.__name__] = module
    return module.Thing()


def process_factory(preset: str = "tiny-llama", setup: tuple[str, ...] = (),
                    **config: Any) -> Callable[[], EngineCore]:
    """An engine in an engine process (`stencild serve --engine-process`), warmed up
    without a grammar; `setup`: "module:function" hooks it calls first."""
    from service.engine_proc import EngineProcessSpec, RemoteEngine

    config.setdefault("kv_cache_gib", 0.05)
    spec = EngineProcessSpec(EngineConfig(model=str(ensure_preset(preset)), **config), warmup_grammar=False,
                             setup=setup, log_level="WARNING")
    return lambda: cast(EngineCore, RemoteEngine(spec))


def engine_factory(preset: str = "tiny-llama", slow_s: float = 0.0, **config: Any) -> Callable[[], EngineCore]:
    path = ensure_preset(preset)
    config.setdefault("kv_cache_gib", 0.05)
    wrap = (lambda real: SlowModel(real, slow_s)) if slow_s else None
    return lambda: EngineCore(EngineConfig(model=str(path), **config), wrap_model=wrap)


def speech_factory(preset: str = "demo-speech", codec: str = "tiny-codec",
                   **config: Any) -> SpeechEngineFactory:
    """A separate speech engine; its model is a SlowModel (delay 0) that a test may slow down."""
    path, codec_path = ensure_preset(preset), ensure_preset(codec)
    config.setdefault("kv_cache_gib", 0.05)
    engine_config = EngineConfig(model=str(path), speech_codec=str(codec_path), **config)

    def build(executor: StepExecutor | None) -> EngineCore:
        return EngineCore(engine_config, wrap_model=lambda real: SlowModel(real, 0.0), executor=executor)

    return build


def reachable(host: str) -> str:
    """The address a client on this machine reaches a server bound to `host` at."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)


class ServerHandle:
    """A StencilServer under test plus a client channel to it."""

    def __init__(self, runner: LoopThread, server: StencilServer):
        self.runner = runner
        self.server = server
        self.port: int = runner.run(server.start())
        self.address = host_port(reachable(server.config.host), self.port)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.speech_stub = speech_pb2_grpc.SpeechStub(self.channel)

    def wait_ready(self) -> None:
        assert self.runner.run(self.server.wait_ready()), f"model failed to load: {self.server.load_error}"

    def engine_call(self, fn: Callable[[EngineCore], Any]) -> Any:
        loop = self.server.engine_loop
        assert loop is not None
        return self.runner.run(loop.call(fn))

    @property
    def engine(self) -> EngineCore:
        """The generation engine (the server must serve generation)."""
        loop = self.server.engine_loop
        assert loop is not None, "this server serves no generation"
        return loop.engine

    @property
    def speech_engine(self) -> EngineCore:
        """The engine that serves speech (the generation engine when shared)."""
        loop = self.server.speech.loop
        assert loop is not None, "this server serves no speech"
        return loop.engine

    def speech_call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run `fn(speech engine)` on its engine thread, between steps."""
        loop = self.server.speech.loop
        assert loop is not None
        return self.runner.run(loop.call(fn))

    def decode(self, codes: list[int]) -> np.ndarray:
        """One-shot decoding of SNAC codes with the server's codec, on its device thread."""
        engine = self.speech_engine
        assert engine.audio is not None
        codec = engine.audio.codec
        frames = np.asarray(codes, dtype=np.int64).reshape(-1, 7)
        return engine.executor.call(lambda: codec.decode_all(frames))

    def pages_in_use(self, speech: bool = False) -> tuple[int, int]:
        """(pages referenced, requests holding pages), read on the engine thread."""
        call = self.speech_call if speech else self.engine_call
        return call(pages_held)

    def wait_no_pages(self, timeout: float = TIMEOUT, speech: bool = False) -> tuple[int, int]:
        """Poll until no page is referenced and no request holds pages."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.pages_in_use(speech)
            if state == (0, 0) or time.monotonic() > deadline:
                return state
            time.sleep(0.02)

    def wait_pending(self, n: int, timeout: float = TIMEOUT, speech: bool = False) -> None:
        loop = self.server.speech.loop if speech else self.server.engine_loop
        assert loop is not None
        deadline = time.monotonic() + timeout
        while loop.num_pending != n:
            assert time.monotonic() < deadline, "requests never settled"
            time.sleep(0.02)

    @property
    def finished(self) -> dict[str, int]:
        loop = self.server.engine_loop
        assert loop is not None
        return dict(loop.stats.finished)

    def drain(self, grace_s: float | None = None) -> Any:
        """Start a drain; returns a concurrent future that completes when stopped."""
        async def go() -> None:
            await self.server.drain(grace_s)
        return asyncio.run_coroutine_threadsafe(go(), self.runner.loop)

    def stop(self) -> None:
        self.channel.close()
        self.runner.run(self.server.stop())


def hold_compiles(handle: ServerHandle) -> tuple[threading.Event, threading.Event]:
    """Make `handle`'s constraint compiles wait: returns (set once a call waits
    in its compile, set it to let them go on)."""
    state = handle.server.state
    compiling, release = threading.Event(), threading.Event()
    compile_constraint = state.compile_constraint

    async def held(*args: Any) -> Any:
        compiling.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return await compile_constraint(*args)

    state.compile_constraint = held  # type: ignore[method-assign,assignment]
    return compiling, release


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


def synthesize(stub: speech_pb2_grpc.SpeechStub, req: speech_pb2.SynthesizeRequest,
               timeout: float = TIMEOUT) -> tuple[list[speech_pb2.AudioChunk], list[float]]:
    """Run a Synthesize stream to its end: (the chunks, each one's arrival time in seconds
    since the call)."""
    chunks: list[speech_pb2.AudioChunk] = []
    times: list[float] = []
    start = time.perf_counter()
    for chunk in stub.Synthesize(req, timeout=timeout):
        times.append(time.perf_counter() - start)
        assert not chunks or not chunks[-1].final, "nothing may follow the final chunk"
        chunks.append(chunk)
    assert chunks and chunks[-1].final, "the stream ended without a final chunk"
    return chunks, times


def greedy(text: str | None = None, max_new_tokens: int = 16, **fields: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(**fields)
    if text is not None:
        req.text = text
    req.sampling.temperature = 0.0
    req.stopping.max_new_tokens = max_new_tokens
    return req


def _stencild() -> list[str]:
    script = Path(sys.executable).parent / "stencild"
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


class ServeProcess:
    """`stencild serve` on a free port; its log lines are collected on a thread."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*_stencild(), "serve", "--port", "0", *args], cwd=REPO_ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = int(self.wait_for(r"listening on [^ ]+:(\d+)").group(1))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "stencild exited:\n" + "".join(self.log)
                continue
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no {pattern!r} in the log:\n" + "".join(self.log))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
