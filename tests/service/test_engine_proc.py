"""The engine process's side of the link, without a process: commands in
(adds whose constraint compiles meanwhile, aborts, failures), step messages out,
and what crosses the pipe pickling as itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import pickle
import threading
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from engine import RequestOutput, SamplingParams
from engine.context import GenerationStatus, TextContext, TokenLogprobs
from engine.engine import EngineLoad, StepStats
from engine.request_factory import RequestFactory
from grammar import GrammarError, GrammarSpec
from service.engine_proc.child import EngineChild
from service.engine_proc.wire import Submission, ThreadCpu, mirror_times, portable_error, times_of

from ..conftest import process_running


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, message: tuple[Any, ...]) -> None:
        self.sent.append(pickle.loads(pickle.dumps(message)))  # as the server would read it


class _Structured:
    """Compiles nothing: each compile is a future the test completes."""

    def __init__(self) -> None:
        self.pending: list[concurrent.futures.Future[Any]] = []
        self.tenants: list[str] = []

    def compile_async(self, spec: GrammarSpec, backend: str | None = None,
                      given: Any = None, tenant: str = "") -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.pending.append(future)
        self.tenants.append(tenant)
        return future


def _child() -> tuple[EngineChild, _Outbox, _Structured]:
    structured = _Structured()
    # This thread stands in for the device thread.
    engine = SimpleNamespace(structured=structured, last_step=StepStats(0.001, 2, 2),
                             executor=SimpleNamespace(thread=threading.current_thread()),
                             requests=RequestFactory(None, 100, 64, frozenset({0}), None, None, None),  # type: ignore[arg-type]
                             load=lambda: EngineLoad(2, 0, 3, 10))
    outbox = _Outbox()
    return EngineChild(engine, outbox), outbox, structured  # type: ignore[arg-type]


def _submission(rid: str, grammar: bool = False) -> Submission:
    return Submission(rid, np.array([5, 6, 7]), SamplingParams(temperature=0.0, max_new_tokens=4), 7, 1,
                      (GrammarSpec.regex("[ab]+"), "llguidance") if grammar else None, resample=False)


def _commands(child: EngineChild) -> list[tuple[Any, ...]]:
    out = []
    while not child.driver.commands.empty():
        out.append(child.driver.commands.get())
    return out


def test_what_crosses_the_pipe_pickles_as_itself() -> None:
    params = SamplingParams(temperature=0.7, logit_bias={3: 2.5, 9: -1.0}, stop=("end",), seed=5)
    again = pickle.loads(pickle.dumps(params))
    assert again == params and dict(again.logit_bias) == {3: 2.5, 9: -1.0}
    out = RequestOutput("r", [1, 2], "ab", [TokenLogprobs(2, -0.5, [(2, -0.5)])], finished=True,
                        status=GenerationStatus.STOP_STRING, stop_reason="end", prompt_tokens=3,
                        completion_tokens=2, grammar_backend="xgrammar")
    assert pickle.loads(pickle.dumps(out)) == out
    sub = pickle.loads(pickle.dumps(_submission("s", grammar=True)))
    assert sub.grammar == (GrammarSpec.regex("[ab]+"), "llguidance") and list(sub.spec.prompt) == [5, 6, 7]


def test_an_unconstrained_request_goes_to_the_engine_at_once() -> None:
    child, outbox, _ = _child()
    assert child.handle(("add", _submission("a")))
    [(kind, ctx)] = _commands(child)
    assert kind == "add" and isinstance(ctx, TextContext) and ctx.request_id == "a" and ctx.seed == 1
    assert not child.handle(("stop",)) and _commands(child) == [("stop",)]
    assert outbox.sent == []


def test_a_request_aborted_while_its_constraint_compiles_is_added_then_aborted() -> None:
    child, outbox, structured = _child()
    child.handle(("add", _submission("c", grammar=True)))
    child.handle(("abort", "c"))
    assert _commands(child) == [("abort", "c")]  # not in the engine yet: nothing to abort there
    structured.pending[0].set_result(object())
    kinds = [(cmd[0], cmd[1] if cmd[0] == "abort" else cmd[1].request_id) for cmd in _commands(child)]
    # In the engine, then ended by the abort: it reports as any aborted request.
    assert kinds == [("add", "c"), ("abort", "c")]


def test_an_abort_as_the_compile_ends_reaches_the_engine_after_its_request() -> None:
    # The compile ends on the compiler's thread while the reader thread takes
    # the abort: the abort must not reach the engine ahead of the add (an abort
    # of an unknown id does nothing there, and the request would run on).
    child, _, structured = _child()
    child.handle(("add", _submission("c", grammar=True)))
    reader: list[threading.Thread] = []

    class AbortWhileAdding(dict):  # the moment _enqueue registers the request
        def __setitem__(self, key: str, value: Any) -> None:
            reader.append(threading.Thread(target=child.handle, args=(("abort", key),)))
            reader[0].start()
            reader[0].join(0.2)
            super().__setitem__(key, value)

    child._sent = AbortWhileAdding()
    structured.pending[0].set_result(object())  # the compile is done (compiler thread)
    reader[0].join()
    kinds = [(cmd[0], cmd[1] if cmd[0] == "abort" else cmd[1].request_id) for cmd in _commands(child)]
    assert kinds == [("add", "c"), ("abort", "c")]


def test_a_constraint_that_fails_to_compile_fails_its_request_alone() -> None:
    child, outbox, structured = _child()
    child.handle(("add", _submission("bad", grammar=True)))
    child.handle(("add", _submission("good")))
    structured.pending[0].set_exception(GrammarError("compile timed out", reason="timeout"))
    compiling, (kind, rid, exc) = outbox.sent
    assert compiling == ("compiling", "bad")
    assert (kind, rid) == ("reject", "bad") and "timed out" in str(exc)
    assert [cmd[1].request_id for cmd in _commands(child)] == ["good"]


def test_the_server_hears_when_a_constraint_compiles_before_the_engine_holds_it() -> None:
    # The watchdog counted a request compiling in the engine process as engine
    # work: a compile longer than --watchdog-timeout turned health NOT_SERVING
    # with the engine idle.
    from service.engine_proc.client import ProcessLink

    child, outbox, structured = _child()
    child.handle(("add", _submission("slow", grammar=True)))
    assert outbox.sent == [("compiling", "slow")]
    structured.pending[0].set_result(object())
    assert outbox.sent[1:] == [("compiled", "slow")]  # then in the engine
    child.handle(("add", _submission("plain")))
    assert len(outbox.sent) == 2  # a request the engine takes at once says nothing

    process = SimpleNamespace(send=lambda command: None, proc=SimpleNamespace(poll=lambda: None))
    link = ProcessLink(SimpleNamespace(process=process))  # type: ignore[arg-type]
    sink = SimpleNamespace(rejected=lambda *args: None)
    ctx = RequestFactory(None, 100, 64, frozenset({0}), None, None, None).context(  # type: ignore[arg-type]
        _submission("slow").spec, None, False, None)
    link.add(ctx, SimpleNamespace(matcher=None, spec=_submission("slow").spec, resample=False, reasoning=None))  # type: ignore[arg-type]
    link._handle(sink, ("compiling", ctx.request_id))  # type: ignore[arg-type]
    link._heard -= 100  # a long compile
    assert link.stalled_for() == 0.0
    link._handle(sink, ("compiled", ctx.request_id))  # type: ignore[arg-type]
    link._heard -= 100  # the engine holds it and says nothing for as long
    assert link.stalled_for() >= 100


def test_a_compile_in_the_engine_process_is_for_the_requests_client() -> None:
    # The compiler's fair queue: one client's compiles must not hold up another's.
    child, _, structured = _child()
    for rid, tenant in (("a", "key:alice"), ("b", "key:bob")):
        sub = _submission(rid, grammar=True)
        child.handle(("add", dataclasses.replace(sub, tenant=tenant)))
    assert structured.tenants == ["key:alice", "key:bob"]


def test_a_compile_error_from_the_engine_process_is_the_clients_status() -> None:
    # Not INTERNAL: the same status an in-process compile's failure gives.
    from service.api.generation import next_outputs
    from service.errors import ServiceError

    class Rejected:
        shutdown_reason = None

        async def next_outputs(self) -> list[Any]:
            raise GrammarError("grammar compile timed out after 10 s", reason="timeout", backend="xgrammar")

    with pytest.raises(ServiceError) as err:
        asyncio.run(next_outputs(Rejected(), "constraint.json_schema"))  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "timed out" in err.value.message


def test_a_step_message_carries_times_only_when_they_change() -> None:
    child, outbox, _ = _child()
    child.handle(("add", _submission("t")))
    [(_, ctx)] = _commands(child)
    ctx.times.arrival = 1.0
    child.stepped(child.engine, [RequestOutput("t", [1])])
    ctx.times.first_token = 2.0
    child.stepped(child.engine, [RequestOutput("t", [1])])
    child.stepped(child.engine, [RequestOutput("t", [2])])
    ctx.times.finished = 3.0
    child.stepped(child.engine, [RequestOutput("t", [3], finished=True)])
    child.stepped(child.engine, [])  # a step with no output still reports its stats and load
    assert [m[2] for m in outbox.sent] == [
        [("t", (1.0, None, None, None, 0))], [("t", (1.0, None, 2.0, None, 0))], [],
        [("t", (1.0, None, 2.0, 3.0, 0))], []]
    assert all(m[0] == "step" and m[3] == StepStats(0.001, 2, 2) and m[4] == EngineLoad(2, 0, 3, 10)
               for m in outbox.sent)
    # So does the CPU time of the process's engine and device threads, for the server's metrics.
    cpu = [m[5] for m in outbox.sent]
    assert all(isinstance(c, ThreadCpu) and c.engine and c.device for c in cpu)
    assert all(a.engine <= b.engine and a.device <= b.device  # type: ignore[operator]
               for a, b in zip(cpu, cpu[1:], strict=False))
    # The server's copy of the context gets them.
    server_ctx = TextContext(tokens=np.array([5, 6, 7]), max_length=7)
    mirror_times(server_ctx, outbox.sent[3][2][0][1])
    assert times_of(server_ctx) == (1.0, None, 2.0, 3.0, 0)
    # ... and the passes its grammar's forced runs saved (the passes_saved metric).
    mirror_times(server_ctx, (1.0, None, 2.0, 3.0, 7))
    assert server_ctx.grammar.num_jumped == 7


def test_a_call_answers_with_its_result_or_its_error() -> None:
    child, outbox, _ = _child()
    child.handle(("call", 7, len))
    [(kind, fn, future)] = _commands(child)
    future.set_result(3)
    child.handle(("call", 8, len))
    [(_, _, failing)] = _commands(child)
    failing.set_exception(ValueError("no"))
    assert outbox.sent[0] == ("result", 7, True, 3)
    assert outbox.sent[1][:3] == ("result", 8, False) and str(outbox.sent[1][3]) == "no"


def test_an_error_that_does_not_pickle_crosses_as_its_message() -> None:
    class Local(Exception):
        pass

    err = portable_error(Local("lost class"))
    assert isinstance(err, RuntimeError) and "Local: lost class" in str(err)
    kept = ValueError("kept")
    assert portable_error(kept) is kept
    # A rejection crosses as itself, its field kept (it would not unpickle).
    from engine.sampling_params import InvalidSamplingParams

    bad = pickle.loads(pickle.dumps(portable_error(InvalidSamplingParams("top_p", "must be in (0, 1]"))))
    assert isinstance(bad, InvalidSamplingParams) and (bad.field, bad.description) == ("top_p", "must be in (0, 1]")


def test_an_engine_process_whose_server_died_exits() -> None:
    # While the engine loads nothing reads the pipe, so the process watches
    # its parent: a server that died (here, a parent that exits at once) takes it down.
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    # As the engine process runs it: a thread of its own, while the process
    # goes on (here a long sleep: only the watch can end it in time).
    watch = (f"import os, sys, threading, time; sys.path.insert(0, {root!r}); "
             "from service.engine_proc.child import _exit_when_orphaned; "
             "threading.Thread(target=_exit_when_orphaned, args=(os.getppid(), 0.05), daemon=True).start(); "
             "print(os.getpid(), flush=True); time.sleep(600)")
    parent = ("import subprocess, sys; "
              f"child = subprocess.Popen([sys.executable, '-c', {watch!r}], stdout=subprocess.PIPE); "
              "print(child.stdout.readline().decode().strip(), flush=True)")
    pid = int(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True,
                             timeout=120).stdout)
    deadline = time.monotonic() + 30
    while process_running(pid):
        assert time.monotonic() < deadline, "the orphaned engine process kept running"
        time.sleep(0.05)


def test_a_spawn_that_fails_leaves_no_pipe_open(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's ends of both pipes stayed open after a failed fork (two fds
    # a try: a server embedded in a longer-lived process ran out of them).
    import os

    from service.engine_proc import client

    def no_fork(*args: Any, **kwargs: Any) -> Any:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(client.subprocess, "Popen", no_fork)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(OSError):
            client.EngineProcess(None)  # type: ignore[arg-type]
    assert len(os.listdir("/proc/self/fd")) == before
