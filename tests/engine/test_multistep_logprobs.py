"""Multi-step decoding, log-probabilities, and outputs that must not depend on batching."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams, step_run

from .reference import GREEDY, hf_greedy, hf_logits, prompts


def test_multi_step_decode_matches_single_step(make_llm):
    batch = prompts(8)
    single = make_llm("tiny-qwen2")
    multi = make_llm("tiny-qwen2", num_steps=4, overlap=False)
    for prompt, res in zip(batch, multi.generate(batch, GREEDY), strict=True):
        assert res.token_ids == hf_greedy("tiny-qwen2", prompt)
    sampled = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_new_tokens=20, ignore_eos=True,
                              repetition_penalty=1.3, frequency_penalty=0.5) for i in range(8)]
    before = multi.engine.pipeline.forward_passes
    a = single.generate(batch, sampled)
    b = multi.generate(batch, sampled)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # Same number of forward passes, fewer scheduler round trips.
    assert multi.engine.pipeline.forward_passes - before == single.engine.pipeline.forward_passes


@pytest.mark.parametrize("slice_rows", [None, 4])
def test_logprobs_match_transformers(make_llm, monkeypatch, slice_rows):
    # Prompt log-probabilities come from the logits of a few rows at a time
    # (step_run.PROMPT_LOGPROB_ROWS): the 17-token prompt whole, and in slices of 4.
    if slice_rows is not None:
        monkeypatch.setattr(step_run, "PROMPT_LOGPROB_ROWS", slice_rows)
    llm = make_llm("tiny-mistral")
    prompt = prompts(3)[2]
    params = SamplingParams(temperature=0, max_new_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    ref = hf_logits("tiny-mistral", prompt + out.token_ids).log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        top = row.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4, rtol=0)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry is not None and entry.token_id == prompt[i] and len(entry.top) == 3
        assert abs(entry.logprob - float(ref[i - 1, prompt[i]])) < 1e-4


def test_each_request_gets_the_top_logprobs_it_asked_for_in_a_mixed_batch(make_llm):
    # The step computes the batch's widest top-N; each row keeps its own N
    # (and a request without logprobs none), its own token always listed.
    llm = make_llm("tiny-llama")
    wants = [1, 5, None, 0]
    params = [SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, logprobs=n, prompt_logprobs=n)
              for n in wants]
    for n, out in zip(wants, llm.generate(prompts(4), params), strict=True):
        if n is None:
            assert not out.logprobs and not out.prompt_logprobs
            continue
        assert len(out.logprobs) == 4 and all(len(lp.top) == n for lp in out.logprobs)
        assert all(lp is None or len(lp.top) == n for lp in out.prompt_logprobs or [])


def test_prompt_logprobs_bypass_the_prefix_cache(make_llm):
    llm = make_llm("tiny-llama", max_num_batched_tokens=16)
    prompt = prompts(2)[1]
    params = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=0)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.cached_prompt_tokens == 0
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and abs(a.logprob - b.logprob) < 1e-5


def test_bf16_runs_close_to_fp32(make_llm):
    fp32 = make_llm("tiny-llama")
    bf16 = make_llm("tiny-llama", dtype="bfloat16")
    assert bf16.engine.model.dtype == torch.bfloat16
    prompt = prompts(2)[1]
    params = SamplingParams(temperature=0, max_new_tokens=1, logprobs=20)
    a = fp32.generate([prompt], params)[0].logprobs[0]
    b = bf16.generate([prompt], params)[0].logprobs[0]
    overlap = {t for t, _ in a.top} & {t for t, _ in b.top}
    assert len(overlap) >= 15  # same distribution up to bf16 rounding


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_survive_a_preemption_mid_prefill(make_llm, overlap):
    # A preempted request computes its prompt again from the start (no prefix
    # lookup when it wants prompt log-probabilities): the positions it had
    # stored are kept, not appended a second time.
    llm = make_llm("tiny-llama", max_num_batched_tokens=16, overlap=overlap)
    eng = llm.engine
    prompt = list(range(10, 50))  # 40 tokens: three chunks of 16
    params = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=1)
    ctx = eng.make_context(prompt, params)
    eng.add_request(ctx)
    got, steps = None, 0
    while eng.has_work():
        for out in eng.step():
            if out.prompt_logprobs is not None:
                got = out.prompt_logprobs
        steps += 1
        if steps == 2 and not ctx.is_done:
            assert 0 < ctx.start_idx < ctx.prompt_len  # mid prefill
            eng.scheduler.requeue(ctx)  # what a preemption does to it
    ref = hf_logits("tiny-llama", prompt).log_softmax(-1)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        assert entry is not None and entry.token_id == prompt[i]
        assert abs(entry.logprob - float(ref[i - 1, prompt[i]])) < 1e-4
    assert len(ctx.output.prompt_logprobs) == len(prompt)
