"""What every attention backend shares: a step's spans, page-tensor row math,
where each new token's keys and values go, and SDPA helpers.

A backend's `plan` runs on the engine thread and builds host tensors only
(through its `Staging`); the device thread uploads them with the rest of the
step (engine/staging.py)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from engine.kv_cache import KVCacheInputs
from engine.staging import Staging


@dataclass(frozen=True)
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


class CacheRows:
    """Row arithmetic on the page tensor seen as rows of [kv_heads, head_dim]."""

    def __init__(self, kv_blocks: torch.Tensor):
        num_pages, two, layers, page_size, kv_heads, head_dim = kv_blocks.shape
        self.blocks = kv_blocks
        self.flat = kv_blocks.view(num_pages * two * layers * page_size, kv_heads, head_dim)
        self.layers = layers
        self.page_size = page_size

    def base_rows(self, table_row: np.ndarray, start: int, end: int) -> np.ndarray:
        """Layer-0 key rows for positions [start, end) of one sequence."""
        pos = np.arange(start, end)
        pages = table_row[pos // self.page_size].astype(np.int64)
        return pages * (2 * self.layers * self.page_size) + pos % self.page_size

    def key_offset(self, layer: int) -> int:
        """What a layer-0 key row adds to be `layer`'s key row."""
        return layer * self.page_size

    def value_offset(self, layer: int) -> int:
        """What a layer-0 key row adds to be `layer`'s value row."""
        return (self.layers + layer) * self.page_size

    def key_rows(self, base: torch.Tensor, layer: int) -> torch.Tensor:
        return base + self.key_offset(layer)

    def value_rows(self, base: torch.Tensor, layer: int) -> torch.Tensor:
        return base + self.value_offset(layer)

    def write(self, base: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new keys and values at layer-0 rows `base`."""
        self.flat.index_copy_(0, self.key_rows(base, layer), k)
        self.flat.index_copy_(0, self.value_rows(base, layer), v)


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`arange(starts[i], starts[i] + lengths[i])` for every i, concatenated, in
    starts' dtype (whole-array numpy, no arange per range: a step has one range
    per span)."""
    first = np.cumsum(lengths) - lengths  # where each range begins in the output
    out = np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()))
    return out.astype(starts.dtype, copy=False)


@dataclass(frozen=True)
class TokenPlaces:
    """Where each new token of a step lies (host arrays, one entry per token)."""

    seq: np.ndarray  # row of its sequence in the lookup table
    position: np.ndarray  # absolute position in its sequence
    page: np.ndarray  # page its keys and values go to
    offset: np.ndarray  # offset inside that page

    @classmethod
    def of(cls, spans: list[SeqSpan], table: np.ndarray, page_size: int) -> TokenPlaces:
        q_lens = np.array([s.q_len for s in spans], dtype=np.int64)
        starts = np.array([s.cache_len for s in spans], dtype=np.int64)
        seq = np.repeat(np.arange(len(spans)), q_lens)
        position = concat_ranges(starts, q_lens)
        return cls(seq, position, table[seq, position // page_size], position % page_size)

    def write_rows(self, rows: CacheRows, staging: Staging) -> torch.Tensor:
        """Layer-0 key rows of the new tokens (for backends that write with index_copy)."""
        base = self.page.astype(np.int64) * (2 * rows.layers * rows.page_size) + self.offset
        return staging.tensor(base)


def cap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scores (q.k times the scale) capped as Gemma 2 caps them, softcap *
    tanh(s / softcap), in place; as they are when `softcap` is 0."""
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         causal: bool, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, KVH, D] -> [Lq, H, D]; `mask` [Lq, Lk] bool
    (True: seen), or `causal` (query i sees keys up to i)."""
    if softcap:
        return _capped_attention(q, k, v, mask, causal, scale, softcap)
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


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool, scale: float, softcap: float) -> torch.Tensor:
    """`sdpa` with capped scores, which SDPA cannot take: the scores in
    float32, each key head serving its group of query heads where it is."""
    lq, heads, dim = q.shape
    kv_heads = k.shape[1]
    queries = q.float().view(lq, kv_heads, heads // kv_heads, dim)
    scores = cap_scores(torch.einsum("qhgd,khd->hgqk", queries, k.float()) * scale, softcap)
    if causal:
        mask = visible_keys(torch.arange(k.shape[0], device=q.device), torch.arange(lq, device=q.device))
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    out = torch.einsum("hgqk,khd->qhgd", torch.softmax(scores, dim=-1), v.float())
    return out.reshape(lq, heads, dim).to(q.dtype)


@dataclass(frozen=True)
class Gathered:
    """A span whose keys and values are gathered from the pages for SDPA."""

    span: SeqSpan
    rows: torch.Tensor  # layer-0 key rows of its whole context


def gather(span: SeqSpan, rows: CacheRows, table: np.ndarray, staging: Staging) -> Gathered:
    return Gathered(span, staging.tensor(rows.base_rows(table[span.index], 0, span.ctx_len)))


# Float32 bytes of one span's attention scores at a time: a longer prompt chunk
# attends in slices of its queries (2048 queries over a 32k context would
# otherwise take 8 GiB for 32 heads).
SCORE_BYTES = 256 << 20


def visible_keys(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[Q, K] bool: whether the query at `query_pos[i]` sees the key at
    `key_pos[j]`: causally, and with a sliding `window` only the last `window`
    keys up to its own."""
    visible = key_pos[None, :] <= query_pos[:, None]
    if window:
        visible &= key_pos[None, :] > query_pos[:, None] - window
    return visible


def gathered_attention(q: torch.Tensor, rows: CacheRows, layer: int, item: Gathered,
                       scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """SDPA of one span's queries over its keys and values read from the pages.
    Several queries are causal: query i (at position cache_len + i) sees keys
    0..cache_len + i, or with a sliding `window` only the last `window` of
    them, a mask made on the device (a host-built one would be q_len x ctx_len
    bytes to copy every step)."""
    span = item.span
    if span.q_len == 0:  # a sequence with nothing to compute this step, as the other backends allow
        return q[span.q_start:span.q_end]
    # Keys before `first` are out of every query's window.
    first = max(0, span.cache_len + 1 - window) if window else 0
    base = item.rows[first:] if first else item.rows
    keys = rows.flat.index_select(0, rows.key_rows(base, layer))
    values = rows.flat.index_select(0, rows.value_rows(base, layer))
    queries = q[span.q_start:span.q_end]
    if span.q_len == 1:
        return sdpa(queries, keys, values, None, False, scale, softcap)
    per_slice = max(1, SCORE_BYTES // (q.shape[1] * span.ctx_len * 4))
    key_pos = torch.arange(first, span.ctx_len, device=q.device)
    out = []
    for start in range(0, span.q_len, per_slice):
        end = min(start + per_slice, span.q_len)
        query_pos = torch.arange(span.cache_len + start, span.cache_len + end, device=q.device)
        mask = visible_keys(key_pos, query_pos, window)
        out.append(sdpa(queries[start:end], keys, values, mask, False, scale, softcap))
    return out[0] if len(out) == 1 else torch.cat(out)


M = TypeVar("M")


class AttentionBackend(ABC, Generic[M]):
    """Attention over the paged KV cache for a mixed batch, without padding.

    `plan` runs once per step on the host and returns the backend's own
    metadata (what it reads of the step's KVCacheInputs, as host tensors the
    device thread uploads); the model then calls the backend once per layer
    with it.
    """

    name = "base"

    def __init__(self, num_heads: int, head_dim: int, staging: Staging | None = None,
                 windows: Sequence[int] = (), scale: float | None = None, softcap: float = 0.0):
        self.num_heads = num_heads
        self.head_dim = head_dim
        # What q.k is multiplied by: 1/sqrt(head_dim) unless the model says (Granite, Gemma).
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        # Gemma 2's cap on the scaled scores (cap_scores); 0: none.
        self.softcap = float(softcap)
        self.staging = staging or Staging(torch.device("cpu"))
        # Per layer, the sliding window of its queries (0: the whole context);
        # empty: no layer slides (ModelConfig.sliding_windows).
        self.windows = tuple(windows)

    def window(self, layer: int) -> int:
        """How many keys up to its own position a query of `layer` sees (0: all)."""
        return self.windows[layer] if self.windows else 0

    @abstractmethod
    def plan(self, spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs) -> M:
        """This backend's metadata for a step (`table` is kv.lookup_table on the host)."""

    # Whether `attend_rotating` works: the rotary embedding done in the cache write.
    rotates_in_write = False

    @abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: M) -> torch.Tensor:
        """Store the new keys and values of `layer`, attend, return [T, heads, head_dim]."""

    def attend_rotating(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: M,
                        rotation_pairs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`__call__` for q and k not yet rotated: each token's pairs turn by
        `rotation_pairs[positions[t]]` (float32 (cos, sin), interleaved) as its
        keys are stored. Only where `rotates_in_write`."""
        raise NotImplementedError(f"{self.name} attention does not rotate in its cache write")
