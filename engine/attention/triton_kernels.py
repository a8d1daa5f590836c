"""Paged attention in Triton: our own kernels over the page tensor, for CUDA.

Why our own kernels. PyTorch's flash varlen attention (2.11) has neither a
block table nor per-sequence key counts (`seqused_k`), so a paged cache must be
gathered into a packed copy every layer; FlashAttention itself refuses float32
and wants page sizes divisible by 256. Triton ships with every CUDA build of
PyTorch, compiles for any dtype (float32, float16, bfloat16) and any page size
(the engine uses 1 to 64, powers of two or not), its launches can be captured
in CUDA graphs, and its interpreter (`TRITON_INTERPRET=1`) runs the very same
kernels on the CPU, which is how CI tests them (the interpreter is chosen when
the kernels are decorated, i.e. when this module is first imported). This
module imports without Triton; `triton_available()` says whether it can run.

The cache is one tensor `[num_pages, 2, num_layers, page_size, kv_heads,
head_dim]`; token j of sequence b lies in page `block_table[b, j // page_size]`
at slot `j % page_size`. Keys and values are read where they lie, one token row
at a time (a gather through the block table), so nothing depends on the page
size being a power of two or a multiple of the key block.

Two paths, chosen from the host int `max_q` alone:

- Decode (`max_q == 1`): one program per (sequence, kv head, split). It holds
  every query head of its GQA group as the rows of one `[BLOCK_H, D]` block
  (BLOCK_H >= 16, padded rows masked), so each key/value block is loaded once
  for the whole group and both products are `tl.dot`s. Flash-decoding: with
  `num_splits > 1` each program takes a range of whole pages computed in the
  kernel from `seq_lens` (`cdiv(pages, num_splits)` pages, at least one key
  block's worth, so short sequences leave the last splits empty), writes its
  normalised partial output and log-sum-exp to fp32 scratch `[T, H, S, D]` /
  `[T, H, S]`, and a second kernel (one program per (sequence, head)) merges the
  splits. The default split count depends only on Python ints: the batch size,
  kv heads, block table width and the device's SM count.
- Prefill / extend (`max_q > 1`, mixed batches): one program per (query block,
  sequence, kv head). A block's `BLOCK_M` rows are `BLOCK_M // group` queries x
  the group's heads (queries major), so again K/V blocks are shared by the group.
  The causal mask is bottom-right aligned (query i of a sequence with `q_len`
  queries and `seq_len` keys sits at position `seq_len - q_len + i`). Key blocks
  every query of the block sees run unmasked; the blocks across the diagonal run
  with the mask; blocks past the block's last query are never visited.

Both use an online softmax in base 2 (the scale is folded with log2(e)),
accumulate in float32, and cast on store. Float32 inputs use `input_precision=
"ieee"` dot products (no TF32), so results match a float32 reference to ~1e-5.
float16/bfloat16 use native tensor-core dots (probabilities cast to the value
dtype for P @ V), except that in the interpreter bfloat16 operands are upcast
to float32, since its numpy dot cannot multiply bfloat16.

Every tl.dot operand is at least 16 x 16 x 16 (BLOCK_H, BLOCK_M, BLOCK_N and
BLOCK_D >= 16; head_dim is padded to a power of two and masked), which older
Triton releases require and the interpreter never checks. Tile sizes per dtype
and head_dim are in `_tiles`, chosen so that ptxas reports no register spills
for sm_80 and sm_90; tests/engine/test_triton_kernels.py compiles the kernels
for both without a GPU.

Every launch size comes from Python ints and tensor shapes; the wrappers read
no tensor values on the host and allocate only shape-sized scratch, so
`paged_attention` can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.kernels.triton_base import dot as _dot
from engine.kernels.triton_base import interpreted, next_pow2, tl, triton, triton_available
from engine.kernels.triton_base import jit as _jit
from engine.kernels.triton_ops import rotate_pairs

__all__ = ["default_num_splits", "paged_attention", "rotate_write_kv", "sm_count", "triton_available", "write_kv"]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_MAX_SPLITS = 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@_jit
def _capped(s, cap_log2, SOFTCAP: tl.constexpr):
    """Scores in base 2 (q.k x scale x log2(e)) capped as softcap * tanh(score /
    softcap) in natural units, i.e. cap_log2 * tanh(s / cap_log2) with
    cap_log2 = softcap x log2(e); as they are without SOFTCAP. tanh from exp
    of a non-positive argument: finite for any score."""
    if SOFTCAP:
        x = s / cap_log2
        e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]
        t = (1.0 - e) / (1.0 + e)
        return cap_log2 * tl.where(x < 0, -t, t)
    else:
        return s


@_jit
def _kv_block(k_ptr, v_ptr, table_row, keys, end, head_offs, d_ok, stride_kp, stride_ks,
              PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """The keys and values of token positions `keys` of one sequence, read where
    they lie through its block-table row (`MASKED`: positions from `end` on are
    not read and come back as zeros)."""
    if MASKED:
        k_ok = keys < end
        pages = tl.load(table_row + keys // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
    else:
        pages = tl.load(table_row + keys // PAGE_SIZE).to(tl.int64)
        kv_mask = (keys >= 0)[:, None] & d_ok[None, :]
    offs = (pages * stride_kp + (keys % PAGE_SIZE) * stride_ks)[:, None] + head_offs[None, :]
    k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@_jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, cu_q_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2, cap_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT_PAGES: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One (sequence, kv head, split): the group's query heads over a page range
    (with a sliding WINDOW > 0, of the pages holding the last WINDOW keys)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_row = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_row
    live = tl.minimum(q_len, 1)  # 1, or 0 for a sequence without queries (ints: the
    # interpreter turns `bool_block & bool_scalar` into ints, which it then refuses as a mask)
    seq_len = tl.load(seq_lens_ptr + seq) * live  # an empty row reads no keys

    # The first key the query sees: 0, or the first of the last WINDOW.
    lo = seq_len * 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    first_page = lo // PAGE_SIZE
    # This split's keys: a run of whole pages, at least one key block long,
    # of those from the one holding `lo` (its keys before `lo` are skipped).
    num_pages = tl.cdiv(seq_len, PAGE_SIZE) - first_page
    split_pages = tl.maximum(tl.cdiv(num_pages, NUM_SPLITS), MIN_SPLIT_PAGES)
    start = (first_page + split * split_pages) * PAGE_SIZE
    end = tl.minimum(start + split_pages * PAGE_SIZE, seq_len)
    start = tl.maximum(start, lo)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP * live
    d_ok = dims < HEAD_DIM
    q_row64 = q_row.to(tl.int64)
    q = tl.load(q_ptr + q_row64 * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = table_ptr + seq.to(tl.int64) * stride_bt
    head_offs = kv_head * stride_kh + dims * stride_kd
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + offs_n
        k_ok = keys < end
        k, v = _kv_block(k_ptr, v_ptr, table_row, keys, end, head_offs, d_ok, stride_kp, stride_ks,
                         PAGE_SIZE, True, UPCAST)
        s = _capped(_dot(q, tl.trans(k), IEEE) * scale_log2, cap_log2, SOFTCAP)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        # Every block has a valid key, so m_new is finite from the first block on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_row64 * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + q_row64 * stride_pt + heads[:, None] * stride_ph + split * stride_ps
                 + dims[None, :], o, mask=mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + q_row64 * stride_lt + heads * stride_lh + split, lse, mask=row_ok)


@_jit
def _merge_kernel(
    part_ptr, lse_ptr, cu_q_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence, head): merge the splits' partial outputs by their log-sum-exp."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_q_ptr + seq)
    live = tl.minimum(tl.load(cu_q_ptr + seq + 1) - q_row, 1)  # 0 for a sequence without queries
    q_row64 = q_row.to(tl.int64)

    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    s_ok = splits < NUM_SPLITS * live
    d_ok = dims < HEAD_DIM * live
    lse = tl.load(lse_ptr + q_row64 * stride_lt + head * stride_lh + splits, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits (lse -inf) weigh 0
    total = tl.sum(w, 0)
    part = tl.load(part_ptr + q_row64 * stride_pt + head * stride_ph + splits[:, None] * stride_ps
                   + dims[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + q_row64 * stride_ot + head * stride_oh + dims * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)


@_jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, cu_q_ptr, out_ptr,
    scale_log2, cap_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One (query block, sequence, kv head): BLOCK_Q queries x GROUP heads as BLOCK_M rows.
    With a sliding WINDOW > 0 a query sees only the last WINDOW keys up to its
    own: every key block runs masked, from the block holding the first query's
    first key."""
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_row0 = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_row0
    seq_len = tl.load(seq_lens_ptr + seq)
    first_q = q_block * BLOCK_Q
    live = first_q < q_len
    first_pos = seq_len - q_len + first_q  # absolute position of the block's first query
    # Keys the block's queries see: [0, kv_end); all of them see [0, full_end).
    kv_end = tl.where(live, tl.minimum(seq_len, first_pos + BLOCK_Q), 0)
    full_end = tl.where(live, ((first_pos + 1) // BLOCK_N) * BLOCK_N, 0)
    mask_start = full_end  # the masked blocks: [mask_start, kv_end)
    if WINDOW > 0:
        mask_start = (tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = full_end * 0

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_idx = first_q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = seq_len - q_len + q_idx
    d_ok = dims < HEAD_DIM
    tok = (q_row0 + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = table_ptr + seq.to(tl.int64) * stride_bt
    head_offs = kv_head * stride_kh + dims * stride_kd

    # Below the diagonal: every key is valid and visible, no masks.
    for n0 in range(0, full_end, BLOCK_N):
        keys = n0 + offs_n
        k, v = _kv_block(k_ptr, v_ptr, table_row, keys, full_end, head_offs, d_ok, stride_kp, stride_ks,
                         PAGE_SIZE, False, UPCAST)
        s = _capped(_dot(q, tl.trans(k), IEEE) * scale_log2, cap_log2, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    # Across the diagonal (and the window's edge): the mask, and keys past kv_end never loaded.
    for n0 in range(mask_start, kv_end, BLOCK_N):
        keys = n0 + offs_n
        k_ok = keys < kv_end
        k, v = _kv_block(k_ptr, v_ptr, table_row, keys, kv_end, head_offs, d_ok, stride_kp, stride_ks,
                         PAGE_SIZE, True, UPCAST)
        s = _capped(_dot(q, tl.trans(k), IEEE) * scale_log2, cap_log2, SOFTCAP)
        seen = (keys[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW > 0:
            seen = seen & (keys[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@_jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, rows_ptr, key_offset, value_offset,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cr, stride_ch, kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token `t`'s keys and values into the cache rows `rows[t] + key_offset`
    and `rows[t] + value_offset` (rows of `[kv_heads, head_dim]`)."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < kv_heads)[:, None] & (d < head_dim)[None, :]
    base = tl.load(rows_ptr + tok).to(tl.int64)
    inner = h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    tl.store(cache_ptr + (base + key_offset) * stride_cr + inner, k, mask=ok)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(cache_ptr + (base + value_offset) * stride_cr + inner, v, mask=ok)


@_jit
def _rotate_write_kv_kernel(q_ptr, k_ptr, v_ptr, cache_ptr, rows_ptr, table_ptr, pos_ptr, key_offset, value_offset,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cr, stride_ch,
                            stride_tab, q_heads, kv_heads, half, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                            BLOCK_P: tl.constexpr):
    """Token `t`: its query heads rotated in place, its key heads rotated into
    the cache row `rows[t] + key_offset`, its values copied to `rows[t] +
    value_offset`. Pair i of a token at position p turns by `table[p, 2i]`
    (cos) and `table[p, 2i + 1]` (sin), in float32 (`triton_ops.rotate_pairs`,
    as triton_ops.rotary_embedding turns them), rounded once on store."""
    tok = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(table_ptr + pos * stride_tab + 2 * p, mask=p_ok, other=0.0)[None, :]
    sin = tl.load(table_ptr + pos * stride_tab + 2 * p + 1, mask=p_ok, other=0.0)[None, :]

    hq = tl.arange(0, BLOCK_QH)
    ok = (hq < q_heads)[:, None] & p_ok[None, :]
    at = q_ptr + tok * stride_qt + hq[:, None] * stride_qh + 2 * p[None, :]
    re, im = rotate_pairs(tl.load(at, mask=ok, other=0.0).to(tl.float32),
                          tl.load(at + 1, mask=ok, other=0.0).to(tl.float32), cos, sin)
    tl.store(at, re.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(at + 1, im.to(q_ptr.dtype.element_ty), mask=ok)

    base = tl.load(rows_ptr + tok).to(tl.int64)
    hk = tl.arange(0, BLOCK_KH)
    ok = (hk < kv_heads)[:, None] & p_ok[None, :]
    at = k_ptr + tok * stride_kt + hk[:, None] * stride_kh + 2 * p[None, :]
    re, im = rotate_pairs(tl.load(at, mask=ok, other=0.0).to(tl.float32),
                          tl.load(at + 1, mask=ok, other=0.0).to(tl.float32), cos, sin)
    inner = hk[:, None] * stride_ch + 2 * p[None, :]
    key = cache_ptr + (base + key_offset) * stride_cr + inner
    tl.store(key, re.to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(key + 1, im.to(cache_ptr.dtype.element_ty), mask=ok)
    at = v_ptr + tok * stride_vt + hk[:, None] * stride_vh + 2 * p[None, :]
    value = cache_ptr + (base + value_offset) * stride_cr + inner
    tl.store(value, tl.load(at, mask=ok), mask=ok)
    tl.store(value + 1, tl.load(at + 1, mask=ok), mask=ok)


# ---------------------------------------------------------------------------
# Launch wrappers (host ints and shapes only: no tensor value is read here)
# ---------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host query, no sync); a small
    fixed figure elsewhere (the interpreter runs programs one after another)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


@dataclass(frozen=True)
class _Tiles:
    """Block sizes and warps for one dtype and padded head_dim."""

    decode_n: int  # keys per block, decode
    prefill_n: int  # keys per block, prefill
    max_block_m: int  # prefill rows (queries x group heads) per program, at most
    num_warps: int
    num_stages: int = 2


def _tiles(block_d: int, dtype: torch.dtype) -> _Tiles:
    """Tiles that compile without register spills for sm_80 and sm_90 (checked with
    ptxas for head_dim 64 to 256, page sizes 1/3/16/64, groups 1/4/8).

    float16/bfloat16 use tensor-core dots. float32 uses IEEE dots, which run on the
    FMA units with each thread holding its operands for the whole reduction, so
    its tiles are smaller and spread over 8 warps."""
    if dtype == torch.float32:
        return _Tiles(decode_n=32, prefill_n=32, max_block_m=32 if block_d <= 64 else 16, num_warps=8)
    if block_d <= 64:
        return _Tiles(decode_n=64, prefill_n=64, max_block_m=64, num_warps=4)
    if block_d <= 128:
        return _Tiles(decode_n=64, prefill_n=32, max_block_m=64, num_warps=4)
    return _Tiles(decode_n=32, prefill_n=16, max_block_m=64, num_warps=8)


def default_num_splits(batch: int, kv_heads: int, max_keys: int, num_sms: int, block_n: int = 64) -> int:
    """Flash-decoding splits for a decode launch, from host ints only: enough
    (sequence, kv head) programs to cover the device twice, at most `_MAX_SPLITS`,
    and no more splits than key blocks fit in a block-table row (`max_keys`)."""
    programs = max(batch * kv_heads, 1)
    want = _cdiv(2 * num_sms, programs)
    return max(1, min(want, _MAX_SPLITS, _cdiv(max(max_keys, 1), block_n)))


def paged_attention(q: torch.Tensor, kv_blocks: torch.Tensor, layer: int, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_q: torch.Tensor, max_q: int, scale: float,
                    out: torch.Tensor | None = None, num_splits: int | None = None, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of a flat, mixed batch over the paged cache (keys/values of this step already written).
    q: [T, H, D]; block_table: [B, W] int32 page ids per sequence (row width W fixed, unused entries may hold anything);
    seq_lens: [B] int32 keys of each sequence INCLUDING this step's new tokens; cu_q: [B+1] int32 query offsets
    (sequence b's queries are rows cu_q[b]:cu_q[b+1] of q, at absolute positions seq_lens[b]-q_len_b .. seq_lens[b]-1:
    bottom-right aligned causal mask, which is what chunked prefill and decode need); max_q: a host int >= every q_len
    (grid sizing only); window: a sliding window (a query at position p sees keys p - window + 1 .. p), 0 for none;
    softcap: each score s (q.k x scale) becomes softcap * tanh(s / softcap) (Gemma 2), 0 for none.
    A sequence with q_len 0 contributes nothing. Returns out [T, H, D] in q's dtype.

    Rows of `out` outside cu_q[0]:cu_q[B] (padding of a captured batch) are left as
    they are. `num_splits` applies to the decode path (max_q == 1) only: None picks
    `default_num_splits`, other values are clamped to 1..64. Any strides are accepted
    for q, out and kv_blocks; block_table rows, seq_lens and cu_q must be contiguous
    (int32 or int64).
    """
    if triton is None:
        raise RuntimeError("paged_attention needs Triton, which is not installed")
    _check(q, kv_blocks, layer, block_table, seq_lens, cu_q, max_q, out, window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv_blocks.shape[4]
    page_size = kv_blocks.shape[3]
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0 or max_q <= 0:
        return out

    keys = kv_blocks[:, 0, layer]  # [num_pages, page_size, kv_heads, head_dim] views
    values = kv_blocks[:, 1, layer]
    if keys.stride() != values.stride():
        raise ValueError("keys and values of kv_blocks must share strides")
    group = num_heads // kv_heads
    block_d = max(16, next_pow2(head_dim))
    tiles = _tiles(block_d, q.dtype)
    upcast = q.dtype == torch.bfloat16 and interpreted(_decode_kernel)
    ieee = q.dtype == torch.float32 or upcast
    kv_strides = keys.stride()
    common = dict(PAGE_SIZE=page_size, HEAD_DIM=head_dim, GROUP=group, WINDOW=window, SOFTCAP=softcap > 0,
                  BLOCK_D=block_d, UPCAST=upcast, IEEE=ieee, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    cap_log2 = softcap * _LOG2E if softcap > 0 else 1.0

    if max_q > 1:
        block_m = min(max(16, next_pow2(max_q * group)), tiles.max_block_m)
        block_m = max(block_m, next_pow2(group))
        block_q = block_m // group
        grid = (_cdiv(max_q, block_q), batch, kv_heads)
        _prefill_kernel[grid](
            q, keys, values, block_table, seq_lens, cu_q, out, scale * _LOG2E, cap_log2,
            *q.stride(), *kv_strides, block_table.stride(0), *out.stride(),
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=tiles.prefill_n, **common)
        return out

    # Decode: a program per (sequence, kv head, split), then the merge when split.
    block_n = tiles.decode_n
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, block_table.shape[1] * page_size,
                                        sm_count(q.device), block_n)
    num_splits = min(max(1, num_splits), 4 * _MAX_SPLITS)  # the merge holds all splits in registers
    block_h = max(16, next_pow2(group))
    min_split_pages = _cdiv(block_n, page_size)
    if num_splits == 1:
        part = lse = out  # unused by the kernel when NUM_SPLITS == 1
        part_strides: tuple[int, ...] = (0, 0, 0)
        lse_strides: tuple[int, ...] = (0, 0)
    else:
        part = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides = part.stride()[:3]
        lse_strides = lse.stride()[:2]
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, keys, values, block_table, seq_lens, cu_q, out, part, lse, scale * _LOG2E, cap_log2,
        *q.stride(), *kv_strides, block_table.stride(0), *out.stride(), *part_strides, *lse_strides,
        NUM_SPLITS=num_splits, MIN_SPLIT_PAGES=min_split_pages, BLOCK_H=block_h, BLOCK_N=block_n, **common)
    if num_splits > 1:
        _merge_kernel[(batch, num_heads)](
            part, lse, cu_q, out, *part_strides, *lse_strides, *out.stride(),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
            num_warps=4)
    return out


def write_kv(flat: torch.Tensor, rows: torch.Tensor, key_offset: int, value_offset: int,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """One kernel for a layer's new keys and values: `flat[rows + key_offset] = k`,
    `flat[rows + value_offset] = v`, where `flat` is the cache as rows of
    `[kv_heads, head_dim]` (contiguous), `rows` `[T]` int64 and k, v `[T, kv_heads,
    head_dim]` of unit last stride (views of the fused projection are fine).
    What `CacheRows.write` does in four kernels (two index adds, two index copies)."""
    if triton is None:
        raise RuntimeError("write_kv needs Triton, which is not installed")
    num_tokens, kv_heads, head_dim = k.shape
    if v.shape != k.shape or flat.shape[1:] != k.shape[1:] or not flat.is_contiguous() \
            or k.stride(2) != 1 or v.stride(2) != 1 or flat.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError("write_kv: k and v [T, kv_heads, head_dim] of unit last stride, of the cache's dtype")
    if num_tokens == 0:
        return
    block_h, block_d = next_pow2(kv_heads), next_pow2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, flat, rows, key_offset, value_offset, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        flat.stride(0), flat.stride(1), kv_heads, head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=1 if block_h * block_d <= 512 else 4)


def rotate_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation_pairs: torch.Tensor,
                    positions: torch.Tensor, flat: torch.Tensor, rows: torch.Tensor, key_offset: int,
                    value_offset: int) -> None:
    """Rotary embedding and the cache write of a layer in one kernel: q `[T, H,
    D]` rotated in place, k `[T, kv_heads, D]` rotated into `flat[rows +
    key_offset]` (k itself is left as it was), v copied into `flat[rows +
    value_offset]`; token t turns by `rotation_pairs[positions[t]]` (float32
    (cos, sin) pairs, interleaved). What triton_ops.rotary_embedding on q and k
    and then `write_kv` do, in one launch instead of two, bit for bit."""
    if triton is None:
        raise RuntimeError("rotate_write_kv needs Triton, which is not installed")
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if v.shape != k.shape or k.shape[::2] != q.shape[::2] or flat.shape[1:] != k.shape[1:] \
            or not flat.is_contiguous() or head_dim % 2 or flat.dtype != q.dtype \
            or any(t.stride(2) != 1 or t.dtype != q.dtype for t in (k, v)) or q.stride(2) != 1:
        raise ValueError("rotate_write_kv: q [T, H, D], k and v [T, kv_heads, D] of unit last stride, even D, "
                         "of the cache's dtype")
    if rotation_pairs.stride(1) != 1 or rotation_pairs.dtype != torch.float32:
        raise ValueError("rotate_write_kv takes float32 (cos, sin) pairs of unit last stride")
    if num_tokens == 0:
        return
    block_qh, block_kh, block_p = next_pow2(num_heads), next_pow2(kv_heads), next_pow2(head_dim // 2)
    _rotate_write_kv_kernel[(num_tokens,)](
        q, k, v, flat, rows, rotation_pairs, positions, key_offset, value_offset, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), flat.stride(0), flat.stride(1), rotation_pairs.stride(0),
        num_heads, kv_heads, head_dim // 2, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_P=block_p,
        num_warps=1 if block_qh * block_p <= 512 else 4)


def _check(q: torch.Tensor, kv_blocks: torch.Tensor, layer: int, block_table: torch.Tensor,
           seq_lens: torch.Tensor, cu_q: torch.Tensor, max_q: int, out: torch.Tensor | None, window: int,
           softcap: float) -> None:
    """Shape, dtype and device checks (metadata only, nothing is read from the device)."""
    if q.dim() != 3 or kv_blocks.dim() != 6:
        raise ValueError(f"q must be [T, H, D] and kv_blocks 6-D, got {tuple(q.shape)}, {tuple(kv_blocks.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, two, num_layers, page_size, kv_heads, kv_dim = kv_blocks.shape
    if two != 2 or kv_dim != head_dim or kv_heads == 0 or num_heads % kv_heads:
        raise ValueError(f"kv_blocks {tuple(kv_blocks.shape)} does not fit q {tuple(q.shape)}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range for {num_layers} layers")
    if q.dtype not in _DTYPES or kv_blocks.dtype != q.dtype:
        raise ValueError(f"q and kv_blocks must share a dtype of {_DTYPES}, got {q.dtype}, {kv_blocks.dtype}")
    if not 1 <= head_dim <= _MAX_HEAD_DIM or page_size < 1:
        raise ValueError(f"head_dim must be 1..{_MAX_HEAD_DIM} and page_size >= 1")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if block_table.dim() != 2 or block_table.shape[0] != batch or cu_q.shape != (batch + 1,):
        raise ValueError(f"block_table [B, W], seq_lens [B] and cu_q [B+1] disagree: {tuple(block_table.shape)}, "
                         f"{tuple(seq_lens.shape)}, {tuple(cu_q.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("cu_q", cu_q)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if block_table.shape[1] and block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    if seq_lens.stride(0) != 1 or cu_q.stride(0) != 1:
        raise ValueError("seq_lens and cu_q must be contiguous")
    if kv_blocks.device != q.device:
        raise ValueError(f"kv_blocks is on {kv_blocks.device}, q on {q.device}")
    if max_q < 0:
        raise ValueError("max_q must be >= 0")
    if window < 0:
        raise ValueError("window must be >= 0")
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError("softcap must be a finite number >= 0")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}")
