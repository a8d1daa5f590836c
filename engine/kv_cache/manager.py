"""Per-request page tables over one preallocated page tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from .allocator import OutOfPages, PageAllocator, chain_hash

if TYPE_CHECKING:
    from engine.context import TextContext
    from engine.staging import Staging


def page_tensor_shape(num_pages: int, num_layers: int, page_size: int, num_kv_heads: int,
                      head_dim: int) -> tuple[int, ...]:
    return (num_pages, 2, num_layers, page_size, num_kv_heads, head_dim)


def pages_for_budget(gib: float, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> int:
    """How many pages fit in `gib` GiB."""
    per_page = 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return int(gib * (1 << 30)) // per_page


@dataclass(frozen=True)
class KVCacheInputs:
    """What attention reads each step to find every sequence's keys and values (MAX's names).

    Built once per step by `KVCacheManager.inputs`, on the device the attention
    backend runs on; every backend reads it in every layer.

    kv_blocks:      the page tensor [num_pages, 2, num_layers, page_size, kv_heads, head_dim]
    cache_lengths:  [B] int32, tokens of each sequence already in the cache
    lookup_table:   [B, max_pages] int32, page ids of each sequence (padded with 0)
    max_lengths:    [num_steps, 2] int32 on the host: per decode step, the longest
                    query and the longest context (prompt chunk + cache)
    """

    kv_blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    max_lengths: torch.Tensor

    def after_decode_step(self) -> KVCacheInputs:
        """The inputs of the next step of a multi-step decode: one more cached token each."""
        return replace(self, cache_lengths=self.cache_lengths + 1, max_lengths=self.max_lengths[1:])


class _SeqState:
    __slots__ = ("pages", "hashes")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.hashes: list[int] = []  # chained hashes of the leading full pages, as computed


class KVCacheManager:
    """Claims, grows, publishes and frees the pages of running requests."""

    def __init__(self, kv_blocks: torch.Tensor, allocator: PageAllocator):
        self.kv_blocks = kv_blocks
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._seqs: dict[str, _SeqState] = {}

    # -- lifecycle --------------------------------------------------------
    def claim(self, ctx: TextContext, use_prefix_cache: bool = True) -> int:
        """Start tracking `ctx`; reuse cached pages for its leading tokens.

        Returns the number of tokens found in the cache. The hit is capped so
        that at least the last known token is computed (its logits are needed).
        """
        if ctx.request_id in self._seqs:
            raise ValueError(f"request {ctx.request_id} already holds pages")
        state = _SeqState()
        self._seqs[ctx.request_id] = state
        if not use_prefix_cache or not self.allocator.enable_prefix_caching:
            return 0
        p = self.page_size
        tokens = ctx.tokens
        parent: int | None = None
        for i in range((ctx.end_idx - 1) // p):
            page_tokens = tuple(tokens[i * p:(i + 1) * p].tolist())
            h = chain_hash(parent, page_tokens)
            page = self.allocator.lookup(h, page_tokens)
            if page is None:
                break
            self.allocator.retain(page)
            state.pages.append(page)
            state.hashes.append(h)
            parent = h
        hit = len(state.pages) * p
        if hit:
            self.allocator.hits += len(state.pages)
            ctx.skip_cached_tokens(hit)
        return hit

    def reserve(self, ctx: TextContext, upto: int) -> bool:
        """Make sure pages exist for token positions [0, upto).

        Either allocates everything needed or nothing (returns False).
        """
        state = self._seqs[ctx.request_id]
        need = -(-upto // self.page_size) - len(state.pages)
        if need <= 0:
            return True
        try:
            state.pages.extend(self.allocator.allocate(need))
        except OutOfPages:
            return False
        return True

    def commit(self, ctx: TextContext, computed: int) -> None:
        """Publish full pages whose tokens are final and whose keys and values
        are written: positions [0, `computed`), as of the step just finished.
        (With overlap ctx has moved on past the next step's chunk, whose pages
        are still being written: a failed step would leave them unwritten.)"""
        state = self._seqs.get(ctx.request_id)
        if state is None or not self.allocator.enable_prefix_caching:
            return
        p = self.page_size
        final = min(ctx.start_idx, ctx.num_final_tokens, computed)
        full = min(final // p, len(state.pages))
        parent = state.hashes[-1] if state.hashes else None
        for i in range(len(state.hashes), full):
            page_tokens = tuple(ctx.tokens[i * p:(i + 1) * p].tolist())
            page_hash = chain_hash(parent, page_tokens)
            state.hashes.append(page_hash)
            self.allocator.publish(state.pages[i], page_hash, page_tokens, parent)
            parent = page_hash
        ctx.committed_idx = max(ctx.committed_idx, full * p)

    def truncate(self, ctx: TextContext) -> None:
        """After `ctx.rollback`: keep pages only for its remaining tokens.

        A published page is never written again (other requests may share it
        through the prefix cache): when the positions ctx recomputes start
        inside one, ctx lets go of it and every page after it, and recomputes
        from that page's start into fresh pages.
        """
        state = self._seqs.get(ctx.request_id)
        if state is None:
            return
        p = self.page_size
        first = ctx.start_idx // p  # the page the next computed position lands in
        if first < len(state.hashes):
            del state.hashes[first:]
            ctx.recompute_from(first * p)
            keep = first
        else:
            keep = -(-ctx.end_idx // p)
        # Last page first, as `release`: eviction then takes a tail before
        # its head, and what stays cached is always a reachable prefix.
        for page in reversed(state.pages[keep:]):
            self.allocator.release(page)
        del state.pages[keep:]

    def release(self, ctx: TextContext) -> None:
        """Give back every page of `ctx` (safe to call twice)."""
        state = self._seqs.pop(ctx.request_id, None)
        if state is None:
            return
        # Last page first: cached pages are evicted least recently released
        # first, so a sequence's tail goes before its head, and what stays
        # cached is always a prefix that a later request can reuse.
        for page in reversed(state.pages):
            self.allocator.release(page)

    # -- step inputs ------------------------------------------------------
    def num_pages_held(self, request_id: str) -> int:
        state = self._seqs.get(request_id)
        return len(state.pages) if state else 0

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    def lookup_table(self, batch: Sequence[TextContext]) -> np.ndarray:
        """[B, max_pages] int32 page ids of each request of `batch` (padded with 0)."""
        width = max(1, max(len(self._seqs[c.request_id].pages) for c in batch))
        table = np.zeros((len(batch), width), dtype=np.int32)
        for row, ctx in enumerate(batch):
            pages = self._seqs[ctx.request_id].pages
            table[row, :len(pages)] = pages
        return table

    def inputs(self, table: np.ndarray, cache_lengths: np.ndarray, q_lens: np.ndarray,
               num_steps: int, staging: Staging) -> KVCacheInputs:
        """KVCacheInputs for a step whose requests have `table` (from `lookup_table`),
        `cache_lengths` cached tokens and `q_lens` new ones each, as host tensors
        (uploaded by the device thread; on the CPU they share the arrays' memory)."""
        longest_q = int(q_lens.max())
        longest_ctx = int((cache_lengths + q_lens).max())
        max_lengths = np.array([[longest_q if s == 0 else 1, longest_ctx + s] for s in range(num_steps)],
                               dtype=np.int32)
        return KVCacheInputs(
            kv_blocks=self.kv_blocks,
            cache_lengths=staging.tensor(cache_lengths.astype(np.int32)),
            lookup_table=staging.tensor(table),
            max_lengths=torch.from_numpy(max_lengths),
        )
