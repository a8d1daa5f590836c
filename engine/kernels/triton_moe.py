"""A mixture-of-experts layer's routing and experts in three Triton kernels, on the device.

The host-grouped path (engine/models/moe.py) reads how many tokens each
expert got to slice its batch, one device-to-host copy a layer: on a GPU each
one stalls the host until the layer before it has run, and a decode step with
such reads cannot be captured in a CUDA graph. Here nothing is read back:

1. `route_and_align` (one Triton program, `_route_kernel`) routes each token
   (softmax of the router's logits in float32, top-k, optionally rescaled)
   and lays the (token, slot) pairs out expert by expert in blocks of
   `block_m` rows, each block one expert's, a block's unused rows holding
   the pair count as a sentinel, and names each block's expert (the expert
   count for blocks no expert needed: there are at most `max_blocks` of
   them, a bound from the shapes alone). One launch, where torch ops took
   about twenty a layer.
2. `_gate_up_kernel`: per (block, column tile), the block's rows of the input
   times its expert's gate and up projections, SiLU(gate) x up on the way out,
   one row per pair.
3. `_down_kernel`: per (block, column tile), those rows times the expert's
   down projection, scaled by each pair's routing weight, one row per pair;
   a pair's slots are summed in torch after.

Launch grids come from shapes only, so the layer runs inside a CUDA graph
(graphs emulated on CPU replay the same launches). Numerics follow the
host-grouped path: products accumulated in float32 (IEEE for float32 inputs,
not TF32) and rounded to the model dtype where torch's linear layers round
(after each projection and after SiLU), the routing weight applied in float32
and the weighted row rounded. On CPU the tests run the kernels in Triton's
interpreter against that path.
"""

from __future__ import annotations

import torch

from .triton_base import dot, interpreted, jit, next_pow2, tl
from .triton_ops import silu_times

__all__ = ["fused_experts", "max_blocks", "route_and_align"]

# The kernels' tiles (block_n, block_k, num_stages): tl.dot needs every side
# >= 16; float32's are narrower, lest registers spill on sm_80 / sm_90
# (tests/engine/test_triton_kernels.py compiles both). Rows a block: `block_rows`.
_TILES = {torch.float32: (64, 32, 2), torch.float16: (64, 64, 3), torch.bfloat16: (64, 64, 3)}
# Pairs grouped at once: bounds the scratch of a long prompt chunk (a row per
# pair in each kernel).
_MAX_PAIRS = 16384
# The routing's tiles (8 warps): pairs x experts int32, and tokens x experts
# float32 (several live at once through the unrolled top-k: smaller).
_ROUTE_TILE = 8192
_TOKEN_TILE = 2048


def block_rows(pairs: int, num_experts: int, dtype: torch.dtype) -> int:
    """Rows a block: 16 for decode, 64 for prompts; 16 always in float32,
    whose exact products are plain FMAs that hold their tiles in registers."""
    return 16 if pairs <= 16 * num_experts or dtype == torch.float32 else 64


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing of `pairs` pairs: each expert used
    wastes at most one partly filled block, and at most `pairs` are used."""
    return -(-pairs // block_m) + min(num_experts, pairs)


def route_and_align(logits: torch.Tensor, top_k: int, renormalize: bool,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route each token by its router `logits` (`[T, E]`) and group the
    routed (token, slot) pairs by expert: pair p is token p // top_k's slot
    p % top_k, to its `top_k`-th most probable expert (softmax in float32,
    the chosen probabilities rescaled to sum to 1 with `renormalize`).
    Returns `(weights [T * top_k] float32, rows [max_blocks * block_m] int32,
    block_expert [max_blocks] int32)`: the pairs expert by expert in blocks
    of `block_m` rows (within an expert in pair order), unused rows holding
    T * top_k and unused blocks the expert count. One Triton program; no
    value is read on the host."""
    tokens, num_experts = logits.shape
    pairs = tokens * top_k
    total = max_blocks(pairs, num_experts, block_m)
    device = logits.device
    weights = torch.empty(pairs, dtype=torch.float32, device=device)
    chosen = torch.empty(pairs, dtype=torch.int32, device=device)  # scratch: each pair's expert
    rows = torch.empty(total * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(total, dtype=torch.int32, device=device)
    block_e = next_pow2(num_experts)
    chunk = max(16, min(next_pow2(max(pairs, total)), _ROUTE_TILE // block_e))
    chunk_t = max(1, min(next_pow2(tokens), _TOKEN_TILE // block_e))
    _route_kernel[(1,)](logits, logits.stride(0), weights, chosen, rows, block_expert, tokens, num_experts, total,
                        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
                        CHUNK_T=chunk_t, num_warps=8)
    return weights, rows, block_expert


@jit
def _route_kernel(logits_ptr, stride_l, weight_ptr, chosen_ptr, rows_ptr, expert_ptr, num_tokens, num_experts,
                  num_blocks, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_T: tl.constexpr):
    """`route_and_align` in one program, all experts at once: CHUNK_T tokens
    at a time, the softmax and the top-k (repeated arg-max, ties to the lower
    expert) with each expert's pair count; then each expert's first row and
    block; then CHUNK pairs at a time, each pair placed after its expert's
    pairs before it."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    counts = tl.zeros([BLOCK_E], tl.int32)
    for t0 in range(0, num_tokens, CHUNK_T):
        t = t0 + tl.arange(0, CHUNK_T)
        t_ok = t < num_tokens
        logit = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_l + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                        other=float("-inf")).to(tl.float32)
        logit = tl.where(t_ok[:, None], logit, 0.0)  # rows past the end: finite, never stored
        prob = tl.exp(logit - tl.max(logit, axis=1)[:, None])
        prob = prob / tl.sum(prob, axis=1)[:, None]
        total = tl.full([CHUNK_T], 1.0, tl.float32)
        if RENORMALIZE:
            rest = prob
            total = tl.zeros([CHUNK_T], tl.float32)
            for _ in tl.static_range(TOP_K):
                best = tl.argmax(rest, axis=1)
                total += tl.max(rest, axis=1)
                rest = tl.where(e[None, :] == best[:, None], -1.0, rest)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(prob, axis=1)
            tl.store(weight_ptr + t * TOP_K + j, tl.max(prob, axis=1) / total, mask=t_ok)
            tl.store(chosen_ptr + t * TOP_K + j, best.to(tl.int32), mask=t_ok)
            picked = e[None, :] == best[:, None]
            counts += tl.sum((picked & t_ok[:, None]).to(tl.int32), axis=0)
            prob = tl.where(picked, -1.0, prob)
    num_pairs = num_tokens * TOP_K
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, axis=0)  # one past each expert's last block
    first_row = (ends - blocks) * BLOCK_M
    for r0 in range(0, num_blocks * BLOCK_M, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + r, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=r < num_blocks * BLOCK_M)
    # A block's expert: how many experts end at or before it (all of them
    # past the last used block: the "unused" value).
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= b[:, None]) & e_ok[None, :]
        tl.store(expert_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < num_blocks)
    # The chosen experts and the sentinels above land before they are read or overwritten.
    tl.debug_barrier()
    seen = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(chosen_ptr + p, mask=p < num_pairs, other=-1)
        hit = (expert[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit + seen[None, :]
        tl.store(rows_ptr + tl.sum((first_row[None, :] + before) * hit, axis=1), p, mask=p < num_pairs)
        seen += tl.sum(hit, axis=0)


@jit
def _product(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in float32; UPCAST: bfloat16 operands widened first (Triton's
    interpreter multiplies bfloat16 wrongly; exact products either way)."""
    if UPCAST:
        return dot(a.to(tl.float32), b.to(tl.float32), True)
    else:
        return dot(a, b, IEEE)


@jit
def _block_pairs(rows_ptr, expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block: its expert (int64; the expert count when unused)
    and its rows' pairs, with which of them are real."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block).to(tl.int64)
    pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pair, pair < num_pairs


@jit
def _grouped_product(a_ptr, a_rows, row_ok, stride_a, w, stride_wn, cols, col_ok, second, width,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr, PAIRED: tl.constexpr):
    """Rows `a_rows` of A (`width` wide) times weight rows `cols` of one
    expert's matrix `w`, float32 `[BLOCK_M, BLOCK_N]`; PAIRED: also times the
    rows `second` further on (gate and up share A's loads)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        b = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + k[:, None], mask=w_ok, other=0.0)
        acc += _product(a, b, IEEE, UPCAST)
        if PAIRED:
            b2 = tl.load(w + (cols[None, :] + second).to(tl.int64) * stride_wn + k[:, None], mask=w_ok, other=0.0)
            acc2 += _product(a, b2, IEEE, UPCAST)
    return acc, acc2


@jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, expert_ptr, num_pairs, num_experts, top_k, hidden, inter,
                    stride_x, stride_we, stride_wn, stride_out,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr):
    expert, pair, row_ok = _block_pairs(rows_ptr, expert_ptr, num_pairs, BLOCK_M)
    if expert < num_experts:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        gate, up = _grouped_product(x_ptr, (pair // top_k).to(tl.int64), row_ok, stride_x, w_ptr + expert * stride_we,
                                    stride_wn, cols, col_ok, inter, hidden, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, UPCAST,
                                    True)
        dtype = out_ptr.dtype.element_ty
        # Rounded as torch's projection stores them, then SiLU x up as everywhere.
        act = silu_times(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
        at = out_ptr + pair[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(at, act, mask=row_ok[:, None] & col_ok[None, :])


@jit
def _down_kernel(act_ptr, w_ptr, weight_ptr, out_ptr, rows_ptr, expert_ptr, num_pairs, num_experts, inter, hidden,
                 stride_act, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    expert, pair, row_ok = _block_pairs(rows_ptr, expert_ptr, num_pairs, BLOCK_M)
    if expert < num_experts:
        rows = pair.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        acc, _ = _grouped_product(act_ptr, rows, row_ok, stride_act, w_ptr + expert * stride_we, stride_wn, cols,
                                  col_ok, 0, inter, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, UPCAST, False)
        dtype = out_ptr.dtype.element_ty
        scale = tl.load(weight_ptr + rows, mask=row_ok, other=0.0)
        y = acc.to(dtype).to(tl.float32) * scale[:, None]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(dtype),
                 mask=row_ok[:, None] & col_ok[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """Sum over each token's `top_k` experts, chosen by the router's `logits`
    `[T, E]` (see `route_and_align`), of weight x down(SiLU(gate) x up):
    x `[T, hidden]`, gate_up `[E, 2 * inter, hidden]` (rows gate | up), down
    `[E, hidden, inter]`."""
    t, hidden = x.shape
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(2) != 1 or down.stride(2) != 1 or x.stride(1) != 1 or logits.stride(1) != 1:
        raise ValueError("fused_experts takes weights, inputs and logits of unit last stride")
    if t == 0:
        return torch.zeros_like(x)
    # Prompt chunks a slice at a time: the scratch grows with the pairs.
    step = max(1, _MAX_PAIRS // top_k)
    if t > step:
        return torch.cat([fused_experts(x[i:i + step], gate_up, down, logits[i:i + step], top_k, renormalize)
                          for i in range(0, t, step)])
    pairs = t * top_k
    block_m = block_rows(pairs, num_experts, x.dtype)
    weights, rows, block_expert = route_and_align(logits, top_k, renormalize, block_m)
    blocks = block_expert.numel()
    block_n, block_k, stages = _TILES[x.dtype]
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages)
    ieee = x.dtype == torch.float32
    upcast = x.dtype == torch.bfloat16 and interpreted(_gate_up_kernel)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, -(-inter // block_n))](
        x, gate_up, act, rows, block_expert, pairs, num_experts, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        IEEE=ieee, UPCAST=upcast, **tiles)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, -(-hidden // block_n))](
        act, down, weights, out, rows, block_expert, pairs, num_experts, inter, hidden,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        IEEE=ieee, UPCAST=upcast, **tiles)
    # A token's slots summed in float32 and rounded once (torch's sum of a
    # 16-bit tensor accumulates in float32).
    return out.view(t, top_k, hidden).sum(dim=1)
