"""The Triton pointwise kernels (engine/kernels/triton_ops.py) and the one-kernel
KV write (engine/attention/triton_kernels.py `write_kv`, and `rotate_write_kv`
with the rotary embedding in it) against the ops they replace.

Without CUDA they run in Triton's interpreter (chosen when the kernels are
decorated, so TRITON_INTERPRET is set before the modules are imported); with
CUDA the same tests run on the GPU. Float32 agrees with the torch path to
float32 rounding (the norm's reduction order differs); 16-bit types to one
rounding of the output; the KV write exactly. The interpreter truncates
float32 to bfloat16 where a GPU rounds to nearest, so there a rounded sum may
differ from torch's in its last bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.attention import triton_kernels as tk  # noqa: E402
from engine.attention.base import CacheRows  # noqa: E402
from engine.kernels import model_ops, triton_ops  # noqa: E402
from engine.kernels.triton_base import interpreted  # noqa: E402
from engine.models.rope import apply_rotation  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of the output in the dtype (bfloat16 keeps 8 bits, float16 11).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 1000])
def test_add_rms_norm_matches_add_then_norm(dtype, width):
    x = _randn(5, width, dtype=dtype, seed=1)
    residual = _randn(5, width, dtype=dtype, seed=2)
    weight = _randn(width, dtype=dtype, seed=3)
    want_residual = residual + x
    want = F.rms_norm(want_residual, (width,), weight, 1e-5)
    triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    atol, rtol = TOL[dtype]
    if dtype == torch.bfloat16 and interpreted(triton_ops._add_rms_norm_kernel):
        torch.testing.assert_close(residual, want_residual, atol=atol, rtol=rtol)
    else:  # the torch path's rounded sum, bit for bit
        assert torch.equal(residual, want_residual)
    torch.testing.assert_close(x.float(), want.float(), atol=atol, rtol=rtol)


def test_add_rms_norm_on_strided_rows_leaves_the_rest():
    base = _randn(4, 96, dtype=torch.float32, seed=4)
    x = base[:, :64]  # rows of a wider tensor
    residual = _randn(4, 64, dtype=torch.float32, seed=5)
    weight = torch.ones(64, device=DEVICE)
    tail = base[:, 64:].clone()
    want = F.rms_norm(residual + x, (64,), weight, 1e-6)
    triton_ops.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(x, want)
    assert torch.equal(base[:, 64:], tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 1536, 1100])
def test_silu_mul_matches_torch(dtype, inter):
    gate_up = _randn(3, 2 * inter, dtype=dtype, seed=6) * 4
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = triton_ops.silu_mul(gate_up)
    assert got.shape == (3, inter) and got.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(6, 16), (36, 64), (5, 128)])
def test_rotary_matches_apply_rotation_on_a_view_of_the_projection(dtype, heads, head_dim):
    """As the model calls it: q and k heads, a view into the fused q|k|v rows."""
    tokens, kv_width = 7, 2 * head_dim
    qkv = _randn(tokens, heads * head_dim + kv_width, dtype=dtype, seed=7)
    qk = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    v_before = qkv[:, heads * head_dim:].clone()
    angles = torch.rand(50, head_dim // 2, generator=torch.Generator().manual_seed(8)) * 6
    rotations = torch.polar(torch.ones_like(angles), angles).to(DEVICE)
    pairs = torch.view_as_real(rotations).flatten(1)
    positions = torch.tensor([0, 49, 3, 3, 17, 1, 30], device=DEVICE)
    want = apply_rotation(qk, rotations[positions])
    triton_ops.rotary_embedding(qk, pairs, positions)
    if dtype == torch.float32:
        torch.testing.assert_close(qk, want, atol=1e-6, rtol=1e-6)
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(qk.float(), want.float(), atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, heads * head_dim:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_dim", "page_size"), [(2, 16, 4), (3, 64, 16), (1, 128, 5)])
def test_write_kv_stores_what_cache_rows_write_does(dtype, kv_heads, head_dim, page_size):
    layers, layer, pages, tokens = 3, 2, 6, 9
    blocks = torch.zeros(pages, 2, layers, page_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    want_blocks = blocks.clone()
    rows, want_rows = CacheRows(blocks), CacheRows(want_blocks)
    # k and v as views of a fused projection, as the model passes them.
    proj = _randn(tokens, 3 * kv_heads * head_dim, dtype=dtype, seed=9)
    k = proj[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = proj[:, 2 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(10)).numpy()
    base = torch.from_numpy(rows.base_rows(table, 3, 3 + tokens)).to(DEVICE)
    want_rows.write(base, layer, k, v)
    tk.write_kv(rows.flat, base, rows.key_offset(layer), rows.value_offset(layer), k, v)
    assert torch.equal(blocks, want_blocks)
    assert blocks.abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page_size"), [(4, 2, 16, 4), (6, 3, 64, 16),
                                                                       (5, 1, 128, 5)])
def test_rotate_write_kv_is_the_rotary_kernel_then_the_kv_write(dtype, heads, kv_heads, head_dim, page_size):
    """One kernel, the same bits: q rotated in place, the rotated keys and the
    values in the cache rows, k itself untouched (views of the fused q|k|v rows)."""
    layers, layer, pages, tokens = 3, 1, 6, 9
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=11)
    want_qkv = qkv.clone()

    def split(t):
        q = t[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = t[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        return q, k, t[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)

    angles = torch.rand(40, head_dim // 2, generator=torch.Generator().manual_seed(12)) * 6
    pairs = torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).flatten(1).to(DEVICE)
    positions = torch.tensor([0, 39, 3, 3, 17, 1, 30, 8, 2], device=DEVICE)
    blocks = torch.zeros(pages, 2, layers, page_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    want_blocks = blocks.clone()
    rows, want_rows = CacheRows(blocks), CacheRows(want_blocks)
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(13)).numpy()
    base = torch.from_numpy(rows.base_rows(table, 2, 2 + tokens)).to(DEVICE)

    wq, wk, wv = split(want_qkv)
    triton_ops.rotary_embedding(wq, pairs, positions)
    rotated_k = wk.clone()
    triton_ops.rotary_embedding(rotated_k, pairs, positions)
    tk.write_kv(want_rows.flat, base, want_rows.key_offset(layer), want_rows.value_offset(layer), rotated_k, wv)
    q, k, v = split(qkv)
    tk.rotate_write_kv(q, k, v, pairs, positions, rows.flat, base, rows.key_offset(layer), rows.value_offset(layer))
    assert torch.equal(blocks, want_blocks) and blocks.abs().sum() > 0
    assert torch.equal(qkv, want_qkv)  # q rotated in place as the rotary kernel does; k and v as they were


def test_wrappers_refuse_shapes_they_cannot_take():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError):
        triton_ops.add_rms_norm(x, torch.zeros(2, 4, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError):
        triton_ops.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError):
        triton_ops.rotary_embedding(torch.zeros(2, 2, 8, device=DEVICE), torch.zeros(4, 8, dtype=torch.float64,
                                                                                     device=DEVICE),
                                    torch.zeros(2, dtype=torch.int64, device=DEVICE))
    flat = torch.zeros(10, 2, 8, device=DEVICE)
    with pytest.raises(ValueError):
        tk.write_kv(flat, torch.zeros(3, dtype=torch.int64, device=DEVICE), 0, 5, torch.zeros(3, 2, 8, device=DEVICE),
                    torch.zeros(3, 2, 8, dtype=torch.float16, device=DEVICE))


def test_empty_batches_launch_nothing():
    empty = torch.zeros(0, 8, device=DEVICE)
    triton_ops.add_rms_norm(empty, empty.clone(), torch.ones(8, device=DEVICE), 1e-6)
    assert triton_ops.silu_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)


# -- the start-up choice --------------------------------------------------------


def test_the_probe_passes_here():
    for dtype in DTYPES:
        assert triton_ops.probe(DEVICE, dtype) is None


def test_model_ops_follow_the_attention_probe(monkeypatch):
    monkeypatch.delenv("STENCILD_NO_KERNELS", raising=False)
    ops, why = model_ops(DEVICE, torch.float32, triton=True)
    assert ops is triton_ops and why.startswith("triton")
    # A probe that fails leaves CUDA on torch ops, and a CPU on its extension.
    monkeypatch.setattr(triton_ops, "probe", lambda device, dtype: "broken here")
    ops, why = model_ops(torch.device("cuda"), torch.float32, triton=True)
    assert ops is None and "broken here" in why
    ops, why = model_ops(torch.device("cpu"), torch.float32, triton=False)
    assert ops is not triton_ops
    monkeypatch.setenv("STENCILD_NO_KERNELS", "1")
    assert model_ops(DEVICE, torch.float32, triton=True) == (None, "torch ops (STENCILD_NO_KERNELS is set)")
