"""One request's token buffer and its indices (MAX's TextContext).

    tokens: | processed (KV cached) | next_tokens | ...                |
            0                   start_idx    active_idx   end_idx      capacity

- start_idx: tokens before it have keys/values in the cache.
- active_idx: next_tokens = tokens[start_idx:active_idx] run in the next step
  (a prompt chunk, one decode token, or a token plus grammar-forced tokens).
- end_idx: tokens known so far (prompt + generated, placeholders included).
- committed_idx: tokens whose pages are published in the prefix cache.

A *future token* is a placeholder for a token the device has sampled but the
host has not read yet (overlap scheduling); it is realized in order later.
"""

from __future__ import annotations

import enum
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from grammar import Matcher

    from .reasoning import ReasoningGate
    from .resample import Resampler

FUTURE_TOKEN = -1


class GenerationStatus(enum.Enum):
    """Where a request stands; everything but ACTIVE is final.

    The values are the finish reasons the offline API reports; the service
    derives its proto enums from the members, so this is the only table.
    """

    ACTIVE = "active"
    END_OF_SEQUENCE = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAXIMUM_LENGTH = "length"
    CONTEXT_LENGTH = "context_length"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def is_done(self) -> bool:
        return self is not GenerationStatus.ACTIVE

    @property
    def finish_reason(self) -> str | None:
        """The offline API's reason: the value, except that both length limits
        read "length" (the service tells them apart); None while active."""
        if not self.is_done:
            return None
        return "length" if self is GenerationStatus.CONTEXT_LENGTH else self.value


_ACTIVE = GenerationStatus.ACTIVE


@dataclass(frozen=True)
class Failure:
    """Why a request failed: the message for the client, and whose fault it was
    (`cause` "constraint": its grammar hit a library limit; None: the server's)."""

    message: str
    cause: str | None = None


# How a rule ends a request: a final status, or a failure.
Verdict = GenerationStatus | Failure


@dataclass
class RequestTimes:
    """When a request reached each stage, on the `time.monotonic()` clock (None
    until then). Written by the engine thread, each field once; the service
    reads them for its metrics, logs and trace spans after the output that
    follows the write has been delivered."""

    arrival: float | None = None  # entered the engine (add_request)
    scheduled: float | None = None  # first admitted to a step: its queue time ends
    first_token: float | None = None  # first output token on the host: its prefill ends
    finished: float | None = None  # its final output was built


@dataclass
class TokenLogprobs:
    """Log-probability of one chosen token plus the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GrammarState:
    """What the grammar path owns of a request: the matcher's progress, forced
    tokens, the resampler and the reasoning gate. Written on the engine thread
    by the matcher's advance (step_masks.py), the gate (reasoning.py) and the
    resampler (resample.py); the index core's `jump_ahead`, `rollback` and
    `drop_futures` keep it in step with the tokens."""

    grammar_idx: int  # tokens [prompt_len, grammar_idx) have been fed to the matcher
    # The token an in-flight step must sample (the grammar forces it).
    forced_next: int | None = None
    # Positions of tokens the grammar forced (output without a model choice).
    forced_positions: set[int] = field(default_factory=set)
    # Forced tokens appended without a forward pass sampling them
    # (jump_ahead): each one is a decode step saved.
    num_jumped: int = 0
    # Resampling JSON requests whose grammar leaves keywords unenforced:
    # rolls back and resamples a value that breaks one (resample.py); None otherwise.
    resampler: Resampler | None = None
    # With a reasoning parser: where the thought ends and the answer (and
    # the grammar) starts (reasoning.py); None: the output is all answer.
    gate: ReasoningGate | None = None
    # Steps in a row whose grammar work took over step_masks.GRAMMAR_STEP_LIMIT_S.
    slow_steps: int = 0


@dataclass
class OutputState:
    """What the postprocess owns: log-probabilities and the stage times."""

    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    times: RequestTimes = field(default_factory=RequestTimes)


@dataclass
class ScheduleState:
    """What scheduling and recovery own: the token-buffer row, resets, suspicion, cache hits."""

    # This request's row in the device token buffer (see TokenBuffer).
    buffer_row: int | None = None
    # Bumped by every reset: a launched step whose rows carry an older epoch
    # was computed for work that has been thrown away.
    epoch: int = 0
    # Set when a step this request was in failed: it then runs alone until
    # one of its steps succeeds, so a request that breaks steps is found
    # and ended without taking its batch with it (see EngineCore.step).
    suspect: bool = False
    num_cached_prompt_tokens: int = 0


@dataclass(eq=False)
class TextContext:
    """A request's tokens, indices, parameters and status (the index core, which
    the step's phases move: docs/structures.md lists who moves what), and the
    parts each owned by one phase: `grammar` (GrammarState), `output`
    (OutputState) and `sched` (ScheduleState)."""

    tokens: np.ndarray
    max_length: int
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    eos_token_ids: frozenset[int] = frozenset()
    status: GenerationStatus = GenerationStatus.ACTIVE
    matcher: Matcher | None = None  # the grammar matcher, when the output is constrained
    seed: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        prompt = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("a context needs at least one prompt token")
        if prompt.size >= self.max_length:
            raise ValueError(f"prompt of {prompt.size} tokens leaves no room (max_length {self.max_length})")
        self.prompt_len = int(prompt.size)
        self.tokens = np.empty(max(16, 2 * prompt.size), dtype=np.int64)
        self.tokens[: prompt.size] = prompt
        self.start_idx = 0
        self.active_idx = self.prompt_len
        self.end_idx = self.prompt_len
        self.committed_idx = 0
        # Positions of placeholders, oldest first. Forced tokens may follow a
        # placeholder, so futures are not always at the tail.
        self._futures: deque[int] = deque()
        # The parts of a request each owned by one phase (docs/structures.md).
        self.grammar = GrammarState(grammar_idx=self.prompt_len)
        self.output = OutputState()
        self.sched = ScheduleState()
        # What ERROR was caused by: "constraint" when the request's grammar hit
        # a library limit (the client's to fix), None for a server fault.
        self.error_cause: str | None = None

    # -- names kept for callers outside the engine (their owners are the parts) --
    @property
    def gate(self) -> ReasoningGate | None:
        return self.grammar.gate

    @gate.setter
    def gate(self, gate: ReasoningGate | None) -> None:
        self.grammar.gate = gate

    @property
    def resampler(self) -> Resampler | None:
        return self.grammar.resampler

    @property
    def forced_positions(self) -> set[int]:
        return self.grammar.forced_positions

    @property
    def epoch(self) -> int:
        return self.sched.epoch

    @property
    def buffer_row(self) -> int | None:
        return self.sched.buffer_row

    @property
    def times(self) -> RequestTimes:
        return self.output.times

    @property
    def num_cached_prompt_tokens(self) -> int:
        return self.sched.num_cached_prompt_tokens

    # -- views -------------------------------------------------------------
    @property
    def next_tokens(self) -> np.ndarray:
        return self.tokens[self.start_idx:self.active_idx]

    @property
    def active_length(self) -> int:
        return self.active_idx - self.start_idx

    @property
    def num_generated(self) -> int:
        return self.end_idx - self.prompt_len

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.tokens[:self.prompt_len]

    @property
    def generated_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len:self.end_idx]

    @property
    def pending_futures(self) -> int:
        return len(self._futures)

    @property
    def num_final_tokens(self) -> int:
        """Length of the leading run of tokens the host knows (up to the first placeholder)."""
        return self._futures[0] if self._futures else self.end_idx

    @property
    def in_prefill(self) -> bool:
        """True while prompt (or recomputed) tokens remain beyond next_tokens."""
        return self.active_idx < self.end_idx

    @property
    def is_done(self) -> bool:
        # Read several times per request per step: one comparison, not a second property.
        return self.status is not _ACTIVE

    @property
    def produces_text(self) -> bool:
        """False for requests whose tokens are not text (speech)."""
        return True

    def allowed_token_range(self) -> tuple[int, int, int | None] | None:
        """A per-position token range rule (lo, hi, extra), or None (speech uses it)."""
        return None

    @property
    def num_forced_tokens(self) -> int:
        """Output tokens the grammar forced, of those known: a position forced
        ahead of its token (the next one, or one in flight) counts once the
        token is there, and never for a request that ends first."""
        forced = self.grammar.forced_positions
        if not forced:
            return 0
        end = self.num_final_tokens
        # Only the few positions past the known tokens can be pending (the
        # next one and the in-flight steps': at most three): O(1), not a scan.
        return len(forced) - ((end in forced) + (end + 1 in forced) + (end + 2 in forced) + (end + 3 in forced))

    # -- the grammar and the thought ------------------------------------------
    @property
    def constrained(self) -> bool:
        """Whether the grammar decides this request's next token: it has one
        and is not inside a thought (a reasoning model's answer has started,
        or may start with the next token). Every rule that differs between
        constrained and free sampling asks this (scheduler, stop rules, masks,
        the matcher's advance)."""
        return self.matcher is not None and (self.grammar.gate is None or not self.grammar.gate.thinking)

    @property
    def needs_mask(self) -> bool:
        """Whether a step sampling this request may need a mask for it: it has
        a grammar (whose answer may start while the step is in flight), or a
        thinking budget that may force the end of its thought."""
        gate = self.grammar.gate
        return self.matcher is not None or (gate is not None and gate.budget is not None and not gate.answering)

    @property
    def grammar_start(self) -> int | None:
        """Position of the first token the matcher reads (the answer's); None
        while a thought is open."""
        gate = self.grammar.gate
        if gate is None or gate.undecided:
            return self.prompt_len
        return gate.answer_start

    @property
    def max_new_tokens(self) -> int:
        return self.max_length - self.prompt_len

    # -- index moves --------------------------------------------------------
    def _append(self, token: int) -> None:
        if self.end_idx == len(self.tokens):
            grown = np.empty(2 * len(self.tokens), dtype=np.int64)
            grown[: self.end_idx] = self.tokens[: self.end_idx]
            self.tokens = grown
        self.tokens[self.end_idx] = token
        self.end_idx += 1

    def set_chunk(self, num_tokens: int) -> None:
        """Limit the next step to `num_tokens` of the pending tokens (chunked prefill)."""
        pending = self.end_idx - self.start_idx
        if not 1 <= num_tokens <= pending:
            raise ValueError(f"chunk of {num_tokens} tokens with {pending} pending")
        self.active_idx = self.start_idx + num_tokens

    def skip_cached_tokens(self, num_tokens: int) -> None:
        """Mark `num_tokens` leading tokens as already in the cache (prefix hit)."""
        if self.start_idx + num_tokens >= self.end_idx:
            raise ValueError("a prefix hit must leave at least one token to compute")
        self.start_idx += num_tokens
        self.active_idx = self.end_idx

    def mark_chunk_done(self) -> None:
        """next_tokens were computed but were not the last pending ones: no sample."""
        self.start_idx = self.active_idx
        self.active_idx = self.end_idx

    def update(self, token: int) -> None:
        """next_tokens were computed and `token` sampled after them."""
        self.start_idx = self.active_idx
        self._append(int(token))
        self.active_idx = self.end_idx

    def jump_ahead(self, token: int) -> None:
        """Append a grammar-forced token: it is output, and computed in the next step."""
        self.grammar.forced_positions.add(self.end_idx)
        self._append(int(token))
        self.active_idx = self.end_idx
        self.grammar.num_jumped += 1

    def update_with_future_token(self) -> None:
        """Like update(), with a placeholder for a token not yet on the host."""
        self.start_idx = self.active_idx
        self._futures.append(self.end_idx)
        self._append(FUTURE_TOKEN)
        self.active_idx = self.end_idx

    def realize_future_token(self, token: int) -> int:
        """Write the oldest placeholder's real value; returns its position."""
        if not self._futures:
            raise ValueError("no future token to realize")
        index = self._futures.popleft()
        self.tokens[index] = int(token)
        return index

    def drop_futures(self) -> None:
        """Cut the buffer at the first placeholder (the request ended before it)."""
        if not self._futures:
            return
        cut = self._futures[0]
        self._futures.clear()
        self.grammar.forced_next = None
        self.grammar.forced_positions = {p for p in self.grammar.forced_positions if p < cut}
        self.end_idx = cut
        self.active_idx = min(self.active_idx, cut)
        self.start_idx = min(self.start_idx, max(cut - 1, 0))

    def rollback(self, num_tokens: int) -> None:
        """Drop the last `num_tokens` generated tokens (never prompt tokens)."""
        if not 0 <= num_tokens <= self.num_generated:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_generated} generated tokens")
        if num_tokens == 0:
            return
        self.end_idx -= num_tokens
        while self._futures and self._futures[-1] >= self.end_idx:
            self._futures.pop()
        self.grammar.forced_positions = {p for p in self.grammar.forced_positions if p < self.end_idx}
        # The last remaining token is recomputed to get fresh logits after it.
        self.start_idx = min(self.start_idx, self.end_idx - 1)
        self.active_idx = self.end_idx
        self.committed_idx = min(self.committed_idx, self.start_idx)
        del self.output.logprobs[self.num_generated:]
        self.grammar.grammar_idx = min(self.grammar.grammar_idx, self.end_idx)
        if self.grammar.gate is not None:
            self.grammar.gate.rewind(self.tokens, self.end_idx)

    def recompute_from(self, position: int) -> None:
        """Tokens from `position` on must be computed again (their keys and values
        are not in the cache any more); nothing is dropped."""
        self.start_idx = min(self.start_idx, position)
        self.active_idx = self.end_idx
        self.committed_idx = min(self.committed_idx, self.start_idx)

    @property
    def schema_retries(self) -> int:
        """Values resampled because they broke the schema (see resample.py)."""
        return self.grammar.resampler.retries if self.grammar.resampler is not None else 0

    def reset(self) -> None:
        """After preemption: everything known is recomputed from scratch."""
        # Work in flight for this request is discarded; its placeholders go.
        # A token the grammar forces at the first of them stays forced: the
        # matcher has not moved, and that position is sampled again.
        forced, cut = self.grammar.forced_next, self._futures[0] if self._futures else None
        self.drop_futures()
        if forced is not None and cut is not None:
            self.grammar.forced_next = forced
            self.grammar.forced_positions.add(cut)
        self.start_idx = 0
        self.active_idx = self.end_idx
        self.committed_idx = 0
        self.sched.epoch += 1

    def can_multi_step(self) -> bool:
        """Whether this request can take several decode steps with no host work
        in between: one decode token, no mask (no grammar, even one waiting
        for a thought to end; no thinking budget), no token-range rule, and no
        stop token it must be kept from (min_new_tokens reached)."""
        return (self.active_length == 1 and self.active_idx == self.end_idx and not self.needs_mask
                and self.allowed_token_range() is None
                and self.num_generated >= self.sampling_params.min_new_tokens)

    def compute_num_available_steps(self, max_seq_len: int) -> int:
        """Tokens that may still be generated before max_seq_len or max_length."""
        return max(0, min(max_seq_len, self.max_length) - self.end_idx)

    def finish(self, status: GenerationStatus) -> None:
        if not self.status.is_done:
            self.status = status

    def end_at_stop_string(self) -> None:
        """A stop string ended the output (its text is cut there, the tokens
        after it rolled back): it wins over a length limit or stop token met in
        the same step, whose tokens it cut off (vLLM's rule), but not over a
        cancel or a failure."""
        if self.status not in (GenerationStatus.CANCELLED, GenerationStatus.ERROR):
            self.status = GenerationStatus.STOP_STRING

    def fail(self, failure: Failure) -> None:
        """End with ERROR.

        Unlike `finish`, this overrides a status already final: output that
        cannot be delivered (a failed decode of the last audio or text) makes
        a finished request a failed one.
        """
        self.error = failure.message
        self.error_cause = failure.cause
        self.status = GenerationStatus.ERROR

    def end(self, verdict: Verdict) -> None:
        """Apply a rule's verdict: `finish` for a status, `fail` for a failure."""
        if isinstance(verdict, Failure):
            self.fail(verdict)
        else:
            self.finish(verdict)
