"""The engine thread, its bridge to asyncio, and admission control.

`EngineCore` is not thread-safe, so exactly one thread drives it (an
`EngineDriver`): it takes commands (add, abort, call) from a queue, runs
`step()` while there is work and blocks on the queue when there is none.
Commands are applied between steps, so an abort frees a request's pages before
the next step starts. Each step's outputs go back to the event loop in one
`call_soon_threadsafe`, which hands every output to its request's
`RequestStream`. An `EngineLoop` reaches its driver through a link: a thread
of this process (`ThreadLink`), or an engine process of its own
(`service/engine_proc`, `ProcessLink`), where the same driver runs.

Admission is ours: grpc's `maximum_concurrent_rpcs` has queued calls instead of
rejecting them, so requests beyond the limits are refused here with
RESOURCE_EXHAUSTED before they reach the engine.

Streams are paced (`pace`): all of a loop's streams together send at most
`stream_messages_per_s` messages a second, each stream waiting its share
after a message, and the tokens produced meanwhile go out together in its
next one. One message per token per stream is fine for a few streams, but at
64 streams on a GPU the event loop's work per message (building it, gRPC's
write, waking the coroutine) takes the GIL from the engine thread for most
of each step; a stream that waits sends the same tokens in fewer messages.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from engine import EngineCore, RequestOutput
from engine.context import TextContext
from engine.kv_cache import KVEvent, PagesStored
from engine.reasoning import ReasoningOptions
from engine.requests import RequestSpec
from service.errors import Reason, ServiceError, resource_exhausted, unavailable
from service.ops.request_log import note_refusal

if TYPE_CHECKING:
    from grammar import Matcher

log = logging.getLogger(__name__)

T = TypeVar("T")
# How long stopping waits for an engine to end: a step that hangs (the
# watchdog's case) must not hold a drain, or a second signal, for ever.
STOP_TIMEOUT_S = 30.0
# A stream waits only when its share of the message budget is at least this.
_MIN_PACE_S = 0.001


@dataclass(frozen=True)
class AdmissionLimits:
    """How much work may be in flight (queued or running) at once.

    A request's token cost is its prompt plus the most it may generate
    (max_new_tokens, or up to the context length): the KV tokens it may claim.
    max_pending_tokens None means four times the KV cache's capacity.
    """

    max_pending_requests: int = 256
    max_pending_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_pending_requests < 1:
            raise ValueError("max_pending_requests must be >= 1")
        if self.max_pending_tokens is not None and self.max_pending_tokens < 1:
            raise ValueError("max_pending_tokens must be >= 1")


class EngineFailed(Exception):
    """The engine thread died; no request can run any more."""


@dataclass
class LoopStats:
    """Counters kept on the event loop (for GetServerInfo-style reporting and tests)."""

    added: int = 0
    rejected: int = 0
    finished: collections.Counter[str] = field(default_factory=collections.Counter)


class RequestStream:
    """One request's engine outputs, delivered on the event loop."""

    def __init__(self, request_id: str, cost: int):
        self.request_id = request_id
        self.cost = cost
        self.finished = False
        # What the loop's observer keeps about this request (telemetry).
        self.observed: Any = None
        # Set when the server, not the client, ended the request (shutdown).
        self.shutdown_reason: str | None = None
        self.abort_sent = False
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self._ended = asyncio.Event()
        self._pause: asyncio.Future[None] | None = None

    def _end(self) -> None:
        """It left the engine (finished, refused or failed): its id is free again."""
        self.finished = True
        self._ended.set()

    async def ended(self) -> None:
        """Wait until the request has left the engine."""
        await self._ended.wait()

    def _push(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()
        if self._pause is not None and (isinstance(item, BaseException) or item.finished):
            _wake(self._pause)  # the last message goes out now, not after the pause

    async def pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if the request ends meanwhile (its last
        output or its failure arrives): a paced stream's outputs gather while
        it waits, but its end is never held back."""
        if self.finished:
            return
        loop = asyncio.get_running_loop()
        self._pause = loop.create_future()
        timer = loop.call_later(seconds, _wake, self._pause)
        try:
            await self._pause
        finally:
            timer.cancel()
            self._pause = None

    async def next_outputs(self) -> list[RequestOutput]:
        """Wait for output; return everything delivered since the last call."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        out: list[RequestOutput] = []
        for item in items:
            if isinstance(item, BaseException):
                raise item
            out.append(item)
        return out


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class LoopObserver(Protocol):
    """Told about a loop's requests (on the event loop) and steps (on the engine
    thread), for metrics and logs (service/ops/telemetry.py); must not block."""

    def submitted(self, ctx: TextContext, stream: RequestStream) -> None: ...

    def delivered(self, stream: RequestStream, output: RequestOutput) -> None: ...

    def stepped(self, engine: EngineCore) -> None: ...


class DriverSink(Protocol):
    """Where an `EngineDriver` sends what the engine does, on the driving thread."""

    def stepped(self, engine: EngineCore, outputs: list[RequestOutput]) -> None:
        """After each step, with its outputs (maybe none)."""

    def rejected(self, request_id: str, exc: Exception) -> None:
        """The engine refused a request it was given; it fails alone."""

    def failed(self, exc: BaseException) -> None:
        """The engine failed; the driver has stopped (calls still queued have failed)."""


class EngineDriver:
    """Drives one EngineCore on the thread that calls `run`: commands between
    steps, each step's outputs to a sink. The one owner of an engine's thread,
    whether that thread is the server's (EngineLoop) or an engine process's
    (service/engine_proc/child.py).

    Commands: ("add", ctx), ("abort", request_id), ("call", fn, future), ("stop",).
    """

    def __init__(self, engine: EngineCore, sink: DriverSink):
        self.engine = engine
        self.sink = sink
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        # When the engine last made progress while it had work (None while
        # idle); written by the driving thread, read by the watchdog.
        self.progress_at: float | None = None

    def put(self, command: tuple[Any, ...]) -> None:
        self.commands.put(command)

    def stalled_for(self) -> float:
        """Seconds since the engine last completed a step while it had work (0 when idle)."""
        since = self.progress_at
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _take(self, block: bool) -> list[tuple[Any, ...]]:
        cmds = [self.commands.get()] if block else []
        while True:
            try:
                cmds.append(self.commands.get_nowait())
            except queue.Empty:
                return cmds

    def run(self) -> None:
        """Serve commands and steps until ("stop",) or a failure; the engine is closed after."""
        try:
            self._serve()
        finally:
            # The engine's helpers (step worker, grammar compiler) end with the thread.
            try:
                self.engine.close()
            except Exception:
                log.exception("error while closing the engine")

    def _serve(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_work()
                if idle:
                    self.progress_at = None
                commands = self._take(block=idle)
                if self.progress_at is None:
                    self.progress_at = time.monotonic()  # work may have arrived: the clock starts
                for cmd in commands:
                    kind = cmd[0]
                    if kind == "stop":
                        return
                    if kind == "add":
                        try:
                            engine.add_request(cmd[1])
                        except Exception as exc:  # refused by the engine: fail this request only
                            log.warning("engine refused request %s: %s", cmd[1].request_id, exc)
                            self.sink.rejected(cmd[1].request_id, exc)
                    elif kind == "abort":
                        engine.abort(cmd[1])
                    elif kind == "call":
                        fn, fut = cmd[1], cmd[2]
                        # Its waiter may have gone (a cancelled call cancels
                        # the future, asyncio.wrap_future): then nothing runs.
                        if fut.set_running_or_notify_cancel():
                            try:
                                result = fn(engine)
                            except Exception as exc:
                                fut.set_exception(exc)
                            else:
                                fut.set_result(result)
                if engine.has_work():
                    outputs = engine.step()
                    self.progress_at = time.monotonic()
                    self.sink.stepped(engine, outputs)
        except BaseException as exc:
            log.exception("the engine failed; no request can run any more")
            # Whoever waits on a call must not wait forever.
            for cmd in self._take(block=False):
                if cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                    cmd[2].set_exception(EngineFailed("the engine failed"))
            self.sink.failed(exc)


class EngineLoop:
    """The asyncio side of an engine: admission, one `RequestStream` per request,
    delivery. Here the engine runs on a thread of this process (an `EngineDriver`);
    `engine_proc.ProcessEngineLoop` runs it in a process of its own."""

    def __init__(self, engine: EngineCore, limits: AdmissionLimits | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 observer: LoopObserver | None = None, stream_messages_per_s: float = 0.0,
                 link: EngineLink | None = None):
        self.engine = engine
        self.observer = observer
        self.limits = limits or AdmissionLimits()
        # Messages a second all streams may send together (0: no pacing).
        self.stream_messages_per_s = stream_messages_per_s
        capacity = engine.load().kv_pages_total * engine.config.page_size
        self.max_pending_tokens = self.limits.max_pending_tokens or 4 * capacity
        self.stats = LoopStats()
        self._on_failure = on_failure
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only
        self._pending_tokens = 0
        # Room held for the sequences an admitted multi-sequence call (vLLM's
        # n) has not submitted yet: counted by every later admission.
        self._reserved_requests = 0
        self._reserved_tokens = 0
        self._failure: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._link: EngineLink = link or ThreadLink(engine)
        # Loops of the server's other engines (a separate speech engine): a
        # request id is one request server-wide, since Abort reaches every loop.
        self.peers: tuple[EngineLoop, ...] = ()

    # -- lifecycle (event loop) ---------------------------------------------
    def start(self) -> None:
        """Start the engine's thread (or its link); call from the event loop that will own the requests."""
        self._loop = asyncio.get_running_loop()
        self._link.start(_LoopSink(self))

    async def stop(self) -> None:
        """Stop the engine thread (after abort_all, or when nothing runs)."""
        if self._stopping:
            return
        self._stopping = True
        self._link.send(("stop",))
        await self._link.join()
        # Requests still registered will get no more output from the engine.
        streams, self._streams = self._streams, {}
        self._pending_tokens = self._reserved_requests = self._reserved_tokens = 0
        for stream in streams.values():
            stream._end()
            stream._push(unavailable("the server is shutting down", Reason.DRAINING))

    @property
    def alive(self) -> bool:
        return self._failure is None and not self._stopping and self._link.alive

    def stalled_for(self) -> float:
        """Seconds since the engine last completed a step while it had work (0 when idle)."""
        return self._link.stalled_for()

    @property
    def threads(self) -> list[threading.Thread | None]:
        """This process's threads that run the engine: the engine and device
        threads (the link's reader thread for an engine in another process)."""
        return self._link.threads

    def is_running(self, request_id: str) -> bool:
        """Whether a request of this id is admitted and not yet finished."""
        return request_id in self._streams

    def stream_of(self, request_id: str) -> RequestStream | None:
        """The stream of the request of this id admitted and not yet finished."""
        return self._streams.get(request_id)

    @property
    def num_pending(self) -> int:
        """Requests admitted and not yet finished."""
        return len(self._streams)

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    async def pace(self, stream: RequestStream) -> None:
        """After `stream` sent a message: wait its share of the loop's message
        budget (nothing while few streams run; less if the request ends)."""
        if self.stream_messages_per_s <= 0:
            return
        delay = len(self._streams) / self.stream_messages_per_s
        if delay >= _MIN_PACE_S:
            await stream.pause(delay)

    # -- requests (event loop) ----------------------------------------------
    def submit_request(self, spec: RequestSpec, matcher: Matcher | None = None, resample: bool = True,
                       reasoning: ReasoningOptions | None = None, *, room_for: int = 1,
                       admitted: bool = False) -> RequestStream:
        """Build a checked request's context (`RequestFactory.context`, which may
        raise InvalidRequest) and `submit` it. A call that brings several
        sequences (vLLM's n) is admitted as a whole with its first: `room_for`
        sequences of this size must fit now, and that room is held for the
        rest, which come later `admitted` (no limit refuses them; each takes
        its share of the room). The caller gives back the shares of any it
        never submits (`release`)."""
        ctx = self.engine.requests.context(spec, matcher, resample, reasoning)
        return self._admit(ctx, Recipe(spec, matcher, resample, reasoning), room_for, admitted)

    def submit(self, ctx: TextContext) -> RequestStream:
        """Admit a request or refuse it (RESOURCE_EXHAUSTED, UNAVAILABLE, ALREADY_EXISTS)."""
        return self._admit(ctx, None)

    def _admit(self, ctx: TextContext, recipe: Recipe | None, room_for: int = 1,
               admitted: bool = False) -> RequestStream:
        """Register `ctx`'s stream within the limits, then hand it to the engine."""
        if not self.alive:
            raise unavailable("the engine is not running", Reason.ENGINE_STOPPED)
        rid = ctx.request_id
        if self.is_running(rid) or any(peer.is_running(rid) for peer in self.peers):
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running",
                               Reason.DUPLICATE_REQUEST_ID)
        cost = ctx.max_length
        if not admitted:
            self._check_room(room_for, cost)
        stream = RequestStream(rid, cost)
        self._streams[rid] = stream
        self._pending_tokens += cost
        try:
            if self.observer is not None:
                self.observer.submitted(ctx, stream)
            self._link.add(ctx, recipe)
        except BaseException:  # not in the engine: nothing will ever finish it
            del self._streams[rid]
            self._pending_tokens -= cost
            raise
        if admitted:
            self.release(1, cost)
        elif room_for > 1:
            self._reserved_requests += room_for - 1
            self._reserved_tokens += (room_for - 1) * cost
        self.stats.added += 1
        return stream

    def release(self, count: int, cost: int) -> None:
        """Give back the room held for `count` sequences of `cost` tokens that
        an admitted call will not submit (it ended first)."""
        self._reserved_requests = max(0, self._reserved_requests - count)
        self._reserved_tokens = max(0, self._reserved_tokens - count * cost)

    def _check_room(self, count: int, cost: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) `count` more requests of `cost` tokens
        each beyond the limits. An idle server takes any valid call, so a
        large one is never refused forever."""
        if not self._streams and not self._reserved_requests:
            return
        limit = self.limits.max_pending_requests
        if len(self._streams) + self._reserved_requests + count > limit:
            self.stats.rejected += 1
            note_refusal("max_pending_requests")
            raise resource_exhausted(f"the server is at capacity ({limit} requests in flight); retry later",
                                     Reason.QUEUE_FULL)
        held = self._pending_tokens + self._reserved_tokens
        if held + count * cost > self.max_pending_tokens:
            self.stats.rejected += 1
            note_refusal("max_pending_tokens")
            raise resource_exhausted(f"the server's token budget is full ({held} of "
                                     f"{self.max_pending_tokens} tokens in flight); retry later", Reason.TOKEN_BUDGET_FULL)

    def abort(self, request_id: str, shutdown_reason: str | None = None) -> bool:
        """Abort a running request; False if no such request is in flight."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        if shutdown_reason and stream.shutdown_reason is None:
            stream.shutdown_reason = shutdown_reason
        if not stream.abort_sent:
            stream.abort_sent = True
            self._link.send(("abort", request_id))
        return True

    def abort_all(self, shutdown_reason: str) -> int:
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid, shutdown_reason)
        return len(ids)

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(engine)` on the engine thread, between steps, and return its result.

        `fn` should be a module-level function: a loop whose engine runs in
        another process sends it there by reference (pickle)."""
        if not self.alive:
            raise EngineFailed("the engine is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._link.send(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    # -- the prefix cache's events (event loop) ------------------------------
    async def listen_kv(self, listener: Callable[[list[KVEvent]], None]) -> None:
        """Have the allocator's events handed to `listener` from now on, each
        step's batch on the thread that drives (or reads) the engine, in order."""
        if not self.alive:
            raise EngineFailed("the engine is not running")
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._link.listen_kv(listener, fut)
        await asyncio.wrap_future(fut)

    async def kv_snapshot(self, register: Callable[[], None]) -> list[PagesStored]:
        """The prefix cache's pages now: between steps, the events recorded so far
        go to the listener, then `register()` runs, on the listener's thread and
        before any later batch reaches it, then the pages are read."""
        if not self.alive:
            raise EngineFailed("the engine is not running")
        fut: concurrent.futures.Future[list[PagesStored]] = concurrent.futures.Future()
        self._link.kv_snapshot(register, fut)
        return await asyncio.wrap_future(fut)

    # -- delivery (event loop) ----------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream._end()
                del self._streams[out.request_id]
                self._pending_tokens -= stream.cost
                self.stats.finished[out.finish_reason or "unknown"] += 1
            if self.observer is not None:
                self.observer.delivered(stream, out)
            stream._push(out)

    def _reject(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._end()
            self._pending_tokens -= stream.cost
            stream._push(exc)

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        streams, self._streams = self._streams, {}
        self._pending_tokens = self._reserved_requests = self._reserved_tokens = 0
        for stream in streams.values():
            stream._end()
            stream._push(EngineFailed("the engine failed"))
        if self._on_failure is not None:
            self._on_failure(exc)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)


class _LoopSink:
    """An EngineLoop's driver sink: everything goes to the event loop; the
    observer hears of each step on the thread that drives (or reads) the engine."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def stepped(self, engine: EngineCore, outputs: list[RequestOutput]) -> None:
        loop = self.loop
        if loop.observer is not None:
            loop.observer.stepped(engine)
        if outputs:
            loop._to_loop(loop._deliver, outputs)

    def rejected(self, request_id: str, exc: Exception) -> None:
        self.loop._to_loop(self.loop._reject, request_id, exc)

    def failed(self, exc: BaseException) -> None:
        self.loop._to_loop(self.loop._fail, exc)


@dataclass(frozen=True)
class Recipe:
    """What a request's context was built from (`RequestFactory.context`'s
    arguments): an engine in another process builds its own from it."""

    spec: RequestSpec
    matcher: Matcher | None
    resample: bool
    reasoning: ReasoningOptions | None


class EngineLink(Protocol):
    """How an EngineLoop reaches its engine: a thread here (`ThreadLink`) or a
    process of its own (`engine_proc.ProcessLink`). Commands as EngineDriver's."""

    def start(self, sink: DriverSink) -> None: ...

    def add(self, ctx: TextContext, recipe: Recipe | None) -> None: ...

    def send(self, command: tuple[Any, ...]) -> None: ...

    def listen_kv(self, listener: Callable[[list[KVEvent]], None], done: concurrent.futures.Future[None]) -> None:
        ...

    def kv_snapshot(self, register: Callable[[], None],
                    done: concurrent.futures.Future[list[PagesStored]]) -> None: ...

    @property
    def alive(self) -> bool: ...

    def stalled_for(self) -> float: ...

    @property
    def threads(self) -> list[threading.Thread | None]: ...

    async def join(self) -> None: ...


class ThreadLink:
    """An engine driven by a thread of this process (an EngineDriver)."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self._driver: EngineDriver | None = None
        self._thread: threading.Thread | None = None

    def start(self, sink: DriverSink) -> None:
        self._driver = EngineDriver(self.engine, sink)
        self._thread = threading.Thread(target=self._driver.run, name="stencild-engine", daemon=True)
        self._thread.start()

    def add(self, ctx: TextContext, recipe: Recipe | None) -> None:
        self.send(("add", ctx))

    def send(self, command: tuple[Any, ...]) -> None:
        assert self._driver is not None, "start the link first"
        self._driver.put(command)

    def listen_kv(self, listener: Callable[[list[KVEvent]], None], done: concurrent.futures.Future[None]) -> None:
        self.send(("call", lambda engine: engine.allocator.add_listener(listener), done))

    def kv_snapshot(self, register: Callable[[], None],
                    done: concurrent.futures.Future[list[PagesStored]]) -> None:
        def snapshot(engine: EngineCore) -> list[PagesStored]:
            engine.allocator.flush_events()
            register()
            return engine.allocator.snapshot()

        self.send(("call", snapshot, done))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled_for(self) -> float:
        return self._driver.stalled_for() if self._driver is not None else 0.0

    @property
    def threads(self) -> list[threading.Thread | None]:
        return [self._thread, self.engine.executor.thread]

    async def join(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, STOP_TIMEOUT_S)
            if self._thread.is_alive():  # a daemon: it ends with the process
                log.warning("the engine thread did not stop in %.0fs (a step hangs); leaving it", STOP_TIMEOUT_S)
