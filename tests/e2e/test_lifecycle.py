"""Health, reflection and draining."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.telemetry import TelemetryConfig
from service.server import ServerConfig, StencilServer

from .helpers import TIMEOUT, LoopThread, ServerHandle, engine_factory, greedy, hold_compiles

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GENERATION = "stencil.v1.Generation"
Finish = pb.GenerateComplete.FinishReason


def _check(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status


def test_reflection_lists_the_services(server: ServerHandle) -> None:
    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = set(db.get_services())
    assert {GENERATION, "grpc.health.v1.Health"} <= services
    desc = db.FindFileContainingSymbol(GENERATION)
    assert desc.package == "stencil.v1"


def test_health_not_serving_until_loaded_then_serving_then_drain(make_server) -> None:
    gate = threading.Event()
    factory = engine_factory(slow_s=0.02)

    def gated():  # type: ignore[no-untyped-def]
        assert gate.wait(TIMEOUT)
        return factory()

    server = make_server(gated, wait=False)
    watch = health_pb2_grpc.HealthStub(server.channel).Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert next(watch).status == NOT_SERVING
    assert _check(server.channel) == NOT_SERVING
    assert _check(server.channel, GENERATION) == NOT_SERVING
    gate.set()
    assert next(watch).status == SERVING
    server.wait_ready()
    assert _check(server.channel, GENERATION) == SERVING

    # A stream in flight keeps the drain open long enough to look at it.
    req = greedy("drain me", max_new_tokens=30)
    req.stopping.ignore_eos = True
    call = server.stub.Generate(req, timeout=TIMEOUT)
    next(call)
    stopped = server.drain(grace_s=60.0)
    assert next(watch).status == NOT_SERVING
    # Draining or done, the server takes no new work.
    try:
        assert _check(server.channel, GENERATION) == NOT_SERVING
        list(server.stub.Generate(greedy("late"), timeout=TIMEOUT))
        raise AssertionError("a new call was accepted while draining")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    msgs = list(call)
    assert msgs[-1].complete.finish_reason == Finish.LENGTH, "the stream in flight finished"
    stopped.result(TIMEOUT)


def test_a_drain_waits_for_a_call_still_compiling_its_constraint(make_server) -> None:  # type: ignore[no-untyped-def]
    """A call counted only once its request reached the engine: a drain that
    began while it compiled stopped the server under it after a second
    (CANCELLED). Now the drain waits, and the call ends UNAVAILABLE."""
    server = make_server()
    compiling, release = hold_compiles(server)
    req = greedy("compile me", max_new_tokens=4)
    req.constraint.regex = "[a-z]+"
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(lambda: list(server.stub.Generate(req, timeout=TIMEOUT)))
        assert compiling.wait(TIMEOUT)
        stopped = server.drain(grace_s=30.0)
        time.sleep(1.5)  # the server used to stop within a second here
        assert not stopped.done(), "the drain did not wait for the call"
        release.set()
        with pytest.raises(grpc.RpcError) as err:
            call.result(TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    stopped.result(TIMEOUT)


def test_drain_past_grace_period_cancels_streams(make_server) -> None:
    server = make_server(engine_factory(slow_s=0.02))
    req = greedy("never finishes in time", max_new_tokens=400)
    req.stopping.ignore_eos = True
    call = server.stub.Generate(req, timeout=TIMEOUT)
    next(call)
    start = time.monotonic()
    stopped = server.drain(grace_s=0.5)
    try:
        list(call)
        raise AssertionError("the stream should have been cut off")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in err.details()
    stopped.result(TIMEOUT)
    assert time.monotonic() - start < TIMEOUT
    loop = server.server.engine_loop
    assert loop.num_pending == 0 and not loop.alive
    engine = loop.engine  # the engine thread has stopped: safe to look directly
    assert engine.allocator.num_used == 0 and engine.kv_manager.num_active == 0


def test_a_hung_step_does_not_hold_the_drain_for_ever(make_server, monkeypatch) -> None:
    # A step that never ends (the watchdog's case): the drain stops waiting
    # for the engine thread after STOP_TIMEOUT_S and the server stops; the
    # stream still open gets UNAVAILABLE.
    from engine import EngineConfig, EngineCore
    from engine.presets import ensure_preset
    from service import engine_loop

    monkeypatch.setattr(engine_loop, "STOP_TIMEOUT_S", 1.0)
    hang, release = threading.Event(), threading.Event()

    class Hangs:
        def __init__(self, real):  # type: ignore[no-untyped-def]
            self._real = real

        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if hang.is_set():
                release.wait(TIMEOUT)
            return self._real.forward(*args, **kwargs)

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(self._real, name)

    path = ensure_preset("tiny-llama")
    server = make_server(lambda: EngineCore(EngineConfig(model=str(path), kv_cache_gib=0.05), wrap_model=Hangs))
    call = server.stub.Generate(greedy("hang here", max_new_tokens=200), timeout=TIMEOUT)
    next(call)
    hang.set()
    try:
        stopped = server.drain(0.0)
        stopped.result(15)  # grace 0, the aborts' 10 s bound, then 1 s for the thread
        try:
            list(call)
            raise AssertionError("the stream should have been cut off")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        release.set()


@pytest.mark.parametrize("method", ["ValidateConstraint", "GetTokenizer"])
def test_a_drain_waits_for_unary_calls_that_work(method: str, make_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """ValidateConstraint (a compile of up to --grammar-timeout) and GetTokenizer
    (a zip built on a thread) were not counted: a drain that began under them
    stopped the server a second later, and the call ended CANCELLED."""
    from service.gen.vllm import common_pb2 as cpb
    from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc
    from service.vllm_protocol import info as vllm_info

    server = make_server()
    working, release = threading.Event(), threading.Event()

    def hold() -> None:
        working.set()
        assert release.wait(TIMEOUT)

    if method == "ValidateConstraint":
        compiler = server.server.state.constraints
        compile_noting_cache = compiler.compile_noting_cache

        async def slow_compile(*args):  # type: ignore[no-untyped-def]
            await asyncio.to_thread(hold)
            return await compile_noting_cache(*args)

        monkeypatch.setattr(compiler, "compile_noting_cache", slow_compile)
        req = pb.ValidateConstraintRequest()
        req.constraint.regex = "[a-z]+"
        call = lambda: server.stub.ValidateConstraint(req, timeout=TIMEOUT).grammar_backend  # noqa: E731
    else:
        tokenizer_zip = vllm_info.tokenizer_zip

        def slow_zip(*args):  # type: ignore[no-untyped-def]
            hold()
            return tokenizer_zip(*args)

        monkeypatch.setattr(vllm_info, "tokenizer_zip", slow_zip)
        stub = vpb_grpc.VllmEngineStub(server.channel)
        call = lambda: b"".join(c.data for c in stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=TIMEOUT))  # noqa: E731
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(call)
        assert working.wait(TIMEOUT)
        stopped = server.drain(grace_s=30.0)
        time.sleep(1.5)  # the server used to stop within a second here
        assert not stopped.done(), "the drain did not wait for the call"
        release.set()
        assert answer.result(TIMEOUT), "the call was answered"
    stopped.result(TIMEOUT)


def test_nothing_of_the_server_runs_on_after_it_stops(make_server) -> None:  # type: ignore[no-untyped-def]
    # The watchdog polled for ever after a stop, keeping the engines alive
    # (in-process uses: tests, an embedding application).
    server = make_server()
    watchdog = server.server._watchdog
    assert watchdog is not None and not watchdog.done()
    server.stop()
    server.runner.run(asyncio.sleep(0.05))  # the cancellation lands
    assert watchdog.done()


@pytest.mark.parametrize("side", ["health", "metrics"])
def test_a_side_port_that_cannot_bind_leaves_nothing_listening(side: str, loop_thread: LoopThread) -> None:
    # The main port was left serving (a health port taken) when a later port
    # failed: the caller got the error and no server to stop.
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        probe.bind(("127.0.0.1", 0))
        main_port = probe.getsockname()[1]
        probe.close()
        busy = taken.getsockname()[1]
        extra = {"health_port": busy} if side == "health" else \
            {"telemetry": TelemetryConfig(metrics_host="127.0.0.1", metrics_port=busy)}
        server = StencilServer(engine_factory(), "m", ServerConfig(port=main_port, **extra))
        with pytest.raises(OSError):
            loop_thread.run(server.start())
    with socket.socket() as again:  # free again: nothing listens there
        again.bind(("127.0.0.1", main_port))
