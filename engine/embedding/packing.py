"""Pack sequences of different lengths into one flat token buffer, without padding.

Sequences are ordered by length so that sequences of equal length sit next to
each other: a run of `count` sequences of `length` tokens is then a contiguous
`[count * length, ...]` slice of every activation, which attention can view as
`[count, length, ...]` and run as one dense batch with no mask and no gather.
Everything outside attention (GEMMs, LayerNorm, GELU) is per token and runs on
the flat buffer, so no FLOP is spent on padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LengthGroup:
    """`count` sequences of `length` tokens starting at token offset `start`."""

    start: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.count * self.length


@dataclass(frozen=True)
class PackedBatch:
    """A flat batch; tensors are in packed (length-sorted) order unless noted."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 for each sequence
    seq_index: torch.Tensor  # [T] int64, packed sequence of each token
    starts: torch.Tensor  # [n] int64, first token of each packed sequence
    lengths: torch.Tensor  # [n] int64
    restore: torch.Tensor  # [n] int64: row i of the input order is packed row restore[i]
    groups: tuple[LengthGroup, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.shape[0])


def pack(sequences: Sequence[Sequence[int]], device: torch.device) -> PackedBatch:
    """Pack token-id sequences (each non-empty) for one forward pass on `device`."""
    if not sequences:
        raise ValueError("cannot pack an empty batch")
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    if lengths.min() < 1:
        raise ValueError("every sequence needs at least one token")
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    starts = np.zeros(len(order), dtype=np.int64)
    np.cumsum(sorted_lengths[:-1], out=starts[1:])

    groups: list[LengthGroup] = []
    positions: list[np.ndarray] = []
    values, first, counts = np.unique(sorted_lengths, return_index=True, return_counts=True)
    for length, i, count in zip(values.tolist(), first.tolist(), counts.tolist(), strict=True):
        groups.append(LengthGroup(start=int(starts[i]), count=count, length=length))
        positions.append(np.tile(np.arange(length, dtype=np.int64), count))

    ids = np.concatenate([np.asarray(sequences[i], dtype=np.int64) for i in order])
    restore = np.empty_like(order)
    restore[order] = np.arange(len(order))
    seq_index = np.repeat(np.arange(len(order), dtype=np.int64), sorted_lengths)

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return PackedBatch(
        input_ids=to_device(ids),
        position_ids=to_device(np.concatenate(positions)),
        seq_index=to_device(seq_index),
        starts=to_device(starts),
        lengths=to_device(sorted_lengths),
        restore=to_device(restore),
        groups=tuple(groups),
    )
