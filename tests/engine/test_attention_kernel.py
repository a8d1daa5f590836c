"""The native CPU paged-attention kernel against a plain torch reference.

The reference-model tests run tiny checkpoints whose head_dim (16, 32) takes
the kernel's generic path; this file covers the fp32 fast path for head_dim
64 and 128 too, with group sizes that do and do not fill its head blocks,
page sizes below, at and above its 16-key blocks, and contexts that end
mid-block.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

import pytest
import torch

from engine.kernels import cpu_ops

from .reference import mixed_step

_loaded = cpu_ops()
pytestmark = pytest.mark.skipif(_loaded is None, reason="CPU kernels unavailable")
ops = cast(ModuleType, _loaded)  # None only where pytestmark skips every test


def reference(q, cache, layer, tokens, token_seq, token_ctx, table, scale, window=0, softcap=0.0):
    kv_heads, head_dim = cache.shape[4], cache.shape[5]
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q, dtype=torch.float64)
    for t in tokens.tolist():
        n = int(token_ctx[t])
        first = max(0, n - window) if window else 0
        pages = table[int(token_seq[t])]
        keys = cache[pages.long(), 0, layer].reshape(-1, kv_heads, head_dim)[first:n].double()
        values = cache[pages.long(), 1, layer].reshape(-1, kv_heads, head_dim)[first:n].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[t, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[t, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 4), (1, 5)])
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_tokens", [2, 12])
def test_paged_attention_matches_reference(head_dim, kv_heads, group, page_size, num_tokens):
    g = torch.Generator().manual_seed(head_dim * 1000 + kv_heads * 100 + group * 10 + page_size)
    layers, num_pages, max_pages = 2, 40, 8
    cache = torch.randn(num_pages, 2, layers, page_size, kv_heads, head_dim, generator=g)
    num_seqs = 3
    table = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in range(num_seqs)]).int()
    # Contexts ending mid-block, on a block edge, and past one page.
    lengths = [1, 15, 16, 17, 33, page_size * 3 + 5, 50, page_size * max_pages]
    token_ctx = torch.tensor([lengths[i % len(lengths)] for i in range(num_tokens)], dtype=torch.int32)
    token_seq = torch.tensor([i % num_seqs for i in range(num_tokens)], dtype=torch.int32)
    # q as a strided view, the way the model passes it.
    q = torch.randn(num_tokens, kv_heads * group + 2, head_dim, generator=g)[:, 1:-1]
    tokens = torch.arange(num_tokens, dtype=torch.int32)
    scale = head_dim ** -0.5
    for layer in range(layers):
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, cache, layer, tokens, token_seq, token_ctx, table, scale, 0, 0.0)
        expected = reference(q, cache, layer, tokens, token_seq, token_ctx, table, scale)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 3, 3), (128, 2, 4), (64, 1, 7)])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_long_contexts_span_several_held_chunks(head_dim, kv_heads, group, num_tokens):
    """The fast path holds at most ~128 KiB of value rows before it folds them
    in (160 keys at 3 x 64 fp32): contexts of hundreds of keys fold several
    times, the softmax carrying its max and sum across the folds."""
    g = torch.Generator().manual_seed(head_dim + kv_heads + group + num_tokens)
    page_size, max_pages = 16, 64
    cache = torch.randn(80, 2, 1, page_size, kv_heads, head_dim, generator=g)
    # Spread scores so a later chunk's max exceeds an earlier one's.
    cache[:, 0] *= torch.linspace(0.5, 3.0, 80).view(80, 1, 1, 1, 1)
    table = torch.randperm(80, generator=g)[:max_pages].int().unsqueeze(0)
    lengths = [1000, 161, 321, 999, 17, 640, 1024, 500, 163]
    token_ctx = torch.tensor(lengths[:num_tokens], dtype=torch.int32)
    token_seq = torch.zeros(num_tokens, dtype=torch.int32)
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=g)
    tokens = torch.arange(num_tokens, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(out, q, cache, 0, tokens, token_seq, token_ctx, table, head_dim ** -0.5, 0, 0.0)
    expected = reference(q, cache, 0, tokens, token_seq, token_ctx, table, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,dtype", [(16, torch.float32), (64, torch.float32), (128, torch.float32),
                                            (64, torch.bfloat16)])
@pytest.mark.parametrize("page_size,window", [(16, 16), (16, 5), (8, 37), (32, 200)])
def test_a_sliding_window_reads_only_the_last_keys(head_dim, dtype, page_size, window):
    """With a window, token t sees keys [ctx - window, ctx): starting mid-page,
    on a page edge, or at 0 for a context shorter than the window. Every key
    before a token's window is NaN, so one read shows (the fast path for
    head_dim 64/128 in fp32, the generic one otherwise)."""
    g = torch.Generator().manual_seed(head_dim + page_size + window)
    kv_heads, group, max_pages = 2, 3, 12
    table = torch.randperm(max_pages, generator=g).int().unsqueeze(0)
    lengths = [1, window, window + 1, window + page_size + 3, page_size * max_pages, 50]
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=g).to(dtype)
    tokens = torch.arange(len(lengths), dtype=torch.int32)
    token_seq = torch.zeros(len(lengths), dtype=torch.int32)
    scale = head_dim ** -0.5
    for i, n in enumerate(lengths):
        cache = torch.randn(max_pages, 2, 1, page_size, kv_heads, head_dim, generator=g).to(dtype)
        for pos in range(max(0, n - window)):
            cache[table[0, pos // page_size], :, 0, pos % page_size] = float("nan")
        one = tokens[i:i + 1]
        token_ctx = torch.tensor(lengths, dtype=torch.int32)
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, cache, 0, one, token_seq, token_ctx, table, scale, window, 0.0)
        expected = reference(q.float(), cache.float(), 0, one, token_seq, token_ctx, table, scale, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].double(), expected[i], rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim,dtype", [(16, torch.float32), (64, torch.float32), (128, torch.float32),
                                            (64, torch.bfloat16)])
@pytest.mark.parametrize("window", [0, 21])
def test_capped_scores(head_dim, dtype, window):
    """Gemma 2's cap: each score s (q.k x scale) becomes c * tanh(s / c)
    before the softmax, on both paths, over contexts that fold several held
    chunks on the fast one. Queries are scaled up so that most scores are
    past the cap (uncapped, the softmax would pick other keys)."""
    g = torch.Generator().manual_seed(head_dim + window)
    kv_heads, group, page_size, max_pages, cap = 2, 3, 16, 40, 2.5
    cache = torch.randn(max_pages, 2, 1, page_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(max_pages, generator=g).int().unsqueeze(0)
    lengths = [1, 17, 300, 640]
    q = (4 * torch.randn(len(lengths), kv_heads * group, head_dim, generator=g)).to(dtype)
    tokens = torch.arange(len(lengths), dtype=torch.int32)
    token_seq = torch.zeros(len(lengths), dtype=torch.int32)
    token_ctx = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(out, q, cache, 0, tokens, token_seq, token_ctx, table, scale, window, cap)
    args = (q.float(), cache.float(), 0, tokens, token_seq, token_ctx, table, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(*args, softcap=cap), rtol=tol, atol=tol)
    assert not torch.allclose(out.double(), reference(*args), rtol=0.1, atol=0.1)  # the cap binds


def test_paged_attention_bf16_cache():
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(12, 2, 1, 16, 2, 64, generator=g).bfloat16()
    table = torch.randperm(12, generator=g)[:4].int().unsqueeze(0)
    q = torch.randn(3, 6, 64, generator=g).bfloat16()
    token_ctx = torch.tensor([5, 30, 64], dtype=torch.int32)
    token_seq = torch.zeros(3, dtype=torch.int32)
    tokens = torch.arange(3, dtype=torch.int32)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, cache, 0, tokens, token_seq, token_ctx, table, 0.125, 0, 0.0)
    expected = reference(q.float(), cache.float(), 0, tokens, token_seq, token_ctx, table, 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_kernel_backend_matches_torch_backend_on_a_mixed_step(head_dim):
    """Decode tokens, a fresh prompt, a prompt chunk over cached context and a
    chunk too long for the kernel, in one step, through both CPU backends."""
    from engine.attention import KernelAttention, TorchAttention
    from engine.kv_cache import KVCacheInputs

    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, page_size, layers = 6, 2, 16, 2
    probe = KernelAttention(heads, head_dim, ops, torch.empty(1, 2, layers, page_size, kv_heads, head_dim))
    too_long = probe.kernel_max_context + 9 if probe.kernel_max_context else 200
    # (cache_len, q_len): decode, decode, fresh prompt, chunk over cached keys, long chunk.
    shapes = [(40, 1), (7, 1), (0, 37), (20, 30), (too_long - 150, 150)]
    spans, start, pages_per_seq = mixed_step(shapes, page_size)
    num_pages = len(shapes) * pages_per_seq
    shape = (num_pages, 2, layers, page_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g) for _ in range(2)]
    caches[1].copy_(caches[0])
    kernel = KernelAttention(heads, head_dim, ops, caches[0])
    torch_backend = TorchAttention(heads, head_dim)
    table = torch.randperm(num_pages, generator=g).view(len(shapes), -1).int().numpy()
    outs = []
    cache_lengths = torch.tensor([c for c, _ in shapes], dtype=torch.int32)
    max_lengths = torch.tensor([[max(q for _, q in shapes), max(c + q for c, q in shapes)]], dtype=torch.int32)
    # Each backend plans its own metadata type and takes it back.
    backends: list[tuple[Any, torch.Tensor]] = [(kernel, caches[0]), (torch_backend, caches[1])]
    for backend, cache in backends:
        kv = KVCacheInputs(cache, cache_lengths, torch.from_numpy(table), max_lengths)
        meta = backend.plan(spans, table, kv)
        g2 = torch.Generator().manual_seed(1)
        per_layer = []
        for layer in range(layers):
            q = torch.randn(start, heads, head_dim, generator=g2)
            k = torch.randn(start, kv_heads, head_dim, generator=g2)
            v = torch.randn(start, kv_heads, head_dim, generator=g2)
            per_layer.append(backend(q, k, v, layer, meta))
        outs.append(per_layer)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], caches[1])
