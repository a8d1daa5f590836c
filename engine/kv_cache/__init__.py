"""Paged KV cache: page tensor, ref-counted allocator with prefix caching, manager."""

from .allocator import OutOfPages, PageAllocator, chain_hash, wire_hash
from .events import CacheCleared, KVEvent, PagesRemoved, PagesStored
from .manager import KVCacheInputs, KVCacheManager, page_tensor_shape, pages_for_budget

__all__ = [
    "CacheCleared",
    "KVEvent",
    "PagesRemoved",
    "PagesStored",
    "KVCacheInputs",
    "KVCacheManager",
    "OutOfPages",
    "PageAllocator",
    "chain_hash",
    "wire_hash",
    "page_tensor_shape",
    "pages_for_budget",
]
