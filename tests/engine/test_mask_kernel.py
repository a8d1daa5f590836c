"""The grammar mask on CPU logits: the CPU extension's kernel against the
bitmask's definition, over random bitmasks, vocabularies and row sets.

(The reference is written out here, not xgrammar's CPU kernel, which the
grammar package uses: at a vocabulary of one token that kernel writes past
the row.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import step_masks
from engine.kernels import cpu_ops
from engine.step_masks import mask_applier

needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="the CPU extension did not build")

# Words as a JSON schema's masks have them: none allowed, all allowed, or mixed.
WORDS = st.one_of(st.just(0), st.just(-1), st.integers(-(2**31), 2**31 - 1))


@st.composite
def masked_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    batch = draw(st.integers(1, 9))
    vocab = draw(st.integers(1, 300))
    # Narrower than the vocabulary (ids past it are disallowed), exact, or wider.
    width = draw(st.integers(1, (vocab + 31) // 32 + 1))
    words = draw(st.lists(WORDS, min_size=batch * width, max_size=batch * width))
    bitmask = torch.tensor(words, dtype=torch.int32).view(batch, width)
    rows = draw(st.lists(st.integers(0, batch - 1), unique=True, max_size=batch))
    seed = draw(st.integers(0, 2**16))
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))
    return logits, bitmask, rows


@needs_kernels
@settings(max_examples=300, deadline=None)
@given(masked_batches(), st.booleans())
def test_the_cpu_kernel_masks_as_the_bitmask_says(case, rows_as_tensor):
    logits, bitmask, rows = case
    expected = logits.clone()
    words = bitmask.tolist()
    for r in rows:
        for t in range(logits.shape[1]):
            if t >= 32 * len(words[r]) or not (words[r][t // 32] >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply = mask_applier(torch.device("cpu"))
    assert apply is not step_masks._apply_anywhere
    apply(logits, bitmask, torch.tensor(rows, dtype=torch.int64) if rows_as_tensor else rows)
    assert torch.equal(logits, expected)


@needs_kernels
def test_the_cpu_kernel_refuses_rows_outside_the_batch():
    logits, bitmask = torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32)
    for bad in ([2], [-1]):
        with pytest.raises(RuntimeError, match="out of range"):
            mask_applier(torch.device("cpu"))(logits, bitmask, bad)
    assert not logits.isinf().any()


def test_without_the_cpu_extension_or_off_the_cpu_the_grammar_package_applies(monkeypatch):
    assert mask_applier(torch.device("cuda")) is step_masks._apply_anywhere
    monkeypatch.setenv("STENCILD_NO_KERNELS", "1")
    apply = mask_applier(torch.device("cpu"))
    assert apply is step_masks._apply_anywhere
    logits = torch.zeros(3, 40)
    apply(logits, torch.tensor([[1, 0], [0, -1], [5, 0]], dtype=torch.int32), [0, 2])
    allowed = [(logits[r] == 0).nonzero().flatten().tolist() for r in range(3)]
    assert allowed == [[0], list(range(40)), [0, 2]]
