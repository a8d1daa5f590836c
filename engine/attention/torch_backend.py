"""`TorchAttention`: per-sequence SDPA over keys gathered from the pages.

Runs on any device: the fallback when no native kernel can be built, and the
tests' reference for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache import KVCacheInputs

from .base import (
    AttentionBackend,
    CacheRows,
    Gathered,
    SeqSpan,
    TokenPlaces,
    gather,
    gathered_attention,
)


@dataclass(frozen=True)
class TorchMetadata:
    """A step as TorchAttention runs it: every span gathered from the pages.

    It holds no `KVCacheInputs`: nothing here reads its lengths or table on
    the device, and the upload would copy them (its `max_lengths`, host data,
    from pageable memory: a synchronous copy on CUDA)."""

    rows: CacheRows
    write_rows: torch.Tensor  # layer-0 rows of the new tokens' keys
    spans: list[Gathered]


class TorchAttention(AttentionBackend[TorchMetadata]):
    """Paged attention in plain torch on any device: each span's pages are
    gathered and attended with SDPA (the reference the other backends are
    tested against)."""

    name = "torch"

    def plan(self, spans: list[SeqSpan], table: np.ndarray, kv: KVCacheInputs) -> TorchMetadata:
        rows = CacheRows(kv.kv_blocks)
        places = TokenPlaces.of(spans, table, rows.page_size)
        return TorchMetadata(rows, places.write_rows(rows, self.staging),
                             [gather(span, rows, table, self.staging) for span in spans])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 meta: TorchMetadata) -> torch.Tensor:
        meta.rows.write(meta.write_rows, layer, k, v)
        out = q.new_empty(q.shape)
        window = self.window(layer)
        for item in meta.spans:
            out[item.span.q_start:item.span.q_end] = gathered_attention(q, meta.rows, layer, item, self.scale,
                                                                        window, self.softcap)
        return out
