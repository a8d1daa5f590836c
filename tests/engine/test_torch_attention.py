"""`TorchAttention` (the fallback on any device, and the reference the other
backends are tested against) over a float64 reference, on a step of decode
tokens, a fresh prompt and prompt chunks over cached keys; with its causal
masks made whole, and in slices of queries (`SCORE_BYTES`), which bound its
memory over long contexts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import SeqSpan, TorchAttention
from engine.attention import base as attention_base
from engine.kv_cache import KVCacheInputs

from .reference import mixed_step

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, LAYERS = 6, 2, 16, 4, 2
# (cache_len, q_len): two decode tokens, a fresh prompt, two chunks over cached
# keys, and a sequence with no queries this step (the other backends take one).
SHAPES = [(9, 1), (0, 1), (0, 13), (6, 10), (5, 0), (17, 5)]


def reference(q: torch.Tensor, cache: torch.Tensor, layer: int, table: np.ndarray,
              spans: list[SeqSpan]) -> torch.Tensor:
    group = HEADS // KV_HEADS
    out = torch.zeros(q.shape, dtype=torch.float64)
    for span in spans:
        pages = torch.from_numpy(table[span.index]).long()
        keys = cache[pages, 0, layer].reshape(-1, KV_HEADS, HEAD_DIM).double()
        values = cache[pages, 1, layer].reshape(-1, KV_HEADS, HEAD_DIM).double()
        for i in range(span.q_len):
            seen = span.cache_len + i + 1
            for h in range(HEADS):
                scores = keys[:seen, h // group] @ q[span.q_start + i, h].double() / HEAD_DIM ** 0.5
                out[span.q_start + i, h] = torch.softmax(scores, 0) @ values[:seen, h // group]
    return out


@pytest.mark.parametrize("slice_queries", [None, 1, 7])
def test_torch_attention_matches_the_reference(monkeypatch, slice_queries: int | None) -> None:
    if slice_queries is not None:  # float32 scores of one query over the longest context: HEADS x 22
        monkeypatch.setattr(attention_base, "SCORE_BYTES", slice_queries * HEADS * 22 * 4)
    g = torch.Generator().manual_seed(0)
    spans, start, per_seq = mixed_step(SHAPES, PAGE_SIZE)
    num_pages = len(SHAPES) * per_seq
    cache = torch.randn((num_pages, 2, LAYERS, PAGE_SIZE, KV_HEADS, HEAD_DIM), generator=g)
    table = torch.randperm(num_pages, generator=g).view(len(SHAPES), -1).int().numpy()
    kv = KVCacheInputs(cache, torch.tensor([c for c, _ in SHAPES], dtype=torch.int32), torch.from_numpy(table),
                       torch.tensor([[13, 22]], dtype=torch.int32))
    backend = TorchAttention(HEADS, HEAD_DIM)
    meta = backend.plan(spans, table, kv)
    for layer in range(LAYERS):
        q = torch.randn(start, HEADS, HEAD_DIM, generator=g)
        k = torch.randn(start, KV_HEADS, HEAD_DIM, generator=g)
        v = torch.randn(start, KV_HEADS, HEAD_DIM, generator=g)
        out = backend(q, k, v, layer, meta)  # writes this step's keys and values first
        torch.testing.assert_close(out.double(), reference(q, cache, layer, table, spans), rtol=1e-5, atol=1e-5)
