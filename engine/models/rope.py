"""Rotary position embeddings, as complex rotations of interleaved pairs.

Hugging Face checkpoints rotate pairs (i, i + d/2) ("rotate_half"; with
Phi-3's partial rotation d is the rotated part of the head). The loader
permutes the rows of the q and k projections so that those pairs become
neighbours (2i, 2i + 1); a rotation is then one complex multiply. Attention
scores are dot products of q and k, which do not change when both are permuted
the same way, so the model computes the same function.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def uses_long_factors(rope: RopeConfig, context: int) -> bool:
    """longrope: whether a served context of `context` positions turns by the
    long factors. Chosen once for the whole context, as vLLM does: transformers
    switches when a sequence first passes the pretraining length, which would
    leave the keys cached before it turned by the short ones."""
    return context > rope.original_max_position_embeddings


def inverse_frequencies(rope: RopeConfig, dim: int, context: int = 0) -> torch.Tensor:
    """Per-pair frequencies of a rotation over `dim` dims, scaled as the
    checkpoint's `rope_type` says; `context`: the positions served (longrope's choice)."""
    # float32 throughout, as transformers computes it, so angles agree bit for bit.
    wavelengths = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "longrope":
        factors = rope.long_factor if uses_long_factors(rope, context) else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * wavelengths)
    inv = 1.0 / wavelengths
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    if rope.rope_type != "llama3":
        return inv  # default, and dynamic below the checkpoint's positions
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)


def _yarn(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN: pairs that turn fewer than `beta_slow` times over the pretraining
    length are interpolated by `factor`, those turning more than `beta_fast`
    times kept, and a linear ramp between them."""
    def pair_turning(turns: float) -> float:
        # The pair index at which a frequency turns `turns` times over the original length.
        return head_dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) \
            / (2 * math.log(rope.theta))

    low, high = pair_turning(rope.beta_fast), pair_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair's own frequency, 0: interpolated
    wavelengths = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (1.0 / (rope.factor * wavelengths)) * (1 - kept) + (1.0 / wavelengths) * kept


def rotation_table(rope: RopeConfig, head_dim: int, max_positions: int,
                   rotary_dim: int | None = None) -> torch.Tensor:
    """Rotations `[max_positions, head_dim // 2]` (complex64): unit ones, or
    of yarn's or longrope's magnitude, which scales the attention scores by
    its square. With `rotary_dim` only the first `rotary_dim // 2` pairs turn;
    the rest are rotated by 1, so every kernel that applies the table leaves
    them as they are."""
    dim = rotary_dim or head_dim
    inv = inverse_frequencies(rope, dim, max_positions)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    turned = torch.polar(torch.full_like(angles, rope.magnitude), angles)
    kept = torch.ones(max_positions, (head_dim - dim) // 2, dtype=turned.dtype)
    return torch.cat([turned, kept], dim=1)


def interleave_permutation(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Index map from HF's half-split pair layout to interleaved pairs: over
    the first `rotary_dim` dims (all by default), the rest left in place."""
    dim = rotary_dim or head_dim
    half = dim // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return torch.cat([pairs, torch.arange(dim, head_dim)])


def apply_rotation(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` (interleaved pairs) by `rotations` `[T, head_dim/2]`."""
    t, heads, dim = x.shape
    pairs = torch.view_as_complex(x.float().reshape(t, heads, dim // 2, 2))
    out = torch.view_as_real(pairs * rotations[:, None, :]).reshape(t, heads, dim)
    return out.to(x.dtype)
