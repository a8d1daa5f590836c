"""Paged KV cache: page tensor, ref-counted allocator with prefix caching, manager."""

from .allocator import OutOfPages, PageAllocator, chain_hash
from .manager import KVCacheInputs, KVCacheManager, page_tensor_shape, pages_for_budget

__all__ = [
    "KVCacheInputs",
    "KVCacheManager",
    "OutOfPages",
    "PageAllocator",
    "chain_hash",
    "page_tensor_shape",
    "pages_for_budget",
]
