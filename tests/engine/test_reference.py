"""Our engine against `transformers` on tiny random checkpoints of every architecture."""

from __future__ import annotations

import pytest
import torch

from engine.presets import ARCHITECTURE_PRESETS

from .reference import GREEDY, engine_logits, hf_greedy, hf_logits, prompts

ARCHS = ARCHITECTURE_PRESETS
# Chunked prefill and prefix-cache hits are the scheduler's, the same for
# every architecture: they run on one of each kind of model-side difference
# (plain; biases and a padded vocabulary; Phi-3's fused weights and a window
# shorter than the prompts; Gemma 3's window, local rotation and norms;
# experts read on the host; OLMo 3's missing pre-norms beside a window).
# Every architecture's own prefill chunks meet cached keys in
# test_fp32_logits_within_1e4.
SCHEDULING_ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-phi3", "tiny-gemma3", "tiny-mixtral", "tiny-olmo3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch1_and_batch8(make_llm, arch):
    llm = make_llm(arch)
    single = prompts(1, seed=7)
    assert llm.generate(single, GREEDY)[0].token_ids == hf_greedy(arch, single[0])
    batch = prompts(8)
    results = llm.generate(batch, GREEDY)
    for prompt, res in zip(batch, results, strict=True):
        assert res.token_ids == hf_greedy(arch, prompt)
        assert res.finish_reason == "length"


@pytest.mark.parametrize("arch", SCHEDULING_ARCHS)
def test_tiny_prefill_chunks(make_llm, arch):
    # A 7-token budget per step: long prompts are spread over many steps and
    # share steps with other requests' decode tokens.
    llm = make_llm(arch, max_num_batched_tokens=7)
    scheduler = llm.engine.scheduler
    schedule, sizes = scheduler.schedule, []

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = schedule(*args, **kwargs)
        if out is not None:
            sizes.append(sum(c.active_length for c in out.contexts))
        return out

    scheduler.schedule = recorded  # type: ignore[method-assign]
    batch = prompts(8)
    for prompt, res in zip(batch, llm.generate(batch, GREEDY), strict=True):
        assert res.token_ids == hf_greedy(arch, prompt)
    assert sizes and max(sizes) <= 7  # the budget held every step
    assert sum(sizes) >= sum(map(len, batch)) and sum(s == 7 for s in sizes) > sum(map(len, batch)) // 7 // 2


@pytest.mark.parametrize("arch", SCHEDULING_ARCHS)
def test_second_run_hits_prefix_cache(make_llm, arch):
    llm = make_llm(arch)
    batch = prompts(8)
    first = llm.generate(batch, GREEDY)
    second = llm.generate(batch, GREEDY)
    for prompt, a, b in zip(batch, first, second, strict=True):
        assert a.token_ids == b.token_ids == hf_greedy(arch, prompt)
        assert a.cached_prompt_tokens == 0
        # Every full page but the one holding the last prompt token is reused.
        assert b.cached_prompt_tokens == (len(prompt) - 1) // 16 * 16
    assert llm.engine.allocator.hits > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_within_1e4(make_llm, arch):
    llm = make_llm(arch)
    tokens = prompts(2)[1]  # 60 tokens
    ref = hf_logits(arch, tokens)
    # One long prefill; then chunked prefill with a cached prefix and single
    # decode tokens, which run through the paged attention kernel.
    for chunks in ([60], [20, 33, 1, 1, 5]):
        ours = engine_logits(llm, tokens, chunks)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_torch_fallback_path_matches(make_llm, monkeypatch, arch):
    """Without native kernels (no compiler, or STENCILD_NO_KERNELS=1) the pure-torch
    attention and norms give the same answers."""
    monkeypatch.setenv("STENCILD_NO_KERNELS", "1")
    llm = make_llm(arch, attention="torch", max_num_batched_tokens=40)
    assert llm.engine.attention.name == "torch"
    assert llm.engine.model.ops is None
    batch = prompts(8)
    for prompt, res in zip(batch, llm.generate(batch, GREEDY), strict=True):
        assert res.token_ids == hf_greedy(arch, prompt)
    tokens = prompts(2)[1]
    torch.testing.assert_close(engine_logits(llm, tokens, [20, 33, 1, 1, 5]), hf_logits(arch, tokens),
                               atol=1e-4, rtol=0)


def test_without_the_small_batch_kernel(make_llm):
    """cpu_small_batch_gemm=False keeps only oneDNN's packed weights; same answers."""
    llm = make_llm("tiny-qwen2", cpu_small_batch_gemm=False)
    assert all(layer.qkv.blocked is None for layer in llm.engine.model.layers)
    batch = prompts(4)
    for prompt, res in zip(batch, llm.generate(batch, GREEDY), strict=True):
        assert res.token_ids == hf_greedy("tiny-qwen2", prompt)
    tokens = prompts(2)[1]
    torch.testing.assert_close(engine_logits(llm, tokens, [20, 33, 1, 1, 5]), hf_logits("tiny-qwen2", tokens),
                               atol=1e-4, rtol=0)
