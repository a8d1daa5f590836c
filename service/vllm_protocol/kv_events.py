"""The prefix cache's events, numbered and fanned out to SubscribeKvEvents streams.

The engine's allocator (engine/kv_cache) tells one listener, on the engine
thread, what each step did to the prefix cache: pages stored under their chain
hashes, pages removed, everything cleared. `KvEventHub` is that listener (for
an engine in an engine process, the events cross the pipe and reach it, in
order, on the thread that reads it: EngineLoop.listen_kv): it
numbers each step's events on that thread and, only while someone
subscribes, hands them to the event loop (one `call_soon_threadsafe`, never a
lock held while anything runs), which turns them into one
`smg.grpc.common.KvEventBatch` and puts it on every subscriber's queue. With
no subscriber a step costs the event loop nothing: no wake-up, no protobuf.

A router's cache-aware policy keeps an index of which worker holds which
prefix. A new subscriber first gets the cache's current state as a snapshot
(a `cleared` followed by every cached page, parents first, in
`KvSnapshotChunk`s of at most `SNAPSHOT_CHUNK_TOKENS` tokens, built off the
event loop), its chunks numbered consecutively up to the last sequence number
sent, so the live batches that follow continue with no gap and no repeat: the
snapshot is taken between steps (EngineLoop.kv_snapshot), and from there the
subscriber's registration is posted to the event loop ahead of any later
batch. A subscriber resuming from a cursor (`start_sequence_number`) that the
hub's bounded history of recent steps still covers gets the batches it missed
instead, under their own numbers (the history is kept from the first
subscription on: a server no router follows keeps none).

Numbers start at the wall clock in microseconds, not at 1: a restarted
server then numbers on above any cursor a router kept from the one before it,
so that cursor can never be mistaken for one of the new server's (the router
gets a snapshot, never the new server's batches as if they followed the old
one's state). A server steps far less often than once a microsecond.

A subscriber that does not keep up (its queue over `MAX_QUEUED` batches) is
dropped: its stream ends, and the router resubscribes and resyncs from a fresh
snapshot, rather than the engine buffering without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.kv_cache import CacheCleared, KVEvent, PagesRemoved, PagesStored, wire_hash
from service.engine_loop import EngineLoop
from service.gen.vllm import common_pb2 as cpb

log = logging.getLogger(__name__)

MAX_QUEUED = 4096
# A snapshot chunk's size, in tokens (about 4 bytes each on the wire): far
# under a router's 4 MiB message limit, whatever the page size.
SNAPSHOT_CHUNK_TOKENS = 1 << 18
# The recent steps kept for subscribers resuming from a cursor, in tokens of
# the pages stored or removed (the batches themselves, not copies): ~40 MiB.
# Kept only once a router has subscribed: until then nobody can resume.
HISTORY_TOKENS = 1 << 20
_TIER = cpb.KV_CACHE_TIER_DEVICE
_LOCAL = cpb.KV_CACHE_LOCALITY_LOCAL


class SubscriberGone(Exception):
    """The subscriber fell too far behind and was dropped."""


def _stored(ev: PagesStored, page_size: int) -> cpb.KvCacheEvent:
    stored = cpb.KvBlocksStored(tier=_TIER, locality=_LOCAL,
                                blocks=[cpb.KvBlock(block_hash=wire_hash(h), token_ids=list(toks),
                                                    block_size=page_size)
                                        for h, toks in zip(ev.hashes, ev.tokens, strict=True)])
    if ev.parent is not None:
        stored.parent_block_hash = wire_hash(ev.parent)
    return cpb.KvCacheEvent(stored=stored)


def to_proto(events: list[KVEvent], page_size: int) -> list[cpb.KvCacheEvent]:
    """The engine's events as the protocol's, in order."""
    out = []
    for ev in events:
        if isinstance(ev, PagesStored):
            out.append(_stored(ev, page_size))
        elif isinstance(ev, PagesRemoved):
            out.append(cpb.KvCacheEvent(removed=cpb.KvBlocksRemoved(block_hashes=[wire_hash(h) for h in ev.hashes],
                                                                    tier=_TIER, locality=_LOCAL)))
        elif isinstance(ev, CacheCleared):
            out.append(cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()))
    return out


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue[cpb.KvEventBatch | None] = field(default_factory=asyncio.Queue)
    # Both under the hub's lock: False once its stream ended (a registration
    # that arrives later is ignored); whether it is in the hub's count.
    active: bool = True
    counted: bool = False
    # Called (on the event loop) when it is dropped: its consumer may be
    # blocked outside the queue, in a write to a client that stopped reading.
    on_drop: Callable[[], None] | None = None


class KvEventHub:
    """Numbers the engine's KV cache events and delivers them to subscribers.

    `attach` registers the hub with the engine's allocator (on the engine
    thread) once the engine runs; from then on every step that changed the
    cache is one numbered batch, whether or not anyone subscribed, so the
    numbering is the engine's own. Only while someone subscribes do batches
    cross to the event loop.
    """

    def __init__(self) -> None:
        # The last batch's number (written on the engine thread only); the
        # first batch is one above this start (see the module's docstring).
        self.sequence = time.time_ns() // 1000
        self.page_size = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop: EngineLoop | None = None
        self._subscribers: set[_Subscriber] = set()  # the event loop's
        # Subscribers registered or joining: the engine thread posts batches
        # while this is above zero. Both threads change it, under the lock.
        self._listening = 0
        self._lock = threading.Lock()
        # The last steps' events, oldest first, at most HISTORY_TOKENS tokens
        # (written on the listener's thread, read there by `register`), from
        # the first subscription on.
        self._history: deque[tuple[int, list[KVEvent]]] = deque()
        self._history_pages = 0
        self._keeping = False

    async def attach(self, engine_loop: EngineLoop) -> None:
        self._loop = asyncio.get_running_loop()
        self._engine_loop = engine_loop
        self.page_size = engine_loop.engine.config.page_size
        await engine_loop.listen_kv(self._on_events)

    @property
    def attached(self) -> bool:
        return self._engine_loop is not None

    # -- engine thread ------------------------------------------------------
    def _on_events(self, events: list[KVEvent]) -> None:
        self.sequence += 1
        if self._keeping:
            self._remember(self.sequence, events)
        if self._listening:
            self._post(self._publish, self.sequence, events)

    def _remember(self, number: int, events: list[KVEvent]) -> None:
        self._history.append((number, events))
        self._history_pages += _pages(events)
        while self._history_pages * max(self.page_size, 1) > HISTORY_TOKENS and len(self._history) > 1:
            self._history_pages -= _pages(self._history.popleft()[1])

    def _missed(self, cursor: int) -> list[tuple[int, list[KVEvent]]] | None:
        """The batches after `cursor`, if the history still holds all of them."""
        if not 0 < cursor <= self.sequence:
            return None
        if cursor == self.sequence:
            return []
        if not self._history or self._history[0][0] > cursor + 1:
            return None
        return [(n, ev) for n, ev in self._history if n > cursor]

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # A loop that closed meanwhile raises RuntimeError: nobody listens any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    # -- event loop ---------------------------------------------------------
    def _publish(self, number: int, events: list[KVEvent]) -> None:
        if not self._subscribers:
            return
        batch = self._batch(number, events)
        for sub in list(self._subscribers):
            if sub.queue.qsize() >= MAX_QUEUED:
                self._subscribers.discard(sub)
                sub.queue.put_nowait(None)  # it ends with SubscriberGone
                log.warning("a KV event subscriber fell %d batches behind and was dropped", MAX_QUEUED)
                if sub.on_drop is not None:
                    sub.on_drop()
            else:
                sub.queue.put_nowait(batch)

    def _join(self, sub: _Subscriber) -> None:
        if sub.active:
            self._subscribers.add(sub)

    def _batch(self, number: int, events: list[KVEvent]) -> cpb.KvEventBatch:
        """One step's events as the protocol's numbered batch."""
        return cpb.KvEventBatch(sequence_number=number, timestamp=time.time(),
                                events=to_proto(events, self.page_size), dp_rank=0)

    def _snapshot_batches(self, number: int, pages: list[PagesStored]) -> list[cpb.KvEventBatch]:
        """The state as of batch `number` in chunks numbered up to it (chunk 0
        opens with `cleared`). Off the event loop: a large cache is seconds of work."""
        per_chunk = max(1, SNAPSHOT_CHUNK_TOKENS // max(self.page_size, 1))
        count = max(1, -(-len(pages) // per_chunk))
        per_chunk = max(1, -(-len(pages) // count))
        batches = []
        for index in range(count):
            events = to_proto(list[KVEvent](pages[index * per_chunk:(index + 1) * per_chunk]), self.page_size)
            if index == 0:
                events.insert(0, cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()))
            batches.append(cpb.KvEventBatch(
                sequence_number=number - count + 1 + index, timestamp=time.time(), events=events, dp_rank=0,
                snapshot=cpb.KvSnapshotChunk(index=index, count=count, blocks=len(pages))))
        return batches

    def _replayed(self, missed: list[tuple[int, list[KVEvent]]]) -> list[cpb.KvEventBatch]:
        return [self._batch(n, ev) for n, ev in missed]

    async def subscribe(self, cursor: int = 0, on_drop: Callable[[], None] | None = None
                        ) -> AsyncGenerator[cpb.KvEventBatch, None]:
        """The current state (when there is one), then every batch from now on;
        from `cursor` (the last batch a resuming subscriber has), the batches
        since instead of the state, while the history holds them. A subscriber
        MAX_QUEUED batches behind is dropped: its next read raises
        SubscriberGone, and `on_drop` is called at once."""
        engine_loop = self._engine_loop
        assert engine_loop is not None, "attach the hub first"
        sub = _Subscriber(on_drop=on_drop)
        number = 0
        missed: list[tuple[int, list[KVEvent]]] | None = None

        def register() -> None:
            # Between steps, on the listener's thread: the events recorded but
            # not yet numbered have gone out first (to the other subscribers),
            # so the snapshot is the state as of batch `self.sequence`; the
            # registration is posted before any later batch, so this
            # subscriber sees them all.
            nonlocal number, missed
            with self._lock:
                if sub.active:  # else the stream ended while this call waited
                    self._listening += 1
                    sub.counted = True
            self._post(self._join, sub)
            number = self.sequence
            missed = self._missed(cursor)
            self._keeping = True  # a router may resume from here on

        try:
            pages = await engine_loop.kv_snapshot(register)
            if missed is not None:
                first = await asyncio.to_thread(self._replayed, missed)
            else:  # an empty cache too: its `cleared` tells a router its numbers go on from here
                first = await asyncio.to_thread(self._snapshot_batches, number, pages)
            for batch in first:
                yield batch
            while True:
                live = await sub.queue.get()
                if live is None:
                    raise SubscriberGone("the subscriber fell behind")
                yield live
        finally:
            self._subscribers.discard(sub)
            with self._lock:
                sub.active = False
                if sub.counted:
                    self._listening -= 1

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)


def _pages(events: list[KVEvent]) -> int:
    return sum(len(ev.hashes) for ev in events if isinstance(ev, PagesStored | PagesRemoved)) + 1
