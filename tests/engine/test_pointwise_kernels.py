"""The native CPU row kernels (residual add + RMSNorm, rotary embedding,
SiLU-and-multiply) against their torch definitions.

Sizes include ones that are not multiples of 16, so the AVX-512 paths' masked
tails run, and bf16, which takes the scalar paths.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_ops
from engine.models.config import RopeConfig
from engine.models.rope import apply_rotation, rotation_table

_loaded = cpu_ops()
pytestmark = pytest.mark.skipif(_loaded is None, reason="CPU kernels unavailable")
ops = cast(ModuleType, _loaded)  # None only where pytestmark skips every test


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 100), (37, 7)])
def test_add_rms_norm_matches_torch(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual.float(), (hidden,), weight.float(), 1e-6)
    ops.add_rms_norm(x, residual, weight, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(x.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary_embedding_matches_complex_rotation(dtype, head_dim):
    rope = RopeConfig(theta=10000.0)
    table = rotation_table(rope, head_dim, 512)
    pairs = torch.view_as_real(table).flatten(1)
    g = torch.Generator().manual_seed(head_dim)
    # A strided view, as the model passes the q|k part of its fused qkv rows.
    qkv = torch.randn(9, 7, head_dim, generator=g).to(dtype)
    x = qkv[:, 1:6]
    positions = torch.tensor([0, 1, 5, 17, 100, 511, 3, 3, 250])
    expected = apply_rotation(x.clone(), table[positions])
    untouched = qkv[:, [0, 6]].clone()
    ops.rotary_embedding(x, pairs, positions)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(qkv[:, [0, 6]], untouched, rtol=0, atol=0)


def test_rotary_embedding_rejects_a_position_outside_the_table():
    pairs = torch.view_as_real(rotation_table(RopeConfig(theta=10000.0), 64, 16)).flatten(1)
    x = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="outside the rotation table"):
        ops.rotary_embedding(x, pairs, torch.tensor([3, 16]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 40), (3, 9)])
def test_silu_mul_matches_torch(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g).to(dtype) * 4
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ops.silu_mul(gate_up).float(), expected.float(), rtol=tol, atol=tol)
