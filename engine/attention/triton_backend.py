"""`TritonAttention` (CUDA): our Triton kernels reading the page pool (triton_kernels.py).

Any batch (prompt chunks over cached prefixes, decode tokens, forced runs),
any dtype and page size, and capturable in a CUDA graph: its metadata is
tensors only (paged.py), and the kernels take every launch size from Python
ints. The decode split count (flash-decoding) is fixed once for the engine,
from the device and the longest context, not from the batch: a decode step
replayed from a CUDA graph and the same step run eagerly compute every row
the same way, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kv_cache import KVCacheInputs
from engine.staging import Staging

from .base import AttentionBackend, SeqSpan
from .paged import PagedMetadata, paged_plan
from .triton_kernels import default_num_splits, paged_attention, rotate_write_kv, sm_count, write_kv


class TritonAttention(AttentionBackend[PagedMetadata]):
    """Paged attention in our Triton kernels (decode and prefill over the page
    pool, any dtype and page size, capturable in a CUDA graph); the KV write
    applies the rotary embedding too."""

    name = "triton"
    rotates_in_write = True

    def __init__(self, num_heads: int, head_dim: int, staging: Staging, num_kv_heads: int, max_keys: int,
                 windows: Sequence[int] = (), scale: float | None = None, softcap: float = 0.0):
        super().__init__(num_heads, head_dim, staging, windows, scale, softcap)
        self.decode_splits = default_num_splits(1, num_kv_heads, max_keys, sm_count(staging.device))

    def plan(self, spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs) -> PagedMetadata:
        return paged_plan(spans, table, kv, self.staging)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 meta: PagedMetadata) -> torch.Tensor:
        rows = meta.rows
        # One kernel for the layer's keys and values (CacheRows.write takes four).
        write_kv(rows.flat, meta.write_rows, rows.key_offset(layer), rows.value_offset(layer), k, v)
        return self._attend(q, layer, meta)

    def attend_rotating(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: PagedMetadata,
                        rotation_pairs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = meta.rows
        # The rotary embedding of q and k and the cache write in one kernel (a launch fewer a layer).
        rotate_write_kv(q, k, v, rotation_pairs, positions, rows.flat, meta.write_rows, rows.key_offset(layer),
                        rows.value_offset(layer))
        return self._attend(q, layer, meta)

    def _attend(self, q: torch.Tensor, layer: int, meta: PagedMetadata) -> torch.Tensor:
        return paged_attention(q, meta.rows.blocks, layer, meta.block_table, meta.seq_lens, meta.cu_q, meta.max_q,
                               self.scale, num_splits=self.decode_splits, window=self.window(layer),
                               softcap=self.softcap)
