"""What any thread may ask of an engine: check a request and build its context.

The service's servicers run on the event loop and must never touch the
engine's state (the scheduler, the KV cache, the step path), which only the
engine thread may change. What they need before a request reaches the engine
thread — its checks, its seed, its `TextContext` — depends only on facts fixed
at start-up (the vocabulary, the context length, stop tokens, the reasoning
parser, the speech layout), so it lives here, apart from `EngineCore`: every
method of `RequestFactory` is safe from any thread. The context it builds is
handed to the engine thread (`EngineCore.add_request`) and owned there from then
on (docs/structures.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from grammar.vocab import token_bytes

from .context import TextContext
from .errors import InvalidRequest
from .reasoning import ReasoningOptions, ReasoningParser
from .requests import RequestSpec, check_request
from .resample import Resampler, watch_for
from .sampling_params import SamplingParams
from .speech import SpeechModel, SpeechRequest, SpeechUnavailable, TTSContext, speech_context
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from grammar import Matcher


class RequestFactory:
    """Checks requests and builds their contexts from an engine's fixed facts (any thread)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 reasoning: ReasoningParser | None, max_thinking_tokens: int | None,
                 speech: SpeechModel | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.reasoning = reasoning
        self.max_thinking_tokens = max_thinking_tokens  # the default thinking budget
        self.speech = speech

    def check(self, prompt: Sequence[int], params: SamplingParams | None = None,
              request_id: str | None = None) -> RequestSpec:
        """Check a tokenized prompt and its parameters (InvalidRequest names the field)."""
        return check_request(prompt, params, request_id, self.vocab_size, self.max_model_len)

    def context(self, spec: RequestSpec, matcher: Matcher | None = None,
                resample: bool = True, reasoning: ReasoningOptions | None = None) -> TextContext:
        """The context of a checked request; `matcher` is its compiled grammar, if constrained.

        `resample` (JSON schemas, and the JSON inside structural tags and
        tool calls): a value that breaks a keyword the grammar does not
        enforce is rolled back and resampled (resample.py).
        `reasoning`: how a server with a reasoning parser treats this
        request's thought (reasoning.py; default: the constraint starts after
        it, with the engine's default thinking budget). Without a parser it
        must set no budget.
        """
        kwargs: dict[str, Any] = {"request_id": spec.request_id} if spec.request_id else {}
        ctx = TextContext(tokens=spec.prompt, max_length=spec.max_length, sampling_params=spec.params,
                          eos_token_ids=self.eos_token_ids, seed=spec.seed, matcher=matcher, **kwargs)
        options = reasoning or ReasoningOptions()
        if self.reasoning is not None and options.after_thought:
            budget = options.max_thinking_tokens
            ctx.grammar.gate = self.reasoning.gate(spec.prompt, self.max_thinking_tokens if budget is None else budget)
        elif options.max_thinking_tokens is not None:
            raise InvalidRequest("max_thinking_tokens", "applies on a server with a reasoning parser, "
                                 "to a constraint that starts after the thought")
        watch = watch_for(matcher) if resample and matcher is not None else None
        if watch is not None:
            assert matcher is not None
            ctx.grammar.resampler = Resampler(watch, token_bytes(matcher.tokenizer))
        return ctx

    def make_context(self, prompt: Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, matcher: Matcher | None = None,
                     resample: bool = True, reasoning: ReasoningOptions | None = None) -> TextContext:
        """`check` and `context` in one call, for callers with the matcher in hand."""
        return self.context(self.check(prompt, params, request_id), matcher, resample, reasoning)

    def make_speech_context(self, text: str, params: SamplingParams | None = None,
                            request_id: str | None = None, chunk_frames: int = 4,
                            max_audio_seconds: float = 30.0,
                            audio_prompt_codes: Sequence[int] | None = None,
                            audio_prompt_transcription: str = "") -> TTSContext:
        """Check a speech request and build its context (see engine.speech.request)."""
        if self.speech is None:
            raise SpeechUnavailable("this server has no speech model")
        req = SpeechRequest(text, params, request_id, chunk_frames, max_audio_seconds, audio_prompt_codes,
                            audio_prompt_transcription)
        return speech_context(req, self.speech, self.tokenizer, self.vocab_size, self.max_model_len,
                              self.eos_token_ids)
