"""Compile worker processes, owned by the parent: spawn, dispatch, kill on timeout.

Why processes. A JSON schema compile is native code that cannot be interrupted:
xgrammar expands nested `anyOf`/`oneOf` super-exponentially (measured here: a
77 KB schema with six levels of nested anyOf took 7.4 s, ten levels did not
finish in a minute) and holds a core the whole time. A thread that gives up
waiting leaves that core burning; a process can simply be killed. Each worker
is forked from the process's compile zygote (`_zygote`), which has imported
the grammar libraries once; where there is none, it is a plain `python -c`
child (not `multiprocessing`, which would re-import the server's `__main__`).
Either way it talks over two pipes it inherits.

Costs. A fresh interpreter imports xgrammar (and with it torch) at start-up,
about 1-3 s and a few hundred MB of memory; a worker forked from the zygote
only builds its tokenizer objects. Workers are started ahead of need and a
replacement is spawned as soon as one is killed. Per compile, the
result crosses the pipe: xgrammar's CompiledGrammar as JSON (~0.3 MB and ~5 ms
to rebuild for a small schema on an 8k vocabulary), llguidance's grammar text
(the parent then rebuilds the matcher template, ~0.5 ms).

Workers started as interpreters are spawned from one long-lived thread,
because PR_SET_PDEATHSIG ties a child's life to the thread that forked it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from ._worker import start_compile_process
from ._zygote import ForkedProcess, fork_worker
from .errors import GrammarError

# How often a compile waiting for a starting worker looks whether it is ready.
_READY_POLL_S = 0.05


class _Timeout(Exception):
    pass


class _Crashed(Exception):
    pass


class WorkerProcess:
    """One compile worker: a child process and the two pipe ends that reach it."""

    def __init__(self, init_blob: bytes, first: bool = False, startup_timeout_s: float = 60.0) -> None:
        self.first = first  # started with the pool, not to replace a killed one
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            # Forking waits for the zygote (its imports, the first time), up to
            # `startup_timeout_s`; a fresh interpreter is started at once.
            self.proc: subprocess.Popen[bytes] | ForkedProcess = (
                fork_worker(to_child_r, from_child_w, startup_timeout_s)
                or _start_interpreter(to_child_r, from_child_w))
        except BaseException:
            os.close(to_child_w)  # our ends too: nothing will use them
            os.close(from_child_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        # Its start-up time counts from here: a worker that falls back to an
        # interpreter after a zygote gave up is not born too old.
        self.started = time.monotonic()
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self._ready = False
        self._reading = threading.Lock()  # the ready message is read once, by one thread
        self._job = 0
        # The init message can be megabytes; the child reads it only after its
        # interpreter starts, so it is written from a helper thread.
        threading.Thread(target=self._send_init, args=(init_blob,), daemon=True).start()

    def _send_init(self, blob: bytes) -> None:
        # A dead child shows in wait_ready. A worker killed meanwhile has its
        # connection closed under this thread: OSError, ValueError, or TypeError
        # once the handle is None.
        with contextlib.suppress(OSError, ValueError, TypeError):
            self._send.send_bytes(blob)

    @property
    def ready(self) -> bool:
        return self._ready

    def wait_ready(self, timeout: float) -> None:
        with self._reading:
            self._read_ready(timeout)

    def poll_ready(self) -> bool:
        """Whether the worker is ready, without waiting (False while another
        thread reads its ready message). _Crashed if it died starting."""
        if self._ready:
            return True
        if not self._reading.acquire(blocking=False):
            return False
        try:
            self._read_ready(0.0)
        except _Timeout:
            return False
        finally:
            self._reading.release()
        return True

    def _read_ready(self, timeout: float) -> None:
        if self._ready:
            return
        try:
            if not self._recv.poll(timeout):
                raise _Timeout
            msg = self._recv.recv()
        except (EOFError, OSError) as e:
            raise _Crashed from e
        if not (isinstance(msg, tuple) and msg and msg[0] == "ready"):
            raise _Crashed
        self._ready = True

    def call(self, backend: str, spec: Any, max_bytes: int, timeout: float) -> tuple[Any, ...]:
        self._job += 1
        try:
            self._send.send(("compile", self._job, backend, spec, max_bytes))
            if not self._recv.poll(max(timeout, 0.0)):
                raise _Timeout
            reply = self._recv.recv()
        except (EOFError, OSError, ValueError, TypeError) as e:
            # (TypeError: the pool closed this worker's connection mid-read, at shutdown.)
            raise _Crashed from e
        if not isinstance(reply, tuple) or len(reply) != 4 or reply[1] != self._job:
            raise _Crashed
        return reply

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for conn in (self._send, self._recv):
            with contextlib.suppress(OSError):
                conn.close()


def _start_interpreter(to_child_r: int, from_child_w: int) -> subprocess.Popen[bytes]:
    """A worker as a fresh interpreter, where no zygote forks one (`_zygote`)."""
    return start_compile_process("grammar._worker:main", (to_child_r, from_child_w, os.getpid()),
                                 (to_child_r, from_child_w))


class WorkerPool:
    """A fixed number of compile workers; a killed one is replaced at once.

    A compile takes a ready idle worker when there is one, and waits for a
    starting one only when none is: a worker being replaced never delays a
    compile that another worker could run now.
    """

    def __init__(self, init: dict[str, Any], size: int, startup_timeout_s: float) -> None:
        self._blob = pickle.dumps(init, protocol=pickle.HIGHEST_PROTOCOL)
        self._startup_timeout = startup_timeout_s
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-spawn")
        self._cond = threading.Condition()
        self._idle: list[Future[WorkerProcess]] = []  # guarded by _cond, oldest first
        # The pool's first spawns: while one is being forked (its zygote may
        # still be importing), a compile takes it as it would the started worker.
        self._first_spawns: set[Future[WorkerProcess]] = set()
        self._all: set[WorkerProcess] = set()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(size):
            self._spawn(first=True)

    def _spawn(self, first: bool = False) -> Future[WorkerProcess] | None:
        with self._lock:
            if self._closed:
                return None
            fut = self._spawner.submit(self._start, first)
            if first:
                self._first_spawns.add(fut)
        self._give_back(fut)
        return fut

    def _give_back(self, fut: Future[WorkerProcess]) -> None:
        with self._cond:
            self._idle.append(fut)
            self._cond.notify()

    def _start(self, first: bool) -> WorkerProcess:
        worker = WorkerProcess(self._blob, first, self._startup_timeout)
        with self._lock:
            if self._closed:
                worker.kill()
                raise GrammarError("grammar compiler is closed", reason="crashed")
            self._all.add(worker)
        return worker

    def _discard(self, worker: WorkerProcess) -> Future[WorkerProcess] | None:
        """Kill `worker` and start its replacement (whose future is returned)."""
        worker.kill()
        with self._lock:
            self._all.discard(worker)
        return self._spawn()

    def _replace(self, worker: WorkerProcess, on_kill: Callable[[Callable[[float], None]], None] | None) -> None:
        """Kill a worker a compile made useless; tell `on_kill` how to wait for its replacement."""
        fut = self._discard(worker)
        if on_kill is not None and fut is not None:
            on_kill(lambda timeout: self._wait_started(fut, timeout))

    def _wait_started(self, fut: Future[WorkerProcess], timeout: float) -> None:
        """Block until the worker of `fut` is ready (or dead, or `timeout` passed)."""
        end = time.monotonic() + min(timeout, self._startup_timeout)
        try:
            worker = fut.result(max(0.0, end - time.monotonic()))
        except Exception:  # noqa: BLE001 - its start failed; the pool copes with that
            return
        while not self._closed and time.monotonic() < end and worker.proc.poll() is None:
            try:
                if worker.poll_ready():
                    return
            except _Crashed:
                return
            time.sleep(_READY_POLL_S)

    def run(self, backend: str, spec: Any, max_bytes: int, deadline: float,
            on_kill: Callable[[Callable[[float], None]], None] | None = None) -> tuple[Any, ...]:
        """Compile in a worker by `deadline` (time.monotonic()): the reply tuple,
        or GrammarError on timeout or crash.

        Waiting for a free worker counts against the deadline, and so does
        waiting for one to start (the replacement of one killed at a
        timeout): either way the server was busy, the spec is not to blame
        (GrammarError timeout without a backend). Were start-up excluded, a
        compile queued behind a killed one would hold its compile thread for
        the whole start-up, then time out at once and kill the new worker.

        When the compile kills its worker (timeout, crash), `on_kill` is
        called with a function that waits (up to a timeout in seconds) until
        the replacement is ready: the caller may charge that wait to whoever
        asked for the compile.
        """
        budget = deadline - time.monotonic()
        worker = self._acquire(deadline)
        started_by = worker.started + self._startup_timeout
        # A compiler's first workers start with it: a caller that uses it at
        # once waits for them, as for its construction, and then has the
        # budget it came with (no more: the start-up budget is minutes, which
        # a hostile compile would otherwise get too).
        first_wait = worker.first and not worker.ready
        worker.first = False
        try:
            worker.wait_ready(max(0.0, (started_by if first_wait else min(started_by, deadline)) - time.monotonic()))
        except _Timeout:
            if time.monotonic() >= started_by:  # it never started
                self._discard(worker)
                raise GrammarError("grammar compile worker could not start", reason="crashed") from None
            self._give_back(_done(worker))  # still starting: the next caller waits on
            raise GrammarError("grammar compile timed out waiting for a worker", reason="timeout") from None
        except _Crashed:
            self._discard(worker)
            raise GrammarError("grammar compile worker could not start", reason="crashed") from None
        if first_wait:
            deadline = max(deadline, time.monotonic() + budget)
        if deadline - time.monotonic() <= 0:
            # The wait for a worker used up the budget. Giving it a compile
            # now would only time out and kill a worker that did nothing
            # wrong, and every caller queued behind would do the same in turn.
            self._give_back(_done(worker))
            raise GrammarError("grammar compile timed out waiting for a worker", reason="timeout")
        try:
            reply = worker.call(backend, spec, max_bytes, deadline - time.monotonic())
        except _Timeout:
            self._replace(worker, on_kill)  # the only way to stop a native compile
            raise GrammarError(
                "grammar compile timed out", reason="timeout", backend=backend
            ) from None
        except _Crashed:
            self._replace(worker, on_kill)
            raise GrammarError(
                "grammar compile crashed", reason="crashed", backend=backend
            ) from None
        self._give_back(_done(worker))
        return reply

    def _acquire(self, deadline: float) -> WorkerProcess:
        """An idle worker: a ready one if any; else one of the pool's first
        workers still starting (see `run`); else the first replacement to
        become ready. GrammarError (timeout, no backend) at `deadline`."""
        # A worker that died while idle (OOM killer, operator) is replaced
        # transparently: the request has no part in that failure.
        for _ in range(3):
            fut = self._take(deadline)
            try:
                worker = fut.result()
            except Exception:  # noqa: BLE001 - it could not be spawned; try another
                self._spawn()
                continue
            if worker.proc.poll() is None:
                return worker
            self._discard(worker)
        raise GrammarError("grammar compile worker could not start", reason="crashed")

    def _take(self, deadline: float) -> Future[WorkerProcess]:
        while True:
            dead: list[WorkerProcess] = []
            fut = None
            with self._cond:
                if self._closed:
                    raise GrammarError("grammar compiler is closed", reason="crashed")
                fut = self._pick(dead)
                if fut is not None:
                    self._idle.remove(fut)
                elif not dead:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise GrammarError("grammar compile timed out waiting for a worker", reason="timeout")
                    # Readiness is polled: a starting worker sends no notice.
                    starting = any(_starting(f) for f in self._idle)
                    self._cond.wait(min(_READY_POLL_S if starting else 0.5, remaining))
            for worker in dead:  # replaced outside the lock (a kill waits for the process)
                self._discard(worker)
            if fut is not None:
                return fut

    def _pick(self, dead: list[WorkerProcess]) -> Future[WorkerProcess] | None:
        """The idle worker to use now, if any (under `_cond`); dead ones, and
        ones that never started, are moved to `dead`."""
        first = None
        now = time.monotonic()
        for fut in list(self._idle):
            if not fut.done():
                if fut in self._first_spawns:
                    first = first or fut
                continue  # being spawned
            if fut.cancelled() or fut.exception() is not None:
                return fut  # _acquire spawns another (a spawn cancelled by close(): it is closed)
            worker = fut.result()
            if worker.proc.poll() is not None:
                self._idle.remove(fut)
                dead.append(worker)
                continue
            try:
                if worker.poll_ready():
                    return fut
            except _Crashed:
                self._idle.remove(fut)
                dead.append(worker)
                continue
            if worker.first:
                first = first or fut
            elif now > worker.started + self._startup_timeout:
                self._idle.remove(fut)  # it never started
                dead.append(worker)
        return first

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        with self._cond:
            self._cond.notify_all()
        for worker in workers:
            worker.kill()
        self._spawner.shutdown(wait=False, cancel_futures=True)


def _starting(fut: Future[WorkerProcess]) -> bool:
    """Whether `fut` is a worker still being spawned or one that has not said it is ready."""
    return not fut.done() or (not fut.cancelled() and fut.exception() is None and not fut.result().ready)


def _done(worker: WorkerProcess) -> Future[WorkerProcess]:
    fut: Future[WorkerProcess] = Future()
    fut.set_result(worker)
    return fut
