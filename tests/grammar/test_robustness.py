"""Regressions from a hostile-client harness: compiler deadlock, abandoned
compiles."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future

import pytest

from grammar import GrammarCompiler, GrammarError, GrammarSpec

from .conftest import BACKENDS, MODEL_VOCAB, STOP_IDS


def _in_thread(fn, timeout: float = 20.0):
    """Run fn() on a thread; fail (instead of hanging the suite) if it never returns."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call never returned (deadlock)"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def thread_compiler(tokenizer):
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation="thread", compile_timeout_s=5.0) as c:
        yield c


def test_compile_finished_before_its_callback_is_registered_does_not_deadlock(thread_compiler):
    # The executor finishes the compile before submit() returns: the in-flight
    # bookkeeping callback then runs at once, on this thread. It used to run
    # under the compiler's lock, which it takes again: the caller (the event
    # loop, in the server) blocked for ever.
    c = thread_compiler

    def submit_done(fn, *args):
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    c._executor.submit = submit_done  # type: ignore[method-assign]
    fut = _in_thread(lambda: c.compile_async(GrammarSpec.regex("(unbalanced")))
    with pytest.raises(GrammarError, match="regex"):
        fut.result(timeout=5)
    ok = _in_thread(lambda: c.compile_async(GrammarSpec.regex("[a-c]+")))
    assert ok.result(timeout=5).backend in BACKENDS
    assert c.pending_compiles == 0


def _slow_compiles(c: GrammarCompiler, seconds: dict[str, float]) -> list[str]:
    """Make regex compiles take `seconds[source]`; returns the log of compiles that ran."""
    ran: list[str] = []
    real = c._compile_one

    def compile_one(backend, spec, timeout):
        ran.append(spec.source)
        time.sleep(seconds.get(spec.source, 0.0))
        return real(backend, spec, timeout)

    c._compile_one = compile_one  # type: ignore[method-assign]
    return ran


def test_an_abandoned_compile_leaves_the_queue(thread_compiler):
    c = thread_compiler
    ran = _slow_compiles(c, {"a+": 1.0})
    first = c.compile_async(GrammarSpec.regex("a+"))
    time.sleep(0.2)  # the one compile thread is busy with it now
    abandoned = c.compile_async(GrammarSpec.regex("b+"))
    waited = c.compile_async(GrammarSpec.regex("c+"))
    assert c.pending_compiles == 3
    assert abandoned.cancel()
    assert c.pending_compiles == 2
    assert first.result(timeout=10).backend and waited.result(timeout=10).backend
    with pytest.raises(CancelledError):
        abandoned.result()
    assert ran == ["a+", "c+"]  # the abandoned one never compiled
    assert c.pending_compiles == 0


def test_a_compile_shared_by_two_callers_runs_while_one_waits(thread_compiler):
    c = thread_compiler
    ran = _slow_compiles(c, {"a+": 0.5, "d+": 0.0})
    busy = c.compile_async(GrammarSpec.regex("a+"))
    time.sleep(0.1)
    one = c.compile_async(GrammarSpec.regex("d+"))
    two = c.compile_async(GrammarSpec.regex("d+"))
    assert one.cancel()
    assert two.result(timeout=10).backend and busy.result(timeout=10)
    assert ran == ["a+", "d+"]


def test_queue_wait_counts_against_the_timeout_and_is_not_cached(tokenizer):
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation="thread", compile_timeout_s=0.5) as c:
        seconds = {"a+": 1.0}
        _slow_compiles(c, seconds)
        busy = c.compile_async(GrammarSpec.regex("a+"))
        queued = c.compile_async(GrammarSpec.regex("e+"))
        start = time.monotonic()
        with pytest.raises(GrammarError, match="busy") as err:
            queued.result(timeout=10)
        assert err.value.reason == "timeout"
        assert time.monotonic() - start < 2.0
        busy.exception(timeout=10)
        # The failure was the queue's, not the spec's: compiled fine once idle.
        assert c.compile(GrammarSpec.regex("e+")).backend in BACKENDS


def test_distinct_failing_constraints_beside_each_other_never_hang(compiler):
    futures = [compiler.compile_async(GrammarSpec.regex(f"(unbalanced{i}")) for i in range(40)]
    for fut in futures:
        with pytest.raises(GrammarError):
            fut.result(timeout=60)
    assert compiler.pending_compiles == 0
