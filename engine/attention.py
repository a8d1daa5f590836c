"""Attention over the paged KV cache for a mixed batch, without padding.

A step's batch is a flat run of tokens: prompt chunks of some sequences and
single decode tokens (or short runs of forced tokens) of others. Three
implementations share one metadata object built once per step:

- `KernelAttention` (CPU): a native kernel writes the new keys/values into their
  pages and computes attention for short queries, and for prompt chunks whose
  context fits in L2, directly from the pages; longer prompt chunks use SDPA
  (GEMM-based) over the chunk's context.
- `VarlenAttention` (CUDA): gathers each sequence's context into one packed
  buffer and runs flash varlen attention (bottom-right causal).
- `TorchAttention`: per-sequence SDPA over gathered pages. Works on any device;
  the fallback when no kernel can be built, and the tests' reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

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


@dataclass
class SeqSpan:
    """One sequence's slice of the step: queries [q_start, q_end) at positions
    [cache_len, cache_len + q_len); keys [0, ctx_len)."""

    index: int
    q_start: int
    q_end: int
    cache_len: int

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def ctx_len(self) -> int:
        return self.cache_len + self.q_len


@dataclass
class AttentionMetadata:
    """Per-step facts every attention layer needs, computed once per step."""

    num_tokens: int
    spans: list[SeqSpan]
    slot_page: torch.Tensor  # [T] int32 page of each new token
    slot_offset: torch.Tensor  # [T] int32 offset inside that page
    token_seq: torch.Tensor  # [T] int32 row of the token's sequence in lookup_table
    token_ctx: torch.Tensor  # [T] int32 keys visible to the token (position + 1)
    lookup_table: torch.Tensor  # [B, max_pages] int32
    page_size: int
    # Filled by the backend that uses them.
    short_tokens: torch.Tensor | None = None
    gather_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)


def build_metadata(
    spans: list[SeqSpan], lookup_table: np.ndarray, page_size: int, device: torch.device
) -> AttentionMetadata:
    """Slot and context arrays for `spans`; `lookup_table[b]` lists span b's pages."""
    q_lens = np.array([s.q_len for s in spans], dtype=np.int64)
    starts = np.array([s.cache_len for s in spans], dtype=np.int64)
    seq_of_token = np.repeat(np.arange(len(spans)), q_lens)
    first_token = np.cumsum(q_lens) - q_lens
    positions = starts[seq_of_token] + (np.arange(int(q_lens.sum())) - first_token[seq_of_token])
    pages = lookup_table[seq_of_token, positions // page_size]

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    return AttentionMetadata(
        num_tokens=int(q_lens.sum()),
        spans=spans,
        slot_page=to_dev(pages),
        slot_offset=to_dev(positions % page_size),
        token_seq=to_dev(seq_of_token),
        token_ctx=to_dev(positions + 1),
        lookup_table=to_dev(lookup_table),
        page_size=page_size,
    )


class CacheRows:
    """Row arithmetic on the page tensor seen as rows of [kv_heads, head_dim]."""

    def __init__(self, cache: torch.Tensor):
        num_pages, two, layers, page_size, kv_heads, head_dim = cache.shape
        self.flat = cache.view(num_pages * two * layers * page_size, kv_heads, head_dim)
        self.layers = layers
        self.page_size = page_size

    def base_rows(self, table_row: np.ndarray, start: int, end: int) -> np.ndarray:
        """Layer-0 key rows for positions [start, end) of one sequence."""
        pos = np.arange(start, end)
        pages = table_row[pos // self.page_size].astype(np.int64)
        return pages * (2 * self.layers * self.page_size) + pos % self.page_size

    def key_rows(self, base: torch.Tensor, layer: int) -> torch.Tensor:
        return base + layer * self.page_size

    def value_rows(self, base: torch.Tensor, layer: int) -> torch.Tensor:
        return base + (self.layers + layer) * self.page_size


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, KVH, D] -> [Lq, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _causal_mask(span: SeqSpan, device: torch.device) -> torch.Tensor:
    # Query i (absolute position cache_len + i) sees keys 0..cache_len + i.
    q_pos = torch.arange(span.q_len, device=device)[:, None] + span.cache_len
    return torch.arange(span.ctx_len, device=device)[None, :] <= q_pos


class AttentionBackend:
    """Interface: `prepare` once per step, then `__call__` once per layer."""

    name = "base"

    def __init__(self, cache: torch.Tensor, num_heads: int, head_dim: int):
        self.cache = cache
        self.rows = CacheRows(cache)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def prepare(self, meta: AttentionMetadata, lookup_table: np.ndarray) -> None:
        raise NotImplementedError

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def _gather_long_spans(self, meta: AttentionMetadata, lookup_table: np.ndarray,
                           spans: list[SeqSpan]) -> None:
        device = self.cache.device
        for span in spans:
            if span.cache_len == 0:
                continue  # fresh prompt chunk: its own k/v, plain causal attention
            rows = self.rows.base_rows(lookup_table[span.index], 0, span.ctx_len)
            meta.gather_rows[span.index] = torch.from_numpy(rows).to(device)
            meta.masks[span.index] = _causal_mask(span, device)

    def _span_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                        meta: AttentionMetadata, span: SeqSpan) -> torch.Tensor:
        sl = slice(span.q_start, span.q_end)
        if span.index not in meta.gather_rows:
            return _sdpa(q[sl], k[sl], v[sl], None, span.q_len > 1, self.scale)
        base = meta.gather_rows[span.index]
        keys = self.rows.flat.index_select(0, self.rows.key_rows(base, layer))
        values = self.rows.flat.index_select(0, self.rows.value_rows(base, layer))
        mask = meta.masks[span.index] if span.q_len > 1 else None
        return _sdpa(q[sl], keys, values, mask, False, self.scale)


class TorchAttention(AttentionBackend):
    """Per-sequence SDPA over keys gathered from the pages (any device)."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata, lookup_table: np.ndarray) -> None:
        device = self.cache.device
        pages = meta.slot_page.to(torch.int64)
        meta.extra["write_base"] = pages * (2 * self.rows.layers * self.rows.page_size) + meta.slot_offset
        for span in meta.spans:
            rows = self.rows.base_rows(lookup_table[span.index], 0, span.ctx_len)
            meta.gather_rows[span.index] = torch.from_numpy(rows).to(device)
            if span.q_len > 1:
                meta.masks[span.index] = _causal_mask(span, device)

    def __call__(self, q, k, v, layer, meta):
        base = meta.extra["write_base"]
        assert isinstance(base, torch.Tensor)
        self.rows.flat.index_copy_(0, self.rows.key_rows(base, layer), k)
        self.rows.flat.index_copy_(0, self.rows.value_rows(base, layer), v)
        out = q.new_empty(q.shape)
        for span in meta.spans:
            out[span.q_start:span.q_end] = self._span_attention(q, k, v, layer, meta, span)
        return out


class KernelAttention(AttentionBackend):
    """CPU: native paged kernel for short queries, SDPA for long chunks."""

    name = "cpu-kernel"

    def __init__(self, cache: torch.Tensor, num_heads: int, head_dim: int, ops: ModuleType):
        super().__init__(cache, num_heads, head_dim)
        self.ops = ops
        # The kernel's fp32 fast path (head_dim 64 or 128) takes whole prompt
        # chunks while their context is short enough; other layouts only decode.
        fast = cache.dtype == torch.float32 and head_dim in (64, 128)
        kv_bytes_per_token = 2 * cache.shape[4] * head_dim * cache.element_size()
        self.kernel_max_context = KERNEL_CONTEXT_BYTES // kv_bytes_per_token if fast else 0

    def _in_kernel(self, span: SeqSpan) -> bool:
        return span.q_len <= SHORT_QUERY or span.ctx_len <= self.kernel_max_context

    def prepare(self, meta: AttentionMetadata, lookup_table: np.ndarray) -> None:
        short = [s for s in meta.spans if self._in_kernel(s)]
        long = [s for s in meta.spans if not self._in_kernel(s)]
        if short:
            idx = np.concatenate([np.arange(s.q_start, s.q_end) for s in short]).astype(np.int32)
            meta.short_tokens = torch.from_numpy(idx)
        fresh_runs, cached = _fresh_runs(long)
        meta.extra["fresh_runs"] = fresh_runs
        meta.extra["cached"] = cached
        self._gather_long_spans(meta, lookup_table, cached)

    def __call__(self, q, k, v, layer, meta):
        self.ops.write_kv(k, v, self.cache, layer, meta.slot_page, meta.slot_offset)
        out = q.new_empty(q.shape)
        if meta.short_tokens is not None:
            self.ops.paged_attention(out, q, self.cache, layer, meta.short_tokens, meta.token_seq,
                                     meta.token_ctx, meta.lookup_table, self.scale)
        for start, count, length in meta.extra["fresh_runs"]:  # type: ignore[union-attr]
            # Equal-length fresh prompt chunks lying side by side: one batched call.
            sl = slice(start, start + count * length)
            shape = (count, length)
            res = F.scaled_dot_product_attention(
                q[sl].unflatten(0, shape).transpose(1, 2), k[sl].unflatten(0, shape).transpose(1, 2),
                v[sl].unflatten(0, shape).transpose(1, 2), is_causal=True, scale=self.scale,
                enable_gqa=q.shape[1] != k.shape[1])
            out[sl].unflatten(0, shape).copy_(res.transpose(1, 2))
        for span in meta.extra["cached"]:  # type: ignore[union-attr]
            out[span.q_start:span.q_end] = self._span_attention(q, k, v, layer, meta, span)
        return out


def _fresh_runs(spans: list[SeqSpan]) -> tuple[list[tuple[int, int, int]], list[SeqSpan]]:
    """Split long spans into runs of adjacent, equal-length chunks with no cached
    context (start, count, length) and the rest, which need their pages."""
    runs: list[tuple[int, int, int]] = []
    rest: list[SeqSpan] = []
    for span in spans:
        if span.cache_len:
            rest.append(span)
        elif runs and runs[-1][2] == span.q_len and runs[-1][0] + runs[-1][1] * span.q_len == span.q_start:
            start, count, length = runs[-1]
            runs[-1] = (start, count + 1, length)
        else:
            runs.append((span.q_start, 1, span.q_len))
    return runs, rest


class VarlenAttention(AttentionBackend):
    """CUDA: flash varlen attention reading keys and values from the pages.

    `varlen_attn` takes the page pool, a block table and per-sequence key
    counts, so no gather is needed; causal masking is bottom-right aligned
    (window (-1, 0)), which is what chunked prefill and decode need. If the
    kernel rejects the cache (flash builds have had page-size limits), the
    backend falls back to gathering each sequence's keys into one packed
    buffer. Not exercised in CI (no GPU); CPU tests cover the same metadata.
    """

    name = "cuda-varlen"

    def __init__(self, cache: torch.Tensor, num_heads: int, head_dim: int):
        super().__init__(cache, num_heads, head_dim)
        self._paged: bool | None = None  # None: not tried yet

    def prepare(self, meta: AttentionMetadata, lookup_table: np.ndarray) -> None:
        device = self.cache.device
        pages = meta.slot_page.to(torch.int64)
        meta.extra["write_base"] = pages * (2 * self.rows.layers * self.rows.page_size) + meta.slot_offset
        q_lens = [s.q_len for s in meta.spans]
        k_lens = [s.ctx_len for s in meta.spans]
        meta.extra["cu_q"] = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32,
                                          device=device)
        meta.extra["seqused_k"] = torch.tensor(k_lens, dtype=torch.int32, device=device)
        meta.extra["k_lens"] = k_lens
        meta.extra["host_table"] = lookup_table
        meta.extra["max_q"], meta.extra["max_k"] = max(q_lens), max(k_lens)

    def __call__(self, q, k, v, layer, meta):
        from torch.nn.attention.varlen import varlen_attn

        base = meta.extra["write_base"]
        self.rows.flat.index_copy_(0, self.rows.key_rows(base, layer), k)
        self.rows.flat.index_copy_(0, self.rows.value_rows(base, layer), v)
        q = q.contiguous()
        common = dict(scale=self.scale, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])
        if self._paged is not False:
            try:
                out = varlen_attn(q, self.cache[:, 0, layer], self.cache[:, 1, layer], meta.extra["cu_q"], None,
                                  meta.extra["max_q"], meta.extra["max_k"], seqused_k=meta.extra["seqused_k"],
                                  block_table=meta.lookup_table, **common)
                self._paged = True
                return out
            except (RuntimeError, ValueError):
                if self._paged:
                    raise
                self._paged = False
        if "cu_k" not in meta.extra:
            table = meta.extra["host_table"]
            rows = np.concatenate([self.rows.base_rows(table[s.index], 0, s.ctx_len) for s in meta.spans])
            meta.extra["packed_rows"] = torch.from_numpy(rows).to(q.device)
            meta.extra["cu_k"] = torch.tensor(np.concatenate([[0], np.cumsum(meta.extra["k_lens"])]),
                                              dtype=torch.int32, device=q.device)
        packed = meta.extra["packed_rows"]
        keys = self.rows.flat.index_select(0, self.rows.key_rows(packed, layer))
        values = self.rows.flat.index_select(0, self.rows.value_rows(packed, layer))
        return varlen_attn(q, keys, values, meta.extra["cu_q"], meta.extra["cu_k"], meta.extra["max_q"],
                           meta.extra["max_k"], **common)


def make_attention(cache: torch.Tensor, num_heads: int, head_dim: int,
                   prefer: str = "auto") -> AttentionBackend:
    """Pick the attention implementation for the cache's device."""
    if prefer == "torch":
        return TorchAttention(cache, num_heads, head_dim)
    if cache.device.type == "cuda":
        try:
            from torch.nn.attention import varlen  # noqa: F401
            return VarlenAttention(cache, num_heads, head_dim)
        except ImportError:
            return TorchAttention(cache, num_heads, head_dim)
    if cache.device.type == "cpu":
        from engine.kernels import cpu_ops

        ops = cpu_ops()
        if ops is not None:
            return KernelAttention(cache, num_heads, head_dim, ops)
    return TorchAttention(cache, num_heads, head_dim)
