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
prefix. A new subscriber first gets the cache's current state as one snapshot
batch (a `cleared` followed by every cached page, parents first, marked as a
`KvSnapshotChunk`), numbered with the last sequence number sent, so the live
batches that follow continue with no gap and no repeat: the snapshot is taken
between steps (EngineLoop.kv_snapshot), and from there the subscriber's
registration is posted to the event loop ahead of any later batch. The hub
keeps no history, so a subscriber resuming from a cursor gets the snapshot too.

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
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.kv_cache import CacheCleared, KVEvent, PagesRemoved, PagesStored, wire_hash
from service.engine_loop import EngineLoop
from service.gen.vllm import common_pb2 as cpb

log = logging.getLogger(__name__)

MAX_QUEUED = 4096
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


class KvEventHub:
    """Numbers the engine's KV cache events and delivers them to subscribers.

    `attach` registers the hub with the engine's allocator (on the engine
    thread) once the engine runs; from then on every step that changed the
    cache is one numbered batch, whether or not anyone subscribed, so the
    numbering is the engine's own. Only while someone subscribes do batches
    cross to the event loop.
    """

    def __init__(self) -> None:
        self.sequence = 0  # the last batch's number (written on the engine thread only)
        self.page_size = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop: EngineLoop | None = None
        self._subscribers: set[_Subscriber] = set()  # the event loop's
        # Subscribers registered or joining: the engine thread posts batches
        # while this is above zero. Both threads change it, under the lock.
        self._listening = 0
        self._lock = threading.Lock()

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
        if self._listening:
            self._post(self._publish, self.sequence, events)

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
        batch = cpb.KvEventBatch(sequence_number=number, timestamp=time.time(),
                                 events=to_proto(events, self.page_size), dp_rank=0)
        for sub in list(self._subscribers):
            if sub.queue.qsize() >= MAX_QUEUED:
                self._subscribers.discard(sub)
                sub.queue.put_nowait(None)  # it ends with SubscriberGone
                log.warning("a KV event subscriber fell %d batches behind and was dropped", MAX_QUEUED)
            else:
                sub.queue.put_nowait(batch)

    def _join(self, sub: _Subscriber) -> None:
        if sub.active:
            self._subscribers.add(sub)

    def _snapshot_batch(self, number: int, pages: list[PagesStored]) -> cpb.KvEventBatch:
        events = [cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()), *to_proto(list(pages), self.page_size)]
        return cpb.KvEventBatch(sequence_number=number, timestamp=time.time(), events=events, dp_rank=0,
                                snapshot=cpb.KvSnapshotChunk(index=0, count=1, blocks=len(pages)))

    async def subscribe(self) -> AsyncGenerator[cpb.KvEventBatch, None]:
        """The current state (when there is one), then every batch from now on."""
        engine_loop = self._engine_loop
        assert engine_loop is not None, "attach the hub first"
        sub = _Subscriber()
        number = 0

        def register() -> None:
            # Between steps, on the listener's thread: the events recorded but
            # not yet numbered have gone out first (to the other subscribers),
            # so the snapshot is the state as of batch `self.sequence`; the
            # registration is posted before any later batch, so this
            # subscriber sees them all.
            nonlocal number
            with self._lock:
                if sub.active:  # else the stream ended while this call waited
                    self._listening += 1
                    sub.counted = True
            self._post(self._join, sub)
            number = self.sequence

        try:
            pages = await engine_loop.kv_snapshot(register)
            if number > 0 or pages:
                yield self._snapshot_batch(number, pages)
            while True:
                batch = await sub.queue.get()
                if batch is None:
                    raise SubscriberGone("the subscriber fell behind")
                yield batch
        finally:
            self._subscribers.discard(sub)
            with self._lock:
                sub.active = False
                if sub.counted:
                    self._listening -= 1

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
