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
and the zygote answers with the child's pid. The parent opens a pidfd on that
pid (`ForkedProcess`), through which it sees the worker end and kills it, as
it would a child of its own.

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
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
_BOOT = (
    "import os, sys; os.nice(int(sys.argv[3])); sys.path.insert(0, sys.argv[1]); "
    "from grammar._zygote import serve; serve(int(sys.argv[2]))"
)
_PID = struct.Struct("!q")
# Zygotes that failed (could not start, died, answered nonsense) before this
# process stops trying: each costs a fresh interpreter's start-up at most.
_MAX_FAILURES = 3


class ForkedProcess:
    """A worker forked by the zygote, seen through a pidfd: the parts of
    `subprocess.Popen` the pool uses (`pid`, `poll`, `kill`, `wait`), safe to
    call from any thread. Its exit status belongs to the zygote; `returncode`
    is -1 once it has ended."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # Opened while the worker waits for its init message, before it can
        # end, so the pid cannot have been reused by another process.
        self._pidfd: int | None = os.pidfd_open(pid)
        self.returncode: int | None = None
        # Guards the pidfd: `wait` closes it, which another thread's `poll`
        # must not see half done (a closed descriptor's number is reused).
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and self._ended(0.0):
                self.returncode = -1
            return self.returncode

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


class _Zygote:
    """The parent's end of one zygote process."""

    def __init__(self) -> None:
        from ._worker import COMPILE_NICENESS

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # One compile uses one core; keep torch/tokenizers in the workers from
        # starting thread pools they never use (and the zygote from forking
        # with threads running).
        env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _PACKAGE_PARENT, str(theirs.fileno()), str(COMPILE_NICENESS)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                # Native libraries log warnings to stderr; they are not ours to show.
                stderr=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request and its answer at a time

    def fork(self, read_fd: int, write_fd: int, timeout: float) -> int:
        """The pid of a worker forked on these pipe ends (which the caller still
        closes); OSError if the zygote does not answer within `timeout` (its
        first answer waits for its imports)."""
        with self._lock:
            self._sock.settimeout(timeout)
            socket.send_fds(self._sock, [b"f"], [read_fd, write_fd])
            answer = b""
            while len(answer) < _PID.size:
                chunk = self._sock.recv(_PID.size - len(answer))
                if not chunk:
                    raise ConnectionError("the compile zygote exited")
                answer += chunk
        (pid,) = _PID.unpack(answer)
        if pid <= 0:
            raise ConnectionError("the compile zygote could not fork")
        return pid

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            self.proc.kill()
            self.proc.wait(timeout=5)


_lock = threading.Lock()
_zygote: _Zygote | None = None
_owner_pid = 0  # the process `_zygote` belongs to (a forked child must not use its parent's)
_failures = 0  # guarded by _lock


@functools.cache
def supported() -> bool:
    """Whether this platform can fork workers from a zygote and watch them by
    pidfd (probed once: a container's seccomp profile may refuse pidfd_open)."""
    if not (hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
            and hasattr(socket, "send_fds")):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def fork_worker(read_fd: int, write_fd: int, timeout: float) -> ForkedProcess | None:
    """A compile worker forked from this process's zygote on the given pipe
    ends, or None where there is no zygote to fork it (the caller then starts
    one itself). The zygote is started on first use; one that fails (it died,
    say) is closed and another started in its place, up to `_MAX_FAILURES`
    in the life of this process."""
    global _zygote, _owner_pid, _failures
    if not supported():
        return None
    while True:
        with _lock:
            if _owner_pid != os.getpid():
                _zygote, _owner_pid, _failures = None, os.getpid(), 0
            if _failures >= _MAX_FAILURES:
                return None
            if _zygote is None:
                try:
                    _zygote = _Zygote()
                except OSError as e:
                    _failed(f"could not start: {e}")
                    continue
            zygote = _zygote
        try:
            return ForkedProcess(zygote.fork(read_fd, write_fd, timeout))
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
        if _zygote is None or _owner_pid != os.getpid():
            return None
        return _zygote.proc.pid


# ---- the zygote process ------------------------------------------------------


def serve(sock_fd: int) -> None:
    """Entry point of the zygote: import what workers need, then fork one per
    request until the parent's end of the socket closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
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
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            sock.sendall(_PID.pack(0))
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _worker.main(fds[0], fds[1], me)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        sock.sendall(_PID.pack(pid))
