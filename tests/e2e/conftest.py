"""Fixtures: real servers on loopback ports, run on a background event loop in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from engine import EngineCore
from engine.embedding import EmbeddingConfig
from engine.presets import ensure_preset
from service.api.embeddings import EmbeddingOptions
from service.api.speech import SpeechOptions
from service.cli import build_parser
from service.cli.serve import ServePlan, plan_serve
from service.engine_loop import AdmissionLimits
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.server import ServerConfig, StencilServer

from .helpers import LoopThread, ServerHandle, engine_factory, speech_factory


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    runner = LoopThread()
    yield runner
    runner.close()


@contextmanager
def _servers(loop_thread: LoopThread) -> Iterator[Callable[..., ServerHandle]]:
    """A maker of servers (ready unless wait=False); on leaving, each is checked
    for leaked pages and stopped, its engine and compile workers with it."""
    made: list[ServerHandle] = []

    def start(factory: Callable[[], EngineCore] | None = None, wait: bool = True,
              model_name: str = "tiny-llama", embedding: EmbeddingOptions | None = None,
              generation: bool = True, speech: SpeechOptions | None = None,
              **config: Any) -> ServerHandle:
        """No embedding or speech model unless `embedding` or `speech` is given, and
        no grammar worker started at warm-up unless asked: all cost seconds that
        most tests do not need."""
        config.setdefault("port", 0)
        config.setdefault("grace_period_s", 30.0)
        config.setdefault("warmup_grammar", False)
        if "max_pending_requests" in config:
            config["admission"] = AdmissionLimits(config.pop("max_pending_requests"))
        factory = (factory or engine_factory()) if generation else None
        server = StencilServer(factory, model_name, ServerConfig(**config), embedding, speech)
        handle = ServerHandle(loop_thread, server)
        made.append(handle)
        if wait:
            handle.wait_ready()
        return handle

    yield start
    for handle in made:
        loop = handle.server.engine_loop
        if loop is not None and loop.alive:
            assert handle.wait_no_pages() == (0, 0), "a request leaked KV pages"
        speech = handle.server.speech.loop
        if speech is not None and speech.alive:
            assert handle.wait_no_pages(speech=True) == (0, 0), "a speech request leaked KV pages"
        handle.stop()


# One maker per scope: a server lives as long as the fixture or test that made
# it, not to the end of the session (each holds an engine and compile worker
# processes; kept to the end, a run's servers outgrew the machine's memory).
@pytest.fixture(scope="session")
def make_session_server(loop_thread: LoopThread) -> Iterator[Callable[..., ServerHandle]]:
    with _servers(loop_thread) as start:
        yield start


@pytest.fixture(scope="module")
def make_module_server(loop_thread: LoopThread) -> Iterator[Callable[..., ServerHandle]]:
    with _servers(loop_thread) as start:
        yield start


@pytest.fixture
def make_server(loop_thread: LoopThread) -> Iterator[Callable[..., ServerHandle]]:
    """Servers of one test, stopped when it ends."""
    with _servers(loop_thread) as start:
        yield start


@pytest.fixture(scope="session")
def server(make_session_server: Callable[..., ServerHandle]) -> ServerHandle:
    """The shared server: tiny-llama at full speed."""
    return make_session_server()


@pytest.fixture(scope="session")
def slow_server(make_session_server: Callable[..., ServerHandle]) -> ServerHandle:
    """tiny-llama with 20 ms per step, for cancelling requests mid-stream."""
    return make_session_server(engine_factory(slow_s=0.02))


@pytest.fixture(scope="session")
def grammar_server(make_session_server: Callable[..., ServerHandle]) -> ServerHandle:
    """tiny-llama with a 1.5 s grammar compile timeout and the compile worker warm."""
    return make_session_server(engine_factory(grammar_compile_timeout_s=1.5), warmup_grammar=True)


@pytest.fixture(scope="session")
def embed_server(make_session_server: Callable[..., ServerHandle]) -> ServerHandle:
    """tiny-llama and all-MiniLM-L6-v2 at once, sharing the engine's device thread."""
    return make_session_server(embedding=EmbeddingOptions(EmbeddingConfig()))


@pytest.fixture
def stub(server: ServerHandle) -> pb_grpc.GenerationStub:
    return server.stub


@pytest.fixture(scope="session")
def speech_server(make_session_server: Callable[..., ServerHandle]) -> ServerHandle:
    """tiny-llama, and demo-speech + tiny-codec on a speech engine of its own
    (sharing the generation engine's device thread)."""
    return make_session_server(speech=SpeechOptions("demo-speech", speech_factory()))


def shared_plan() -> ServePlan:
    """`stencild serve` with demo-speech as both --model and --speech-model."""
    speech = str(ensure_preset("demo-speech"))
    args = build_parser().parse_args([
        "serve", "--model", speech, "--speech-model", speech, "--codec", str(ensure_preset("tiny-codec")),
        "--kv-cache-gib", "0.05", "--no-embedding-model"])
    plan = plan_serve(args)
    assert isinstance(plan, ServePlan), plan
    return plan


@pytest.fixture(scope="session")
def shared_speech_server(make_session_server: Callable[..., ServerHandle]) -> ServerHandle:
    """One engine (demo-speech + tiny-codec) serving text and speech, as the CLI builds it."""
    plan = shared_plan()
    return make_session_server(plan.engine_factory, model_name=plan.model_name, speech=plan.speech)
