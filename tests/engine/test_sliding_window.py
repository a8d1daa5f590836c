"""Sliding-window attention end to end: a checkpoint whose layers see only the
last `sliding_window` keys is served over its whole context, token for token
as transformers runs it, on every attention backend a CPU can run (the native
kernel, torch's SDPA over gathered pages, the dense decode path of the graphs,
and Triton's kernels in its interpreter), through chunked prefill and prefix
cache hits.

The window here (12 keys) is far shorter than the prompts (up to 60 tokens)
and pages are 4 or 16 tokens, so windows start mid-page and whole pages fall
behind them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch

# Triton's kernels run on a CPU in its interpreter, chosen when they are first
# imported (as tests/engine/test_triton_kernels.py does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams  # noqa: E402

from .reference import assert_engine_matches, greedy_argmax, prompts, variant_checkpoint  # noqa: E402

WINDOW = 12
NEW_TOKENS = 24
# Pages of 4 tokens (a window spans three and starts mid-page) and of 16 (a
# window ends inside the page it starts in, or the next).
CASES: dict[str, dict[str, Any]] = {
    "cpu-kernel": dict(attention="auto", page_size=4),
    "torch": dict(attention="torch", page_size=16),
    "graphs-dense-decode": dict(attention="auto", cuda_graphs="emulate", page_size=4),
    "chunked": dict(attention="torch", max_num_batched_tokens=16, page_size=4),
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """tiny-mistral with a 12-key window on every layer (its context stays 512)."""
    return variant_checkpoint("tiny-mistral", {"sliding_window": WINDOW}, tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def expected(mistral) -> list[list[int]]:
    _, model = mistral
    return [list(greedy_argmax(model, tuple(p), NEW_TOKENS)) for p in prompts(4)]


def _greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(batch, params)]


def test_the_window_is_read_per_layer_and_the_context_is_not_cut(mistral) -> None:
    llm = LLM(str(mistral[0]), kv_cache_gib=0.05)
    try:
        assert llm.engine.model_config.sliding_windows == (WINDOW, WINDOW)
        assert llm.engine.max_model_len == 512  # the window no longer caps it
        assert llm.engine.attention.windows == (WINDOW, WINDOW)
    finally:
        llm.close()


def test_logits_match_transformers_across_prefill_chunks_and_decode(mistral) -> None:
    # 60 tokens in chunks of 20 and 33 over cached keys, then decode tokens.
    assert_engine_matches(*mistral)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(mistral, expected, case: str) -> None:
    llm = LLM(str(mistral[0]), kv_cache_gib=0.05, **CASES[case])
    try:
        assert _greedy(llm, prompts(4)) == expected
        # Again: the prompts now hit the prefix cache, so their prefill starts
        # past the window over cached pages.
        assert _greedy(llm, prompts(4)) == expected
    finally:
        llm.close()


def test_greedy_matches_transformers_in_triton_kernels(mistral, expected) -> None:
    pytest.importorskip("triton")
    llm = LLM(str(mistral[0]), kv_cache_gib=0.05, attention="triton", page_size=4)
    try:
        # The 60-token prompt (Triton's interpreter is slow): its window starts mid-page.
        assert _greedy(llm, prompts(2)[1:]) == expected[1:2]
    finally:
        llm.close()


def test_only_the_sliding_layers_of_a_qwen2_checkpoint_slide(tmp_path) -> None:
    # Layer 0 attends to everything, layer 1 to its last 12 keys.
    path, model = variant_checkpoint("tiny-qwen2", {"sliding_window": WINDOW, "use_sliding_window": True,
                                                    "layer_types": ["full_attention", "sliding_attention"]},
                                     tmp_path / "qwen2")
    assert cast(Any, model).config.layer_types == ["full_attention", "sliding_attention"]
    llm = LLM(str(path), kv_cache_gib=0.05, page_size=4)
    try:
        assert llm.engine.model_config.sliding_windows == (0, WINDOW)
        want = [list(greedy_argmax(model, tuple(p), NEW_TOKENS)) for p in prompts(3)]
        assert _greedy(llm, prompts(3)) == want
    finally:
        llm.close()
