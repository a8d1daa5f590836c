"""The decoder's pointwise steps as single Triton kernels, for CUDA.

On a GPU at small batch a decode step is bound by kernel count as much as by
bandwidth: the torch path runs a residual add and an RMSNorm as two kernels,
SiLU and the product of gate and up as two, and rotary embedding as three (a
float copy, the complex product, the cast back). Each kernel reads and writes
its whole input, and each launch costs a few microseconds of GPU time in a
CUDA graph. Here each of those steps is one kernel, with the same contract as
the CPU extension's ops of the same names (engine/kernels/cpu), so the model
takes either module as its `ops`:

- `add_rms_norm(x, residual, weight, eps)`: `residual += x`, then
  `x = rms_norm(residual) * weight`, both in place;
- `silu_mul(gate_up)`: `silu(gate) * up` of a fused `[T, 2 * inter]` projection;
- `rotary_embedding(x, rotation_pairs, positions)`: rotates the interleaved
  pairs of `x` `[T, heads, head_dim]` (any row and head strides) in place by
  the (cos, sin) pairs of each token's position.

Numerics follow the torch path step by step: math in float32, the sum of the
residual rounded to the model dtype before it is normalised and stored, and
SiLU rounded before the product, as torch rounds between its kernels. So the
two paths agree to float32 rounding in float32 (a norm's sum is reduced in
another order) and to one rounding of the output in 16-bit types
(tests/engine/test_triton_ops.py). Launch sizes come from shapes only,
so the kernels run inside CUDA graphs. The math of SiLU x up and of a rotary
pair lives in one device function each (`silu_times`, `rotate_pairs`), which
the kernels that fold those steps into others (the batch-1 GEMV, the KV write
with rotation) call too.
"""

from __future__ import annotations

import torch

from .triton_base import jit, next_pow2, tl

__all__ = ["add_rms_norm", "rotary_embedding", "rotate_pairs", "silu_mul", "silu_times"]

# A row of RMSNorm is one program; rows wider than this would spill registers.
_MAX_NORM_WIDTH = 32768
_SILU_BLOCK = 1024


@jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, stride_x, stride_r, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    # Rounded to the model dtype first, as the torch path's in-place add stores it.
    s = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * stride_r + offs, s, mask=ok)
    s32 = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + offs, (s32 * inv * w).to(x_ptr.dtype.element_ty), mask=ok)


@jit
def silu_times(gate, up, dtype: tl.constexpr):
    """`silu(gate) * up` from float32 operands, in `dtype`: SiLU rounded to it
    before the product, as torch's F.silu stores its result in the model dtype.
    Every kernel that computes this step calls it (the batch-1 GEMV's gated
    input too), so they agree bit for bit."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@jit
def rotate_pairs(re, im, cos, sin):
    """An interleaved pair (re, im) turned by (cos, sin), in float32; every
    kernel that applies the rotary embedding calls it."""
    return re * cos - im * sin, re * sin + im * cos


@jit
def _silu_mul_kernel(in_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(in_ptr + row * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + inter + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, silu_times(gate, up, out_ptr.dtype.element_ty), mask=ok)


@jit
def _rotary_kernel(x_ptr, table_ptr, pos_ptr, stride_xt, stride_xh, stride_tab, heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(table_ptr + pos * stride_tab + 2 * p, mask=p_ok, other=0.0)
    sin = tl.load(table_ptr + pos * stride_tab + 2 * p + 1, mask=p_ok, other=0.0)
    ok = (h < heads)[:, None] & p_ok[None, :]
    at = x_ptr + tok * stride_xt + h[:, None] * stride_xh + 2 * p[None, :]
    re = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    im = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
    re, im = rotate_pairs(re, im, cos[None, :], sin[None, :])
    tl.store(at, re.to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(at + 1, im.to(x_ptr.dtype.element_ty), mask=ok)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """`residual += x; x = rms_norm(residual) * weight`, in place, rows of `[T, n]`."""
    t, n = x.shape
    if residual.shape != x.shape or x.stride(1) != 1 or residual.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("add_rms_norm takes [T, n] tensors of unit column stride and a contiguous weight")
    if n > _MAX_NORM_WIDTH:
        raise ValueError(f"add_rms_norm handles rows of at most {_MAX_NORM_WIDTH} values")
    if t == 0:
        return
    block = next_pow2(n)
    _add_rms_norm_kernel[(t,)](x, residual, weight, x.stride(0), residual.stride(0), n, eps,
                               BLOCK=block, num_warps=_warps(block))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate_up[:, :inter]) * gate_up[:, inter:]` as a new `[T, inter]` tensor."""
    t, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul takes a [T, 2 * inter] tensor of unit column stride")
    inter = width // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(_SILU_BLOCK, next_pow2(inter))
    _silu_mul_kernel[(t, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                              BLOCK=block, num_warps=_warps(block))
    return out


def rotary_embedding(x: torch.Tensor, rotation_pairs: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate `x` `[T, heads, head_dim]` in place: pair i of a token at position p
    by `rotation_pairs[p, 2i]` (cos) and `[p, 2i + 1]` (sin), float32."""
    t, heads, dim = x.shape
    if x.stride(2) != 1 or dim % 2 or rotation_pairs.stride(1) != 1 or rotation_pairs.dtype != torch.float32:
        raise ValueError("rotary_embedding takes x of unit last stride and float32 (cos, sin) pairs")
    if t == 0:
        return
    block_h, block_p = next_pow2(heads), next_pow2(dim // 2)
    _rotary_kernel[(t,)](x, rotation_pairs, positions, x.stride(0), x.stride(1), rotation_pairs.stride(0),
                         heads, dim // 2, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=_warps(block_h * block_p))


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run each kernel once on tiny tensors of `dtype` against torch: None if
    they agree, else why not (a compile error for this GPU, a wrong result)."""
    from engine.models.rope import apply_rotation

    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 40, generator=gen).to(device, dtype)
        r = torch.randn(3, 40, generator=gen).to(device, dtype)
        w = torch.rand(40, generator=gen).to(device, dtype)
        want = torch.nn.functional.rms_norm(r + x, (40,), w, 1e-6)
        add_rms_norm(x, r, w, 1e-6)
        gate_up = torch.randn(3, 48, generator=gen).to(device, dtype)
        act = silu_mul(gate_up)
        want_act = torch.nn.functional.silu(gate_up[:, :24]) * gate_up[:, 24:]
        qk = torch.randn(3, 2, 8, generator=gen).to(device, dtype)
        rotations = torch.polar(torch.ones(5, 4), torch.rand(5, 4, generator=gen)).to(device)
        pos = torch.tensor([4, 0, 2], device=device)
        rotated = apply_rotation(qk, rotations[pos])  # the model's torch path
        rotary_embedding(qk, torch.view_as_real(rotations).flatten(1), pos)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        for got, ref in ((x, want), (act, want_act), (qk, rotated)):
            if not torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol):
                return "the Triton pointwise kernels disagree with torch on this device"
    except Exception as e:  # noqa: BLE001 - any failure means: the torch path
        return f"the Triton pointwise kernels failed on this device ({type(e).__name__}: {str(e)[:200]})"
    return None
