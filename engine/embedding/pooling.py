"""Pooling over packed hidden states, and the per-request output transform.

Pooling mirrors sentence-transformers' `Pooling` module (each mode, and the
concatenation of several), computed on the flat token buffer with segment
sums instead of padded masks. It always runs in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .packing import PackedBatch


def _segment_sum(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    out = torch.zeros(batch.num_seqs, values.shape[-1], device=values.device, dtype=values.dtype)
    return out.index_add_(0, batch.seq_index, values)


def _pool_one(hidden: torch.Tensor, batch: PackedBatch, mode: str) -> torch.Tensor:
    lengths = batch.lengths.to(hidden.dtype).unsqueeze(1)
    if mode == "cls":
        return hidden[batch.starts]
    if mode == "lasttoken":
        return hidden[batch.starts + batch.lengths - 1]
    if mode == "mean":
        return _segment_sum(hidden, batch) / lengths
    if mode == "mean_sqrt_len_tokens":
        return _segment_sum(hidden, batch) / lengths.sqrt()
    if mode == "weightedmean":
        # Token i (0-based) of a sequence weighs i + 1.
        weights = (batch.position_ids + 1).to(hidden.dtype).unsqueeze(1)
        return _segment_sum(hidden * weights, batch) / (lengths * (lengths + 1) / 2)
    if mode == "max":
        index = batch.seq_index.unsqueeze(1).expand_as(hidden)
        out = torch.empty(batch.num_seqs, hidden.shape[1], device=hidden.device, dtype=hidden.dtype)
        return out.scatter_reduce_(0, index, hidden, "amax", include_self=False)
    raise ValueError(f"unknown pooling mode {mode!r}")


def pool(hidden: torch.Tensor, batch: PackedBatch, modes: Sequence[str]) -> torch.Tensor:
    """One float32 vector per sequence, rows in the caller's (unpacked) order."""
    hidden = hidden.float()
    pooled = [_pool_one(hidden, batch, m) for m in modes]
    out = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
    return out[batch.restore]


def finalize(pooled: torch.Tensor, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Matryoshka truncation, then L2 normalization; float32 numpy on the host.

    Truncating first and normalizing after is the same as normalizing the full
    vector, truncating and renormalizing, in one pass.
    """
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    if normalize:
        pooled = F.normalize(pooled, p=2.0, dim=1)
    return np.ascontiguousarray(pooled.detach().to("cpu", torch.float32).numpy())
