"""A bounded, thread-safe LRU for compiled grammars (and compile failures).

xgrammar's own compiler cache is unbounded by default, so a server that sees
many distinct schemas grows without limit; this one is bounded both by entry
count and by the approximate bytes of what it holds. Failures are cached too
(small entries): a client repeating a schema that times out must not cost a
worker `compile_timeout_s` every time. A cached failure is kept, and handed
out, as a fresh copy: an exception that was raised holds its traceback, whose
frames (and their callers') hold the compile's job and, through its future,
the matchers of the requests that waited for it (~80 MB each, for a large
grammar, kept as long as the failure was cached).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheInfo:
    """The compiled-grammar cache's counters and size at one moment."""

    hits: int
    misses: int
    entries: int
    bytes: int


class GrammarCache:
    """LRU keyed by (tokenizer fingerprint, backend, spec); may be shared by compilers."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 1 << 30) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("cache limits must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self._misses += 1
                return None
            self._data.move_to_end(key)
            self._hits += 1
            return _bare(item[0])

    def put(self, key: Hashable, value: Any, size: int) -> None:
        size = max(int(size), 1)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return  # would evict everything else and still not fit
            self._data[key] = (_bare(value), size)
            self._bytes += size
            while len(self._data) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, evicted) = self._data.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._data), self._bytes)


def _bare(value: Any) -> Any:
    """An exception as a copy of its own, with no traceback, cause or context
    (a raise attaches them to the object raised); anything else as it is."""
    return copy.copy(value) if isinstance(value, BaseException) else value
