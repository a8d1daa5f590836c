"""`VarlenAttention` (CUDA): flash varlen attention reading the page pool.

`varlen_attn` takes the page pool, a block table (the step's lookup table) and
per-sequence key counts, so no gather is needed; causal masking is
bottom-right aligned (window (-1, 0)), which is what chunked prefill and
decode need. If the kernel rejects the cache (flash builds have had page-size
limits), the backend falls back to gathering each sequence's keys into one
packed buffer. Not exercised in CI (no GPU); CPU tests cover the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache import KVCacheInputs

from .base import AttentionBackend, CacheRows, SeqSpan, TokenPlaces


@dataclass
class VarlenMetadata:
    """A step as VarlenAttention runs it."""

    kv: KVCacheInputs
    rows: CacheRows
    write_rows: torch.Tensor  # layer-0 rows of the new tokens' keys
    cu_q: torch.Tensor  # [B + 1] int32 query offsets
    seqused_k: torch.Tensor  # [B] int32 keys per sequence
    max_q: int
    max_k: int
    # The gather fallback's packed key rows and key offsets, built on first use.
    packed: tuple[torch.Tensor, torch.Tensor] | None = None
    table: np.ndarray | None = None  # the host lookup table, for the fallback


class VarlenAttention(AttentionBackend[VarlenMetadata]):
    name = "cuda-varlen"

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__(num_heads, head_dim)
        self._paged: bool | None = None  # None: not tried yet

    def plan(self, spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs) -> VarlenMetadata:
        device = kv.kv_blocks.device
        rows = CacheRows(kv.kv_blocks)
        places = TokenPlaces.of(spans, table, rows.page_size)
        q_lens = np.array([s.q_len for s in spans], dtype=np.int32)
        cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)).to(device)
        seqused_k = kv.cache_lengths + torch.from_numpy(q_lens).to(device)
        max_q, max_k = (int(x) for x in kv.max_lengths[0])
        return VarlenMetadata(kv, rows, places.write_rows(rows, device), cu_q, seqused_k, max_q, max_k,
                              table=table)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 meta: VarlenMetadata) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        meta.rows.write(meta.write_rows, layer, k, v)
        q = q.contiguous()
        gqa = q.shape[1] != k.shape[1]
        kv = meta.kv
        if self._paged is not False:
            try:
                out = varlen_attn(q, kv.kv_blocks[:, 0, layer], kv.kv_blocks[:, 1, layer], meta.cu_q, None,
                                  meta.max_q, meta.max_k, seqused_k=meta.seqused_k,
                                  block_table=kv.lookup_table, scale=self.scale, window_size=(-1, 0),
                                  enable_gqa=gqa)
                self._paged = True
                return _tensor(out)
            except (RuntimeError, ValueError):
                if self._paged:
                    raise
                self._paged = False
        if meta.packed is None:
            assert meta.table is not None
            k_lens = meta.seqused_k.cpu().numpy().astype(np.int64)
            base = np.concatenate([meta.rows.base_rows(meta.table[i], 0, int(n)) for i, n in enumerate(k_lens)])
            offsets = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
            meta.packed = (torch.from_numpy(base).to(q.device), torch.from_numpy(offsets).to(q.device))
        packed, cu_k = meta.packed
        keys = meta.rows.flat.index_select(0, meta.rows.key_rows(packed, layer))
        values = meta.rows.flat.index_select(0, meta.rows.value_rows(packed, layer))
        return _tensor(varlen_attn(q, keys, values, meta.cu_q, cu_k, meta.max_q, meta.max_k, scale=self.scale,
                                   window_size=(-1, 0), enable_gqa=gqa))


def _tensor(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """varlen_attn's output (it returns a tuple when asked for auxiliary results)."""
    return out[0] if isinstance(out, tuple) else out
