"""The offline Python API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import numbers
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .config import EngineConfig
from .context import TokenLogprobs
from .engine import EngineCore
from .errors import InvalidRequest, RequestFailed
from .output import RequestOutput
from .postprocess import EngineBroken
from .reasoning import ReasoningOptions
from .sampling_params import SamplingParams, default_length


@dataclass
class CompletionOutput:
    """The whole result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_prompt_tokens: int = 0
    forced_tokens: int = 0
    grammar_backend: str | None = None
    error: str | None = None
    # "constraint" when the grammar library failed on the request's constraint
    # (its input's fault); None for a server fault (generate then raises).
    error_cause: str | None = None
    schema_retries: int = 0
    # With a reasoning parser (EngineConfig.reasoning_parser): the thought
    # (`text` is then the answer), its tokens, and how it went ("none",
    # "closed", "forced", "unfinished"); None without a parser.
    reasoning: str = ""
    reasoning_tokens: int = 0
    thought: str | None = None

    def _add(self, delta: RequestOutput) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.reasoning += delta.reasoning
        if self.logprobs is not None:
            self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.cached_prompt_tokens = delta.cached_prompt_tokens
            self.forced_tokens = delta.forced_tokens
            self.grammar_backend = delta.grammar_backend
            self.error = delta.error
            self.error_cause = delta.error_cause
            self.schema_retries = delta.schema_retries
            self.reasoning_tokens = delta.reasoning_tokens
            self.thought = delta.thought


@dataclass
class SpeechOutput:
    """The whole result of one speech request."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    chunks: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # set with finish_reason "error"

    @property
    def audio(self) -> np.ndarray:
        """All streamed chunks, concatenated (float32 mono)."""
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)

    def _add(self, delta: RequestOutput) -> None:
        self.token_ids += delta.token_ids
        if delta.audio is not None:
            self.chunks.append(delta.audio)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.error = delta.error


# Steps an aborted call's drain may take (a few: the steps in flight, then
# the aborted requests' final outputs) before the engine counts as broken.
_MAX_DRAIN_STEPS = 64


class LLM:
    """Load a checkpoint and generate for batches of prompts, offline.

    Extra keyword arguments go to `EngineConfig` (page_size,
    max_num_batched_tokens, max_model_len, enable_prefix_caching, num_steps, ...).
    """

    def __init__(self, model: str | os.PathLike[str], device: str = "cpu", dtype: str | None = None,
                 kv_cache_gib: float = 1.0, max_num_seqs: int = 64, wrap_model: Any = None,
                 executor: Any = None, **kwargs: Any):
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype,
                                   kv_cache_gib=kv_cache_gib, max_num_seqs=max_num_seqs, **kwargs)
        self.engine = EngineCore(self.config, wrap_model=wrap_model, executor=executor)
        self.tokenizer = self.engine.tokenizer
        # An LLM dropped without close() still stops its device thread and
        # grammar worker (the engine itself holds no reference back to us).
        self._finalizer = weakref.finalize(self, self.engine.close)
        # Why no call can run any more (set when a failed call could not be undone).
        self._broken: BaseException | None = None

    def _check_usable(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed")
        if self._broken is not None:
            raise EngineBroken(f"an earlier call left the engine broken ({type(self._broken).__name__}: "
                               f"{self._broken}); make a new LLM") from self._broken

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 constraint: Any = None, resample: bool = True,
                 reasoning: ReasoningOptions | Sequence[ReasoningOptions | None] | None = None,
                 ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); results in prompt order.

        `constraint` is a `grammar.GrammarSpec` for all prompts, or a list with
        one spec (or None) per prompt. An invalid spec raises GrammarError.
        `resample` (default on): a JSON-schema output's value that breaks a
        keyword the grammar does not enforce is rolled back and resampled (see
        engine/resample.py); off, it stays and only validation would see it.
        `reasoning` (one for all prompts, or one per prompt): with a reasoning
        parser, whether the constraint starts after the thought (the default)
        and the thought's budget; see engine/reasoning.py.

        Failures: a request that fails through no fault of its input (a step
        that breaks, a failed decode) makes the call raise `RequestFailed`
        once every request has ended, whatever the batch size; its `outputs`
        still hold every result. Steps that keep failing whatever runs in
        them raise `EngineBroken` at once. A constraint the grammar library
        cannot follow is the input's fault: that result has finish_reason
        "error", `error` and error_cause "constraint", and nothing is raised.
        """
        self._check_usable()
        if isinstance(prompts, str | Mapping) or (
                isinstance(prompts, Sequence) and prompts and all(isinstance(t, numbers.Integral) for t in prompts)) \
                or (isinstance(prompts, np.ndarray) and prompts.ndim == 1 and prompts.dtype.kind in "iu"):
            prompts = [prompts]  # type: ignore[assignment]  # one prompt (text, ids or a dict), as vLLM reads it
        model_params = params is None
        if params is None or isinstance(params, SamplingParams):
            # None: the model's own defaults (generation_config.json), as vLLM's LLM.
            params = [params or SamplingParams(**self.engine.sampling_defaults)] * len(prompts)  # type: ignore[arg-type]
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        specs = list(constraint) if isinstance(constraint, list | tuple) else [constraint] * len(prompts)
        if len(specs) != len(prompts):
            raise ValueError("give one constraint, or one (or None) per prompt")
        options: list[ReasoningOptions | None] = list(reasoning) if isinstance(reasoning, list | tuple) \
            else [cast(ReasoningOptions | None, reasoning)] * len(prompts)
        if len(options) != len(prompts):
            raise ValueError("give one ReasoningOptions, or one (or None) per prompt")
        # Compile everything first, so a bad spec fails before any work starts.
        futures = [self.engine.structured.compile_async(s) if s is not None else None for s in specs]
        matchers = [f.result() if f is not None else None for f in futures]
        if resample:
            for matcher in matchers:  # once per schema, here rather than on the engine thread
                if matcher is not None and not matcher.checks_ready:
                    matcher.prepare_checks()
        results: dict[str, CompletionOutput] = {}
        order: list[str] = []
        contexts = []
        # Every request is made (and checked) before any is added: a bad one
        # leaves no others queued behind it.
        for prompt, p, matcher, option in zip(prompts, params, matchers, options, strict=True):
            ids = self._prompt_ids(prompt)
            if model_params:
                p = default_length(p, self.engine.default_max_new_tokens, len(ids), self.engine.max_model_len)
            ctx = self.engine.make_context(ids, p, matcher=matcher, resample=resample, reasoning=option)
            ids = [int(t) for t in ids]  # checked: integers in the vocabulary
            contexts.append(ctx)
            results[ctx.request_id] = CompletionOutput(ctx.request_id, ids,
                                                       logprobs=[] if p.logprobs is not None else None)
            order.append(ctx.request_id)
        for ctx in contexts:
            self.engine.add_request(ctx)
        self._run(results)
        outputs = [results[r] for r in order]
        failed = [o.request_id for o in outputs if o.finish_reason == "error" and o.error_cause is None]
        if failed:
            raise RequestFailed(outputs, failed)
        return outputs

    def _prompt_ids(self, prompt: Any) -> list[int]:
        """A prompt's token ids: from its text, its ids, or vLLM's dict forms
        (`{"prompt": text}`, `{"prompt_token_ids": ids}`). Ids are checked
        as the request is made (requests.check_token_ids), not converted
        here: `int()` truncated a float, and b"Hi" was read as its bytes."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise InvalidRequest("prompt", 'a dict prompt needs "prompt" (text) or "prompt_token_ids"')
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence | np.ndarray) or isinstance(prompt, bytes | bytearray):
            raise InvalidRequest("prompt", f"give a prompt as text or a list of token ids, not {type(prompt).__name__} "
                                 "(several prompts: a list of them)")
        return list(prompt)

    def _run(self, results: Mapping[str, CompletionOutput | SpeechOutput]) -> None:
        """Step the engine until every request in `results` has finished. A call
        that does not finish (Ctrl-C, `EngineBroken`) is undone first: see `_undo`."""
        pending = set(results)
        try:
            while pending:
                for delta in self.engine.step():
                    out = results.get(delta.request_id)
                    if out is None:
                        continue
                    out._add(delta)
                    if delta.finished:
                        pending.discard(delta.request_id)
            # With overlap a speculative step may still be in flight: finish it.
            while self.engine.has_work():
                self.engine.step()
        except BaseException as exc:
            self._undo(pending, exc)
            raise

    def _undo(self, request_ids: set[str], exc: BaseException) -> None:
        """Abort an unfinished call's requests and drain the engine, so the
        next call starts clean. A step cut off mid-way (Ctrl-C) left them
        holding tokens it would never deliver, and the next call stepped an
        engine that scheduled nothing, for ever. If the engine cannot be
        drained (or broke), every later call raises EngineBroken instead."""
        if isinstance(exc, EngineBroken):
            self._broken = exc
            return
        try:
            for request_id in request_ids:
                self.engine.abort(request_id)
            for _ in range(_MAX_DRAIN_STEPS):
                if not self.engine.has_work():
                    return
                self.engine.step()
            raise EngineBroken(f"the engine still had work {_MAX_DRAIN_STEPS} steps after its call was aborted")
        except BaseException as again:  # noqa: BLE001 - whatever it was, no call may run on this engine
            self._broken = again

    def synthesize(self, texts: Sequence[str] | str, params: SamplingParams | None = None,
                   **kwargs: Any) -> list[SpeechOutput]:
        """Speak every text (needs a speech model and `speech_codec`); in order.

        Keyword arguments go to `EngineCore.make_speech_context`
        (chunk_frames, max_audio_seconds, audio_prompt_codes, ...). A request
        that fails (a failed decode) makes the call raise `RequestFailed` once
        every request has ended, its `outputs` holding every result, as `generate`.
        """
        self._check_usable()
        if isinstance(texts, str):
            texts = [texts]
        # Every request made (and checked) before any is added, as in generate:
        # a bad text leaves no others queued behind it.
        contexts = [self.engine.make_speech_context(text, params, **kwargs) for text in texts]
        outs = {ctx.request_id: SpeechOutput(ctx.request_id) for ctx in contexts}
        if len(outs) < len(contexts):  # a request_id= given for several texts: the second was refused, the first ran on
            raise InvalidRequest("request_id", "one id names one request: give request_id with a single text")
        for ctx in contexts:
            self.engine.add_request(ctx)
        self._run(outs)
        results = [outs[ctx.request_id] for ctx in contexts]
        failed = [o.request_id for o in results if o.finish_reason == "error"]
        if failed:  # as generate: a server-side fault is raised, not returned silently
            raise RequestFailed(results, failed)
        return results

    def close(self) -> None:
        self._finalizer()
