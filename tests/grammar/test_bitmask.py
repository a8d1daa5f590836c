"""Bitmask allocation, batch filling and application to logits."""

from __future__ import annotations

import pytest
import torch

from grammar import GrammarSpec, allocate_bitmask, apply_token_bitmask_inplace

from .conftest import MODEL_VOCAB, STOP_IDS, allowed


def _random_mask(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(
        -(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=g, dtype=torch.int32
    )


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows=None) -> torch.Tensor:
    out = logits.clone()
    for r in range(out.shape[0]) if rows is None else rows:
        ids = allowed(bitmask, r)
        for t in range(out.shape[1]):
            if t not in ids:
                out[r, t] = float("-inf")
    return out


def test_allocate_shape_and_default():
    mask = allocate_bitmask(4, MODEL_VOCAB)
    assert mask.dtype == torch.int32 and tuple(mask.shape) == (4, 260)
    assert bool((mask == -1).all())
    with pytest.raises(ValueError):
        allocate_bitmask(0, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_all_rows_and_selected_rows(dtype):
    vocab = 300
    mask = _random_mask(3, vocab)
    logits = torch.randn(3, vocab).to(dtype)
    expected = _reference(logits.float(), mask).to(dtype)
    got = logits.clone()
    apply_token_bitmask_inplace(got, mask)
    assert torch.equal(got, expected)
    got = logits.clone()
    apply_token_bitmask_inplace(got, mask, rows=[0, 2])
    assert torch.equal(got, _reference(logits.float(), mask, rows=[0, 2]).to(dtype))
    assert torch.equal(got[1], logits[1])  # untouched row


@pytest.mark.parametrize("contiguous", [True, False])
def test_apply_rows_as_a_tensor_equals_rows_as_a_list(contiguous):
    # The engine hands CUDA logits their rows as a staged host tensor.
    vocab = 300
    mask = _random_mask(5, vocab, seed=1)
    base = torch.randn(5, vocab) if contiguous else torch.randn(vocab, 5).t()
    listed, tensor = base.clone(), base.clone()
    apply_token_bitmask_inplace(listed, mask, rows=[4, 1])
    apply_token_bitmask_inplace(tensor, mask, rows=torch.tensor([4, 1]))
    assert torch.equal(tensor, listed)
    assert torch.equal(listed, _reference(base, mask, rows=[4, 1]))
    untouched = base.clone()
    apply_token_bitmask_inplace(untouched, mask, rows=torch.zeros(0, dtype=torch.int64))
    assert torch.equal(untouched, base)


def test_apply_never_writes_past_a_short_row():
    # xgrammar's CPU kernel, given a row of one logit, set the next row's first.
    base = torch.zeros(4, 1)
    mask = torch.tensor([[1], [0], [5], [-1]], dtype=torch.int32)
    logits = base.clone()
    apply_token_bitmask_inplace(logits, mask, rows=[2, 1])
    assert torch.equal(logits, _reference(base, mask, rows=[2, 1]))
    assert logits[3, 0] == 0 and logits[1, 0] == float("-inf")


def test_apply_masks_ids_past_the_bitmask_and_1d_logits():
    mask = torch.full((1, 2), -1, dtype=torch.int32)  # covers 64 tokens
    logits = torch.zeros(1, 100)
    apply_token_bitmask_inplace(logits, mask)
    assert bool(torch.isinf(logits[0, 64:]).all()) and bool((logits[0, :64] == 0).all())
    # ... on the rows given only, as a sequence or a tensor (the engine's fallback passes rows).
    for rows in ([1], torch.tensor([1])):
        logits = torch.zeros(2, 100)
        apply_token_bitmask_inplace(logits, torch.full((2, 2), -1, dtype=torch.int32), rows=rows)
        assert bool(torch.isinf(logits[1, 64:]).all()) and bool((logits[1, :64] == 0).all())
        assert bool((logits[0] == 0).all())
    flat = torch.zeros(64)
    one = torch.zeros(2, dtype=torch.int32)
    one[0] = 1 << 5
    apply_token_bitmask_inplace(flat, one)
    assert torch.isfinite(flat).nonzero().flatten().tolist() == [5]


def test_apply_non_contiguous_logits_uses_generic_path():
    mask = _random_mask(2, 64, seed=3)
    base = torch.randn(64, 2)
    logits = base.t()  # stride(-1) != 1
    expected = _reference(logits.contiguous(), mask)
    apply_token_bitmask_inplace(logits, mask)
    assert torch.equal(logits, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_on_cuda_matches_cpu():
    mask = _random_mask(4, MODEL_VOCAB)
    logits = torch.randn(4, MODEL_VOCAB)
    cpu = logits.clone()
    apply_token_bitmask_inplace(cpu, mask, rows=[1, 3])
    gpu = logits.cuda()
    apply_token_bitmask_inplace(gpu, mask, rows=[1, 3])  # CPU bitmask, copied over
    assert torch.equal(gpu.cpu(), cpu)
    staged = logits.cuda()
    apply_token_bitmask_inplace(staged, mask.pin_memory(), rows=torch.tensor([1, 3]).pin_memory())
    assert torch.equal(staged.cpu(), cpu)


def test_batch_fill_matches_single_fills(compiler):
    tok = compiler.tokenizer_data
    specs = [
        (
            GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
            "xgrammar",
        ),
        (
            GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
            "llguidance",
        ),
        (GrammarSpec.regex("[a-z]+@[a-z]+"), "xgrammar"),
        (GrammarSpec.regex("[a-z]+@[a-z]+"), "llguidance"),
        (GrammarSpec.choice(["done"]), "llguidance"),
    ]
    matchers = [compiler.compile(s, backend=b) for s, b in specs]
    prefixes = ['{"a":', '{"a":1', "ab@", "ab@c", "done"]
    for m, p in zip(matchers, prefixes, strict=True):
        assert m.accept_tokens(tok.encode(p)) == len(tok.encode(p))
    assert matchers[-1].accept_token(STOP_IDS[0])  # terminated: stop tokens only
    batch = [*matchers, None]
    rows = [6, 0, 2, 3, 5, 1]
    bitmask = compiler.allocate_bitmask(7)
    bitmask.zero_()
    compiler.fill_bitmasks(batch, bitmask, rows)
    single = compiler.allocate_bitmask(1)
    for m, row in zip(matchers, rows[: len(matchers)], strict=True):
        m.fill_bitmask(single, 0)
        assert torch.equal(bitmask[row], single[0]), (m.backend, m.spec)
    assert bool((bitmask[1] == -1).all())  # unconstrained row
    assert allowed(bitmask, 5) == set(STOP_IDS)
    assert bool((bitmask[4] == 0).all())  # untouched
    with pytest.raises(IndexError):
        compiler.fill_bitmasks([matchers[0]], bitmask, [7])
    with pytest.raises(ValueError):
        compiler.fill_bitmasks(matchers[:1], torch.zeros((1, 10), dtype=torch.int32))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_one_row_fill_matches_the_matchers_own(compiler, backend):
    # `row_filler` (the engine's path for a step with one constrained request)
    # binds xgrammar's native fill to the row; its rows must equal the
    # matcher's own, and a terminated matcher still gets its stop-only row
    # from the general fill.
    tok = compiler.tokenizer_data
    m = compiler.compile(GrammarSpec.regex("[a-z]+@[a-z]+"), backend=backend)
    bitmask = compiler.allocate_bitmask(4)
    single = compiler.allocate_bitmask(1)
    filler = compiler.filler
    fill = filler.row_filler(m, bitmask, 2)
    if backend == "xgrammar":  # this xgrammar has tvm_ffi: the direct path is the one tested
        assert filler._xgr_target is not None
    for token in tok.encode("ab@c"):
        bitmask.zero_()
        fill()
        m.fill_bitmask(single, 0)
        assert torch.equal(bitmask[2], single[0])
        assert bool((bitmask[1] == 0).all())
        assert m.accept_token(token)
    assert m.accept_token(STOP_IDS[0])
    if backend == "xgrammar":
        with pytest.raises(Exception):  # noqa: B017 - the library refuses a terminated matcher
            fill()
    filler.fill([m], bitmask, [3])
    assert allowed(bitmask, 3) == set(STOP_IDS)
    with pytest.raises(IndexError):
        filler.fill([m], bitmask, [4])


def test_llguidance_template_copies_per_mask_thread(tokenizer):
    # With two mask threads each llguidance grammar keeps two templates (a
    # lexer each) and requests take them in turn; a batch fill groups rows by
    # template, yet every row still gets its own matcher's mask.
    from grammar import GrammarCompiler

    with GrammarCompiler(tokenizer, backend="llguidance", vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation="thread", mask_threads=2) as two:
        tok = two.tokenizer_data
        spec = GrammarSpec.json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
        matchers = [two.compile(spec) for _ in range(6)]
        assert [m.replica for m in matchers] == [0, 1, 0, 1, 0, 1]
        templates = {id(m._template) for m in matchers}  # type: ignore[attr-defined]
        assert len(templates) == 2
        # Different states, so a row filled from another row's matcher would differ.
        prefixes = ['{"name":', '{"name":"a', "{", '{"name":"ab"', '{"na', '{"name":"x"}']
        for m, p in zip(matchers, prefixes, strict=True):
            assert m.accept_tokens(tok.encode(p)) == len(tok.encode(p))
        rows = [5, 0, 3, 1, 4, 2]  # replicas 0 and 1 interleaved across the rows
        bitmask = two.allocate_bitmask(6)
        bitmask.zero_()
        two.fill_bitmasks(matchers, bitmask, rows)
        single = two.allocate_bitmask(1)
        masks = set()
        for m, row in zip(matchers, rows, strict=True):
            m.fill_bitmask(single, 0)
            assert torch.equal(bitmask[row], single[0]), (row, m.replica)
            masks.add(tuple(single[0].tolist()))
        assert len(masks) >= 4  # the states differ, so the check above can fail


def test_one_mask_thread_keeps_one_template(compiler):
    spec = GrammarSpec.regex("[a-z]+")
    matchers = [compiler.compile(spec, backend="llguidance") for _ in range(3)]
    assert {m.replica for m in matchers} == {0}
    assert len({id(m._template) for m in matchers}) == 1  # type: ignore[attr-defined]
