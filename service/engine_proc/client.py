"""The server's side of an engine process: start it, stand in for its engine, link a loop to it.

- `EngineProcess`: the child (`child.py`) and the two pipes that reach it.
- `RemoteEngine`: what the service reads of an engine (tokenizer, config,
  the request factory, a grammar compile service, the latest step's stats and
  load), built here from the same checkpoint and the facts the process reports.
  The server's compiles check constraints and give the validators; a fresh
  compile's result goes down with its request, for the engine process's own
  matchers (grammar/export.py), so a constraint is compiled once.
- `ProcessLink`: an `EngineLoop`'s link to the process. Commands go down the
  pipe from the event loop; a reader thread takes each step's message off the
  pipe and hands it to the loop's sink, as the engine thread does in-process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.context import TextContext
from engine.engine import EngineLoad, StepStats
from engine.kv_cache import KVEvent, PagesStored
from engine.models.config import load_model_config
from engine.reasoning import ReasoningParser
from engine.request_factory import RequestFactory
from engine.sampling_params import model_defaults
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer

from ..engine_loop import STOP_TIMEOUT_S, DriverSink, EngineFailed, Recipe
from ..structured import caller_tenant
from .wire import EngineFacts, EngineProcessSpec, SendQueue, Submission, ThreadCpu, mirror_times

log = logging.getLogger(__name__)

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from service.engine_proc.child import main; main(int(sys.argv[2]), int(sys.argv[3]))")


class EngineProcessFailed(RuntimeError):
    """The engine process could not build its engine, through no fault of the
    checkpoint or the options (those raise ValueError, as in process)."""


class EngineProcess:
    """One engine process: spawned, handed its spec, read until it is ready."""

    def __init__(self, spec: EngineProcessSpec):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            # stdout and stderr are the server's: the engine's log lines join its own.
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _REPO_ROOT, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        except BaseException:  # no process (fork failed): the server's ends too
            os.close(to_child_w)
            os.close(from_child_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send = SendQueue(to_child_w, "stencild-engine-send")
        self.inbox = Connection(from_child_r, writable=False)
        try:
            self.send(spec)
        except BaseException:  # a spec that cannot be sent: the process would wait for it for ever
            self.proc.kill()
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: Any) -> None:
        """Pickle `message` down the pipe (any thread); EngineFailed once the process is gone."""
        if not self._send.send(message):
            raise EngineFailed("the engine process is gone")

    def wait_ready(self) -> EngineFacts:
        """Block until the engine is built and warm; ValueError (a bad checkpoint or
        option) or EngineProcessFailed if it is not."""
        try:
            msg = self.inbox.recv()
        except (EOFError, OSError):
            self.stop()
            raise EngineProcessFailed(f"the engine process exited while loading (code {self.proc.poll()})") \
                from None
        if msg[0] == "ready":
            return msg[1]
        self.stop()
        _, message, user_error = msg
        raise ValueError(message) if user_error else EngineProcessFailed(message)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the process to stop (if it still reads), wait for it, kill it if it will not end."""
        with contextlib.suppress(EngineFailed):
            self.send(("stop",))
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop in %.0fs; killing it", timeout)
            self.proc.kill()
            self.proc.wait()
        self._send.close()
        with contextlib.suppress(OSError):
            self.inbox.close()


class RemoteEngine:
    """The server's stand-in for an engine that runs in an engine process.

    Holds what the service reads of `EngineCore` outside its engine thread,
    under the same names: fixed facts (config, model config, tokenizer,
    vocabulary, context length, stop tokens, reasoning parser), the request
    factory and a grammar compile service, and `last_step` / `load()` as of
    the latest step the process reported.
    """

    audio = None  # a speech engine never runs in a process of its own
    serves_speech = False

    def __init__(self, spec: EngineProcessSpec):
        self.config = spec.config
        self.model_config = load_model_config(spec.config.model)
        self.sampling_defaults, self.default_max_new_tokens = model_defaults(
            spec.config.generation_config, self.model_config.sampling_defaults)
        self.tokenizer = Tokenizer(spec.config.model)
        self.process = EngineProcess(spec)
        try:
            facts = self.process.wait_ready()
            self._built_from(spec, facts)
        except BaseException:
            # Whatever failed after the spawn, the process must not outlive it.
            self.process.stop()
            raise
        self.last_step = StepStats()
        self._load: EngineLoad = facts.load
        # The process's engine and device threads' CPU seconds, as of its latest step.
        self.thread_cpu = ThreadCpu()
        log.info("engine process %d ready (%s attention, %d grammar mask thread(s))", facts.pid,
                 facts.attention, facts.mask_threads)

    def _built_from(self, spec: EngineProcessSpec, facts: EngineFacts) -> None:
        """The server's side of a ready process; the compile workers last, as
        nothing after them can fail and leave them running."""
        self.facts = facts
        self.max_model_len = facts.max_model_len
        self.eos_token_ids = facts.eos_token_ids
        self.reasoning = (ReasoningParser.load(spec.config.reasoning_parser, self.tokenizer.hf.get_vocab())
                          if spec.config.reasoning_parser else None)
        self.requests = RequestFactory(self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
                                       self.reasoning, spec.config.max_thinking_tokens, None)
        self.structured = StructuredOutput.for_engine(spec.config, self.tokenizer.hf, self.vocab_size,
                                                      self.eos_token_ids, export_compiled=True)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def load(self) -> EngineLoad:
        return self._load

    def stepped(self, stats: StepStats, load: EngineLoad, cpu: ThreadCpu) -> None:
        """The process reported a step (the link's reader thread)."""
        self.last_step = stats
        self._load = load
        self.thread_cpu = cpu

    def close(self) -> None:
        self.structured.close()
        self.process.stop()


class ProcessLink:
    """An EngineLoop's link to a `RemoteEngine`'s process (see the module docstring)."""

    def __init__(self, engine: RemoteEngine):
        self.engine = engine
        self.process = engine.process
        self._sink: DriverSink | None = None
        self._reader: threading.Thread | None = None
        # The server's contexts of requests in the engine: their times mirror the process's.
        self._contexts: dict[str, TextContext] = {}
        # Those whose constraint the process compiles before its engine gets
        # them: no engine work, so no stall however long the compile takes.
        self._compiling: set[str] = set()
        # Calls awaiting their result, with what runs on the reader thread just before.
        self._calls: dict[int, tuple[concurrent.futures.Future[Any], Callable[[], None] | None]] = {}
        self._kv_listener: Callable[[list[KVEvent]], None] | None = None
        self._call_ids = itertools.count()
        self._heard = time.monotonic()  # the last message from the process (or the first request)
        self._gone = False
        self._stopping = False  # asked to stop: its exit is no failure

    def start(self, sink: DriverSink) -> None:
        self._sink = sink
        self._reader = threading.Thread(target=self._read, name="stencild-engine-link", daemon=True)
        self._reader.start()

    def add(self, ctx: TextContext, recipe: Recipe | None) -> None:
        if recipe is None:
            raise ValueError("an engine process takes requests with their recipe (EngineLoop.submit_request)")
        matcher = recipe.matcher
        spec = recipe.spec
        if not self._contexts:
            self._heard = time.monotonic()  # idle until now: the stall clock starts here
        self._contexts[ctx.request_id] = ctx
        export = None
        if matcher is not None:
            # Sent once: the server's matcher lives on with the request, its
            # compile's payload (megabytes for xgrammar) need not.
            export, matcher.export = matcher.export, None
        self.send(("add", Submission(ctx.request_id, spec.prompt, spec.params, spec.max_length, spec.seed,
                                     (matcher.spec, matcher.backend) if matcher is not None else None,
                                     recipe.resample, recipe.reasoning, export, caller_tenant())))

    def send(self, command: tuple[Any, ...]) -> None:
        if command[0] == "stop":
            self._stopping = True
        elif command[0] == "call":
            _, fn, future = command
            self._request(("call", fn), future)
            return
        # If the process is gone the reader sees the end and fails the loop.
        with contextlib.suppress(EngineFailed):
            self.process.send(command)

    def listen_kv(self, listener: Callable[[list[KVEvent]], None], done: concurrent.futures.Future[None]) -> None:
        self._kv_listener = listener
        self._request(("kv_listen",), done)

    def kv_snapshot(self, register: Callable[[], None],
                    done: concurrent.futures.Future[list[PagesStored]]) -> None:
        self._request(("kv_snapshot",), done, register)

    def _request(self, command: tuple[Any, ...], future: concurrent.futures.Future[Any],
                 before: Callable[[], None] | None = None) -> None:
        """Send (kind, call_id, *rest); the result completes `future`, after `before()`."""
        call_id = next(self._call_ids)
        self._calls[call_id] = (future, before)
        try:
            self.process.send((command[0], call_id, *command[1:]))
        except EngineFailed:
            entry = self._calls.pop(call_id, None)  # unless the reader has failed it already
            if entry is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineFailed("the engine process is gone"))

    @property
    def alive(self) -> bool:
        return not self._gone and self.process.proc.poll() is None

    def stalled_for(self) -> float:
        working = len(self._contexts) > len(self._compiling)
        return max(0.0, time.monotonic() - self._heard) if working else 0.0

    @property
    def threads(self) -> list[threading.Thread | None]:
        return [self._reader, None]

    async def join(self) -> None:
        # The process, then the server's own compile service (its worker
        # processes), as the engine thread closes an engine in process.
        await asyncio.to_thread(self.engine.close)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, STOP_TIMEOUT_S)

    # -- the reader thread ----------------------------------------------------
    def _read(self) -> None:
        sink = self._sink
        assert sink is not None
        failure: BaseException | None = None
        while failure is None:
            try:
                msg = self.process.inbox.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    failure = EngineFailed("the engine process exited")
                break
            except Exception as exc:  # noqa: BLE001 - one this side cannot unpickle
                failure = self._broken(exc, "(could not be unpickled)")
                break
            self._heard = time.monotonic()
            try:
                failure = self._handle(sink, msg)
            except Exception as exc:  # noqa: BLE001 - a bug here must fail the streams, not strand them
                failure = self._broken(exc, msg[0])
        self._gone = True
        while self._calls:  # popitem: the event loop may still add or fail one meanwhile
            try:
                _, (future, _) = self._calls.popitem()
            except KeyError:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineFailed("the engine process is gone"))
        if failure is not None:
            log.error("the engine process failed: %s", failure)
            sink.failed(failure)

    def _broken(self, exc: Exception, kind: str) -> Exception:
        """A message the link cannot read: logged, and the process killed
        (nothing will read what it sends); the failure the streams end with."""
        log.exception("reading the engine process's message %r failed", kind, exc_info=exc)
        with contextlib.suppress(OSError):
            self.process.proc.kill()
        return exc

    def _handle(self, sink: DriverSink, msg: tuple[Any, ...]) -> BaseException | None:
        """Act on one message from the engine process; the failure it reports, if any."""
        kind = msg[0]
        if kind == "step":
            self._step(sink, *msg[1:])
        elif kind == "reject":
            self._contexts.pop(msg[1], None)
            self._compiling.discard(msg[1])
            sink.rejected(msg[1], msg[2])
        elif kind == "compiling":
            if msg[1] in self._contexts:
                self._compiling.add(msg[1])
        elif kind == "compiled":
            self._compiling.discard(msg[1])  # the stall clock runs from this message on
        elif kind == "kv":
            if self._kv_listener is not None:
                self._kv_listener(msg[1])
        elif kind == "result":
            self._answer(msg[1], msg[2], msg[3])
        elif kind == "failed":
            return EngineFailed(msg[1])
        return None

    def _answer(self, call_id: int, ok: bool, value: Any) -> None:
        entry = self._calls.pop(call_id, None)
        if entry is None:
            return
        future, before = entry
        if not future.set_running_or_notify_cancel():
            return  # its waiter has gone (a cancelled call cancels the future)
        if not ok:
            future.set_exception(value)
            return
        if before is not None:
            before()  # here, before any later message is read
        future.set_result(value)

    def _step(self, sink: DriverSink, outputs: list[Any], times: list[Any], stats: StepStats,
              load: EngineLoad, cpu: ThreadCpu) -> None:
        contexts = self._contexts
        for request_id, t in times:
            ctx = contexts.get(request_id)
            if ctx is not None:
                mirror_times(ctx, t)
        for out in outputs:
            if out.finished:
                contexts.pop(out.request_id, None)
        self.engine.stepped(stats, load, cpu)
        sink.stepped(self.engine, outputs)  # type: ignore[arg-type]  # RemoteEngine reads as EngineCore here
