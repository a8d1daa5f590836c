"""Compile workers forked from the zygote: who their parent is, what happens
when the zygote or the server dies, and the fall-back to fresh interpreters."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from grammar import GrammarCompiler, GrammarSpec, _zygote

from .conftest import MODEL_VOCAB, REPO, STOP_IDS, TOKENIZER_DIR

pytestmark = pytest.mark.skipif(not _zygote.supported(), reason="no fork + pidfd on this platform")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the name (state, ppid, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):  # gone before or while read
        return None


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else int(stat[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _wait_gone(pids: list[int], reaped: bool = False, limit: float = 10.0) -> None:
    """Until none of `pids` runs; with `reaped`, until none is left even as a zombie."""
    deadline = time.monotonic() + limit
    while any(_stat(p) is not None if reaped else _alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still there: {[(p, _stat(p)) for p in pids]}"
        time.sleep(0.05)


def _compiler(tokenizer) -> GrammarCompiler:  # type: ignore[no-untyped-def]
    return GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_workers=1)


def test_every_compiler_forks_its_workers_from_one_zygote(tokenizer):
    with _compiler(tokenizer) as a, _compiler(tokenizer) as b:
        assert a.compile(GrammarSpec.regex("a+"), backend="xgrammar").accept_tokens(a.tokenizer_data.encode("aa"))
        assert b.compile(GrammarSpec.regex("b+"), backend="llguidance").accept_tokens(b.tokenizer_data.encode("bb"))
        zygote = _zygote.zygote_pid()
        assert zygote is not None and _parent(zygote) == os.getpid()
        workers = a.worker_pids() + b.worker_pids()
        assert len(set(workers)) == 2 and all(_parent(w) == zygote for w in workers)
    # Closing the compilers kills their workers (which the zygote reaps) and
    # leaves the zygote for the next.
    _wait_gone(workers, reaped=True)
    assert _zygote.zygote_pid() == zygote and _alive(zygote)


def test_a_killed_zygote_takes_its_workers_and_a_new_one_replaces_it(tokenizer, monkeypatch):
    monkeypatch.setattr(_zygote, "_failures", 0)
    with _compiler(tokenizer) as c:
        c.compile(GrammarSpec.regex("x+"), backend="xgrammar")
        (worker,) = c.worker_pids()
        zygote = _zygote.zygote_pid()
        assert zygote is not None
        os.kill(zygote, signal.SIGKILL)
        _wait_gone([zygote, worker])  # the worker dies with its zygote (PR_SET_PDEATHSIG)
        m = c.compile(GrammarSpec.regex("y+"), backend="xgrammar")
        assert m.accept_tokens(c.tokenizer_data.encode("yy")) >= 1
        fresh = _zygote.zygote_pid()
        assert fresh not in (None, zygote)
        (replacement,) = c.worker_pids()
        assert _parent(replacement) == fresh


def test_a_stuck_zygote_is_replaced_without_waiting_out_the_start_up_budget(tokenizer, monkeypatch):
    # A zygote that answered before and now does not (stopped here; hung in
    # practice) is given seconds, not the worker's start-up budget.
    monkeypatch.setattr(_zygote, "_failures", 0)
    monkeypatch.setattr(_zygote, "_READY_ANSWER_S", 0.5)
    with _compiler(tokenizer) as c:
        c.compile(GrammarSpec.regex("s+"), backend="xgrammar")  # the zygote has answered once
        stuck = _zygote.zygote_pid()
        assert stuck is not None
        os.kill(stuck, signal.SIGSTOP)
        try:
            with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_workers=1,
                                 worker_startup_timeout_s=60.0) as fresh:
                start = time.monotonic()
                m = fresh.compile(GrammarSpec.regex("t+"), backend="xgrammar")
                assert m.accept_tokens(fresh.tokenizer_data.encode("tt")) >= 1
                assert time.monotonic() - start < 30.0
                replacement = _zygote.zygote_pid()
                assert replacement not in (None, stuck)
                assert _parent(fresh.worker_pids()[0]) == replacement
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGCONT)
    _wait_gone([stuck], reaped=True)  # the stuck one was killed and reaped
    assert _zygote._failures == 1


_SERVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from transformers import AutoTokenizer
from grammar import GrammarCompiler, GrammarSpec, _zygote
c = GrammarCompiler(AutoTokenizer.from_pretrained(sys.argv[2]), compile_workers=2)
c.compile(GrammarSpec.regex("a+"), backend="xgrammar")
print(_zygote.zygote_pid(), *c.worker_pids(), flush=True)
time.sleep(600)
"""


def test_the_zygote_and_its_workers_end_with_the_server():
    # However the server ends (here SIGKILL: no cleanup runs), nothing it
    # started for compiles stays behind.
    with subprocess.Popen([sys.executable, "-c", _SERVER, str(REPO), str(TOKENIZER_DIR)],
                          stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            pids = [int(p) for p in server.stdout.readline().split()]
            assert len(pids) == 3 and all(_alive(p) for p in pids)
        finally:
            server.kill()
    _wait_gone(pids)


def test_without_a_zygote_workers_start_as_fresh_interpreters(tokenizer, monkeypatch):
    # A zygote that cannot start is tried _MAX_FAILURES times, then no more;
    # compiles go on either way, in workers that are the server's own children.
    def cannot_start() -> None:
        raise OSError("no zygote today")

    monkeypatch.setattr(_zygote, "_Zygote", cannot_start)
    monkeypatch.setattr(_zygote, "_zygote", None)
    monkeypatch.setattr(_zygote, "_failures", 0)
    with _compiler(tokenizer) as c:
        for i in range(2):
            c.compile(GrammarSpec.regex(f"z{i}+"), backend="xgrammar")
            (worker,) = c.worker_pids()
            assert _parent(worker) == os.getpid()
            assert _zygote._failures == _zygote._MAX_FAILURES and _zygote.zygote_pid() is None
            os.kill(worker, signal.SIGKILL)  # the next compile needs a new worker
            _wait_gone([worker])


def test_a_platform_that_refuses_pidfds_gets_no_zygote(monkeypatch):
    # A container's seccomp profile may refuse pidfd_open: found at the probe,
    # not by three zygotes started for nothing.
    def refused(pid: int) -> int:
        raise PermissionError("pidfd_open")

    monkeypatch.setattr(os, "pidfd_open", refused)
    _zygote.supported.cache_clear()
    try:
        assert not _zygote.supported()
        assert _zygote.fork_worker(0, 0, 1.0) is None
    finally:
        monkeypatch.undo()
        _zygote.supported.cache_clear()
    assert _zygote.supported()


def test_a_compile_waits_for_its_compilers_first_worker_while_the_zygote_starts(tokenizer, monkeypatch):
    # A fresh process's zygote takes seconds to import the libraries before it
    # forks the first worker; a compile that comes at once waits for that, as it
    # waits for its compiler's construction, rather than time out as busy.
    monkeypatch.setattr(_zygote, "_zygote", None)  # the next worker needs a new zygote
    monkeypatch.setattr(_zygote, "_failures", 0)
    try:
        with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_workers=1,
                             compile_timeout_s=0.3) as c:
            assert c.compile(GrammarSpec.regex("a+"), backend="xgrammar").accept_tokens(
                c.tokenizer_data.encode("a"))
            assert _parent(c.worker_pids()[0]) == _zygote.zygote_pid()
    finally:
        if _zygote._zygote is not None:  # this test's; the session's comes back after it
            _zygote._zygote.close()


class _Refusing:
    """A zygote that cannot fork (as under a process limit)."""

    def __init__(self) -> None:
        self.asked = 0

    def fork(self, read_fd: int, write_fd: int, timeout: float) -> _zygote.ForkedProcess:
        self.asked += 1
        raise _zygote.ForkRefused


def test_a_refused_fork_costs_one_worker_its_zygote_and_not_the_zygote(tokenizer, monkeypatch):
    refusing = _Refusing()
    monkeypatch.setattr(_zygote, "_zygote", refusing)
    monkeypatch.setattr(_zygote, "_failures", 0)
    with _compiler(tokenizer) as c:
        c.compile(GrammarSpec.regex("r+"), backend="xgrammar")
        assert _parent(c.worker_pids()[0]) == os.getpid()  # a fresh interpreter instead
    assert refusing.asked == 1 and _zygote._zygote is refusing and _zygote._failures == 0


def test_the_zygote_answers_a_fork_it_cannot_make_with_none(monkeypatch):
    # The zygote's side of a refused fork: no child, no exception (which would
    # end the zygote and every worker with it).
    def no_fork() -> int:
        raise BlockingIOError("fork: resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    assert _zygote._fork(lambda: None) == (0, None)


def test_a_worker_that_cannot_start_leaks_no_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the zygote nor a fresh interpreter could start it (a process
    limit): the parent's two pipe ends leaked on every try (three a compile)."""
    import errno

    from grammar import _pool

    monkeypatch.setattr(_pool, "fork_worker", lambda *args: None)

    def refused(*args: object) -> None:
        raise BlockingIOError(errno.EAGAIN, "fork: Resource temporarily unavailable")

    monkeypatch.setattr(_pool, "_start_interpreter", refused)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(OSError):
            _pool.WorkerProcess(b"", startup_timeout_s=1.0)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_spawn_cancelled_by_close_is_no_worker_starting() -> None:
    """close() cancels spawns still queued; reading one's exception() raised
    CancelledError out of the pool's wait for a worker instead of its closed error."""
    from concurrent.futures import Future

    from grammar import _pool

    cancelled: Future = Future()
    assert cancelled.cancel()
    assert not _pool._starting(cancelled)
