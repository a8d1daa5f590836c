"""Reference-counted page allocator with a prefix cache over full pages.

A page holds `page_size` consecutive tokens of one sequence. Once every token
of a page is final (computed and not a placeholder), the page can be published
under a chained hash: a 128-bit BLAKE2b digest of the previous page's hash and
this page's token ids. A later request whose prompt starts with the same tokens
reuses the page instead of recomputing it. The digest is what makes that safe:
a page's keys and values depend on every token before it, and two prompts
whose chains collided would share them (with Python's `hash`, a client could
craft such a collision in minutes and poison another client's prefix). Token
ids are stored with each published page and compared on a hit as well.

Pages nobody references but that are published stay cached, ordered by last
use; they are evicted (least recently used first) only when the free list is
empty.

Listeners (`add_listener`) hear what happens to the cache (events.py): stored,
removed, cleared. Events are recorded only while someone listens and handed
over in one list by `flush_events`, which the engine calls at the end of each
step; like everything here, on the engine thread, with no lock held.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

from .events import CacheCleared, KVEvent, PagesRemoved, PagesStored

log = logging.getLogger(__name__)
# The parent of a sequence's first page: a page must hash the same in every
# engine of a fleet (a router's index compares them).
_ROOT = 0
_HASH_BYTES = 16


class OutOfPages(RuntimeError):
    """Raised when an allocation cannot be satisfied even after eviction."""


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full page given its parent page's hash (None for the first
    page): a 128-bit BLAKE2b digest, the same in every process and machine."""
    digest = hashlib.blake2b(digest_size=_HASH_BYTES)
    digest.update((_ROOT if parent is None else parent).to_bytes(_HASH_BYTES, "little"))
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(digest.digest(), "little")


def wire_hash(page_hash: int) -> int:
    """A page hash as a router's index takes it (vLLM's protocol: int64): its
    top 63 bits. Only routing reads these; a collision there costs a cache miss."""
    return page_hash >> (8 * _HASH_BYTES - 63)


class PageAllocator:
    """Owns page ids [0, num_pages): reference counts, free list, prefix cache."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = np.zeros(num_pages, dtype=np.int32)
        self._free: deque[int] = deque(range(num_pages))
        self._by_hash: dict[int, int] = {}
        # Pages published under a hash another page holds already (requests
        # that computed the same page before either published it): spares. One
        # takes over when that page goes, so the pages chained after it stay
        # reachable; the hash is announced stored once and removed once.
        self._spares: dict[int, list[int]] = {}
        self._page_hash: dict[int, int] = {}
        self._page_tokens: dict[int, tuple[int, ...]] = {}
        self._page_parent: dict[int, int | None] = {}
        # Published pages with refcount 0, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.evictions = 0
        self._listeners: list[Callable[[list[KVEvent]], None]] = []
        self._events: list[KVEvent] = []

    # -- accounting -------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation could obtain now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return int(np.count_nonzero(self.refcount))

    @property
    def num_cached(self) -> int:
        return len(self._page_hash)

    def check_consistency(self) -> None:
        """Assert the invariants (used by tests): every page is exactly one of
        referenced, free, or cached-and-evictable."""
        free = set(self._free)
        evictable = set(self._evictable)
        used = {int(p) for p in np.flatnonzero(self.refcount)}
        assert not (free & evictable) and not (free & used) and not (evictable & used)
        assert len(free) + len(evictable) + len(used) == self.num_pages, "a page is lost"
        assert all(p in self._page_hash for p in evictable)
        assert all(self._page_hash[p] == h for h, p in self._by_hash.items())
        assert all(h in self._by_hash and all(self._page_hash[p] == h for p in spares)
                   for h, spares in self._spares.items())
        assert (self.refcount >= 0).all()

    # -- allocation -------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` pages with refcount 1, evicting cached pages if needed."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unpublish(page)
                self.evictions += 1
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def retain(self, page: int) -> None:
        if self.refcount[page] == 0:
            self._evictable.pop(page, None)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise AssertionError(f"page {page} released more often than taken")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._page_hash:
                self._evictable[page] = None
            else:
                self._free.append(page)

    # -- prefix cache -----------------------------------------------------
    def lookup(self, page_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The published page holding exactly `tokens` under `page_hash`, if any."""
        if not self.enable_prefix_caching:
            return None
        page = self._by_hash.get(page_hash)
        if page is None or self._page_tokens.get(page) != tokens:
            return None
        return page

    def publish(self, page: int, page_hash: int, tokens: tuple[int, ...],
                parent: int | None = None) -> None:
        """Make a full, final page findable by later requests (`parent`: the
        hash of the page before it, None for a sequence's first page)."""
        if not self.enable_prefix_caching or page in self._page_hash:
            return
        if parent is not None and parent not in self._by_hash:
            return  # its chain was flushed (`clear_cache`): no lookup could reach it
        self._page_hash[page] = page_hash
        self._page_tokens[page] = tokens
        self._page_parent[page] = parent
        if page_hash in self._by_hash:  # an identical page is published: this one is its spare
            self._spares.setdefault(page_hash, []).append(page)
            return
        self._by_hash[page_hash] = page
        if self._listeners:
            last = self._events[-1] if self._events else None
            if isinstance(last, PagesStored) and last.hashes and last.hashes[-1] == parent:
                last.hashes.append(page_hash)  # the chain goes on: one event
                last.tokens.append(tokens)
            else:
                self._events.append(PagesStored([page_hash], [tokens], parent))

    def _unpublish(self, page: int, record: bool = True) -> None:
        page_hash = self._page_hash.pop(page)
        self._page_tokens.pop(page, None)
        self._page_parent.pop(page, None)
        spares = self._spares.get(page_hash)
        if self._by_hash.get(page_hash) == page:
            if spares:  # a spare takes over: the hash stays stored
                self._by_hash[page_hash] = spares.pop()
            else:
                del self._by_hash[page_hash]
        elif spares is not None:  # a spare itself: nothing changes for the hash
            spares.remove(page)
        if spares is not None:
            if not spares:
                del self._spares[page_hash]
            return
        if record and self._listeners:
            last = self._events[-1] if self._events else None
            if isinstance(last, PagesRemoved):
                last.hashes.append(page_hash)
            else:
                self._events.append(PagesRemoved([page_hash]))

    def clear_cache(self) -> int:
        """Unpublish every cached page; returns how many.

        Unreferenced pages go back to the free list. Pages running requests
        hold stay theirs (nothing is preempted or recomputed) but are shared no
        more: no later request finds them, they go to the free list when
        released, and the pages those requests fill after them are not
        published either (`publish` refuses a page whose parent is gone).
        Listeners hear one CacheCleared.
        """
        dropped = len(self._page_hash)
        for page in list(self._page_hash):
            self._unpublish(page, record=False)
        while self._evictable:
            self._free.append(self._evictable.popitem(last=False)[0])
        if dropped and self._listeners:
            self._events.append(CacheCleared())
        return dropped

    # -- listeners --------------------------------------------------------
    def add_listener(self, listener: Callable[[list[KVEvent]], None]) -> list[PagesStored]:
        """Call `listener` with each batch of events from now on; returns what the
        cache holds now (one PagesStored per page, parents first), so a listener
        that starts late knows everything without a gap or a repeat."""
        self._listeners.append(listener)
        return self.snapshot()

    def remove_listener(self, listener: Callable[[list[KVEvent]], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)
        if not self._listeners:
            self._events.clear()

    def snapshot(self) -> list[PagesStored]:
        """Every published page as a PagesStored of its own, each after its parent."""
        out: list[PagesStored] = []
        done: set[int] = set()
        for start in list(self._by_hash.values()):
            chain = []
            page: int | None = start
            while page is not None and page not in done:
                chain.append(page)
                done.add(page)
                parent = self._page_parent[page]
                # Walk up to the first ancestor already listed (or the root).
                page = self._by_hash.get(parent) if parent is not None else None
            for p in reversed(chain):
                out.append(PagesStored([self._page_hash[p]], [self._page_tokens[p]],
                                       self._page_parent[p]))
        return out

    def flush_events(self) -> None:
        """Hand the events recorded since the last flush to every listener."""
        if not self._events:
            return
        events, self._events = self._events, []
        for listener in list(self._listeners):
            try:
                listener(events)
            except Exception:  # a listener's fault must never stop the engine
                log.exception("a KV cache event listener failed")
