"""Turning a request's tokens into streamed text, with stop strings.

Stop strings are matched on text, across token boundaries. Text that could
still be the beginning of a stop string is held back until it cannot, so a
client never receives text that is later trimmed away. The step's postprocess
calls `decode` (and ends the request on a match), then `delta` builds what the
client gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .context import GenerationStatus, TextContext, TokenLogprobs
from .tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    status: GenerationStatus = GenerationStatus.ACTIVE
    stop_reason: str | int | None = None  # matched stop string or stop token id
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    forced_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    # "constraint" when the request's grammar hit a library limit (the client's
    # to fix); None for a server fault.
    error_cause: str | None = None
    audio: np.ndarray | None = None  # new speech samples (float32, mono), speech requests only
    grammar_backend: str | None = None  # the library that compiled the constraint, if any
    schema_retries: int = 0  # values resampled because they broke the schema (JSON, resampling on)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason if self.finished else None


@dataclass(frozen=True)
class StopStringMatch:
    """A stop string found in the output: it ends the request at `keep_tokens`."""

    stop: str
    keep_tokens: int  # generated tokens to keep (the one completing the stop string is the last)


class OutputStream:
    """Per-request detokenizer, stop-string matcher and delta builder."""

    def __init__(self, ctx: TextContext, tokenizer: Tokenizer):
        params = ctx.sampling_params
        self.ctx = ctx
        self._tokenizer = tokenizer
        self.decoder: IncrementalDecoder | None = self._new_decoder()
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.decoded_tokens = 0
        self.stop_reason: str | int | None = None
        self.prompt_logprobs_sent = False
        # len(self.text) after each decoded token (where a held-back stream may cut).
        self._text_ends: list[int] = []

    def _new_decoder(self) -> IncrementalDecoder | None:
        ctx = self.ctx
        if not ctx.produces_text:
            return None
        return self._tokenizer.stream(ctx.prompt_tokens.tolist(), ctx.sampling_params.skip_special_tokens)

    def rolled_back(self) -> None:
        """The context's tokens were rolled back (never below what was sent):
        decode its output again from the start at the next `decode`."""
        self.decoder = self._new_decoder()
        self.text = ""
        self.decoded_tokens = 0
        self._text_ends = []

    def decode(self) -> StopStringMatch | None:
        """Detokenize the tokens known since the last call; the first stop string found, if any."""
        ctx = self.ctx
        if self.decoder is None or self.stop_reason is not None:
            return None
        end = ctx.num_final_tokens
        while ctx.prompt_len + self.decoded_tokens < end:
            tok = int(ctx.tokens[ctx.prompt_len + self.decoded_tokens])
            self.decoded_tokens += 1
            piece = self.decoder.step(tok)
            before = len(self.text)
            self.text += piece
            self._text_ends.append(len(self.text))
            if not piece:
                continue
            if self.stops:
                match = self._match_stop(before)
                if match is not None:
                    return match
        return None

    def _match_stop(self, before: int) -> StopStringMatch | None:
        window_start = max(0, before - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        keep = i + len(s) if self.ctx.sampling_params.include_stop_str_in_output else i
        self.text = self.text[:keep]
        self.stop_reason = s
        return StopStringMatch(s, self.decoded_tokens)

    def delta(self) -> RequestOutput:
        """Everything new since the last call (decode first)."""
        ctx = self.ctx
        done = ctx.is_done
        if done and self.stop_reason is None and ctx.status is GenerationStatus.STOP_TOKEN:
            self.stop_reason = int(ctx.tokens[ctx.end_idx - 1])
        limit = len(self.text) if done or not self.stops else max(self.sent_chars, len(self.text) - self.hold)
        final_tokens = ctx.num_final_tokens - ctx.prompt_len
        if ctx.resampler is not None and not done:
            # What a rollback may still take back is held back (resample.py).
            final_tokens = min(final_tokens, ctx.resampler.stable_tokens)
            text_end = self._text_ends[final_tokens - 1] if 0 < final_tokens <= len(self._text_ends) else 0
            limit = max(self.sent_chars, min(limit, text_end))
        out = RequestOutput(
            request_id=ctx.request_id,
            token_ids=ctx.tokens[ctx.prompt_len + self.sent_tokens:ctx.prompt_len + final_tokens].tolist(),
            text=self.text[self.sent_chars:limit],
            logprobs=ctx.logprobs[self.sent_logprobs:final_tokens],
            finished=done,
            status=ctx.status,
            stop_reason=self.stop_reason if done else None,
            prompt_tokens=ctx.prompt_len,
            completion_tokens=final_tokens,
            cached_prompt_tokens=ctx.num_cached_prompt_tokens,
            forced_tokens=ctx.num_forced_tokens,
            error=ctx.error,
            error_cause=ctx.error_cause,
            grammar_backend=ctx.matcher.backend if ctx.matcher is not None else None,
            schema_retries=ctx.schema_retries,
        )
        if not self.prompt_logprobs_sent and ctx.sampling_params.prompt_logprobs is not None \
                and len(ctx.prompt_logprobs) >= ctx.prompt_len:
            out.prompt_logprobs = ctx.prompt_logprobs[:ctx.prompt_len]
            self.prompt_logprobs_sent = True
        self.sent_chars = limit
        self.sent_tokens = final_tokens
        self.sent_logprobs = min(len(ctx.logprobs), final_tokens)
        return out
