"""One stream order: phase 1 (the engine thread) builds host tensors only, and
the device thread alone moves them to the device (engine/staging.py), so on
CUDA every copy and kernel of a step runs on the executor's stream.

Guarded six ways on CPU: building a step's inputs never calls `Tensor.to`
or `Tensor.cuda`; every tensor of the built inputs is one `upload` reaches
(uploading to the meta device leaves none behind on the host); with the
backends a GPU runs, every host tensor a step uploads was made by `Staging`
(page-locked on CUDA, so its copy is asynchronous); `upload` runs
on the device thread only; the grammar mask (bitmask and rows) reaches the
device thread as staged host buffers, page-locked for CUDA; and while the
device thread runs a step it reads no tensor's value on the host (on CUDA
such a read waits for the forward pass in flight)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine import SamplingParams
from engine import pipeline as pipeline_module
from engine import step_run as step_run_module
from engine.staging import Staging, upload
from engine.step_inputs import advance_with_placeholders, build_step_inputs
from engine.step_masks import PendingMask, StepMasks
from grammar import GrammarSpec

from .reference import prompts

SCHEMA = GrammarSpec.json_schema(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def step_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor `upload` walks to (dataclass fields, tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from step_tensors(getattr(obj, f.name))
    elif isinstance(obj, tuple | list):
        for v in obj:
            yield from step_tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from step_tensors(v)


def _forbid_device_moves(monkeypatch) -> None:
    def refuse(self, *args, **kwargs):  # noqa: ANN001
        raise AssertionError("phase 1 moved a tensor: only the device thread's upload may")

    monkeypatch.setattr(torch.Tensor, "to", refuse)
    monkeypatch.setattr(torch.Tensor, "cuda", refuse)


@pytest.mark.parametrize(("attention", "cuda_graphs"), [("auto", "off"), ("torch", "off"), ("triton", "off"),
                                                        ("auto", "emulate")])
def test_phase_one_builds_host_tensors_only(make_llm, monkeypatch, attention: str, cuda_graphs: str) -> None:
    llm = make_llm("tiny-llama", attention=attention, cuda_graphs=cuda_graphs, kv_cache_gib=0.05)
    eng = llm.engine
    matcher = eng.structured.compile(SCHEMA)
    params = [SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9, min_p=0.05, logit_bias={7: 2.0},
                             repetition_penalty=1.2, frequency_penalty=0.5, min_new_tokens=2, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0)]
    contexts = [eng.make_context(p, sp, matcher=matcher if i else None)
                for i, (p, sp) in enumerate(zip(prompts(2), params, strict=True))]
    for ctx in contexts:
        eng.kv_manager.claim(ctx)
        assert eng.kv_manager.reserve(ctx, ctx.end_idx + 1)
    pipe = eng.pipeline
    with monkeypatch.context() as m:
        _forbid_device_moves(m)
        prefill = build_step_inputs(contexts, 1, eng.kv_manager, pipe.buffer, eng.attention, eng.vocab_size,
                                    pipe.staging, pipe.graphs)
        advance_with_placeholders(contexts, prefill)
        decode = build_step_inputs(contexts, 1, eng.kv_manager, pipe.buffer, eng.attention, eng.vocab_size,
                                   pipe.staging, pipe.graphs)
    assert decode.graph == (cuda_graphs == "emulate")
    assert decode.future_rows.numel() == 2, "the decode step reads both tokens from the token buffer"
    for inputs in (prefill, decode):
        host = [t for t in step_tensors(inputs) if t is not eng.kv_manager.kv_blocks]
        assert host and all(t.device.type == "cpu" for t in host)
        moved = upload(inputs, torch.device("meta"))
        left = [t for t in step_tensors(moved) if t.device.type == "cpu"]
        assert not left, f"{len(left)} host tensors the upload does not reach"
    for ctx in contexts:
        ctx.drop_futures()
        pipe.release(ctx)


@pytest.mark.parametrize(("attention", "cuda_graphs"), [("torch", "off"), ("triton", "off"), ("torch", "emulate"),
                                                        ("triton", "emulate")])
def test_what_a_step_uploads_is_staged(make_llm, monkeypatch, attention: str, cuda_graphs: str) -> None:
    # With the backends a GPU runs, every host tensor of a step that the device
    # thread uploads came from `Staging` (page-locked on CUDA: an asynchronous
    # copy). The KVCacheInputs beside them is the host's plan, never uploaded:
    # a backend's metadata that carried it would upload its `max_lengths`, a
    # pageable tensor, with a synchronous copy on CUDA.
    staged: set[int] = set()
    for name in ("tensor", "buffer"):
        made = getattr(Staging, name)

        def recording(self, *args, _made=made, **kwargs):  # noqa: ANN001
            t = _made(self, *args, **kwargs)
            staged.add(t.untyped_storage().data_ptr())
            return t

        monkeypatch.setattr(Staging, name, recording)
    # Few graph buckets: the emulated capture runs each once (in Triton's interpreter here).
    llm = make_llm("tiny-llama", attention=attention, cuda_graphs=cuda_graphs, kv_cache_gib=0.05, max_num_seqs=4)
    eng = llm.engine
    params = SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9, logit_bias={7: 2.0},
                            repetition_penalty=1.2, min_new_tokens=2, logprobs=2, prompt_logprobs=1)
    contexts = [eng.make_context(p, params) for p in prompts(2)]
    for ctx in contexts:
        eng.kv_manager.claim(ctx)
        assert eng.kv_manager.reserve(ctx, ctx.end_idx + 1)
    pipe = eng.pipeline
    prefill = build_step_inputs(contexts, 1, eng.kv_manager, pipe.buffer, eng.attention, eng.vocab_size,
                                pipe.staging, pipe.graphs)
    advance_with_placeholders(contexts, prefill)
    decode = build_step_inputs(contexts, 1, eng.kv_manager, pipe.buffer, eng.attention, eng.vocab_size,
                               pipe.staging, pipe.graphs)
    for inputs in (prefill, decode):
        uploaded = [t for f in dataclasses.fields(inputs) if f.name != "kv"
                    for t in step_tensors(getattr(inputs, f.name))
                    if t.device.type == "cpu" and t.numel() and t is not eng.kv_manager.kv_blocks]
        assert uploaded
        loose = [(tuple(t.shape), t.dtype) for t in uploaded if t.untyped_storage().data_ptr() not in staged]
        assert not loose, f"host tensors a step uploads that Staging did not make: {loose}"
    for ctx in contexts:
        ctx.drop_futures()
        pipe.release(ctx)


def test_staging_pins_for_cuda_only() -> None:
    assert not Staging(torch.device("cpu")).pin
    assert Staging(torch.device("cuda")).pin
    assert upload((t := torch.ones(2)), torch.device("cpu")) is t


def test_uploads_run_on_the_device_thread(make_llm, monkeypatch) -> None:
    threads: set[str] = set()
    real = step_run_module.upload

    def recording(obj, device):  # noqa: ANN001
        threads.add(threading.current_thread().name)
        return real(obj, device)

    monkeypatch.setattr(step_run_module, "upload", recording)
    for overlap in (True, False):
        llm = make_llm("tiny-llama", overlap=overlap, kv_cache_gib=0.05)
        llm.generate(prompts(3), SamplingParams(temperature=0, max_new_tokens=4))
    assert threads == {"stencild-device"}


@pytest.mark.parametrize("batch", [1, 3])
def test_grammar_mask_is_staged_for_the_device_thread(make_llm, monkeypatch, batch: int) -> None:
    # On CUDA the bitmask and the masked rows reach the device thread as
    # page-locked host tensors (an asynchronous copy); a list of rows, or a
    # pageable bitmask, would make the device thread wait for the forward pass.
    pinned: list[int] = []

    def pin(self):  # noqa: ANN001 - stands in for page-locking, which needs CUDA
        pinned.append(self.data_ptr())
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    llm = make_llm("tiny-llama", kv_cache_gib=0.05)
    eng = llm.engine
    contexts = [eng.make_context(p, SamplingParams(temperature=0), matcher=eng.structured.compile(SCHEMA))
                for p in prompts(batch)]
    staged = StepMasks(eng.structured, eng.vocab_size, Staging(torch.device("cuda")))
    plain = StepMasks(eng.structured, eng.vocab_size, Staging(torch.device("cpu")))
    # One row alone takes the one-row fill; a batch has an unconstrained row 0.
    rows_of = [None, *contexts] if batch > 1 else contexts
    expected = [i for i, c in enumerate(rows_of) if c is not None]
    for _ in range(2):
        on_cuda, on_cpu = PendingMask(), PendingMask()
        staged.fill(on_cuda, rows_of)
        plain.fill(on_cpu, rows_of)
        bitmask, rows = on_cuda._bitmask, on_cuda._rows
        assert isinstance(rows, torch.Tensor) and rows.tolist() == expected
        assert on_cpu._rows == expected
        assert bitmask is not None and on_cpu._bitmask is not None
        assert torch.equal(bitmask[expected], on_cpu._bitmask[expected])
        assert len(pinned) == 2, "the bitmask and the row index are pinned once, when allocated"
        assert {bitmask.untyped_storage().data_ptr(), rows.untyped_storage().data_ptr()} == set(pinned)
        logits = torch.randn(len(rows_of), eng.vocab_size)
        listed = logits.clone()
        on_cuda.apply(logits, staged.apply)  # the grammar package's tensor ops
        on_cpu.apply(listed, plain.apply)  # the CPU extension's kernel
        assert torch.equal(logits, listed)


# Ways Python code turns a tensor's value into a host value. On CUDA each one
# waits for the stream (the forward pass in flight), so the device thread
# must never call one while it queues a step: the host reads a step's tokens
# on the engine thread only, through the copy `SamplerOutput.to_host_async`
# starts and its event.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _refuse_host_reads_while(monkeypatch, guarded: threading.local) -> list[str]:
    """Patch `HOST_READS` to refuse (and record) a read on a thread whose
    `guarded.on` is set; other threads read as usual."""
    refused: list[str] = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def read(self, *args, _real=real, _name=name, **kwargs):  # noqa: ANN001, ANN202
            if getattr(guarded, "on", False):
                refused.append(_name)
                raise AssertionError(f"Tensor.{_name} read a value on a thread that must not read one now")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    return refused


# Sampling with every option a step's device work has a path for (with greedy
# rows beside it): the steps the two no-wait tests (here and tests/cuda) run.
EVERY_OPTION = SamplingParams(temperature=0.8, seed=5, top_k=20, top_p=0.9, min_p=0.02, logit_bias={9: 1.5},
                              repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                              min_new_tokens=3, logprobs=2, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("config", [{"cuda_graphs": "off"}, {"cuda_graphs": "emulate"},
                                    {"overlap": False, "num_steps": 4}], ids=["eager", "graphs", "multi-step"])
def test_device_thread_reads_no_tensor_value_during_a_step(make_llm, monkeypatch, config: dict) -> None:
    """While the device thread runs a step (prefill, decode, graph replay,
    several decode steps a schedule, grammar mask, sampling with every
    option), it reads no tensor's value on the host: on CUDA any such read
    would make the thread wait for the forward pass before it can queue the
    mask, the sampling and the next step (tests/cuda checks the same with
    CUDA's own sync detection)."""
    guarded = threading.local()
    refused = _refuse_host_reads_while(monkeypatch, guarded)
    real_run_step, real_sample_step = pipeline_module.run_step, pipeline_module.sample_step
    steps: list[str] = []

    def guarded_run_step(inputs, *args, **kwargs):  # noqa: ANN001, ANN202
        steps.append("graph" if inputs.graph else f"eager x{inputs.num_steps}")
        guarded.on = True
        try:
            return real_run_step(inputs, *args, **kwargs)
        finally:
            guarded.on = False

    def guarded_sample_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a constrained step's second job
        steps.append("sampling")
        guarded.on = True
        try:
            return real_sample_step(*args, **kwargs)
        finally:
            guarded.on = False

    monkeypatch.setattr(pipeline_module, "run_step", guarded_run_step)
    monkeypatch.setattr(pipeline_module, "sample_step", guarded_sample_step)
    llm = make_llm("tiny-llama", kv_cache_gib=0.05, max_num_seqs=8, **config)
    sampled, greedy = EVERY_OPTION, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts(4), [sampled, greedy, sampled, greedy])
    outs += llm.generate(prompts(3), [greedy, sampled, greedy], constraint=SCHEMA)
    assert not refused, refused
    assert all(o.token_ids for o in outs)
    assert "eager x1" in steps and "sampling" in steps
    if config.get("cuda_graphs") == "emulate":
        assert "graph" in steps, "no step replayed the decode graph path"
    if config.get("num_steps", 1) > 1:
        assert any(s.startswith("eager x") and s != "eager x1" for s in steps), "no schedule took several steps"


def test_engine_thread_reads_step_results_only_through_their_host_copy(make_llm, monkeypatch) -> None:
    """What a step hands back (tokens, log-probabilities, prompt log-probabilities,
    a prompt chunk's that samples nothing included) reaches the engine thread
    only through the HostCopy the device thread started: the engine thread reads
    no tensor while it processes a step's result. On CUDA its own reads would be
    queued on its own stream, unordered with the step (tests/cuda's no-sync test
    sees them as synchronising copies)."""
    from engine.postprocess import Postprocessor
    from engine.staging import HostCopy

    guarded = threading.local()
    refused = _refuse_host_reads_while(monkeypatch, guarded)
    real_done, real_arrays = Postprocessor.step_done, HostCopy.arrays

    def step_done(self, *args, **kwargs):  # noqa: ANN001, ANN202
        guarded.on = True
        try:
            return real_done(self, *args, **kwargs)
        finally:
            guarded.on = False

    def arrays(self):  # noqa: ANN001, ANN202
        guarded.on = False
        try:
            return real_arrays(self)
        finally:
            guarded.on = True

    monkeypatch.setattr(Postprocessor, "step_done", step_done)
    monkeypatch.setattr(HostCopy, "arrays", arrays)
    # 16 tokens a step: the 60-token prompt prefills in chunks, the first steps sampling nothing.
    llm = make_llm("tiny-llama", kv_cache_gib=0.05, max_num_seqs=8, max_num_batched_tokens=16)
    params = dataclasses.replace(EVERY_OPTION, prompt_logprobs=2)
    [out] = llm.generate([prompts(2)[1]], params)
    assert not refused, refused
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 60
    assert all(len(e.top) == 2 for e in out.prompt_logprobs[1:])
