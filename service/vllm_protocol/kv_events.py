"""The prefix cache's events, numbered and fanned out to SubscribeKvEvents streams.

The engine's allocator (engine/kv_cache) tells one listener, on the engine
thread, what each step did to the prefix cache: pages stored under their chain
hashes, pages removed, everything cleared. `KvEventHub` is that listener: it
hands each step's events to the event loop (one `call_soon_threadsafe`, never
a lock held while anything runs), turns them into one numbered
`smg.grpc.common.KvEventBatch` and puts it on every subscriber's queue.

A router's cache-aware policy keeps an index of which worker holds which
prefix. A new subscriber first gets the cache's current state as one snapshot
batch (a `cleared` followed by every cached page, parents first, marked as a
`KvSnapshotChunk`), numbered with the last sequence number sent, so the live
batches that follow continue with no gap and no repeat. The hub keeps no
history, so a subscriber resuming from a cursor gets the snapshot too.

A subscriber that does not keep up (its queue over `MAX_QUEUED` batches) is
dropped: its stream ends, and the router resubscribes and resyncs from a fresh
snapshot, rather than the engine buffering without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from engine import EngineCore
from engine.kv_cache import CacheCleared, KVEvent, PagesRemoved, PagesStored
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
                                blocks=[cpb.KvBlock(block_hash=h, token_ids=list(toks), block_size=page_size)
                                        for h, toks in zip(ev.hashes, ev.tokens, strict=True)])
    if ev.parent is not None:
        stored.parent_block_hash = ev.parent
    return cpb.KvCacheEvent(stored=stored)


def to_proto(events: list[KVEvent], page_size: int) -> list[cpb.KvCacheEvent]:
    """The engine's events as the protocol's, in order."""
    out = []
    for ev in events:
        if isinstance(ev, PagesStored):
            out.append(_stored(ev, page_size))
        elif isinstance(ev, PagesRemoved):
            out.append(cpb.KvCacheEvent(removed=cpb.KvBlocksRemoved(block_hashes=list(ev.hashes),
                                                                    tier=_TIER, locality=_LOCAL)))
        elif isinstance(ev, CacheCleared):
            out.append(cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()))
    return out


class KvEventHub:
    """Numbers the engine's KV cache events and delivers them to subscribers.

    `attach` registers the hub with the engine's allocator (on the engine
    thread) once the engine runs; from then on every step that changed the
    cache is one batch, whether or not anyone subscribed, so the numbering is
    the engine's own.
    """

    def __init__(self) -> None:
        self.sequence = 0  # the last batch's number
        self.page_size = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop: EngineLoop | None = None
        self._subscribers: set[asyncio.Queue[cpb.KvEventBatch | None]] = set()

    async def attach(self, engine_loop: EngineLoop) -> None:
        self._loop = asyncio.get_running_loop()
        self._engine_loop = engine_loop
        self.page_size = engine_loop.engine.config.page_size
        await engine_loop.call(lambda engine: engine.allocator.add_listener(self._on_events))

    @property
    def attached(self) -> bool:
        return self._engine_loop is not None

    # -- engine thread ------------------------------------------------------
    def _on_events(self, events: list[KVEvent]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # A loop that closed meanwhile raises RuntimeError: nobody listens any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._publish, events)

    # -- event loop ---------------------------------------------------------
    def _publish(self, events: list[KVEvent]) -> None:
        self.sequence += 1
        batch = cpb.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(),
                                 events=to_proto(events, self.page_size), dp_rank=0)
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_QUEUED:
                self._subscribers.discard(queue)
                queue.put_nowait(None)  # it ends with SubscriberGone
                log.warning("a KV event subscriber fell %d batches behind and was dropped", MAX_QUEUED)
            else:
                queue.put_nowait(batch)

    def _snapshot_batch(self, pages: list[PagesStored]) -> cpb.KvEventBatch:
        events = [cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()), *to_proto(list(pages), self.page_size)]
        return cpb.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(), events=events, dp_rank=0,
                                snapshot=cpb.KvSnapshotChunk(index=0, count=1, blocks=len(pages)))

    async def subscribe(self) -> AsyncGenerator[cpb.KvEventBatch, None]:
        """The current state (when there is one), then every batch from now on."""
        engine_loop = self._engine_loop
        assert engine_loop is not None, "attach the hub first"

        def snapshot(engine: EngineCore) -> list[PagesStored]:
            # Events recorded but not yet handed over go out first, so the
            # snapshot is the state after the last numbered batch.
            engine.allocator.flush_events()
            return engine.allocator.snapshot()

        pages = await engine_loop.call(snapshot)
        # The batches the flush above posted ran before this await resumed
        # (call_soon_threadsafe keeps order), so `pages` is the state as of
        # `self.sequence`; from here on this queue sees every batch.
        queue: asyncio.Queue[cpb.KvEventBatch | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            if self.sequence > 0 or pages:
                yield self._snapshot_batch(pages)
            while True:
                batch = await queue.get()
                if batch is None:
                    raise SubscriberGone("the subscriber fell behind")
                yield batch
        finally:
            self._subscribers.discard(queue)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
