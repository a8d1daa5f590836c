"""What the prefix cache tells its listeners: pages stored, pages removed, all cleared.

A router in front of several engines (the vLLM gRPC protocol's
`SubscribeKvEvents`) keeps an index of which engine holds which prompt prefix
and routes a request to the engine that already holds most of it. These are
the facts it needs, in the order they happened: a page is *stored* when it is
published under its chained hash (it can now be reused), *removed* when it is
evicted or flushed, and the cache is *cleared* when nothing is left in it.
Hashes are the allocator's own (`chain_hash`, 128 bits), the same in every
process for the same tokens; a protocol that carries 64-bit hashes sends
`wire_hash` of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PagesStored:
    """Full pages published, consecutive pages of one sequence, parents first.

    `parent` is the hash of the page before the first one (None: they start the
    sequence); `tokens[i]` are the token ids of the page hashed `hashes[i]`.
    """

    hashes: list[int] = field(default_factory=list)
    tokens: list[tuple[int, ...]] = field(default_factory=list)
    parent: int | None = None


@dataclass
class PagesRemoved:
    """Published pages evicted or flushed: no request can reuse them any more."""

    hashes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CacheCleared:
    """Every published page was dropped at once: the cache holds nothing."""


KVEvent = PagesStored | PagesRemoved | CacheCleared
