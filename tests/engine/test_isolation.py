"""One request's failure ends that request only: faults injected into one request
of a running batch (forward pass, sampling set-up, grammar mask, grammar advance,
detokenizer, audio decoder) leave the others' outputs as they would have been,
and the next request succeeds. No page leaks (the make_llm fixture checks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, RequestFailed, SamplingParams
from engine import step_inputs as step_inputs_module
from engine.postprocess import MAX_FAILED_STEPS, EngineBroken
from engine.presets import ensure_preset
from grammar import GrammarSpec

from .reference import hf_greedy, prompts

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


class PoisonedModel:
    """The real model, except that a forward pass over `poison` raises (every
    one with `always`, only the `at`-th with `at`), writing no keys or values."""

    def __init__(self, real: Any, poison: int | None = None, always: bool = False, at: int | None = None):
        self._real = real
        self.poison = poison
        self.always = always
        self.at = at
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        self.calls += 1
        if self.always or self.calls == self.at or \
                (self.poison is not None and bool((input_ids == self.poison).any())):
            raise RuntimeError("injected fault in the forward pass")
        return self._real.forward(input_ids, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _poison_token(batch: list[list[int]]) -> int:
    """A token id in none of the prompts nor their greedy continuations."""
    used = {t for p in batch for t in p + hf_greedy("tiny-llama", p, NEW_TOKENS)}
    return next(t for t in range(8191, 0, -1) if t not in used)


def _run(llm: LLM, contexts: list) -> dict[str, Any]:
    """Step the engine until the given contexts finish; their final outputs by id."""
    eng = llm.engine
    for ctx in contexts:
        eng.add_request(ctx)
    final: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {c.request_id: [] for c in contexts}
    while eng.has_work():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                out.token_ids = tokens[out.request_id]
                final[out.request_id] = out
    return final


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_breaks_the_forward_pass_fails_alone(make_llm, overlap):
    batch = prompts(5)
    poison = _poison_token(batch)
    llm = make_llm("tiny-llama", overlap=overlap, wrap_model=lambda real: PoisonedModel(real, poison))
    poisoned = batch[:1] + [[*batch[2], poison]] + batch[1:]
    with pytest.raises(RequestFailed) as failed:
        llm.generate(poisoned, GREEDY)
    results = failed.value.outputs
    assert failed.value.failed == [results[1].request_id]
    assert results[1].finish_reason == "error" and "internal error" in (results[1].error or "")
    for prompt, res in zip(batch, results[:1] + results[2:], strict=True):
        assert res.finish_reason == "length"
        assert res.token_ids == hf_greedy("tiny-llama", prompt, NEW_TOKENS)
    # The engine goes on as before.
    after = llm.generate(batch[:2], GREEDY)
    assert [r.token_ids for r in after] == [hf_greedy("tiny-llama", p, 12) for p in batch[:2]]
    assert llm.engine.postprocessor.failed_steps == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_publishes_no_page_it_did_not_write(make_llm, overlap):
    # A 56-token prompt in chunks of 40 and 16: the second pass fails. With
    # overlap the first chunk's results come in while the second is in flight,
    # and publishing the pages up to the request's position then would have
    # put the failed chunk's unwritten page in the prefix cache, for the
    # request's own retry to reuse.
    rng = np.random.default_rng(3)
    batch = [rng.integers(5, 8000, size=56).tolist(), rng.integers(5, 8000, size=24).tolist()]
    llm = make_llm("tiny-llama", overlap=overlap, max_num_batched_tokens=40,
                   wrap_model=lambda real: PoisonedModel(real, at=2))
    outs = llm.generate(batch, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy("tiny-llama", prompt, 8)
    assert llm.engine.postprocessor.failed_steps == 0


def test_a_request_that_breaks_the_step_set_up_fails_alone(make_llm, monkeypatch):
    llm = make_llm("tiny-llama")
    real = step_inputs_module.build_sampling_batch

    def build(contexts, *args):
        if any(c.seed == 666 for c in contexts):
            raise ValueError("injected fault while preparing sampling")
        return real(contexts, *args)

    monkeypatch.setattr(step_inputs_module, "build_sampling_batch", build)
    batch = prompts(4)
    params = [GREEDY, SamplingParams(temperature=0.5, seed=666, max_new_tokens=4), GREEDY, GREEDY]
    with pytest.raises(RequestFailed) as failed:
        llm.generate(batch, params)
    results = failed.value.outputs
    assert [r.finish_reason for r in results] == ["length", "error", "length", "length"]
    for i in (0, 2, 3):
        assert results[i].token_ids == hf_greedy("tiny-llama", batch[i], NEW_TOKENS)


class BrokenMatcher:
    """A real matcher that fails in one operation (`where`)."""

    def __init__(self, real: Any, where: str):
        self._real = real
        self.where = where
        self.backend = "broken" if where == "fill_bitmask" else real.backend

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self.where == "fill_bitmask":
            raise RuntimeError("injected fault in the grammar mask")
        self._real.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.where == "accept_token":
            raise RuntimeError("injected fault in the matcher")
        return self._real.accept_token(token_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.parametrize("where", ["fill_bitmask", "accept_token"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_matcher_fails_only_its_request(make_llm, where, overlap):
    llm = make_llm("tiny-llama", overlap=overlap)
    eng = llm.engine
    spec = GrammarSpec.regex(r"[a-f]{3,8}(-[0-9]{2}){1,3}")
    params = SamplingParams(temperature=0, max_new_tokens=24)
    batch = prompts(3)

    def contexts(broken: bool) -> list:
        made = []
        for i, prompt in enumerate(batch):
            matcher = eng.structured.compile(spec)
            if broken and i == 1:
                matcher = BrokenMatcher(matcher, where)
            made.append(eng.make_context(prompt, params, request_id=f"{broken}-{i}", matcher=matcher))
        return made

    expected = _run(llm, contexts(False))
    got = _run(llm, contexts(True))
    assert got["True-1"].status.name == "ERROR" and "internal error" in got["True-1"].error
    for i in (0, 2):
        assert got[f"True-{i}"].token_ids == expected[f"False-{i}"].token_ids
        assert got[f"True-{i}"].finish_reason == "eos"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_lone_request_whose_mask_fails_ends_alone(make_llm, backend):
    # A step with one constrained row takes its own short path
    # (StepMasks.fill); a mask failure there fails the request, not
    # the engine, which then serves the next request as usual.
    llm = make_llm("tiny-llama", grammar_backend=backend)
    eng = llm.engine
    spec = GrammarSpec.regex(r"[a-f]{3,8}(-[0-9]{2}){1,3}")
    params = SamplingParams(temperature=0, max_new_tokens=24)
    [prompt, other] = prompts(2)
    broken = BrokenMatcher(eng.structured.compile(spec), "fill_bitmask")
    got = _run(llm, [eng.make_context(prompt, params, request_id="lone", matcher=broken)])
    assert got["lone"].status.name == "ERROR" and "internal error" in got["lone"].error
    got = _run(llm, [eng.make_context(other, params, request_id="next", matcher=eng.structured.compile(spec))])
    assert got["next"].finish_reason == "eos"


def test_a_failing_detokenizer_fails_only_its_request(make_llm):
    llm = make_llm("tiny-llama")
    eng = llm.engine
    batch = prompts(3)
    contexts = [eng.make_context(p, GREEDY, request_id=f"d{i}") for i, p in enumerate(batch)]
    for ctx in contexts:
        eng.add_request(ctx)

    def broken(token: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")

    eng.postprocessor._streams["d1"].decoder.step = broken  # type: ignore[union-attr]
    final = _run(llm, [])
    assert final["d1"].status.name == "ERROR" and "decoding the output" in final["d1"].error
    for i in (0, 2):
        assert final[f"d{i}"].finish_reason == "length"
        assert final[f"d{i}"].token_ids == hf_greedy("tiny-llama", batch[i], NEW_TOKENS)


def test_a_failing_audio_decode_fails_only_its_request(make_llm):
    llm = make_llm("demo-speech", speech_codec=str(ensure_preset("tiny-codec")))
    eng = llm.engine
    params = SamplingParams(temperature=0.7, seed=5)

    def speech(tag: str) -> list:
        return [eng.make_speech_context(text, params, request_id=f"{tag}{i}", chunk_frames=2,
                                        max_audio_seconds=0.6)
                for i, text in enumerate(["one line", "another line", "a third"])]

    expected = _run(llm, speech("ok"))
    contexts = speech("bad")
    real_window: Callable = contexts[1].next_speech_tokens

    def poisoned_window(*args: Any, **kwargs: Any):
        window = real_window(*args, **kwargs)
        if window is not None:
            window.codes[:] = -1  # codes the decoder cannot look up
        return window

    contexts[1].next_speech_tokens = poisoned_window  # type: ignore[method-assign]
    audio: dict[str, list[np.ndarray]] = {}
    for ctx in contexts:
        eng.add_request(ctx)
    final = {}
    while eng.has_work():
        for out in eng.step():
            if out.audio is not None:
                audio.setdefault(out.request_id, []).append(out.audio)
            if out.finished:
                final[out.request_id] = out
    assert final["bad1"].status.name == "ERROR" and "decoding audio" in final["bad1"].error
    for i in (0, 2):
        assert final[f"bad{i}"].finish_reason == expected[f"ok{i}"].finish_reason
        ours = np.concatenate(audio[f"bad{i}"])
        assert ours.shape[0] > 0
    assert eng.allocator.num_used == 0


def test_steps_that_fail_whatever_runs_in_them_break_the_engine():
    llm = LLM(ensure_preset("tiny-llama"), kv_cache_gib=0.05,
              wrap_model=lambda real: PoisonedModel(real, -1, always=True))
    try:
        # A few requests: each fails alone, and the engine goes on; the call
        # raises, as it does for one request alone.
        for batch in (prompts(1), prompts(3)):
            with pytest.raises(RequestFailed) as failed:
                llm.generate(batch, GREEDY)
            results = failed.value.outputs
            assert [r.finish_reason for r in results] == ["error"] * len(batch)
            assert all(r.token_ids == [] for r in results)
        # More failures in a row than any set of bad requests explains: broken.
        with pytest.raises(EngineBroken):
            llm.generate(prompts(8) * 2, GREEDY)
        assert llm.engine.postprocessor.failed_steps == MAX_FAILED_STEPS + 1
        # The next call says so at once: it stepped, for ever, an engine whose
        # requests held tokens of a step that was gone.
        with pytest.raises(EngineBroken, match="make a new LLM"):
            llm.generate(prompts(1), GREEDY)
    finally:
        llm.close()
    with pytest.raises(RuntimeError, match="closed"):  # was a RequestFailed with no cause
        llm.generate(prompts(1), GREEDY)


@pytest.mark.timeout(120)  # the old code's next call never returned
@pytest.mark.parametrize("overlap", [True, False])
def test_a_call_cut_off_by_ctrl_c_leaves_the_engine_ready_for_the_next(make_llm, monkeypatch, overlap):
    from engine import step_run

    llm = make_llm("tiny-llama", overlap=overlap)
    real = step_run.LaunchedStep.result
    calls = {"n": 0}

    def result(self):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # where Ctrl-C lands: waiting for the device
        return real(self)

    monkeypatch.setattr(step_run.LaunchedStep, "result", result)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(4), GREEDY)
    eng = llm.engine
    assert not eng.has_work() and eng.allocator.num_used == 0
    out = llm.generate(prompts(1), GREEDY)[0]
    assert out.token_ids == hf_greedy("tiny-llama", prompts(1)[0])[:NEW_TOKENS]
