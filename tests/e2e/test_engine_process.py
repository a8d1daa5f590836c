"""A server whose generation engine runs in an engine process (`--engine-process`):
the same answers as an in-process engine, aborts that free their pages, and a
dead engine process that fails its calls and stops the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine import EngineCore
from service.engine_proc import RemoteEngine
from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.telemetry import TelemetryConfig

from ..conftest import process_running
from .helpers import (
    TIMEOUT,
    ServerHandle,
    answer_only_the_engine_process_can_read,
    engine_factory,
    generate,
    greedy,
    process_factory,
    unpicklable_answer,
)
from .metrics_helpers import scrape


@pytest.fixture(scope="module")
def process_server(make_module_server: Callable[..., ServerHandle]) -> ServerHandle:
    return make_module_server(process_factory(), telemetry=TelemetryConfig(metrics_port=0))


def _requests() -> list[pb.GenerateRequest]:
    plain = greedy("The engine in a process of its own", max_new_tokens=12)
    seeded = pb.GenerateRequest(text="Seeded, biased and cut")
    seeded.sampling.temperature = 0.9
    seeded.sampling.top_k = 40
    seeded.sampling.seed = 77
    seeded.sampling.logit_bias[100] = 5.0  # a read-only mapping in SamplingParams: it must cross the pipe
    seeded.stopping.max_new_tokens = 12
    regex = greedy("Email:", max_new_tokens=24)
    regex.constraint.regex = "[a-z]{2,6}@example\\.(com|org)"
    schema = greedy("JSON:", max_new_tokens=40)
    schema.constraint.json_schema = ('{"type": "object", "properties": {"n": {"type": "integer"}, '
                                     '"ok": {"type": "boolean"}}, "required": ["n", "ok"]}')
    # uniqueItems is left to resampling: the process sets the value checks up itself.
    unique = greedy("Numbers:", max_new_tokens=40)
    unique.constraint.json_schema = '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'
    return [plain, seeded, regex, schema, unique]


def _answer(server: ServerHandle, req: pb.GenerateRequest) -> tuple[str, list[int], int, int, int, int]:
    text, ids, complete, _ = generate(server.stub, req)
    return (text, ids, complete.finish_reason, complete.usage.completion_tokens,
            complete.usage.forced_tokens, complete.usage.schema_retries)


def _fails_the_server(handle: ServerHandle) -> None:
    deadline = time.monotonic() + TIMEOUT
    while handle.server.health.status() != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "the server kept serving without a working engine"
        time.sleep(0.05)
    assert handle.server.engine_failure is not None
    handle.runner.run(handle.server.wait_stopped())


def test_an_engine_process_answers_as_the_in_process_engine(server: ServerHandle,
                                                             process_server: ServerHandle) -> None:
    for req in _requests():
        assert _answer(process_server, req) == _answer(server, req), req
    engine = process_server.engine
    assert isinstance(engine, RemoteEngine)
    # The process reports each step's stats and load for the metrics.
    assert engine.last_step.seconds > 0 and engine.load().prefix_cache_queries > 0
    assert process_server.pages_in_use() == (0, 0)  # a call's function runs in the process


def _grammar_compiles(engine: EngineCore) -> tuple[int, int]:
    """(library compiles run, compiles loaded from the server's), in the engine process."""
    counts = engine.structured.compiler.counts
    return counts.run, counts.loaded


def test_a_constraint_is_compiled_once_not_again_in_the_engine_process(process_server: ServerHandle) -> None:
    run, loaded = process_server.engine_call(_grammar_compiles)
    req = greedy("Answer:", max_new_tokens=8)
    req.constraint.ebnf = 'root ::= "once" | "twice" | [0-9]+'  # xgrammar's: the slow compile of the two
    first = _answer(process_server, req)
    assert _answer(process_server, req) == first
    # The server's compile went down with the first request and was loaded; the
    # second request was a cache hit on both sides.
    assert process_server.engine_call(_grammar_compiles) == (run, loaded + 1)


def test_the_engine_process_threads_cpu_is_exported(process_server: ServerHandle) -> None:
    # As an in-process engine's are (engine_0, device_0), beside the thread
    # here that reads the process's pipe.
    before = scrape(process_server)
    generate(process_server.stub, greedy("count the cpu", max_new_tokens=16))
    after = scrape(process_server)
    threads = ("event_loop", "engine_link_0", "engine_0", "device_0")
    assert {lab["thread"] for lab in after.labels_of("stencil_thread_cpu_seconds_total")} == set(threads)
    for thread in threads:
        used = after.get("stencil_thread_cpu_seconds_total", thread=thread) - \
            before.get("stencil_thread_cpu_seconds_total", thread=thread)
        assert used > 0, thread


def test_bad_requests_are_refused_before_the_engine_process(process_server: ServerHandle) -> None:
    req = greedy("bad", max_new_tokens=4)
    req.sampling.logit_bias[10**6] = 1.0
    with pytest.raises(grpc.RpcError) as info:
        generate(process_server.stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = greedy("bad", max_new_tokens=4)
    bad.constraint.regex = "(unclosed"
    with pytest.raises(grpc.RpcError) as info:
        generate(process_server.stub, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _answer(process_server, greedy("still fine", max_new_tokens=3))[3] == 3


def test_an_engine_that_cannot_be_built_is_a_load_error(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(process_factory(kv_cache_gib=1e-6), wait=False)
    assert not handle.runner.run(handle.server.wait_ready())
    assert isinstance(handle.server.load_error, ValueError)
    assert "fewer than 2 pages" in str(handle.server.load_error)


def test_a_failure_once_the_engine_process_is_ready_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the server builds after the process reports ready (its reasoning
    parser, request factory, compile workers) could fail and leave the
    process running, with its model and KV cache, for the server's lifetime."""
    from service.engine_proc import client

    pids: list[int] = []
    ready = client.EngineProcess.wait_ready

    def recorded(self: client.EngineProcess) -> object:
        pids.append(self.pid)
        return ready(self)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(client.EngineProcess, "wait_ready", recorded)
    monkeypatch.setattr(client, "RequestFactory", refuse)
    with pytest.raises(RuntimeError, match="injected"):
        process_factory()()
    assert pids and not process_running(pids[0])


def test_a_cancelled_stream_frees_its_pages_in_the_engine_process(
        make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(process_factory(setup=("tests.e2e.helpers:slow_forward",)))
    calls = [handle.stub.Generate(greedy(f"cancel me {i}", max_new_tokens=200), timeout=TIMEOUT)
             for i in range(3)]
    for call in calls:
        next(call)  # running: its first chunk is here
    for call in calls[:2]:
        call.cancel()
    deadline = time.monotonic() + TIMEOUT
    while handle.pages_in_use()[1] != 1:  # the two cancelled hold no page; the third runs on
        assert time.monotonic() < deadline, "cancelled requests kept their pages"
        time.sleep(0.02)
    assert sum(1 for _ in calls[2]) > 1
    assert handle.wait_no_pages() == (0, 0)
    assert handle.finished.get("cancelled", 0) == 2


def test_a_killed_engine_process_fails_its_calls_and_stops_the_server(
        make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(process_factory(setup=("tests.e2e.helpers:slow_forward",)))
    engine = handle.engine
    assert isinstance(engine, RemoteEngine)
    errors: list[grpc.StatusCode] = []
    started = threading.Event()

    def stream() -> None:
        try:
            for _ in handle.stub.Generate(greedy("killed mid-stream", max_new_tokens=500), timeout=TIMEOUT):
                started.set()
        except grpc.RpcError as err:
            errors.append(err.code())

    caller = threading.Thread(target=stream)
    caller.start()
    assert started.wait(TIMEOUT)
    os.kill(engine.process.pid, signal.SIGKILL)
    caller.join(TIMEOUT)
    assert errors and errors[0] in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    _fails_the_server(handle)


@pytest.mark.parametrize("factory", [engine_factory(slow_s=0.2),
                                     process_factory(setup=("tests.e2e.helpers:slow_forward",))],
                         ids=["thread", "process"])
def test_a_call_its_caller_gave_up_on_harms_nothing(make_server: Callable[..., ServerHandle],
                                                    factory: Callable[[], EngineCore]) -> None:
    # A call (FlushCache, a KV-event subscriber's snapshot) whose caller is
    # cancelled while the engine is inside a step: asyncio.wrap_future cancels
    # its future. Answering it anyway used to raise on the engine thread (the
    # engine failed, the server stopped) or on the reader of an engine process
    # (nothing more was delivered, and the server went on saying SERVING).
    handle = make_server(factory)
    loop = handle.server.engine_loop
    assert loop is not None
    stream = handle.stub.Generate(greedy("keep the engine busy", max_new_tokens=30), timeout=TIMEOUT)
    next(stream)  # running

    async def give_up() -> None:
        task = asyncio.ensure_future(loop.call(EngineCore.flush_prefix_cache))
        await asyncio.sleep(0)  # sent
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for _ in range(3):
        handle.runner.run(give_up())
    assert list(stream)[-1].HasField("complete")
    assert handle.server.engine_failure is None and loop.alive
    assert _answer(handle, greedy("still serving", max_new_tokens=3))[3] == 3


def test_a_hung_engine_process_never_stalls_the_event_loop(make_server: Callable[..., ServerHandle]) -> None:
    # A process that stops reading (SIGSTOP stands in for one wedged in native
    # code): the requests sent to it fill the pipe, and writing there must not
    # hold the event loop (health, Abort, the watchdog and a drain run on it).
    handle = make_server(process_factory())
    engine, loop = handle.engine, handle.server.engine_loop
    assert isinstance(engine, RemoteEngine) and loop is not None
    pid = engine.process.pid
    os.kill(pid, signal.SIGSTOP)
    calls = []
    try:
        for _ in range(40):  # ~1.5 KB of prompt each: more than the pipe holds
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(10, 460))))
            req.sampling.temperature = 0.0
            req.stopping.max_new_tokens = 2
            calls.append(handle.stub.Generate(req, timeout=TIMEOUT))
        deadline = time.monotonic() + TIMEOUT
        while loop.num_pending < len(calls):
            assert time.monotonic() < deadline, "the requests never reached the engine loop"
            time.sleep(0.05)
        handle.runner.run(asyncio.sleep(0), timeout=5)  # the loop still runs
        assert handle.server.health.status() == health_pb2.HealthCheckResponse.SERVING
    finally:
        os.kill(pid, signal.SIGCONT)
    # Nothing was lost on the way: once the process reads again, every request ends.
    for call in calls:
        assert list(call)[-1].complete.usage.completion_tokens == 2


def test_stopping_closes_the_servers_own_compile_workers(make_server: Callable[..., ServerHandle]) -> None:
    # The server checks and compiles constraints itself before they go down
    # to the process: its compile workers end with the server, as an
    # in-process engine's end with its engine thread.
    handle = make_server(process_factory())
    req = greedy("Answer:", max_new_tokens=4)
    req.constraint.regex = "[a-z]{2,6}"
    generate(handle.stub, req)
    compiler = handle.engine.structured.compiler
    workers = compiler.worker_pids()
    assert workers
    handle.runner.run(handle.server.stop())
    assert compiler.worker_pids() == []
    deadline = time.monotonic() + TIMEOUT
    while any(process_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "a compile worker outlived the server"
        time.sleep(0.05)


def test_a_call_answer_that_cannot_be_pickled_is_an_error_not_a_hang(process_server: ServerHandle) -> None:
    loop = process_server.server.engine_loop
    assert loop is not None
    with pytest.raises(TypeError, match="pickle"):
        process_server.runner.run(loop.call(unpicklable_answer), timeout=TIMEOUT)
    assert _answer(process_server, greedy("still serving", max_new_tokens=3))[3] == 3


def test_a_message_the_server_cannot_read_fails_the_link_not_its_reader(
        make_server: Callable[..., ServerHandle]) -> None:
    # The server's reader thread used to die on it: streams in flight hung, and health said SERVING.
    handle = make_server(process_factory(setup=("tests.e2e.helpers:slow_forward",)))
    loop = handle.server.engine_loop
    assert loop is not None
    stream = handle.stub.Generate(greedy("in flight", max_new_tokens=400), timeout=TIMEOUT)
    next(stream)
    with contextlib.suppress(Exception):
        handle.runner.run(loop.call(answer_only_the_engine_process_can_read), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    _fails_the_server(handle)


def test_a_command_the_engine_process_cannot_read_fails_the_link_not_its_reader(
        make_server: Callable[..., ServerHandle], tmp_path, monkeypatch) -> None:
    # A function of a module only the server can import: its reader thread used
    # to die, and every later request waited for ever with health SERVING.
    (tmp_path / "stencild_server_only.py").write_text("def pages(engine):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import stencild_server_only  # type: ignore[import-not-found]

    handle = make_server(process_factory())
    loop = handle.server.engine_loop
    assert loop is not None
    with contextlib.suppress(Exception):
        handle.runner.run(loop.call(stencild_server_only.pages), timeout=TIMEOUT)
    _fails_the_server(handle)


def test_a_signal_to_the_process_group_is_the_servers_to_act_on(process_server: ServerHandle) -> None:
    # systemd's stop, `kill -TERM -PGID` and a terminal's hang-up reach the
    # engine process too; the server drains on SIGTERM with it still running.
    engine = process_server.engine
    assert isinstance(engine, RemoteEngine)
    stream = process_server.stub.Generate(greedy("signalled", max_new_tokens=16), timeout=TIMEOUT)
    next(stream)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        os.kill(engine.process.pid, sig)
    assert list(stream)[-1].HasField("complete")
    assert process_running(engine.process.pid)
    assert _answer(process_server, greedy("still serving", max_new_tokens=3))[3] == 3
