"""Reference results from `transformers` for the same tiny checkpoints."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.attention import SeqSpan
from engine.presets import ensure_preset
from engine.staging import upload
from engine.step_inputs import build_step_inputs

# Mixed prompt lengths, from 3 to 60 tokens (pages are 16 tokens).
PROMPT_LENGTHS = [3, 60, 17, 33, 5, 48, 25, 9]


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 8000, size=length).tolist() for length in PROMPT_LENGTHS[:n]]


@functools.cache
def hf_model(name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_preset(name), dtype=torch.float32).eval()


def cache_argument(model) -> str:  # type: ignore[no-untyped-def]
    """What `model.forward` calls its KV cache: transformers 5.24 renamed
    `past_key_values` (in arguments and outputs) to `cache`, and drops the old
    name in 5.40; the tests run on releases from either side."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def greedy_argmax(model, prompt: tuple[int, ...], new_tokens: int, device: str = "cpu") -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """A transformers model's greedy continuation by plain argmax over its KV cache."""
    out: list[int] = []
    name = cache_argument(model)
    past = None
    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        for _ in range(new_tokens):
            r = model(input_ids=x, use_cache=True, **{name: past})
            past = getattr(r, name)
            tok = int(r.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]], device=device)
    return tuple(out)


@functools.cache
def _hf_greedy(name: str, prompt: tuple[int, ...], new_tokens: int) -> tuple[int, ...]:
    return greedy_argmax(hf_model(name), prompt, new_tokens)


def hf_greedy(name: str, prompt: list[int], new_tokens: int = 32) -> list[int]:
    """Greedy continuation by plain argmax (no generation-time processors)."""
    return list(_hf_greedy(name, tuple(prompt), new_tokens))


def hf_logits(name: str, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens`, [len, vocab]."""
    with torch.no_grad():
        return hf_model(name)(input_ids=torch.tensor([tokens])).logits[0].float()


def engine_logits(llm: LLM, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Our logits at every position, computed in the given chunks (prefill pieces
    and single decode tokens) through the paged cache."""
    eng = llm.engine
    assert sum(chunks) == len(tokens)
    ctx = eng.make_context(tokens, SamplingParams(max_new_tokens=1))
    eng.kv_manager.claim(ctx, use_prefix_cache=False)
    pipe = eng.pipeline
    rows = []
    try:
        for n in chunks:
            ctx.set_chunk(n)
            assert eng.kv_manager.reserve(ctx, ctx.active_idx)
            inputs = upload(build_step_inputs([ctx], 1, eng.kv_manager, pipe.buffer, eng.attention,
                                              eng.vocab_size, pipe.staging), pipe.staging.device)
            with torch.inference_mode():
                hidden = eng.model.forward(inputs.input_ids, inputs.positions, eng.attention, inputs.attention)
                rows.append(eng.model.logits(hidden))
            ctx.mark_chunk_done()
    finally:
        pipe.release(ctx)
    return torch.cat(rows)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)


def assert_greedy_matches(llm: LLM, name: str, batch: list[list[int]], new_tokens: int) -> None:
    """Greedy tokens equal to transformers', and each one's log-probability
    within 1e-4 of theirs: a logit that moved shows even where the greedy
    choice did not."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=0)
    for prompt, res in zip(batch, llm.generate(batch, params), strict=True):
        assert res.token_ids == hf_greedy(name, prompt, new_tokens)
        assert res.logprobs is not None
        theirs = torch.log_softmax(hf_logits(name, prompt + res.token_ids)[len(prompt) - 1:-1], dim=-1)
        want = theirs[torch.arange(new_tokens), torch.tensor(res.token_ids)]
        got = torch.tensor([lp.logprob for lp in res.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def mixed_step(shapes: list[tuple[int, int]], page_size: int) -> tuple[list[SeqSpan], int, int]:
    """One step's spans for (cache_len, q_len) pairs, queries laid end to end:
    the spans, the step's token count and the pages each sequence gets."""
    spans, start = [], 0
    for i, (cache_len, q_len) in enumerate(shapes):
        spans.append(SeqSpan(i, start, start + q_len, cache_len))
        start += q_len
    return spans, start, max(c + q for c, q in shapes) // page_size + 1


def variant_checkpoint(preset: str, overrides: dict, out: Path, seed: int = 5,
                       init: Callable[[torch.nn.Module], None] | None = None) -> tuple[Path, torch.nn.Module]:
    """`preset`'s architecture with `overrides` in its config, random weights
    (then `init`), saved to `out` with the preset's tokenizer: the checkpoint
    and the transformers model it holds."""
    import json
    import shutil

    import transformers

    source = ensure_preset(preset)
    config = json.loads((source / "config.json").read_text())
    arch = config["architectures"][0]
    cfg = getattr(transformers, arch).config_class.from_dict({**config, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    if init is not None:
        init(model)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return out, model


def assert_engine_matches(path: Path, model: torch.nn.Module) -> None:
    """Our logits over a prompt (prefill chunks, then decode tokens) are the model's."""
    tokens = prompts(2)[1]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([tokens])).logits[0].float()
    llm = LLM(str(path), kv_cache_gib=0.05)
    try:
        got = engine_logits(llm, tokens, [20, 33, 1, 1, 5])
    finally:
        llm.close()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
