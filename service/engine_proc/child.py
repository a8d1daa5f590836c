"""The engine process: builds an EngineCore, then serves the server's commands.

Its main thread is the engine thread (an `EngineDriver`); a reader thread takes
commands off the pipe, compiles a request's constraint when the compiler has
not got it yet (loading the server's compile when it came along, else in the
compile's own worker process: the engine thread never waits for it), and hands
the driver each built context. Every
step's outputs, and the step's stats and load for the server's metrics, go
back in one message. The process ignores SIGINT (a terminal's Ctrl-C reaches
the whole process group): the server drains, then stops it. If the server
dies first, the pipe's end tells the reader, which stops the engine (and the
process, should a step never end).

Started by `client.EngineProcess` as a plain `python -c` child with two
inherited pipes (not `multiprocessing`, which would re-import the server's
`__main__`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from engine import EngineCore, RequestOutput
from engine.context import TextContext
from engine.kv_cache import KVEvent, PagesStored
from engine.warmup import freeze_heap
from grammar import Matcher

from ..engine_loop import EngineDriver
from ..ops.metrics import thread_cpu_seconds
from .wire import (
    EngineFacts,
    EngineProcessSpec,
    SendEnd,
    Submission,
    ThreadCpu,
    Times,
    portable_error,
    times_of,
)

log = logging.getLogger(__name__)

# After the server's end of the pipe closes, how long the engine may take to stop.
_ORPHAN_EXIT_S = 10.0


class EngineChild:
    """The engine process's side of the link: a driver sink and a command reader."""

    def __init__(self, engine: EngineCore, outbox: SendEnd):
        self.engine = engine
        self.outbox = outbox
        self.driver = EngineDriver(engine, self)
        self._device = engine.executor.thread
        # Requests in the engine: their contexts and the times last sent for them.
        self._sent: dict[str, tuple[TextContext, Times | None]] = {}
        # Requests whose constraint is compiling: True once aborted meanwhile.
        self._compiling: dict[str, bool] = {}
        # Those whose compile the server was told of ("compiling"): it tells
        # the server's watchdog that the engine does not hold them yet.
        self._announced: set[str] = set()
        self._lock = threading.Lock()

    # -- the reader thread ----------------------------------------------------
    def read_commands(self, inbox: Connection) -> None:
        """Feed the driver until ("stop",) or the server's end of the pipe closes."""
        while True:
            try:
                cmd = inbox.recv()
            except (EOFError, OSError):  # the server is gone: stop, whatever the engine is doing
                timer = threading.Timer(_ORPHAN_EXIT_S, os._exit, (1,))
                timer.daemon = True
                timer.start()
                cmd = ("stop",)
            except Exception as exc:  # noqa: BLE001 - a command it cannot unpickle: the link is broken
                # Said to the server, which fails every stream and stops (a
                # dead reader would leave them, and every later one, waiting).
                log.exception("a command from the server could not be read")
                self.failed(exc)
                cmd = ("stop",)
            if not self.handle(cmd):
                return

    def handle(self, cmd: tuple[Any, ...]) -> bool:
        """Apply one command from the server; False once it was ("stop",)."""
        kind = cmd[0]
        if kind == "add":
            self._add(cmd[1])
        elif kind == "abort":
            # Under the lock that `_enqueue` adds under: an abort either finds
            # its request compiling or reaches the driver after its add.
            with self._lock:
                if cmd[1] in self._compiling:
                    self._compiling[cmd[1]] = True
                self.driver.put(cmd)
        elif kind == "call":
            self._call(cmd[1], cmd[2])
        elif kind == "kv_listen":
            self._call(cmd[1], self._listen_kv)
        elif kind == "kv_snapshot":
            self._call(cmd[1], _kv_snapshot)
        else:
            self.driver.put(("stop",))
            return False
        return True

    def _add(self, sub: Submission) -> None:
        if sub.grammar is None:
            self._enqueue(sub, None)
            return
        spec, backend = sub.grammar
        # The server's compile goes to the compiler alone: the callback below
        # keeps `sub` as long as the future lives, and need not keep the payload.
        given, sub = sub.compiled, dataclasses.replace(sub, compiled=None)
        with self._lock:
            self._compiling[sub.request_id] = False
        try:
            future = self.engine.structured.compile_async(spec, backend, given, tenant=sub.tenant)
        except Exception as exc:  # noqa: BLE001 - a compile that cannot start fails this request
            self._compiled_failed(sub.request_id, exc)
            return

        def compiled(done: concurrent.futures.Future[Matcher]) -> None:
            exc = done.exception()
            if exc is not None:
                self._compiled_failed(sub.request_id, exc)
            else:
                self._enqueue(sub, done.result())

        with self._lock:  # before "compiled" (sent under this lock), whichever thread sends that
            if not future.done():
                self._announced.add(sub.request_id)
                self.outbox.send(("compiling", sub.request_id))
        future.add_done_callback(compiled)  # at once on this thread when the compiler has it

    def _compiled_failed(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            self._compiling.pop(request_id, None)
            self._announced.discard(request_id)
        self.outbox.send(("reject", request_id, portable_error(exc)))

    def _enqueue(self, sub: Submission, matcher: Matcher | None) -> None:
        try:
            if matcher is not None and sub.resample and not matcher.checks_ready:
                # The value checks' set-up, once per schema: here (the thread that
                # compiled it, or this reader's on a cache hit), never the engine thread.
                matcher.prepare_checks()
            ctx = self.engine.requests.context(sub.spec, matcher, sub.resample, sub.reasoning)
        except Exception as exc:  # noqa: BLE001 - the server checked it; fail this request only
            self._compiled_failed(sub.request_id, exc)
            return
        with self._lock:
            aborted = self._compiling.pop(sub.request_id, False)
            if sub.request_id in self._announced:
                self._announced.discard(sub.request_id)
                self.outbox.send(("compiled", sub.request_id))  # the engine holds it from now on
            self._sent[ctx.request_id] = (ctx, None)
            self.driver.put(("add", ctx))
            if aborted:  # aborted while it compiled: it ends, with its output, as any abort
                self.driver.put(("abort", ctx.request_id))

    def _call(self, call_id: int, fn: Any) -> None:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def answer(done: concurrent.futures.Future[Any]) -> None:
            exc = done.exception()
            try:
                if exc is not None:
                    self.outbox.send(("result", call_id, False, portable_error(exc)))
                else:
                    self.outbox.send(("result", call_id, True, done.result()))
            except Exception as send_exc:  # noqa: BLE001 - an answer that cannot be pickled is an error answer
                self.outbox.send(("result", call_id, False, portable_error(send_exc)))

        future.add_done_callback(answer)
        self.driver.put(("call", fn, future))

    def _listen_kv(self, engine: EngineCore) -> None:
        engine.allocator.add_listener(self._forward_kv)

    def _forward_kv(self, events: list[KVEvent]) -> None:
        # On the engine thread, ahead of the step's message (or of a snapshot's result).
        self.outbox.send(("kv", events))

    # -- the driver's sink (engine thread) ---------------------------------------
    def stepped(self, engine: EngineCore, outputs: list[RequestOutput]) -> None:
        times: list[tuple[str, Times]] = []
        sent = self._sent
        for out in outputs:
            entry = sent.get(out.request_id)
            if entry is None:
                continue
            now = times_of(entry[0])
            if now != entry[1]:
                times.append((out.request_id, now))
            if out.finished:
                del sent[out.request_id]
            elif now != entry[1]:
                sent[out.request_id] = (entry[0], now)
        # About a microsecond a step: two clock reads.
        cpu = ThreadCpu(time.thread_time(), thread_cpu_seconds(self._device) if self._device is not None else None)
        self.outbox.send(("step", outputs, times, engine.last_step, engine.load(), cpu))

    def rejected(self, request_id: str, exc: Exception) -> None:
        self._sent.pop(request_id, None)
        self.outbox.send(("reject", request_id, portable_error(exc)))

    def failed(self, exc: BaseException) -> None:
        self.outbox.send(("failed", f"{type(exc).__name__}: {exc}"))


def _kv_snapshot(engine: EngineCore) -> list[PagesStored]:
    engine.allocator.flush_events()  # these go out (as "kv") before the snapshot's result
    return engine.allocator.snapshot()


def _run_setup(names: tuple[str, ...]) -> None:
    for name in names:
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function)()


def _build(spec: EngineProcessSpec, outbox: SendEnd) -> EngineCore | None:
    """The warm engine, or None after telling the server why it could not be built."""
    from engine.warmup import warm_up

    try:
        _run_setup(spec.setup)
        engine = EngineCore(spec.config)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which decides
        log.debug("the engine could not be built", exc_info=True)
        outbox.send(("load_failed", f"{exc}", isinstance(exc, ValueError | OSError)))
        return None
    try:
        if spec.warmup:
            warm_up(engine, grammar=spec.warmup_grammar)
    except BaseException as exc:  # noqa: BLE001
        log.exception("the engine failed its warm-up")
        outbox.send(("load_failed", f"warm-up failed: {type(exc).__name__}: {exc}", False))
        engine.close()
        return None
    return engine


def _exit_when_orphaned(server_pid: int, period_s: float = 1.0) -> None:
    """End this process once its server is gone (it is then re-parented)."""
    while os.getppid() == server_pid:
        time.sleep(period_s)
    log.warning("the server (pid %d) is gone; the engine process exits", server_pid)
    os._exit(1)


def main(read_fd: int, write_fd: int) -> None:
    """Entry point of the engine process."""
    from service.ops.request_log import configure_logging

    # The server stops this process through the pipe, and a server that dies
    # is noticed (the pipe, the orphan watch): a signal to the whole process
    # group (a terminal's ^C, systemd's stop, `kill -TERM -PGID`) is the
    # server's to act on, and it drains with this process still running.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    inbox = Connection(read_fd, writable=False)
    outbox = SendEnd(write_fd)  # a send that fails: the server is gone, and this process ends with it
    try:
        spec: EngineProcessSpec = inbox.recv()
    except (EOFError, OSError):
        return
    configure_logging(spec.log_level, spec.log_format)
    # Nothing reads the pipe while the engine loads (minutes for a large
    # checkpoint): a server that dies meanwhile is noticed by its pid instead.
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), name="stencild-orphan-watch",
                     daemon=True).start()
    engine = _build(spec, outbox)
    if engine is None:
        return
    child = EngineChild(engine, outbox)
    freeze_heap()
    outbox.send(("ready", EngineFacts(os.getpid(), engine.max_model_len, engine.eos_token_ids, engine.load(),
                                      engine.attention.name, engine.structured.mask_threads)))
    threading.Thread(target=child.read_commands, args=(inbox,), name="stencild-engine-commands",
                     daemon=True).start()
    child.driver.run()  # this thread is the engine thread; the engine is closed when it returns
    logging.shutdown()
    os._exit(0)  # no helper thread may keep the process
