"""What a hostile client found, end to end: calls that wedged the server, killed
an engine, or ended INTERNAL (or wrongly OK) on valid and invalid input.

Each test starts from the client's side: real servers on loopback ports.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import EngineConfig, EngineCore
from engine.presets import ensure_preset
from service.api.speech import SpeechOptions
from service.errors import bad_request_violations
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import speech_pb2
from service.server import EXIT_ENGINE_FAILED

from .helpers import (
    TIMEOUT,
    ServerHandle,
    engine_factory,
    generate,
    greedy,
    speech_factory,
    synthesize,
)

Finish = pb.GenerateComplete.FinishReason
C = pb.Constraint
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPO = Path(__file__).resolve().parents[2]


def health(handle: ServerHandle, service: str = "", timeout: float = 5.0) -> int:
    stub = health_pb2_grpc.HealthStub(handle.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def error_of(fn: Callable[..., Any], *args: Any) -> grpc.RpcError:
    """The gRPC error `fn(*args)` raises (the test fails if it raises none)."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    return info.value  # type: ignore[return-value]


def constrained(text: str = "Answer:", max_new_tokens: int = 24, **constraint: Any) -> pb.GenerateRequest:
    req = greedy(text, max_new_tokens)
    backend = constraint.pop("backend", None)
    if "choice" in constraint:
        req.constraint.choice.choices.extend(constraint.pop("choice"))
    for kind, value in constraint.items():
        setattr(req.constraint, kind, value)
    if backend is not None:
        req.constraint.backend = backend
    return req


def test_health_answers_while_failing_constraints_hammer_the_compiler(grammar_server: ServerHandle) -> None:
    handle = grammar_server
    stop = threading.Event()
    codes: list[grpc.StatusCode] = []
    slowest = [0.0]

    def bad_constraints(worker: int) -> None:
        for i in range(25):
            req = constrained(regex=f"(unbalanced-{worker}-{i}")
            codes.append(error_of(generate, handle.stub, req).code())

    def big_tokenize() -> None:
        text = "lorem ipsum dolor sit amet " * 100_000  # 2.7 MB
        while not stop.is_set():
            handle.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=TIMEOUT)

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            assert health(handle, timeout=10.0) == SERVING
            slowest[0] = max(slowest[0], time.monotonic() - start)
            time.sleep(0.05)

    helpers = [threading.Thread(target=big_tokenize, daemon=True), threading.Thread(target=probe, daemon=True)]
    clients = [threading.Thread(target=bad_constraints, args=(w,)) for w in range(2)]
    for t in helpers + clients:
        t.start()
    for t in clients:
        t.join(TIMEOUT * 2)
    stop.set()
    for t in helpers:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in clients + helpers), "a call never returned"
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 50
    assert slowest[0] < 5.0, f"a health check took {slowest[0]:.1f} s"
    assert handle.server.state.constraints is not None and handle.server.state.constraints.in_flight == 0


@pytest.mark.parametrize("field,value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("repetition_penalty", 3e38),
    ("presence_penalty", float("-inf")), ("top_p", float("nan")),
])
def test_non_finite_sampling_values_are_refused(grammar_server: ServerHandle, field: str, value: float) -> None:
    for req in (greedy("Hi"), constrained(regex="[a-z]+"), constrained(choice=["yes", "no"]),
                constrained(json_object=True)):
        setattr(req.sampling, field, value)
        err = error_of(generate, grammar_server.stub, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_violations(err.trailing_metadata())[0][0] == f"sampling.{field}"


def test_synthesize_with_an_infinite_temperature_leaves_speech_working(speech_server: ServerHandle) -> None:
    handle = speech_server
    req = speech_pb2.SynthesizeRequest(input="Hello there.", max_audio_seconds=0.5)
    req.sampling.temperature = float("inf")
    err = error_of(lambda: synthesize(handle.speech_stub, req))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(err.trailing_metadata())[0][0] == "sampling.temperature"
    req.sampling.temperature = 0.7
    chunks, _ = synthesize(handle.speech_stub, req)
    assert chunks[-1].final and chunks[-1].finish_reason != speech_pb2.AudioChunk.FINISH_REASON_UNSPECIFIED
    assert health(handle, "stencil.v1.Speech") == SERVING


@pytest.mark.parametrize("backend", [C.BACKEND_XGRAMMAR, C.BACKEND_LLGUIDANCE])
def test_large_valid_constraints_run_to_eos(grammar_server: ServerHandle, backend: int) -> None:
    options = [f"option-{i}" for i in range(2000)]
    text, _, done, _ = generate(grammar_server.stub, constrained(choice=options, backend=backend))
    assert done.finish_reason == Finish.EOS and text in options
    lark = "start: " + " | ".join(f'"t{i}"' for i in range(5000)) + "\n"
    text, _, done, _ = generate(grammar_server.stub, constrained(lark=lark, backend=backend))
    assert done.finish_reason == Finish.EOS and text in {f"t{i}" for i in range(5000)}


@pytest.mark.parametrize("kind,source", [
    ("ebnf", "root ::= root"), ("ebnf", 'root ::= root "a"'), ("lark", "start: start"),
    ("lark", "start: x\nx: y\ny: x"), ("lark", "start: start start"),
    ("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
])
def test_grammars_that_accept_nothing_are_invalid_arguments(grammar_server: ServerHandle, kind: str,
                                                             source: str) -> None:
    constraint: dict[str, Any] = {kind: source}
    for backend in (C.BACKEND_AUTO, C.BACKEND_XGRAMMAR, C.BACKEND_LLGUIDANCE):
        err = error_of(generate, grammar_server.stub, constrained(backend=backend, **constraint))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert bad_request_violations(err.trailing_metadata())[0][0] == f"constraint.{kind}"
        assert "accepts no string" in err.details()


def test_a_cached_constraint_ends_as_an_uncached_one(grammar_server: ServerHandle) -> None:
    # A long forced run: the output is cut by max_new_tokens (LENGTH), never
    # "complete", the first time and from the cache alike.
    results = [generate(grammar_server.stub, constrained(regex="a{100000}", max_new_tokens=12))
               for _ in range(2)]
    for text, _, done, _ in results:
        assert done.finish_reason == Finish.LENGTH
        assert text and set(text) == {"a"}
    assert results[0][0] == results[1][0]
    # Past the repetition limit (llguidance's lexer gave up on a{1000000} at
    # its first token), and ambiguous stacked repetitions: refused, every time.
    for regex in ("a{1000000}", "a{1000000}", "a**", "a{2}{3}"):
        err = error_of(generate, grammar_server.stub, constrained(regex=regex))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.regex"


# -- an engine that dies, an engine that hangs --------------------------------------------------
def killable_engine(preset: str = "tiny-llama", **config: Any) -> EngineCore:
    """An engine whose scheduler raises (outside any request's handling, so the
    engine thread dies) once a request with id "kill" is queued."""
    config.setdefault("kv_cache_gib", 0.05)
    engine = EngineCore(EngineConfig(model=str(ensure_preset(preset)), **config))
    schedule = engine.scheduler.schedule

    def poisoned() -> Any:
        if engine.scheduler.find("kill") is not None:
            raise RuntimeError("injected fault in the scheduler")
        return schedule()

    engine.scheduler.schedule = poisoned  # type: ignore[method-assign]
    return engine


def test_a_dead_engine_takes_the_server_down_at_once(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(killable_engine, speech=SpeechOptions("demo-speech", speech_factory()))
    stub = handle.stub
    slow = stub.Generate(greedy("a long one", 400), timeout=TIMEOUT)
    next(iter(slow))  # running
    err = error_of(lambda: generate(stub, greedy("die", 4, request_id="kill")))
    assert err.code() == grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.RpcError) as other:
        list(slow)
    assert other.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    handle.runner.run(handle.server.wait_stopped())
    assert handle.server.engine_failure is not None
    for service in ("", "stencil.v1.Generation", "stencil.v1.Speech"):
        assert handle.server.health.status(service) == NOT_SERVING


def test_a_dead_speech_engine_takes_the_server_down(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(speech=SpeechOptions("demo-speech", _killable_speech))
    err = error_of(lambda: synthesize(handle.speech_stub, speech_pb2.SynthesizeRequest(
        input="die", max_audio_seconds=0.5, request_id="kill")))
    assert err.code() == grpc.StatusCode.INTERNAL
    handle.runner.run(handle.server.wait_stopped())
    assert handle.server.engine_failure is not None
    assert handle.server.health.status("stencil.v1.Speech") == NOT_SERVING
    assert handle.server.health.status("") == NOT_SERVING


def _killable_speech(executor: Any) -> EngineCore:
    engine = EngineCore(EngineConfig(model=str(ensure_preset("demo-speech")), kv_cache_gib=0.05,
                                     speech_codec=str(ensure_preset("tiny-codec"))), executor=executor)
    schedule = engine.scheduler.schedule

    def poisoned() -> Any:
        if engine.scheduler.find("kill") is not None:
            raise RuntimeError("injected fault in the speech scheduler")
        return schedule()

    engine.scheduler.schedule = poisoned  # type: ignore[method-assign]
    return engine


KILL_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {repo!r})
from tests.e2e.test_robustness import killable_engine
from service.server import ServerConfig, serve
config = ServerConfig(port={port}, warmup_grammar=False)
sys.exit(asyncio.run(serve(killable_engine, "tiny-llama", config)))
"""


def test_the_process_exits_non_zero_when_an_engine_dies(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT.format(repo=str(REPO), port=port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=TIMEOUT)
        health_stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + TIMEOUT
        while health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != SERVING:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.1)
        from service.gen.stencil.v1 import generate_pb2_grpc

        stub = generate_pb2_grpc.GenerationStub(channel)
        err = error_of(lambda: generate(stub, greedy("die", 4, request_id="kill")))
        assert err.code() == grpc.StatusCode.INTERNAL
        assert proc.wait(TIMEOUT) == EXIT_ENGINE_FAILED
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    _, stderr = proc.communicate()
    assert "an engine failed" in stderr


def vllm_health(handle: ServerHandle) -> Any:
    from service.gen.vllm import vllm_engine_pb2 as vpb
    from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

    return vpb_grpc.VllmEngineStub(handle.channel).HealthCheck(vpb.HealthCheckRequest(), timeout=TIMEOUT)


def test_the_watchdog_reports_a_hung_engine_and_its_recovery(make_server: Callable[..., ServerHandle],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    handle = make_server(engine_factory(slow_s=0.0001), watchdog_timeout_s=0.5)
    model = handle.engine_call(lambda e: e.model)
    assert health(handle, "stencil.v1.Generation") == SERVING
    caplog.set_level(logging.ERROR, logger="service.ops.watchdog")
    model.delay_s = 2.5  # the next forward pass hangs for 2.5 s
    call = handle.stub.Generate(greedy("hang", 2), timeout=TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while health(handle, "stencil.v1.Generation") != NOT_SERVING:
        assert time.monotonic() < deadline, "the watchdog never reported the stall"
        time.sleep(0.05)
    assert health(handle, "") == NOT_SERVING
    # vLLM's own HealthCheck, which routers such as SMG poll, agrees (it said healthy).
    assert not vllm_health(handle).healthy
    model.delay_s = 0.0
    list(call)  # the stalled step completes; the request finishes
    while health(handle, "stencil.v1.Generation") != SERVING:
        assert time.monotonic() < deadline, "the watchdog never reported the recovery"
        time.sleep(0.05)
    assert health(handle, "") == SERVING
    assert vllm_health(handle).healthy
    assert "engine stalled" in caplog.text and "stencild-engine" in caplog.text
