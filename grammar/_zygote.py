"""The compile workers' zygote: a process that has imported the grammar
libraries once and forks every compile worker of its parent from itself.

Why. A worker started as a fresh interpreter imports xgrammar, and with it
torch and transformers: about 2 s of CPU and ~300 MB before it can compile
anything. Every compiler starts its workers so, and a worker killed at a
compile timeout is replaced so, while the tenant whose compile timed out waits
for the replacement. Forked from a process that has done those imports, a
worker only builds its tokenizer objects (tens of milliseconds on an 8k
vocabulary) and shares the libraries' memory pages with its siblings.

How. The zygote is a `python -c` child, one per parent process, started when
the parent first needs a worker and shared by all of its compilers. It reads
fork requests from a Unix socket, each carrying the two pipe ends of a new
worker (SCM_RIGHTS); it forks, the child runs `_worker.main` on those pipes,
and the zygote answers with the child's pid and a pidfd on it
(`ForkedProcess`), through which the parent sees the worker end and kills it,
as it would a child of its own.

Lifetimes. The zygote exits when its socket reports end of file, which the
kernel ensures when the parent process ends, however it ends. Each worker is
tied to the zygote by PR_SET_PDEATHSIG (the zygote runs one thread, the one
that forks), so a worker stuck in native code dies with it. The zygote ignores
SIGCHLD: the kernel reaps its children, and a killed worker leaves no zombie.

Where a zygote cannot be had (no fork or pidfd: not Linux; it failed to
start or died three times), `fork_worker` returns None and the pool starts
the worker as a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_PID = struct.Struct("!q")
# Zygotes that failed (could not start, died, answered nonsense) before this
# process stops trying: each costs a fresh interpreter's start-up at most.
_MAX_FAILURES = 3
# How long a zygote that has answered before may take to answer a fork (a
# fork takes milliseconds): one that is stuck is replaced after this, rather
# than after the worker's whole start-up budget (its first answer waits for
# its imports, and gets that budget). Replacing it ends its workers (and the
# compiles they run) and counts towards _MAX_FAILURES: a host frozen for
# longer than this several times ends up with interpreter-started workers.
_READY_ANSWER_S = 10.0


class ForkedProcess:
    """A worker forked by the zygote, seen through its pidfd: the parts of
    `subprocess.Popen` the pool uses (`pid`, `poll`, `kill`, `wait`), safe to
    call from any thread. Its exit status belongs to the zygote; `returncode`
    is -1 once it has ended."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd
        self.returncode: int | None = None
        # Guards the pidfd: `wait` closes it, which another thread's `poll`
        # must not see half done (a closed descriptor's number is reused).
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        # Never blocks (the pool polls under its own lock): while another
        # thread waits for the worker to end, it is taken as running.
        if not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            if self.returncode is None and self._ended(0.0):
                self.returncode = -1
            return self.returncode
        finally:
            self._lock.release()

    def kill(self) -> None:
        with self._lock:
            if self._pidfd is not None and self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                if not self._ended(timeout):
                    raise subprocess.TimeoutExpired(f"compile worker {self.pid}", timeout or 0.0)
                self.returncode = -1
            if self._pidfd is not None:  # nothing more to learn from it
                os.close(self._pidfd)
                self._pidfd = None
            return self.returncode

    def _ended(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        readable, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(readable)

    def __del__(self) -> None:
        fd = getattr(self, "_pidfd", None)  # None too if __init__ failed
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class ForkRefused(Exception):
    """The zygote could not fork this worker (a process limit, say); it serves on."""


class _Zygote:
    """The parent's end of one zygote process."""

    def __init__(self) -> None:
        from ._worker import start_compile_process

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = start_compile_process("grammar._zygote:serve", (theirs.fileno(),), (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request and its answer at a time
        self._answered = False  # its imports are done: later answers come fast

    def fork(self, read_fd: int, write_fd: int, timeout: float) -> ForkedProcess:
        """A worker forked on these pipe ends (which the caller still closes).
        ForkRefused if the zygote could not fork; OSError if it is gone or did
        not answer within `timeout` (its first answer waits for its imports;
        later ones within `_READY_ANSWER_S` at most), after which it must not be
        asked again (a late answer would be read as the next request's)."""
        with self._lock:
            self._sock.settimeout(min(timeout, _READY_ANSWER_S) if self._answered else timeout)
            socket.send_fds(self._sock, [b"f"], [read_fd, write_fd])
            answer, fds, _, _ = socket.recv_fds(self._sock, _PID.size, 1, socket.MSG_WAITALL)
            self._answered = True
        if len(answer) < _PID.size:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the compile zygote exited")
        (pid,) = _PID.unpack(answer)
        if pid <= 0 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ForkRefused
        return ForkedProcess(pid, fds[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=5)


_lock = threading.Lock()
_zygote: _Zygote | None = None
_failures = 0  # zygotes that failed in this process; guarded by _lock


def _after_fork_in_child() -> None:
    # A child forked from a process with a zygote (a worker forked by the
    # zygote is one) must neither use nor keep alive its parent's: it starts
    # its own if it ever needs one.
    global _lock, _zygote, _failures
    _lock = threading.Lock()
    if _zygote is not None:
        with contextlib.suppress(OSError):
            _zygote._sock.close()
    _zygote, _failures = None, 0


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def supported() -> bool:
    """Whether this platform can fork workers from a zygote and watch and kill
    them by pidfd (probed once: a container's seccomp profile may refuse
    pidfd_open or pidfd_send_signal)."""
    if not (hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
            and hasattr(socket, "send_fds")):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
        try:
            signal.pidfd_send_signal(fd, 0)  # signal 0: checks the right to signal, sends nothing
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def fork_worker(read_fd: int, write_fd: int, timeout: float) -> ForkedProcess | None:
    """A compile worker forked from this process's zygote on the given pipe
    ends, or None where the zygote cannot fork it (the caller then starts one
    itself). The zygote is started on first use; one that fails (it died,
    say) is closed and another started in its place, up to `_MAX_FAILURES`
    in the life of this process, all within `timeout` seconds."""
    global _zygote
    if not supported():
        return None
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            if _failures >= _MAX_FAILURES:
                return None
            if _zygote is None:
                try:
                    _zygote = _Zygote()
                except OSError as e:
                    _failed(f"could not start: {e}")
                    continue
            zygote = _zygote
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            return zygote.fork(read_fd, write_fd, remaining)
        except ForkRefused:
            return None  # this worker only: the zygote serves the next
        except OSError as e:
            with _lock:
                if _zygote is zygote:
                    _zygote = None
                    _failed(f"failed: {e}")
            zygote.close()


def _failed(why: str) -> None:
    global _failures
    _failures += 1
    fallback = "; compile workers start as fresh interpreters from now on" if _failures >= _MAX_FAILURES else ""
    log.warning("grammar compile zygote %s%s", why, fallback)


def zygote_pid() -> int | None:
    """The pid of this process's zygote, if one runs (for tests and diagnostics)."""
    with _lock:
        return None if _zygote is None else _zygote.proc.pid


# ---- the zygote process ------------------------------------------------------


def serve(sock_fd: int) -> None:
    """Entry point of the zygote: import what workers need, then fork one per
    request until the parent's end of the socket closes."""
    signal.signal(signal.SIGCHLD, _reap)
    sock = socket.socket(fileno=sock_fd)
    # What a worker imports before it can compile, done once here for all of them.
    import llguidance  # noqa: F401
    import xgrammar  # noqa: F401

    from . import _worker
    me = os.getpid()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 16, 2)
        except OSError:
            return
        if not message:
            return  # the parent is gone
        def worker(inbox: int = fds[0], outbox: int = fds[-1]) -> None:
            sock.close()  # the zygote's, not the worker's
            _worker.main(inbox, outbox, me)

        try:
            pid, pidfd = _fork(worker) if len(fds) == 2 else (0, None)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(sock, [_PID.pack(pid)], [] if pidfd is None else [pidfd])
        except OSError:
            return
        finally:
            if pidfd is not None:
                os.close(pidfd)


def _fork(run: Callable[[], None]) -> tuple[int, int | None]:
    """Fork a child that runs `run`; its pid and a pidfd on it, or (0, None)
    if it could not be forked or watched."""
    # Held back until the pidfd is open: the SIGCHLD handler must not reap a
    # child that ends at once before then (its pid could be reused).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        try:
            pid = os.fork()
        except OSError:
            return 0, None
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                run()
                code = 0
            finally:
                os._exit(code)
        try:
            return pid, os.pidfd_open(pid)
        except OSError:
            os.kill(pid, signal.SIGKILL)  # not yet reaped: the pid is still this child's
            return 0, None
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _reap(signum: int, frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
