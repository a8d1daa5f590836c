"""The grammar mask applied to logits: the CPU extension's kernel and the
Triton kernel (in Triton's interpreter without CUDA) against the bitmask's
definition, over random bitmasks, vocabularies and row sets; and which one
an engine takes.

(The reference is written out here, not xgrammar's CPU kernel, which the
grammar package uses: at a vocabulary of one token that kernel writes past
the row.)"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import step_masks
from engine.kernels import cpu_ops, triton_mask
from engine.kernels.triton_base import triton_available
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


def masked(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """What `rows` of `logits` are with the bitmask applied (ids past it disallowed)."""
    expected = logits.clone()
    words = bitmask.tolist()
    for r in rows:
        for t in range(logits.shape[1]):
            if t >= 32 * len(words[r]) or not (words[r][t // 32] >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    return expected


@needs_kernels
@settings(max_examples=300, deadline=None)
@given(masked_batches(), st.booleans())
def test_the_cpu_kernel_masks_as_the_bitmask_says(case, rows_as_tensor):
    logits, bitmask, rows = case
    expected = masked(logits, bitmask, rows)
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


needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@needs_triton
@settings(max_examples=25, deadline=None)
@given(masked_batches())
def test_the_triton_kernel_masks_as_the_bitmask_says(case):
    logits, bitmask, rows = case
    expected = masked(logits, bitmask, rows)
    on_device = logits.to(DEVICE)
    apply = mask_applier(DEVICE, triton=True)
    assert apply is step_masks._apply_with_triton
    apply(on_device, bitmask, rows)
    assert torch.equal(on_device.cpu(), expected)


@needs_triton
def test_the_triton_kernel_covers_a_large_vocabulary_in_blocks():
    # Several programs a row (1024 logits each), the last one partial, rows out of order.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2500, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 79), dtype=torch.int32, generator=gen)
    bitmask[1] = 0
    expected = masked(logits, bitmask, [3, 1])
    on_device = logits.to(DEVICE)
    triton_mask.apply_token_bitmask(on_device, bitmask.to(DEVICE), torch.tensor([3, 1], device=DEVICE))
    assert torch.equal(on_device.cpu(), expected)


@needs_triton
def test_an_engine_on_triton_kernels_masks_with_triton(make_llm):
    plain = make_llm("tiny-llama", kv_cache_gib=0.05)
    assert plain.engine.masks.apply is not step_masks._apply_with_triton
    on_triton = make_llm("tiny-llama", kv_cache_gib=0.05, attention="triton")
    assert on_triton.engine.ops_choice.startswith("triton")
    assert on_triton.engine.masks.apply is step_masks._apply_with_triton


@needs_triton
@pytest.mark.parametrize("fault", ["raises", "wrong"])
def test_a_triton_mask_kernel_that_fails_its_probe_is_not_taken(monkeypatch, caplog, fault):
    def broken(logits, bitmask, rows):
        if fault == "raises":
            raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(triton_mask, "apply_token_bitmask", broken)
    with caplog.at_level(logging.WARNING, logger="engine.step_masks"):
        apply = mask_applier(DEVICE, triton=True)
    assert apply is not step_masks._apply_with_triton
    assert ("failed on this device" if fault == "raises" else "disagrees") in caplog.text
