"""The engine on a CUDA device: parity with transformers on the same GPU, decode
graphs and overlap that change no token, grammar masks applied on the GPU,
speech and embeddings equal to the CPU's, and the start-up choices.

Skipped without CUDA (one reason, see conftest.py); with
STENCILD_TEST_DEVICE=cuda and no CUDA the module fails to collect instead.

Tolerances, each justified where it is defined:
- float32: greedy tokens exactly equal to transformers' (fp32 on the same GPU,
  no TF32), logits within FP32_ATOL;
- bfloat16 and float16: log-probabilities within BF16_TOL of transformers'
  in the same dtype, and a greedy token may differ from transformers' argmax
  only at a near-tie (within 2 * BF16_TOL), at most 10 % of positions;
- graphs vs eager, overlap on vs off: identical tokens in float32 (greedy and
  seeded sampling); in bfloat16 and float16 (greedy) identical up to the
  first near-tie;
- speech: CUDA audio within test_speech.STREAM_BOUND of the CPU's;
- embeddings: CUDA vectors within 1e-4 of the CPU's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, step_masks
from engine.llm import CompletionOutput
from engine.presets import ARCHITECTURE_PRESETS, ensure_preset
from engine.step_inputs import advance_with_placeholders, build_step_inputs
from grammar import GrammarSpec

from ..engine.reference import engine_logits, greedy_argmax, prompts, variant_checkpoint
from ..engine.test_partial_rotary import LONG_PROMPTS, PHI4_MINI_LIKE
from ..engine.test_speech import STREAM_BOUND
from ..engine.test_stream_order import EVERY_OPTION, step_tensors
from ..engine.test_structured import PERSON
from .conftest import (
    CUDA_REQUIRED,
    HAS_CUDA,
    SKIP_REASON,
    hf_cuda_greedy,
    hf_cuda_log_softmax,
    missing_cuda_message,
    write_tiny_bert,
)

if CUDA_REQUIRED and not HAS_CUDA:
    pytest.fail(missing_cuda_message(), pytrace=False)

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason=SKIP_REASON)

ARCHS = ARCHITECTURE_PRESETS

# float32 on both sides, TF32 off (PyTorch's default for matmuls; our Triton
# kernels use IEEE dot products in fp32). cuBLAS, our kernels and transformers'
# SDPA reduce in other orders: a few 1e-6 relative on logits of magnitude < 5.
# 5e-4 is fp32-level agreement (bf16 is ~100x further off, see BF16_TOL), and
# it leaves room for the GPU's reduction orders that the CPU's 1e-4
# (tests/engine/test_reference.py) does not.
FP32_ATOL = 5e-4

# bfloat16 keeps 8 significant bits (unit roundoff 2^-9); two bf16
# implementations round at different points. On these tiny presets transformers'
# bf16 log-probabilities are up to 0.041 from its own fp32 ones, and ours (on
# CPU, bf16) were 0.031-0.055 from transformers' bf16: 0.125 = 2^-3 leaves a
# ~2x margin for the GPU's kernels. If every log-probability is within BF16_TOL
# of the reference, a token we pick greedily is within 2 * BF16_TOL of the
# reference's best (the two errors can point opposite ways): a near-tie.
BF16_TOL = 0.125
NEAR_TIE = 2 * BF16_TOL


def _on_device(llm: LLM, fn: Any) -> Any:
    """Run `fn` on the engine's device thread (its CUDA stream), as steps do."""
    return llm.engine.executor.call(fn)


def _our_log_softmax(llm: LLM, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    logits = _on_device(llm, lambda: engine_logits(llm, tokens, chunks).float().cpu())
    return torch.log_softmax(logits, dim=-1)


def _mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 8000, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


# -- parity with transformers on the same GPU ----------------------------------------


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_equals_transformers(cuda_llm, arch: str, attention: str) -> None:
    """float32: the same greedy tokens as transformers on this GPU, at batch 1
    and 8 (mixed prompt lengths), with our default attention (Triton on CUDA)
    and with the torch fallback; logits within FP32_ATOL, one long prefill and
    chunked prefill with decode tokens through the paged cache."""
    llm = cuda_llm(arch, dtype="float32", attention=attention)
    assert llm.engine.attention_choice.name == ("triton" if attention == "auto" else "torch")
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    single = prompts(1, seed=7)
    assert llm.generate(single, params)[0].token_ids == hf_cuda_greedy(arch, single[0])
    batch = prompts(8)
    for prompt, res in zip(batch, llm.generate(batch, params), strict=True):
        assert res.token_ids == hf_cuda_greedy(arch, prompt)
        assert res.finish_reason == "length"
    tokens = prompts(2)[1]  # 60 tokens
    ref = hf_cuda_log_softmax(arch, tokens, "float32")
    for chunks in ([60], [20, 33, 1, 1, 5]):
        torch.testing.assert_close(_our_log_softmax(llm, tokens, chunks), ref, atol=FP32_ATOL, rtol=0)


# Checkpoint variants whose attention or rotation differs from their preset's:
# (preset, config overrides, prompts).
VARIANTS: dict[str, tuple[str, dict[str, Any], list[list[int]]]] = {
    # Every layer sees its last 12 keys; prompts up to 60 tokens on 4-token pages.
    "sliding-window": ("tiny-mistral", {"sliding_window": 12}, prompts(4)),
    # Phi-4-mini's rotation: 3/4 of each head turns, by longrope's long
    # factors (every prompt is past the 32-position pretraining length).
    "partial-longrope": ("tiny-phi3", PHI4_MINI_LIKE, LONG_PROMPTS),
}


@pytest.mark.parametrize("cuda_graphs", ["auto", "off"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_variant_greedy_equals_transformers(tmp_path: Path, variant: str, cuda_graphs: str) -> None:
    """The same greedy tokens as transformers on this GPU, through the Triton
    kernels (graphs and eager)."""
    preset, overrides, batch = VARIANTS[variant]
    path, model = variant_checkpoint(preset, overrides, tmp_path / variant)
    model = model.cuda()
    llm = LLM(str(path), device="cuda", dtype="float32", page_size=4, kv_cache_gib=0.25, cuda_graphs=cuda_graphs)
    try:
        assert llm.engine.attention_choice.name == "triton"
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for prompt, res in zip(batch, llm.generate(batch, params), strict=True):
            assert res.token_ids == list(greedy_argmax(model, tuple(prompt), 24, device="cuda"))
    finally:
        llm.close()


@pytest.mark.parametrize("page_size", [1, 7, 64])
def test_any_page_size_the_server_accepts(cuda_llm, page_size: int) -> None:
    """Page sizes at both ends of what the server accepts (1 to 64) and one
    that divides nothing: the start-up probe passes the Triton kernels for it,
    and float32 greedy tokens equal transformers', graphs and chunked prefill
    included (a prompt longer than the chunk budget)."""
    llm = cuda_llm("tiny-llama", dtype="float32", page_size=page_size, max_num_batched_tokens=48)
    assert llm.engine.attention_choice.name == "triton", llm.engine.attention_choice.reason
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    batch = prompts(3)
    for prompt, res in zip(batch, llm.generate(batch, params), strict=True):
        assert res.token_ids == hf_cuda_greedy("tiny-llama", prompt, new_tokens=24)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_16bit_close_to_transformers(cuda_llm, arch: str, dtype: str) -> None:
    """bfloat16 (the CUDA default) and float16: log-probabilities within
    BF16_TOL of transformers' in the same dtype and no further from the fp32
    truth than twice transformers' own error in it (+0.03); greedy tokens,
    teacher-forced through transformers, are its argmax or a near-tie (2 *
    BF16_TOL), and exactly its argmax at >= 90 % of positions (bf16 on CPU:
    127 of 128). float16 keeps 3 more bits than bfloat16, so the bf16 bounds
    hold it with room; the bound relative to transformers' own error scales
    with the dtype."""
    llm = cuda_llm(arch, dtype=dtype)
    tokens = prompts(2)[1]
    ref = hf_cuda_log_softmax(arch, tokens, dtype)
    truth = hf_cuda_log_softmax(arch, tokens, "float32")
    hf_error = float((ref - truth).abs().max())
    for chunks in ([60], [20, 33, 1, 1, 5]):
        ours = _our_log_softmax(llm, tokens, chunks)
        diff = float((ours - ref).abs().max())
        assert diff <= BF16_TOL, f"{chunks}: log-softmax differs by {diff:.4f} from transformers' {dtype}"
        ours_error = float((ours - truth).abs().max())
        assert ours_error <= 2 * hf_error + 0.03, (ours_error, hf_error)

    new = 16
    batch = prompts(8)
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
    exact = total = 0
    for prompt, out in zip(batch, outs, strict=True):
        assert len(out.token_ids) == new
        lp = hf_cuda_log_softmax(arch, prompt + out.token_ids, dtype)[len(prompt) - 1:len(prompt) - 1 + new]
        chosen = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        gaps = lp.max(dim=1).values - chosen
        assert float(gaps.max()) <= NEAR_TIE, f"a greedy token {float(gaps.max()):.3f} below transformers' best"
        exact += int((gaps == 0).sum())
        total += new
    assert exact >= 0.9 * total, f"only {exact} of {total} greedy tokens are transformers' argmax"


# -- graphs and overlap change no token ----------------------------------------------


def _params(dtype: str, n: int) -> list[SamplingParams]:
    """Lengths 4 + i, so a batch shrinks through the graph buckets as requests
    end. float32: every third row greedy, the others seeded sampling; 16-bit:
    greedy (a near-tie can be checked from log-probabilities, a draw cannot)."""
    return [SamplingParams(temperature=0.0 if dtype != "float32" or i % 3 == 0 else 0.8, seed=i,
                           max_new_tokens=4 + i, ignore_eos=True, logprobs=5) for i in range(n)]


def _assert_same_tokens(got: Sequence[CompletionOutput], want: Sequence[CompletionOutput], dtype: str) -> None:
    """float32: identical tokens, log-probabilities within FP32_ATOL. 16-bit:
    identical up to a first difference, where both runs had seen the same
    tokens: the other run's token must be a near-tie in this run's
    distribution; log-probabilities before it within BF16_TOL."""
    tol = FP32_ATOL if dtype == "float32" else BF16_TOL
    for g, w in zip(got, want, strict=True):
        assert g.logprobs is not None and w.logprobs is not None
        assert len(g.token_ids) == len(w.token_ids)
        if dtype == "float32":
            assert g.token_ids == w.token_ids
        first = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True)) if a != b),
                     len(g.token_ids))
        for a, b in zip(g.logprobs[:first], w.logprobs[:first], strict=True):
            assert abs(a.logprob - b.logprob) <= tol, (a, b)
        if first < len(g.token_ids):
            top = dict(w.logprobs[first].top)
            other = g.token_ids[first]
            assert other in top and top[other] >= w.logprobs[first].logprob - NEAR_TIE, \
                f"tokens differ at {first} beyond a near-tie: {g.logprobs[first]} vs {w.logprobs[first]}"


@pytest.mark.parametrize(("preset", "dtype"), [("tiny-llama", "float32"), ("tiny-llama", "bfloat16"),
                                               ("tiny-llama", "float16"), ("tiny-mixtral", "float32"),
                                               ("tiny-qwen2-moe", "bfloat16")])
def test_graphs_and_eager_give_the_same_tokens(cuda_llm, preset: str, dtype: str) -> None:
    """cuda_graphs="auto" (captured) against "off", batches of 1, 3, 9 and 17
    with max_num_seqs=20: every bucket (1, 2, 4, 8, 16, 20) is replayed. The
    mixtures of experts group their tokens on the device, inside the graphs."""
    graphs = cuda_llm(preset, dtype=dtype, max_num_seqs=20)
    eager = cuda_llm(preset, dtype=dtype, max_num_seqs=20, cuda_graphs="off")
    assert graphs.engine.graphs is not None and graphs.engine.graphs.capture
    assert all(mlp.grouped_on_device for mlp in graphs.engine.model.sparse_mlps())
    assert eager.engine.graphs is None
    batch = _mixed_prompts(17)
    params = _params(dtype, len(batch))
    for size in (1, 3, 9, 17):
        _assert_same_tokens(graphs.generate(batch[:size], params[:size]),
                            eager.generate(batch[:size], params[:size]), dtype)
    used = set(graphs.engine.graphs.replays)
    assert {1, 2, 4, 8, 16, 20} <= used, used


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlap_on_and_off_give_the_same_tokens(cuda_llm, dtype: str) -> None:
    """overlap=True against False (graphs on in both), the same batches; in
    float32 a quarter of the rows also follow a JSON schema, whose masks are
    filled while the next step already runs on the GPU."""
    on = cuda_llm("tiny-llama", dtype=dtype, max_num_seqs=20, overlap=True)
    off = cuda_llm("tiny-llama", dtype=dtype, max_num_seqs=20, overlap=False)
    batch = _mixed_prompts(17, seed=1)
    params = _params(dtype, len(batch))
    for size in (1, 3, 9, 17):
        _assert_same_tokens(on.generate(batch[:size], params[:size]),
                            off.generate(batch[:size], params[:size]), dtype)
    if dtype == "float32":
        spec = GrammarSpec.json_schema(json.dumps(PERSON))
        constraint = [spec if i % 4 == 0 else None for i in range(len(batch))]
        longer = [dataclasses.replace(p, max_new_tokens=60, ignore_eos=False) for p in params]
        a = on.generate(batch, longer, constraint=constraint)
        b = off.generate(batch, longer, constraint=constraint)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert any(o.forced_tokens for o in a)


# -- structured output ----------------------------------------------------------------

PATTERN = r"order-[0-9]{3}: (shipped|held|cancelled)"


def _full_match(pattern: str, text: str) -> bool:
    """Whether `text` matches all of `pattern`, by the Rust regex crate (regex_rs,
    a dev tool not in pyproject's extras) when installed, else by `re` (the
    same answer for these patterns)."""
    try:
        from regex_rs import Regex
    except ImportError:
        return re.fullmatch(pattern, text) is not None
    return bool(Regex(rf"\A(?:{pattern})\z").is_match(text))


def test_structured_output_masks_on_the_gpu(cuda_llm, monkeypatch) -> None:
    """A JSON schema and a regex (bf16, graphs and overlap on): every output is
    valid (jsonschema; the Rust regex crate, anchored), uses forced tokens,
    and every mask was applied to logits on the GPU, graph steps included,
    from a pinned bitmask and a pinned row index (asynchronous copies: the
    device thread never waits for the forward pass to apply a mask), by the
    Triton mask kernel where the pointwise kernels are Triton's."""
    llm = cuda_llm("tiny-llama", max_num_seqs=20)
    eng = llm.engine
    assert eng.graphs is not None
    if eng.ops_choice.startswith("triton"):
        assert eng.masks.apply is step_masks._apply_with_triton
    devices: list[str] = []
    staged: set[bool] = set()
    real_apply = eng.masks.apply

    def recording(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
        devices.append(logits.device.type)
        staged.add(bitmask.is_pinned() and isinstance(rows, torch.Tensor) and rows.is_pinned())
        real_apply(logits, bitmask, rows)

    monkeypatch.setattr(eng.masks, "apply", recording)
    n = 9
    temps = [0.0, 0.7, 1.0]
    params = [SamplingParams(temperature=temps[i % 3], seed=i, max_new_tokens=80) for i in range(n)]
    outs = llm.generate([f"person {i}" for i in range(n)], params,
                        constraint=GrammarSpec.json_schema(json.dumps(PERSON)))
    for out in outs:
        assert out.finish_reason == "eos", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.forced_tokens > 0
    outs = llm.generate([f"order {i}" for i in range(n)],
                        [dataclasses.replace(p, max_new_tokens=30) for p in params],
                        constraint=GrammarSpec.regex(PATTERN))
    for out in outs:
        assert out.finish_reason == "eos" and _full_match(PATTERN, out.text), out.text
        assert out.forced_tokens > 0
    # Free words force nothing: these decode steps replay graphs, and their
    # masks are applied to the graph's logits. (Forced runs above are fed a
    # token per step with graphs on, so those steps replay graphs too.)
    replays_before = sum(eng.graphs.replays.values())
    words = r"[a-z]{6,12}( [a-z]{6,12}){3}"
    outs = llm.generate(["words", "more words"], SamplingParams(temperature=0.0, max_new_tokens=60),
                        constraint=GrammarSpec.regex(words))
    assert all(o.finish_reason == "eos" and _full_match(words, o.text) for o in outs)
    assert sum(eng.graphs.replays.values()) > replays_before, "no constrained decode step replayed a graph"
    assert devices and set(devices) == {"cuda"}, set(devices)
    assert staged == {True}, "a mask reached the device thread in pageable memory, or its rows as a list"


@pytest.mark.parametrize("config", ["default", "multi-step", "experts"])
def test_steps_make_no_synchronising_call(cuda_llm, monkeypatch, config: str) -> None:
    """Once warm, no engine step makes a call that waits for the GPU, on the
    device thread (prefill, eager and graph decode, a JSON schema's masks,
    sampling with penalties, bias and log-probabilities; or, with overlap off,
    several decode steps a schedule; a mixture of experts' layers) or on the
    engine thread (scheduling, postprocessing, prompt log-probabilities of
    prompt chunks that sample nothing): `torch.cuda.set_sync_debug_mode("error")`
    (process-wide) is on while each `EngineCore.step` runs, so `.item()`,
    `.tolist()`, `.cpu()`, a copy that synchronises, `nonzero` and the like raise. The host waits only
    where the engine thread reads what a step handed back (an event). The CPU
    twins, which cannot see a synchronising copy, are
    tests/engine/test_stream_order.py::test_device_thread_reads_no_tensor_value_during_a_step
    and ::test_engine_thread_reads_step_results_only_through_their_host_copy."""
    from engine import pipeline as pipeline_module

    multi = config == "multi-step"
    # 32 tokens a step: the longer prompts prefill in chunks, some steps sampling nothing.
    # "experts": a mixture of experts (and a shared expert), grouped on the device.
    llm = cuda_llm("tiny-qwen2-moe" if config == "experts" else "tiny-llama", max_num_seqs=8,
                   max_num_batched_tokens=32, **({"overlap": False, "num_steps": 4} if multi else {}))
    sampled = dataclasses.replace(EVERY_OPTION, max_new_tokens=16, prompt_logprobs=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    params = [sampled, greedy, sampled, greedy, greedy]
    schema = GrammarSpec.json_schema(json.dumps(PERSON))
    # A masked row takes one step a schedule: the multi-step run goes unconstrained.
    constraint = [schema if i % 2 and not multi else None for i in range(len(params))]
    batch = [[7] * 70, *_mixed_prompts(len(params) - 1, seed=3)]  # a 70-token prompt: three chunks

    def run() -> list[CompletionOutput]:
        return llm.generate(batch, params, constraint=constraint)

    warm = run()  # warm: kernels compiled, the schema compiled, buffers allocated
    real_run_step, real_step = pipeline_module.run_step, llm.engine.step
    steps: list[str] = []

    def recorded(inputs, *args, **kwargs):  # noqa: ANN001, ANN202
        steps.append("graph" if inputs.graph else f"eager x{inputs.num_steps}")
        return real_run_step(inputs, *args, **kwargs)

    def checked():  # noqa: ANN202
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(pipeline_module, "run_step", recorded)
    monkeypatch.setattr(llm.engine, "step", checked)
    outs = run()
    assert all(len(o.token_ids) for o in outs)
    # The first prompt's log-probabilities, one a token after the first, as in the warm run.
    lp = outs[0].prompt_logprobs
    assert lp is not None and len(lp) == 70 and lp[0] is None
    got = [e for e in lp[1:] if e is not None]
    assert len(got) == 69 and all(len(e.top) == 2 for e in got)
    assert warm[0].prompt_logprobs is not None
    want = [e.logprob for e in warm[0].prompt_logprobs[1:] if e is not None]
    assert [e.logprob for e in got] == pytest.approx(want, abs=1e-4) and len(want) == 69
    if multi:
        assert any(s.startswith("eager x") and s != "eager x1" for s in steps), steps
    else:
        assert "graph" in steps and "eager x1" in steps, steps


# -- speech and embeddings --------------------------------------------------------------


@contextmanager
def _no_tf32() -> Iterator[None]:
    """float32 matmuls and cuDNN convolutions in full precision (process-wide
    flags, so the device thread sees them too), restored afterwards."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32, cudnn.allow_tf32 = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def test_speech_on_cuda_equals_cpu(cuda_llm, make_llm) -> None:
    """demo-speech with the tiny codec, float32 on CUDA against the CPU: the
    same codes (seeded sampling: per-request uniforms hashed on the host), and
    audio within STREAM_BOUND. TF32 is turned off for the comparison: PyTorch
    lets cuDNN convolutions use TF32 by default, whose 10-bit mantissa alone
    would put SNAC's samples ~1e-3 apart."""
    codec = str(ensure_preset("tiny-codec"))
    gpu = cuda_llm("demo-speech", speech_codec=codec, dtype="float32")
    cpu = make_llm("demo-speech", speech_codec=codec)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, repetition_penalty=1.1)
    texts = ["The GPU speaks.", "A second, longer line of speech on the device."]
    with _no_tf32():
        got = gpu.synthesize(texts, params, max_audio_seconds=1.0, chunk_frames=3)
    want = cpu.synthesize(texts, params, max_audio_seconds=1.0, chunk_frames=3)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.audio.shape == w.audio.shape and len(g.audio) > 0
        assert float(np.abs(g.audio - w.audio).max()) < STREAM_BOUND


def test_embeddings_on_cuda_match_cpu(tmp_path: Path) -> None:
    """A tiny random BERT written here (demo tokenizer, mean pooling): float32
    embeddings on CUDA within 1e-4 of the CPU's, normalized and raw."""
    from engine.embedding import EmbeddingConfig, EmbeddingPipeline

    root = write_tiny_bert(tmp_path / "bert")
    cpu = EmbeddingPipeline(EmbeddingConfig(model=str(root)))
    gpu = EmbeddingPipeline(EmbeddingConfig(model=str(root), device="cuda", dtype="float32"))
    texts = ["a", "Hi!", "The quick brown fox jumps over the lazy dog.",
             "Straße, Ünïcödé — naïve café; 日本語のテキスト",
             "one two three four five six seven eight nine ten " * 8]  # truncated to 64 tokens
    for normalize in (True, False):
        ours, tokens = gpu.embed(texts, normalize=normalize, truncate=True)
        ref, ref_tokens = cpu.embed(texts, normalize=normalize, truncate=True)
        assert tokens == ref_tokens and ours.shape == ref.shape == (len(texts), 32)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_embeddings_beside_generation_on_the_shared_device_thread(cuda_llm, tmp_path: Path) -> None:
    """The server's arrangement: the embedding model on the generation engine's
    device thread (on a stream of its own), batched by an EmbeddingBatcher whose
    passes hold one long text each, so a request spans several passes joined
    after them, while the engine generates on the same thread: every vector
    within 1e-4 of the CPU's, and the generation unchanged by it."""
    import threading

    from engine.embedding import EmbeddingBatcher, EmbeddingConfig, EmbeddingPipeline
    from service.api.embeddings import DevicePipeline

    llm = cuda_llm("tiny-llama", dtype="float32")
    root = write_tiny_bert(tmp_path / "bert")
    cpu = EmbeddingPipeline(EmbeddingConfig(model=str(root)))
    executor = llm.engine.executor
    gpu = executor.call(lambda: EmbeddingPipeline(EmbeddingConfig(model=str(root), device="cuda",
                                                                  dtype="float32")))
    texts = [f"text {i}: " + "one two three four five six seven eight nine ten " * 8 for i in range(5)]
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts()[:4], params)]
    beside: list[list[int]] = []
    runner = threading.Thread(target=lambda: beside.extend(o.token_ids for o in llm.generate(prompts()[:4], params)))
    with EmbeddingBatcher(DevicePipeline(gpu, executor), max_batch_tokens=64) as batcher:  # type: ignore[arg-type]
        runner.start()
        futures = [batcher.submit(texts, truncate=True) for _ in range(3)]
        got = [f.result(timeout=120) for f in futures]
        runner.join(120)
    assert batcher.forward_passes >= 2 * len(futures)
    ref, ref_tokens = cpu.embed(texts, truncate=True)
    for vectors, tokens in got:
        assert tokens == ref_tokens
        np.testing.assert_allclose(vectors, ref, atol=1e-4, rtol=0)
    assert beside == alone


# -- start-up choices and the stream order ----------------------------------------------


def test_batch1_gemv_is_chosen_by_timing_and_agrees_with_cublas(cuda_llm) -> None:
    """bfloat16 on CUDA: the start-up timed every weight shape (the log line
    names each), and each linear layer's one-row product, cuBLAS's or the
    Triton kernel's, agrees with F.linear to bfloat16 rounding; the same holds
    for 8B-shaped weights timed here. Where the Triton kernel serves, its gated
    form (SiLU x up taken in) agrees with the activation kernel followed by it."""
    from engine.kernels import triton_gemv
    from engine.models.linear import Linear

    llm = cuda_llm("tiny-llama", dtype="bfloat16")
    layers = llm.engine.model.linears()
    assert llm.engine.gemv_choice.startswith("batch-1 GEMV: triton for ")
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = [Linear(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5)
           for n, k in ((6144, 4096), (28672, 4096), (4096, 14336))]
    line = triton_gemv.install(big, torch.device("cuda"), torch.bfloat16)
    assert all(f"{n}x{k}:" in line for n, k in ((6144, 4096), (28672, 4096), (4096, 14336))), line
    for lin in [*layers, *big]:
        assert lin.weight is not None
        x = torch.randn(1, lin.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias).float()
        got = lin(x).float()
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), (lin.gemv, lin.weight.shape)
        if lin.gemv is not None:  # the down projection's one-kernel form gives the two-kernel result
            from engine.kernels import triton_ops

            gate_up = torch.randn(1, 2 * lin.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
            fused, two = lin.gated_row(gate_up), lin(triton_ops.silu_mul(gate_up))
            assert fused is not None
            # Bit for bit in the interpreter (tests/engine/test_triton_gemv.py); here the
            # compiler may contract the activation differently in the two kernels.
            assert torch.allclose(fused.float(), two.float(), rtol=1e-2, atol=1e-2 * float(two.abs().max()))


def test_startup_choices_and_pinned_step_inputs(cuda_llm, caplog) -> None:
    """On CUDA with Triton: the log says "attention: triton" and "decode graphs
    (captured)", a batch-1 decode replays bucket 1, and every host tensor of a
    built StepInputs (prefill and decode, a sampling row with every option and
    prompt log-probabilities) is pinned memory, so its upload is asynchronous
    (KVCacheInputs.max_lengths aside: host data, never uploaded); the only
    device tensors in it are views of the page tensor."""
    caplog.set_level(logging.INFO, logger="engine")
    llm = cuda_llm("tiny-llama")
    eng = llm.engine
    assert "attention: triton" in caplog.text
    assert "decode graphs (captured)" in caplog.text
    assert eng.attention_choice.name == "triton"
    assert eng.graphs is not None and eng.graphs.capture
    # The pages start zeroed (engine.py): slots no request wrote are finite.
    assert bool(torch.isfinite(eng.kv_manager.kv_blocks).all())
    llm.generate(prompts(1), SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert eng.graphs.replays[1] > 0

    params = [SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9, min_p=0.05, logit_bias={7: 2.0},
                             repetition_penalty=1.2, frequency_penalty=0.5, min_new_tokens=2, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0)]
    contexts = [eng.make_context(p, sp) for p, sp in zip(prompts(2), params, strict=True)]
    pipe = eng.pipeline
    for ctx in contexts:
        eng.kv_manager.claim(ctx)
        assert eng.kv_manager.reserve(ctx, ctx.end_idx + 1)
    kv_storage = eng.kv_manager.kv_blocks.untyped_storage().data_ptr()
    try:
        prefill = build_step_inputs(contexts, 1, eng.kv_manager, pipe.buffer, eng.attention, eng.vocab_size,
                                    pipe.staging, pipe.graphs)
        advance_with_placeholders(contexts, prefill)
        decode = build_step_inputs(contexts, 1, eng.kv_manager, pipe.buffer, eng.attention, eng.vocab_size,
                                   pipe.staging, pipe.graphs)
        assert decode.graph
        for inputs in (prefill, decode):
            # KVCacheInputs.max_lengths is host data by contract (kv_cache/manager.py):
            # the host plans from it and no step uploads it.
            tensors = [t for t in step_tensors(inputs) if t is not inputs.kv.max_lengths]
            host = [t for t in tensors if t.device.type == "cpu"]
            device = [t for t in tensors if t.device.type != "cpu"]
            assert host
            assert all(t.untyped_storage().data_ptr() == kv_storage for t in device), \
                "a step's inputs hold a device tensor other than the page tensor"
            # An empty tensor has no memory to pin (and nothing to upload).
            unpinned = [(tuple(t.shape), t.dtype) for t in host if t.numel() and not t.is_pinned()]
            assert not unpinned, f"host tensors not in pinned memory: {unpinned}"
    finally:
        for ctx in contexts:
            ctx.drop_futures()
            pipe.release(ctx)


def test_gpu_memory_utilization_sizes_the_cache_within_its_share(cuda_llm) -> None:
    """`gpu_memory_utilization` (vLLM's flag): the KV cache takes what the share
    leaves once the model is loaded, less the estimate of a step's peak
    (engine/memory.py); a step at the largest batch with every sampling option
    and prompt log-probabilities then runs, and the process stays within the share."""
    total = torch.cuda.mem_get_info()[1]
    share = 0.5
    llm = cuda_llm("tiny-llama", gpu_memory_utilization=share, max_num_seqs=16)
    kv = llm.engine.kv_manager.kv_blocks
    kv_bytes = kv.numel() * kv.element_size()
    assert kv_bytes > 0.1 * share * total, "the cache took far less than its share"
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                            logprobs=2, prompt_logprobs=1, max_new_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts(8) * 2, params)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert torch.cuda.max_memory_reserved() <= share * total, "the engine's tensors outgrew their share"
