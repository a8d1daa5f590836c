"""The paged attention metadata: tensors only, so a CUDA graph can be captured over it.

`PagedMetadata` describes a step to the paged backends with nothing but
tensors of fixed shape per batch size (a block table of fixed width, one
length per sequence, query offsets, the rows new keys go to) and one host int
(`max_q`, which picks the kernel). A decode graph (engine/graphs.py) keeps
static copies of these tensors and rewrites them in place before each replay.

Two backends read it:

- `TritonAttention` (triton_backend.py): our Triton kernels, any batch;
- `DenseDecodeAttention` (here): decode steps only (one query per sequence),
  in plain torch ops over the whole block table with a length mask. It is the
  decode graph's attention where Triton is missing, and what CPU tests replay
  the graph path with (the Triton interpreter is too slow for engine tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache import KVCacheInputs
from engine.staging import Staging

from .base import AttentionBackend, CacheRows, SeqSpan, TokenPlaces, cap_scores


@dataclass(frozen=True)
class PagedMetadata:
    """A step over the page tensor, as paged backends read it."""

    rows: CacheRows
    write_rows: torch.Tensor  # [T] int64: layer-0 key row of each new token
    cu_q: torch.Tensor  # [B + 1] int32: query offsets
    seq_lens: torch.Tensor  # [B] int32: keys of each sequence, this step's included
    block_table: torch.Tensor  # [B, W] int32: page ids (unused entries are never read)
    max_q: int  # the longest query (1: a decode step)


def paged_plan(spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs, staging: Staging) -> PagedMetadata:
    """The host tensors of a step's PagedMetadata."""
    rows = CacheRows(kv.kv_blocks)
    places = TokenPlaces.of(spans, table, rows.page_size)
    q_lens = np.array([s.q_len for s in spans], dtype=np.int32)
    cu_q = np.zeros(len(spans) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu_q[1:])
    seq_lens = np.array([s.ctx_len for s in spans], dtype=np.int32)
    return PagedMetadata(rows, places.write_rows(rows, staging), staging.tensor(cu_q), staging.tensor(seq_lens),
                         staging.tensor(np.ascontiguousarray(table, dtype=np.int32)), int(q_lens.max()))


class DenseDecodeAttention(AttentionBackend[PagedMetadata]):
    """Decode attention in torch ops: every sequence's keys gathered through its
    whole block-table row, positions past its length masked. Fixed shapes for a
    given batch and table width, no host reads: capturable in a CUDA graph."""

    name = "dense-decode"

    def plan(self, spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs) -> PagedMetadata:
        if any(s.q_len != 1 for s in spans):
            raise ValueError("dense decode attention runs decode steps only")
        return paged_plan(spans, table, kv, self.staging)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 meta: PagedMetadata) -> torch.Tensor:
        rows = meta.rows
        rows.write(meta.write_rows, layer, k, v)
        batch, width = meta.block_table.shape
        page_size = rows.page_size
        # [B, W * page_size] layer-0 key rows of every slot a sequence's pages hold.
        slots = meta.block_table.to(torch.int64)[:, :, None] * (2 * rows.layers * page_size) \
            + torch.arange(page_size, device=q.device)
        slots = slots.reshape(batch, width * page_size)
        slot_pos = torch.arange(width * page_size, device=q.device)[None, :]
        seq_lens = meta.seq_lens[:, None].to(torch.int64)
        visible = slot_pos < seq_lens
        window = self.window(layer)
        if window:  # the one query sits at seq_len - 1 and sees the last `window` keys
            visible &= slot_pos >= seq_lens - window
        # One query per sequence: T == B.
        return decode_over_slots(q, rows, layer, slots, visible, self.scale, self.softcap)


# Float32 bytes of one chunk of gathered keys (and as many of values): what
# bounds dense decode's scratch memory whatever the context and batch (a
# CUDA graph's pool keeps what its capture allocated).
CHUNK_BYTES = 64 << 20


def decode_over_slots(q: torch.Tensor, rows: CacheRows, layer: int, slots: torch.Tensor, visible: torch.Tensor,
                      scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence over the cache slots `slots` ([B, L] layer-0 key
    rows), those not `visible` ignored, scores capped by `softcap` (0: none):
    q [B, H, D] -> [B, H, D].

    In float32, chunk by chunk with a running maximum and sum (the online
    softmax of flash attention), so its memory is CHUNK_BYTES whatever L, and
    each key head serves its group of query heads where it is (SDPA with a
    mask and grouped heads falls back to its math kernel, which repeats every
    key and value per query head in float32: gigabytes at batch 64 over an 8k
    context). A slot not visible may hold anything (the dummy page, a last
    page's tail, a freed page's old keys): a mask drops its score, but a NaN
    there would still reach the row (0 x NaN), so its key and value are zeroed
    first.
    """
    batch, heads, dim = q.shape
    kv_heads = rows.flat.shape[1]
    group = heads // kv_heads
    queries = q.float().view(batch, kv_heads, group, dim) * scale
    chunk = max(1, CHUNK_BYTES // (batch * kv_heads * dim * 4))
    # A finite start, so that a row with nothing visible (a padded one) gives zeros, not NaN.
    best = torch.full((batch, kv_heads, group), -1e30, dtype=torch.float32, device=q.device)
    total = torch.zeros_like(best)
    acc = torch.zeros(batch, kv_heads, group, dim, dtype=torch.float32, device=q.device)
    for start in range(0, slots.shape[1], chunk):
        part, seen = slots[:, start:start + chunk], visible[:, start:start + chunk]
        unseen = ~seen[:, :, None, None]
        keys = rows.flat[rows.key_rows(part, layer)].masked_fill_(unseen, 0).float()  # [B, C, KVH, D]
        values = rows.flat[rows.value_rows(part, layer)].masked_fill_(unseen, 0).float()
        scores = cap_scores(torch.einsum("bhgd,bchd->bhgc", queries, keys), softcap)
        scores.masked_fill_(~seen[:, None, None, :], float("-inf"))
        top = torch.maximum(best, scores.amax(dim=-1))
        weights = torch.exp(scores - top[..., None])
        rescale = torch.exp(best - top)
        total = total * rescale + weights.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.einsum("bhgc,bchd->bhgd", weights, values)
        best = top
    return (acc / total.clamp_min(1e-30)[..., None]).view(batch, heads, dim).to(q.dtype)
