"""Sampler: exact support of top-k/top-p/min-p, penalty definitions, seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import engine.sampler as sampler_module
from engine import SamplingParams
from engine.context import TextContext
from engine.sampler import apply_penalties_and_bias, build_sampling_batch, filter_logits, sample
from engine.staging import Staging

VOCAB = 10


def ctx(params: SamplingParams, prompt=(1, 2), generated=(), eos=frozenset({9})) -> TextContext:
    c = TextContext(tokens=np.array(prompt), max_length=100, sampling_params=params, eos_token_ids=eos,
                    seed=params.seed or 0)
    for t in generated:
        c.update(t)
    return c


def batch_for(*contexts: TextContext):
    return build_sampling_batch(list(contexts), VOCAB, Staging(torch.device("cpu")))


def support(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


# Distinct logits: token i has logit 0.5 * i, so rank order is 9, 8, ..., 0.
LOGITS = torch.arange(VOCAB, dtype=torch.float32)[None, :] * 0.5


def test_top_k_keeps_exactly_k():
    for k in (1, 3, 9):
        out = filter_logits(LOGITS.clone(), batch_for(ctx(SamplingParams(top_k=k))))
        assert support(out[0]) == set(range(VOCAB - k, VOCAB))


def test_top_p_keeps_smallest_set_reaching_p():
    probs = LOGITS[0].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    for p in (0.05, 0.3, 0.6, 0.9, 0.99):
        expected, mass = set(), 0.0
        for tok in order:
            expected.add(tok)
            mass += float(probs[tok])
            if mass >= p:
                break
        out = filter_logits(LOGITS.clone(), batch_for(ctx(SamplingParams(top_p=p))))
        assert support(out[0]) == expected, p


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = LOGITS[0].softmax(-1)
    for min_p in (0.1, 0.3, 0.7):
        expected = {i for i in range(VOCAB) if probs[i] >= min_p * probs.max()}
        out = filter_logits(LOGITS.clone(), batch_for(ctx(SamplingParams(min_p=min_p))))
        assert support(out[0]) == expected


def test_top_k_keeps_the_tokens_tied_with_the_kth():
    # As vLLM's top-k (16-bit logits tie often): below the k-th value goes.
    tied = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    out = filter_logits(tied.clone(), batch_for(ctx(SamplingParams(top_k=2))))
    assert support(out[0]) == {1, 3, 5}
    out = filter_logits(LOGITS.clone(), batch_for(ctx(SamplingParams(top_k=2**31 - 1))))  # beyond the vocabulary
    assert support(out[0]) == set(range(VOCAB))


def test_min_p_applies_before_top_p_as_in_vllm():
    # Probabilities .5, .25, .15, .1: min-p 0.25 drops .1 (below .125) first;
    # top-p 0.76 over what is left (.5, .25, .15, renormalised) keeps two.
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, :4] = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    out = filter_logits(logits, batch_for(ctx(SamplingParams(min_p=0.25, top_p=0.76))))
    assert support(out[0]) == {0, 1}


def test_filters_apply_per_row_and_after_temperature():
    rows = [ctx(SamplingParams(top_k=2)), ctx(SamplingParams()), ctx(SamplingParams(top_p=0.5, temperature=0.5))]
    out = filter_logits(LOGITS.repeat(3, 1), batch_for(*rows))
    assert support(out[0]) == {8, 9}
    assert support(out[1]) == set(range(VOCAB))
    sharpened = (LOGITS[0] / 0.5).softmax(-1)
    assert sharpened[9] >= 0.5 and support(out[2]) == {9}
    torch.testing.assert_close(out[1], LOGITS[0])


def test_penalties_match_their_definitions():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    c = ctx(params, prompt=(1, 2), generated=(3, 3, 4))
    raw = torch.tensor([[0.5, 1.0, -2.0, 2.0, -1.0, 0.7, 0.0, 0.0, 0.0, 0.0]])
    out = raw.clone()
    apply_penalties_and_bias(out, batch_for(c))
    counts = {3: 2, 4: 1}
    expected = raw.clone()[0]
    for tok in range(VOCAB):
        if tok in (1, 2, 3, 4):  # seen in prompt or output: repetition penalty
            expected[tok] = expected[tok] / 1.5 if expected[tok] > 0 else expected[tok] * 1.5
        n = counts.get(tok, 0)
        expected[tok] -= 0.4 * n + (0.3 if n else 0.0)
    torch.testing.assert_close(out[0], expected)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_tiny_repetition_penalty_favours_the_seen_tokens_and_stays_finite(temperature):
    # Any penalty > 0 is vLLM's range: 1e-45 divided a seen logit to +inf, and
    # sampling then returned the vocabulary's last id, a token never seen.
    logits = torch.tensor([[0.5, 1.0, 2.0, 2.0, 0.0, 0.7, 0.0, 0.0, 0.0, 0.0]])
    for seed in range(8):
        params = SamplingParams(repetition_penalty=1e-45, temperature=temperature, seed=seed)
        c = ctx(params, prompt=(1, 2), generated=(3,))
        out = logits.clone()
        apply_penalties_and_bias(out, batch_for(c))
        assert bool(torch.isfinite(out).all())
        assert int(sample(logits.clone(), batch_for(c)).tokens[0]) in (1, 2, 3)


def test_logit_bias_comes_before_the_penalties():
    # vLLM's order: a biased logit of a seen token is penalised as a whole.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={3: 1.0, 4: 1.0, 6: 3.0})
    c = ctx(params, prompt=(1, 2), generated=(3, 4))
    raw = torch.tensor([[0.5, 1.0, -2.0, 2.0, -3.0, 0.7, 0.0, 0.0, 0.0, 0.0]])
    out = raw.clone()
    apply_penalties_and_bias(out, batch_for(c))
    assert float(out[0, 3]) == (2.0 + 1.0) / 2.0 - 0.5  # not 2.0 / 2.0 + 1.0 - 0.5
    assert float(out[0, 4]) == (-3.0 + 1.0) * 2.0 - 0.5
    assert float(out[0, 6]) == 3.0  # not seen: the bias alone


def test_penalties_of_a_batch_count_per_row_and_cost_the_host_tokens_not_the_vocabulary():
    """Rows without penalties and rows with, prompt tokens seen but not counted,
    placeholders of tokens still on the device left out; the host hands over the
    seen tokens (a few per row), however large the vocabulary: the [B, V] state
    is made where the logits are."""
    free = ctx(SamplingParams(), prompt=(5, 6), generated=(6, 6))
    penalised = ctx(SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0), prompt=(1, 2), generated=(3, 3))
    penalised.update_with_future_token()  # a token still being sampled: not known on the host
    vocab = 1 << 20
    batch = build_sampling_batch([free, penalised], vocab, Staging(torch.device("cpu")))
    pen = batch.penalties
    assert pen is not None
    assert pen.tokens.numel() == 4 and pen.rows.tolist() == [1] * 4
    assert all(t.numel() <= 4 for t in (pen.rows, pen.tokens, pen.generated, pen.frequency))
    counts, seen = pen.state()
    assert counts.shape == seen.shape == (2, vocab)
    assert counts[1, 3] == 2 and counts.sum() == 2 and counts[0].sum() == 0
    assert seen[1, [1, 2, 3]].all() and int(seen.sum()) == 3


def test_logit_bias_of_a_batch_lands_on_its_own_rows_from_arrays_built_once():
    """Rows without a bias, with a few, and with the whole vocabulary biased:
    each bias on its row. The host reads arrays each request built once (a
    Python loop over every entry, every step, cost 10 ms for one such row)."""
    whole = SamplingParams(logit_bias={t: -float(t) for t in range(VOCAB)})
    few = SamplingParams(logit_bias={2: 5.0, 7: -1.0, VOCAB + 3: 9.0})  # past the head's width: left out
    rows = [ctx(SamplingParams()), ctx(whole), ctx(few)]
    out = torch.zeros(3, VOCAB)
    apply_penalties_and_bias(out, batch_for(*rows))
    assert out[0].abs().sum() == 0
    assert out[1].tolist() == [-float(t) for t in range(VOCAB)]
    assert out[2, 2] == 5.0 and out[2, 7] == -1.0 and out[2].abs().sum() == 6.0
    assert whole.logit_bias_arrays is whole.logit_bias_arrays  # built once, kept with the request


def test_logit_bias_and_min_new_tokens_block_eos():
    params = SamplingParams(logit_bias={2: 5.0, 7: -1.0}, min_new_tokens=2, stop_token_ids=(8,))
    c = ctx(params, generated=(4,))
    out = torch.zeros(1, VOCAB)
    apply_penalties_and_bias(out, batch_for(c))
    assert out[0, 2] == 5.0 and out[0, 7] == -1.0
    assert out[0, 9] == -math.inf and out[0, 8] == -math.inf  # EOS and stop token blocked
    done = ctx(params, generated=(4, 5))
    out = torch.zeros(1, VOCAB)
    apply_penalties_and_bias(out, batch_for(done))
    assert torch.isfinite(out).all()
    # ignore_eos decides whether EOS stops, not whether it may come before
    # min_new_tokens (vLLM's block; it was left open).
    ignoring = ctx(SamplingParams(min_new_tokens=2, ignore_eos=True), generated=(4,))
    out = torch.zeros(1, VOCAB)
    apply_penalties_and_bias(out, batch_for(ignoring))
    assert out[0, 9] == -math.inf


def test_a_token_range_keeps_its_row_inside_lo_to_hi_and_its_extra_token():
    # Speech: a row samples only its codebook's codes [lo, hi) (hi is the next
    # codebook's first code) and one extra token; other rows are untouched.
    ranged, free = ctx(SamplingParams()), ctx(SamplingParams())
    ranged.allowed_token_range = lambda: (3, 6, 8)  # type: ignore[method-assign]
    out = torch.zeros(2, VOCAB)
    apply_penalties_and_bias(out, batch_for(free, ranged))
    assert support(out[1]) == {3, 4, 5, 8}
    assert torch.isfinite(out[0]).all()
    ranged.allowed_token_range = lambda: (3, 6, None)  # type: ignore[method-assign]
    out = torch.zeros(2, VOCAB)
    apply_penalties_and_bias(out, batch_for(free, ranged))
    assert support(out[1]) == {3, 4, 5}


def test_greedy_is_argmax_and_logprobs_are_raw():
    c = ctx(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0))
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    out = sample(logits.clone(), batch_for(c))
    # Token 1 appears in the prompt, so the penalty halves it and 3 wins.
    assert out.tokens.tolist() == [3]
    raw = logits.log_softmax(-1)
    assert out.logprob is not None and out.top_ids is not None and out.top_logprobs is not None
    assert abs(float(out.logprob[0]) - float(raw[0, 3])) < 1e-6
    assert out.top_ids[0].tolist() == [1, 3, 2]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)] + [-math.inf] * (VOCAB - 3)])
    counts = np.zeros(VOCAB)
    for seed in range(3000):
        c = ctx(SamplingParams(temperature=1.0, seed=seed))
        counts[int(sample(logits.clone(), batch_for(c)).tokens[0])] += 1
    freq = counts[:3] / counts.sum()
    np.testing.assert_allclose(freq, [1 / 8, 2 / 8, 5 / 8], atol=0.03)
    assert counts[3:].sum() == 0


def test_same_seed_same_tokens_alone_and_in_a_batch(make_llm):
    llm = make_llm("tiny-llama")
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, seed=1234, ignore_eos=True)
    prompt = [11, 22, 33, 44, 55]
    alone = llm.generate([prompt], params)[0].token_ids
    rng = np.random.default_rng(3)
    others = [rng.integers(5, 8000, size=n).tolist() for n in (4, 30, 12, 7)]
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)] * 2 + [params]
                         + [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * 2)
    assert mixed[2].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24,
                                                       seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2**63), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("frequency_penalty", 3.0), ("logprobs", 21), ("prompt_logprobs", -1),
    ("max_new_tokens", 0), ("stop", ("",)),
    # Non-finite and out-of-range values a hostile client sent.
    ("temperature", INF), ("temperature", NAN), ("top_p", NAN), ("min_p", NAN),
    ("repetition_penalty", 3e38), ("repetition_penalty", INF), ("repetition_penalty", 10.5),
    ("presence_penalty", -INF), ("frequency_penalty", NAN), ("presence_penalty", -2.5),
    ("logit_bias", {3: NAN}), ("logit_bias", {3: INF}),
])
def test_invalid_values_name_their_field(field, value):
    from engine import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_min_new_tokens_may_equal_max_new_tokens_but_not_pass_it():
    from engine import InvalidSamplingParams

    assert SamplingParams(min_new_tokens=5, max_new_tokens=5).min_new_tokens == 5  # a fixed length
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(min_new_tokens=6, max_new_tokens=5)
    assert err.value.field == "min_new_tokens"


def test_the_models_default_length_applies_only_inside_the_room_the_prompt_leaves():
    from engine import InvalidSamplingParams
    from engine.sampling_params import default_length

    # generation_config.json's max_new_tokens 7; a 3-token prompt; a context of 100.
    assert default_length(SamplingParams(), 7, 3, 100).max_new_tokens == 7
    assert default_length(SamplingParams(max_new_tokens=50), 7, 3, 100).max_new_tokens == 50  # the caller's
    # At or past the room left it is no limit of the request's: the context's
    # is, and the output ends CONTEXT_LENGTH, not LENGTH.
    assert default_length(SamplingParams(), 97, 3, 100).max_new_tokens is None
    assert default_length(SamplingParams(), 96, 3, 100).max_new_tokens == 96
    # min_new_tokens up to the default is fine; past it the request must say.
    assert default_length(SamplingParams(min_new_tokens=7), 7, 3, 100).max_new_tokens == 7
    with pytest.raises(InvalidSamplingParams, match="default"):
        default_length(SamplingParams(min_new_tokens=8), 7, 3, 100)


def test_a_lone_stop_string_is_one_stop_string():
    # It was one stop string per character: "END" stopped at any E, N or D.
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["END", "x"]).stop == ("END", "x")  # type: ignore[arg-type]


def test_too_many_stops_are_refused_before_any_is_copied():
    # Millions of stop token ids in one request were copied (one C call,
    # ~0.2 s of the GIL, every stream's event loop waiting) before the count
    # was checked. A list that refuses to be read shows none is.
    from engine import InvalidSamplingParams
    from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    class Unread(list):
        def __iter__(self):
            raise AssertionError("read before its length was checked")

    for field, limit, item in (("stop_token_ids", MAX_STOP_TOKEN_IDS, 5), ("stop", MAX_STOP_STRINGS, "x")):
        with pytest.raises(InvalidSamplingParams, match=f"at most {limit}") as err:
            SamplingParams(**{field: Unread([item] * (limit + 1))})  # type: ignore[arg-type]
        assert err.value.field == field
        assert len(getattr(SamplingParams(**{field: [item] * limit}), field)) == limit  # type: ignore[arg-type]


def test_vllm_ranges_are_accepted_and_tiny_temperatures_are_greedy():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=-1.5, repetition_penalty=10.0)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("given, used", [(1e-5, 0.01), (0.005, 0.01), (0.0099, 0.01), (0.01, 0.01),
                                         (0.5, 0.5), (0.0, 0.0), (1e-6, 1e-6)])
def test_temperatures_below_a_hundredth_are_raised_to_it_as_vllm_does(given, used):
    # vLLM serves 0.005 as 0.01; here it sharpened the distribution twice as
    # much, so one request sampled differently on the two servers of a fleet.
    assert SamplingParams(temperature=given).temperature == used


ALLOWED = (3, 6)


def grammar_mask(logits: torch.Tensor) -> None:
    """A hard mask allowing only ALLOWED, as the grammar applies it."""
    keep = torch.full_like(logits, float("-inf"))
    keep[:, list(ALLOWED)] = 0.0
    logits += keep


@pytest.mark.parametrize("model_logit", [float("-inf"), float("nan"), float("inf")])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=4, top_p=0.9, top_k=5, min_p=0.1),
    SamplingParams(temperature=0.01, seed=4, repetition_penalty=10.0, presence_penalty=-2.0),
], ids=["greedy", "filtered", "extreme"])
def test_a_masked_row_never_leaves_its_mask(params, model_logit):
    # The model gives every allowed token (or every token) a non-finite logit:
    # the sampler still picks an allowed token, the best one when it can tell.
    c = ctx(params, generated=(3, 6, 3))
    for logits in (torch.full((1, VOCAB), model_logit),
                   torch.where(torch.arange(VOCAB) == 6, model_logit, 1.0)[None, :].clone(),
                   torch.where(torch.arange(VOCAB) >= 3, model_logit, 1.0)[None, :].clone()):
        tok = int(sample(logits, batch_for(c), grammar_mask).tokens[0])
        assert tok in ALLOWED, (logits, tok)
    if model_logit == float("inf") and params.greedy:
        logits = torch.zeros(1, VOCAB)
        logits[0, 6] = model_logit
        assert int(sample(logits, batch_for(c), grammar_mask).tokens[0]) == 6


def test_a_draw_that_lands_on_an_excluded_token_takes_the_fallback(monkeypatch):
    # On CUDA a one-row cumulative sum may step up by a rounding unit at an
    # excluded (zero-probability) token (see `draw`). Injected here, wider: over
    # probabilities [0.5, 0, 0.5] the CDF rises at the excluded token 1, and
    # the target 0.5005 falls inside that step.
    real = sampler_module._cdf

    def stepped(filtered: torch.Tensor) -> torch.Tensor:
        cdf = real(filtered).clone()
        cdf[:, 1] += 1e-3
        return cdf

    filtered = torch.tensor([[0.0, float("-inf"), 0.0]])
    uniform = torch.tensor([0.5005])
    assert sampler_module.draw(filtered, uniform, torch.tensor([0])).tolist() == [2]  # token 2's bucket
    monkeypatch.setattr(sampler_module, "_cdf", stepped)
    assert sampler_module.draw(filtered, uniform, torch.tensor([0])).tolist() == [0]


def test_sampled_rows_stay_in_their_mask_when_the_cdf_steps_at_excluded_tokens(monkeypatch):
    # The same fault at every excluded token, wide enough that many seeds land
    # in a step: every token drawn is still one the grammar allows.
    real = sampler_module._cdf

    def stepped(filtered: torch.Tensor) -> torch.Tensor:
        cdf = real(filtered)
        return cdf + torch.isinf(filtered) * 0.2

    monkeypatch.setattr(sampler_module, "_cdf", stepped)
    landed = 0
    for seed in range(200):
        c = ctx(SamplingParams(temperature=1.0, seed=seed))
        batch = batch_for(c)
        masked = LOGITS.clone()
        grammar_mask(masked)
        filtered = filter_logits(masked, batch)
        assert batch.uniform is not None
        cdf = stepped(filtered)
        target = batch.uniform[0][:, None] * cdf[:, -1:]
        landed += int(torch.isinf(filtered[0, torch.searchsorted(cdf, target, right=True).clamp(max=VOCAB - 1)]))
        tok = int(sample(LOGITS.clone(), batch, grammar_mask).tokens[0])
        assert tok in ALLOWED, (seed, tok)
    assert landed > 20, "the injected steps were never landed on"
