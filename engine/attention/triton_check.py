"""The Triton attention kernels checked on this device, at a model's shapes:
what `probe_triton` (engine/attention/__init__.py) runs once at start-up.

Separate from triton_kernels.py because it reads results back to the host,
which nothing on the step path may do (a test scans that module for it)."""

from __future__ import annotations

import itertools

import torch

from .triton_kernels import paged_attention, rotate_write_kv, write_kv

# How far a kernel's output may stray from exact math on the same inputs in
# `self_check`: loose (it looks for a broken kernel, not for rounding; the tests
# hold the kernels to their real tolerances).
_CHECK_ATOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def self_check(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
               page_size: int) -> None:
    """Run every kernel once at a model's head shape and page size on `device`
    and compare with float64 math on the same data (not float32, which a
    global TF32 switch would round): `write_kv` fills the cache of two
    sequences (partial last pages, pages out of order), then decode in one
    split and in two (with the merge), then prefill over it. Raises
    RuntimeError on a wrong result; a kernel that cannot compile for this
    device raises whatever Triton raises. Then the rotary embedding with the
    cache write (`rotate_write_kv`), which every layer of a step runs."""
    gen = torch.Generator().manual_seed(0)
    group, scale = num_heads // num_kv_heads, head_dim ** -0.5
    # The longer sequence fills two decode splits: each takes at least a key
    # block (up to 64 keys) of whole pages, so a shorter one would leave the
    # second split empty and the merge of two unchecked.
    pages_a_split = -(-64 // page_size)
    seq_lens = [page_size + 2, 2 * pages_a_split * page_size + 1]
    num_pages = sum(-(-n // page_size) for n in seq_lens)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // page_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype) for n in seq_lens]

    # One layer: a token's key row is page * 2 * page_size + slot, its value row page_size further.
    kv_blocks = torch.zeros(num_pages, 2, 1, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    rows = torch.tensor([t[j // page_size] * 2 * page_size + j % page_size
                         for t, n in zip(tables, seq_lens, strict=True) for j in range(n)], dtype=torch.int64, device=device)
    write_kv(kv_blocks.view(-1, num_kv_heads, head_dim), rows, 0, page_size, torch.cat(keys), torch.cat(values))
    for b, table in enumerate(tables):
        n = seq_lens[b]
        slots = torch.tensor([table[j // page_size] for j in range(n)], device=device), \
            torch.arange(n, device=device) % page_size
        if not (torch.equal(kv_blocks[:, 0, 0][slots], keys[b]) and torch.equal(kv_blocks[:, 1, 0][slots], values[b])):
            raise RuntimeError("write_kv stored keys or values in the wrong cache rows")

    def compare(q_lens: list[int], what: str, num_splits: int | None = None) -> None:
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(device, dtype)
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        got = paged_attention(q, kv_blocks, 0, block_table, lens, cu_q, max(q_lens), scale, num_splits=num_splits)
        want = torch.cat([_exact_attention(q[int(cu_q[b]):int(cu_q[b + 1])], keys[b], values[b], group, scale)
                          for b in range(len(q_lens))])
        err = float((got.double() - want).abs().max())
        if not err <= _CHECK_ATOL[dtype]:  # NaN fails too
            raise RuntimeError(f"{what} differs from exact attention by {err:.3g}")

    compare([1, 1], "decode", num_splits=1)
    compare([1, 1], "split decode", num_splits=2)
    compare([3, 2], "prefill")
    _check_rotate_write(device, dtype, num_heads, num_kv_heads, head_dim, gen)


def _check_rotate_write(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                        head_dim: int, gen: torch.Generator) -> None:
    """`rotate_write_kv` against float64 rotations: queries turned in place,
    keys turned into their cache rows, values copied into theirs."""
    tokens, positions = 3, 7
    angles = torch.rand(positions, head_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    turns = torch.polar(torch.full_like(angles, 0.9), angles)  # not unit: yarn scales them
    pairs = torch.view_as_real(turns).flatten(1).float()
    at = torch.tensor([5, 0, 6], dtype=torch.int64)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    flat = torch.zeros(4 * tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    rows = torch.tensor([4, 0, 8], dtype=torch.int64)
    q_dev = q.to(device, copy=True)  # turned in place
    rotate_write_kv(q_dev, k.to(device), v.to(device), pairs.to(device), at.to(device), flat, rows.to(device), 1, 2)

    def turned(x: torch.Tensor) -> torch.Tensor:
        c = torch.view_as_complex(x.double().reshape(*x.shape[:2], -1, 2).contiguous())
        return torch.view_as_real(c * turns[at].to(torch.complex128)[:, None]).flatten(2)

    flat = flat.cpu()
    err = max(float((q_dev.cpu().double() - turned(q)).abs().max()),
              float((flat[rows + 1].double() - turned(k)).abs().max()),
              float((flat[rows + 2].double() - v.double()).abs().max()))
    if not err <= _CHECK_ATOL[dtype] * 4:  # |x| up to ~4 here, rounded once
        raise RuntimeError(f"rotate_write_kv differs from exact rotation by {err:.3g}")


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """float64 causal attention of `q` `[Q, H, D]`, the last Q positions of a
    sequence, over its keys and values `[N, kv_heads, D]`."""
    q_len, n = q.shape[0], k.shape[0]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    positions = torch.arange(n - q_len, n, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
