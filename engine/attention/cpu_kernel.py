"""`KernelAttention` (CPU): a native kernel over the pages, SDPA for long chunks.

The kernel writes each layer's new keys and values into their pages and
attends straight from the pages for short queries (decode tokens, forced
runs), and for whole prompt chunks while one sequence's keys and values of a
layer fit in L2 (fp32, head_dim 64 or 128). Longer chunks go to SDPA:
equal-length fresh chunks side by side in one batched call, chunks over cached
context over keys gathered from the pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from engine.kv_cache import KVCacheInputs

from .base import (
    AttentionBackend,
    CacheRows,
    Gathered,
    SeqSpan,
    TokenPlaces,
    concat_ranges,
    gather,
    gathered_attention,
    sdpa,
    visible_keys,
)

# Queries at most this long go to the paged kernel; longer chunks to SDPA,
# unless the kernel's fp32 fast path applies and the whole context fits in L2.
SHORT_QUERY = 8
# Keys plus values of one layer of one sequence, in bytes, that the kernel
# reads once per query token: kept in a core's L2 (1-2 MiB on current x86),
# the kernel beats SDPA on a fresh prompt (30 layers of the bench model, 1.5
# KiB of keys and values per token: 123 vs 180 ms for 16 x 128 tokens, 388 vs
# 518 ms at 4 x 512, this limit); at 2 x 1024 the two tie (780 ms) and past
# that SDPA wins (2.3 vs 1.3 s at 1 x 2048).
KERNEL_CONTEXT_BYTES = 768 << 10


@dataclass(frozen=True)
class FreshRun:
    """Adjacent fresh prompt chunks of equal length: one batched SDPA call."""

    start: int
    count: int
    length: int


@dataclass(frozen=True)
class KernelMetadata:
    """A step as KernelAttention runs it."""

    kv: KVCacheInputs
    rows: CacheRows
    write_page: torch.Tensor  # [T] int32: page of each new token
    write_offset: torch.Tensor  # [T] int32: offset inside that page
    token_seq: torch.Tensor  # [T] int32: the token's row in kv.lookup_table
    token_ctx: torch.Tensor  # [T] int32: keys visible to the token (position + 1)
    short_tokens: torch.Tensor | None  # [S] int32: tokens the kernel attends for
    fresh_runs: list[FreshRun]
    cached: list[Gathered]  # long chunks over cached context


class KernelAttention(AttentionBackend[KernelMetadata]):
    """Paged attention on a CPU through the native extension's kernel: decode
    rows read the pages in place; prompt chunks take its fp32 fast path while
    their context is short, else gather their pages for SDPA."""

    name = "cpu-kernel"

    def __init__(self, num_heads: int, head_dim: int, ops: ModuleType, kv_blocks: torch.Tensor,
                 windows: Sequence[int] = (), scale: float | None = None, softcap: float = 0.0):
        super().__init__(num_heads, head_dim, windows=windows, scale=scale, softcap=softcap)
        self.ops = ops
        # The kernel's fp32 fast path (head_dim 64 or 128) takes whole prompt
        # chunks while their context is short enough; other layouts only decode.
        fast = kv_blocks.dtype == torch.float32 and head_dim in (64, 128)
        kv_bytes_per_token = 2 * kv_blocks.shape[4] * head_dim * kv_blocks.element_size()
        self.kernel_max_context = KERNEL_CONTEXT_BYTES // kv_bytes_per_token if fast else 0

    def _in_kernel(self, span: SeqSpan) -> bool:
        return span.q_len <= SHORT_QUERY or span.ctx_len <= self.kernel_max_context

    def plan(self, spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs) -> KernelMetadata:
        rows = CacheRows(kv.kv_blocks)
        places = TokenPlaces.of(spans, table, rows.page_size)
        short = [s for s in spans if self._in_kernel(s)]
        long = [s for s in spans if not self._in_kernel(s)]
        short_tokens = None
        if short:
            short_tokens = torch.from_numpy(concat_ranges(
                np.fromiter((s.q_start for s in short), np.int32, len(short)),
                np.fromiter((s.q_len for s in short), np.int32, len(short))))
        fresh_runs, cached = _fresh_runs(long)
        return KernelMetadata(
            kv, rows, _int32(places.page), _int32(places.offset), _int32(places.seq),
            _int32(places.position + 1), short_tokens, fresh_runs,
            [gather(span, rows, table, self.staging) for span in cached])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 meta: KernelMetadata) -> torch.Tensor:
        kv = meta.kv
        self.ops.write_kv(k, v, kv.kv_blocks, layer, meta.write_page, meta.write_offset)
        out = q.new_empty(q.shape)
        window = self.window(layer)
        if meta.short_tokens is not None:
            self.ops.paged_attention(out, q, kv.kv_blocks, layer, meta.short_tokens, meta.token_seq,
                                     meta.token_ctx, kv.lookup_table, self.scale, window, self.softcap)
        for run in meta.fresh_runs:
            sl = slice(run.start, run.start + run.count * run.length)
            shape = (run.count, run.length)
            mask = None
            if window and run.length > window:  # a fresh chunk: queries and keys at 0..length-1
                pos = torch.arange(run.length, device=q.device)
                mask = visible_keys(pos, pos, window)
            if self.softcap:  # SDPA cannot cap scores: chunk by chunk
                for i in range(sl.start, sl.stop, run.length):
                    chunk = slice(i, i + run.length)
                    out[chunk] = sdpa(q[chunk], k[chunk], v[chunk], mask, mask is None, self.scale, self.softcap)
                continue
            res = F.scaled_dot_product_attention(
                q[sl].unflatten(0, shape).transpose(1, 2), k[sl].unflatten(0, shape).transpose(1, 2),
                v[sl].unflatten(0, shape).transpose(1, 2), attn_mask=mask, is_causal=mask is None,
                scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
            out[sl].unflatten(0, shape).copy_(res.transpose(1, 2))
        for item in meta.cached:
            out[item.span.q_start:item.span.q_end] = gathered_attention(q, meta.rows, layer, item, self.scale,
                                                                        window, self.softcap)
        return out


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def _fresh_runs(spans: list[SeqSpan]) -> tuple[list[FreshRun], list[SeqSpan]]:
    """Split long spans into runs of adjacent, equal-length chunks with no cached
    context and the rest, which need their pages."""
    runs: list[FreshRun] = []
    rest: list[SeqSpan] = []
    for span in spans:
        if span.cache_len:
            rest.append(span)
        elif runs and runs[-1].length == span.q_len and runs[-1].start + runs[-1].count * span.q_len == span.q_start:
            runs[-1] = FreshRun(runs[-1].start, runs[-1].count + 1, span.q_len)
        else:
            runs.append(FreshRun(span.q_start, 1, span.q_len))
    return runs, rest
