"""Per-step grammar masks inside the engine: `StepMasks`.

Before sampling, the rows of constrained requests get their grammar's token
bitmask applied to the logits (on the device; other rows are untouched). The
bitmask of a step is a `PendingMask`: filled on the engine thread once every
matcher has seen the tokens before its sample position (`StepMasks.fill`),
then applied on the device thread by the step's sampling job, which is
submitted only once it is filled (`StepMasks.apply`, chosen for the device by
`mask_applier`; step_run.sample_step). After a
token is known, the request's matcher advances (`advance`), and tokens the
grammar forces are appended at once with `TextContext.jump_ahead`: they are
output without a sample. Without decode graphs the next step feeds a forced
run to the model as one multi-token chunk (one forward pass for the run);
with them the scheduler feeds it a token per step, each a graph replay.

`advance` never ends a request itself: it returns a verdict (complete, or
failed and why) for the step's postprocess to apply. A token the matcher
rejects fails the request: the engine never falls back to unconstrained output.

A reasoning model's request (reasoning.py) is sampled freely while its thought
is open: no grammar row, the matcher sees nothing. Its row is masked only to
force the end marker once a thinking budget is spent, or to keep it from
stopping before min_new_tokens; on the first token of a qwen3 output that may
open a thought, the row is the grammar's plus the start marker.

Threads: `fill` and `advance` run on the engine thread only; `apply` on the
device thread only, through the step's `PendingMask`. The compile service is
`structured.StructuredOutput`, which any thread may call; this module reads
its compiler only for the tokenizer data its bitmask filler is built from.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from grammar import BitmaskFiller, Matcher, apply_token_bitmask_inplace

from .context import Failure, GenerationStatus, TextContext, Verdict
from .kernels import cpu_ops, triton_mask
from .staging import Staging
from .structured import StructuredOutput

log = logging.getLogger(__name__)

# CPU time one request's grammar may take in a step (its new tokens accepted,
# its forced run found): a grammar whose parse grows with every token (an
# ambiguous EBNF on xgrammar: seconds a token within ten tokens) held up every
# request of the batch, since the engine thread does this work for all of
# them. An ordinary grammar takes microseconds a token.
GRAMMAR_STEP_LIMIT_S = 0.1
# Steps in a row over it that a request may take before it fails: a one-off
# (a table a library builds at first use) passes; a growing parse does not.
SLOW_STEPS_ALLOWED = 2


# Masks the disallowed tokens of some rows of the logits in place: (logits, bitmask, rows as
# a list, or a host tensor on CUDA; see PendingMask).
ApplyMask = Callable[[torch.Tensor, torch.Tensor, list[int] | torch.Tensor], None]


def mask_applier(device: torch.device, triton: bool = False) -> ApplyMask:
    """How a step's grammar mask is applied to logits on `device`, chosen once.

    - With `triton` (the model's pointwise kernels are Triton's, probed on this
      device): one Triton kernel (kernels/triton_mask.py; the grammar
      package's tensor path is about eight kernels), after a probe of its own
      here (compiled and checked); where that fails, the next choice, logged.
    - On the CPU: the CPU extension's kernel, where it built (word by word: a
      JSON schema's mask is mostly whole words allowed or not; 35-76x
      xgrammar's CPU kernel, ~2 ms a step at batch 64 over an 8k vocabulary
      and ~30 ms over 128k).
    - Else the grammar package's."""
    if triton:
        problem = triton_mask.probe(device)
        if problem is None:
            return _apply_with_triton
        log.warning("grammar masks: %s; using %s", problem,
                    "the CPU extension" if device.type == "cpu" and cpu_ops() is not None else "tensor ops")
    ops = cpu_ops() if device.type == "cpu" else None
    if ops is None:
        return _apply_anywhere

    def apply_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
        if not _kernel_layout(logits, bitmask) or logits.device.type != "cpu" or bitmask.device.type != "cpu":
            _apply_anywhere(logits, bitmask, rows)
            return
        ops.apply_token_bitmask(logits, bitmask, _row_index(rows))

    return apply_on_cpu


def _apply_anywhere(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
    apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), rows)


def _apply_with_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
    if not _kernel_layout(logits, bitmask):
        _apply_anywhere(logits, bitmask, rows)
        return
    device = logits.device
    # On CUDA the rows come as a page-locked tensor (PendingMask): both copies are asynchronous.
    triton_mask.apply_token_bitmask(logits, bitmask.to(device, non_blocking=True),
                                    _row_index(rows).to(device, non_blocking=True))


def _kernel_layout(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Whether both mask kernels can take these (float32 [B, V] logits and a
    bitmask, each with contiguous rows); the sampler's logits always are."""
    return logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1 \
        and bitmask.dim() == 2 and bitmask.stride(1) == 1


def _row_index(rows: list[int] | torch.Tensor) -> torch.Tensor:
    return rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.int64)


class PendingMask:
    """One step's grammar bitmask: filled on the engine thread, applied on the device thread.

    `failed` holds the batch rows whose matcher could not compute its mask (the
    step's postprocess fails those requests). The rows to mask come as a list,
    or for a model on CUDA as a page-locked int64 tensor, so that moving them
    to the device is an asynchronous copy like the bitmask's (a list would be a
    synchronous one: the device thread would wait for the forward pass).

    No lock: the device job that applies it (step_run.sample_step) is submitted
    only after `set`, and the executor's queue orders the two.
    """

    __slots__ = ("is_set", "_bitmask", "_rows", "failed")

    def __init__(self) -> None:
        self.is_set = False
        self._bitmask: torch.Tensor | None = None
        self._rows: list[int] | torch.Tensor = []
        self.failed: dict[int, Failure] = {}

    def set(self, bitmask: torch.Tensor | None, rows: list[int] | torch.Tensor) -> None:
        """Publish the mask (once; a second call is ignored)."""
        if self.is_set:
            return
        self._bitmask, self._rows = bitmask, rows
        self.is_set = True

    def apply(self, logits: torch.Tensor, apply_mask: ApplyMask) -> None:
        """Mask `logits` with the filled mask."""
        if not self.is_set:
            raise RuntimeError("a grammar mask was applied before it was filled")
        if self._bitmask is not None and len(self._rows):
            apply_mask(logits, self._bitmask, self._rows)


class _OneRow(NamedTuple):
    """How a step with one constrained row fills it (see `StepMasks.fill`)."""

    matcher: Matcher  # the request's, made once per request
    fill: Callable[[], object]  # fills row 0 of `bitmask` for `matcher`
    bitmask: torch.Tensor  # the step bitmask's one-row view

class StepMasks:
    """The per-step mask path: one step bitmask, filled on the engine thread and
    applied on the device thread; the matchers' advance after each token.

    One buffer is enough: a step's bitmask is filled only after the previous
    step, its last reader, has finished (the pipeline fills step N+1's mask
    after it has waited for step N's result). The bitmask and the row index
    are `staging` buffers: page-locked for a model on CUDA, so the device
    thread's copies of them are asynchronous and never wait for the forward pass.
    """

    def __init__(self, structured: StructuredOutput, vocab_size: int, staging: Staging,
                 triton: bool = False):
        self._structured = structured
        self.vocab_size = vocab_size
        self._staging = staging
        # Masks disallowed tokens of some rows of the logits in place, on the
        # device thread (chosen once, for the model's device: `mask_applier`).
        self.apply = mask_applier(staging.device, triton)
        self._filler: BitmaskFiller | None = None  # made once a matcher (so a compiler) exists
        self._one_row: _OneRow | None = None  # for the last matcher alone in a step
        self._bitmask: torch.Tensor | None = None
        self._views: dict[int, torch.Tensor] = {}
        self._words: np.ndarray = np.zeros((0, 0), dtype=np.uint32)
        # The rows a step masks, as the device thread copies them (CUDA only).
        self._index: torch.Tensor = torch.zeros(0, dtype=torch.int64)
        self._index_np: np.ndarray = self._index.numpy()
        # Seconds the last `fill` with constrained rows took (the engine resets
        # it to None at the start of each step and reports it in StepStats).
        self.last_mask_seconds: float | None = None
        # Runs a batch fill whose library releases the GIL while the engine
        # thread does the caller's `meanwhile` (see `fill`); made on first use.
        self._fill_thread: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the fill thread, if one was started."""
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
            self._fill_thread = None

    @property
    def filler(self) -> BitmaskFiller:
        """This path's bitmask filler (the compiler's tokenizer data; started on first use)."""
        if self._filler is None:
            self._filler = BitmaskFiller(self._structured.compiler.tokenizer_data, self._structured.mask_threads)
        return self._filler

    # -- per step (engine thread; `apply` on the device thread) ----------------
    def fill(self, mask: PendingMask, contexts: Sequence[TextContext | None],
             meanwhile: Callable[[], object] | None = None) -> None:
        """Fill `mask` for the constrained contexts (None rows are skipped) and release it.

        A context whose next token is already decided (`forced_next`, see
        `advance`) gets a row allowing only it. A matcher that fails is
        recorded in `mask.failed`; the others are filled all the same. Rows
        inside a thought follow `_thought_row`.

        `meanwhile` runs on this thread once, unless the fill fails first:
        while the library fills the rows on the fill thread when its batch
        call releases the GIL (llguidance's), after the fill otherwise. The
        engine schedules and builds its next step there, work that would
        otherwise wait for the fill on the device's path. It may not touch the
        matchers or the bitmask; its failure is raised once the mask is set.

        This runs once per step on the engine thread, so it is kept lean: one
        pass over the contexts, a bitmask view per batch size made once, and
        forced rows written through a numpy view (torch indexing costs
        microseconds per call).
        """
        pending = [meanwhile] if meanwhile is not None else []

        def run_pending() -> None:
            while pending:
                pending.pop()()

        try:
            self._fill(mask, contexts, run_pending)
        finally:
            if not mask.is_set:  # its sampling job is submitted next: never unset
                mask.set(None, [])
        run_pending()  # nothing ran beside the fill: after it

    def _fill(self, mask: PendingMask, contexts: Sequence[TextContext | None],
              meanwhile: Callable[[], None]) -> None:
        start = time.perf_counter()
        ctx = contexts[0] if len(contexts) == 1 else None
        if ctx is not None and ctx.constrained and ctx.grammar.forced_next is None \
                and ctx.grammar.resampler is None and (ctx.grammar.gate is None or ctx.grammar.gate.answering) \
                and not _stops_held_back(ctx):
            # One constrained request sampling freely (a lone client): its
            # row without the batch bookkeeping below, through a fill made
            # once per request (for xgrammar a native call with no Python
            # frame: grammar.BitmaskFiller.row_filler).
            one = self._one_row
            assert ctx.matcher is not None
            if one is None or one.matcher is not ctx.matcher:
                bitmask = self._view(1)
                one = self._one_row = _OneRow(ctx.matcher, self.filler.row_filler(
                    ctx.matcher, bitmask, 0), bitmask)
            try:
                one.fill()
            except Exception:  # noqa: BLE001 - terminated (xgrammar refuses) or failing
                self._one_row_failed(one, mask)
            mask.set(one.bitmask, self._rows([0]))
            self.last_mask_seconds = time.perf_counter() - start
            return
        rows: list[int] = []
        free: list[int] = []
        matchers: list[Matcher] = []
        also: list[tuple[int, int]] = []  # (row, token): the grammar's row plus this token
        blocked: list[tuple[int, frozenset[int]]] = []  # (row, tokens): any token but these
        held: list[tuple[int, frozenset[int]]] = []  # (row, tokens): the grammar's row less these, if it can
        for i, ctx in enumerate(contexts):
            if ctx is None:
                continue
            gate = ctx.grammar.gate
            if gate is not None and gate.thinking and ctx.grammar.forced_next is None:
                stops = _thought_row(ctx)
                if ctx.grammar.forced_next is None and not stops:
                    continue  # sampled freely
                rows.append(i)
                if stops:
                    blocked.append((i, stops))
                continue
            if ctx.grammar.forced_next is not None:
                rows.append(i)
            elif ctx.constrained:
                assert ctx.matcher is not None
                rows.append(i)
                free.append(i)
                matchers.append(ctx.matcher)
                if ctx.sampling_params.min_new_tokens:  # most rows have none: no call
                    stops = _stops_held_back(ctx)
                    if stops:
                        held.append((i, stops))
                if gate is not None and gate.undecided:
                    also.append((i, gate.parser.start_id))
        if not rows:
            mask.set(None, [])
            return
        bitmask = self._view(len(contexts))
        failure: BaseException | None = None
        if matchers and self.filler.fills_off_gil(matchers):
            job = self._thread().submit(self.filler.fill, matchers, bitmask, free)
            paused = time.perf_counter()
            try:
                meanwhile()
            except BaseException as exc:  # noqa: BLE001 - raised once the mask is whole
                failure = exc
            start += time.perf_counter() - paused  # the mask's own time leaves it out
            try:
                job.result()
            except Exception:  # noqa: BLE001 - one matcher's fault must not fail the batch
                self._fill_one_by_one(matchers, bitmask, free, mask)
        elif matchers:
            try:
                self.filler.fill(matchers, bitmask, free)
            except Exception:  # noqa: BLE001 - one matcher's fault must not fail the batch
                self._fill_one_by_one(matchers, bitmask, free, mask)
        words = self._words
        if len(free) < len(rows):
            for i in rows:
                token = contexts[i].grammar.forced_next  # type: ignore[union-attr]
                if token is not None:
                    words[i] = 0  # allow exactly `token`
                    words[i, token >> 5] = 1 << (token & 31)
        for i, token in also:
            words[i, token >> 5] |= np.uint32(1 << (token & 31))
        for i, tokens in blocked:
            words[i] = np.uint32(0xFFFFFFFF)
            for token in tokens:
                if token < self.vocab_size:
                    words[i, token >> 5] &= ~np.uint32(1 << (token & 31))
        for i, tokens in held:
            # min_new_tokens, as vLLM has it: no stop token yet, unless the
            # grammar allows nothing else (then the grammar's end wins).
            row = words[i].copy()
            for token in tokens:
                if token < self.vocab_size:
                    words[i, token >> 5] &= ~np.uint32(1 << (token & 31))
            if not words[i].any():
                words[i] = row
        _mask_resampled(contexts, bitmask, free)
        mask.set(bitmask, self._rows(rows))
        self.last_mask_seconds = time.perf_counter() - start
        if failure is not None:
            raise failure

    def _thread(self) -> ThreadPoolExecutor:
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="stencil-mask-fill")
        return self._fill_thread

    def _one_row_failed(self, one: _OneRow, mask: PendingMask) -> None:
        """The one-row fill raised: fill (or record the failure) the general
        way, which knows a terminated matcher, and use that way from now on."""
        fill = functools.partial(self.filler.fill, (one.matcher,), one.bitmask, (0,))
        self._one_row = one._replace(fill=fill)
        self._fill_one_by_one([one.matcher], one.bitmask, [0], mask)

    def _rows(self, rows: list[int]) -> list[int] | torch.Tensor:
        """`rows` as the device thread takes them: the list itself, or on CUDA
        their copy in the staged index buffer (sized with the bitmask)."""
        if not self._staging.pin:
            return rows
        self._index_np[:len(rows)] = rows
        return self._index[:len(rows)]

    def _view(self, batch: int) -> torch.Tensor:
        """The first `batch` rows of the step bitmask (allocated, or grown, on demand).

        Views are cached per batch size, so the batch filler sees the same
        tensor object each step.
        """
        view = self._views.get(batch)
        if view is None:
            if self._bitmask is None or self._bitmask.shape[0] < batch:
                # Not through the compiler: a thinking budget masks rows of
                # requests that never start one (its worker processes).
                capacity = max(batch, 64)
                self._bitmask = self._staging.buffer((capacity, (self.vocab_size + 31) // 32), torch.int32, -1)
                self._index = self._staging.buffer((capacity,), torch.int64)
                self._index_np = self._index.numpy()
                self._views.clear()
                self._one_row = None  # its fill wrote the old buffer
                # Shares memory with the bitmask; unsigned, so bit 31 needs no sign trick.
                self._words = self._bitmask.numpy().view(np.uint32)
            view = self._views[batch] = self._bitmask[:batch]
        return view

    def _fill_one_by_one(self, matchers: Sequence[Matcher | None], bitmask: torch.Tensor,
                         rows: Sequence[int], mask: PendingMask) -> None:
        """After a failed batch fill: each row on its own; the failures are recorded
        (those rows are left as they are: their tokens will be discarded)."""
        for matcher, row in zip(matchers, rows, strict=True):
            try:
                self.filler.fill([matcher], bitmask, [row])
            except Exception:  # noqa: BLE001
                log.exception("computing a grammar mask failed (row %d)", row)
                mask.failed[row] = Failure("internal error while computing the grammar mask; "
                                           "see the server log")

    @staticmethod
    def advance(ctx: TextContext, append_forced: bool = True) -> tuple[Verdict | None, bool]:
        """Feed ctx's newly known tokens to its matcher, then append forced tokens
        (not with `append_forced` False: the request is stopping there).

        Returns (verdict, forced): how the grammar ends the request (None: it
        goes on) and whether forced tokens were appended. The matcher only sees
        tokens in order, up to the first placeholder. When one placeholder
        remains (the step in flight samples the next position), the grammar's
        first forced token is what that step will sample (its mask allows
        nothing else), so only the rest are appended behind it. A request with
        log-probabilities has its forced tokens sampled that way, one a step,
        and every request its forced stop tokens (`stop_token_ids`). A grammar
        that takes over GRAMMAR_STEP_LIMIT_S of CPU time a step, more than
        SLOW_STEPS_ALLOWED steps in a row, fails the request.
        """
        began = _Began(time.perf_counter(), time.thread_time())
        verdict, forced = StepMasks._advance(ctx, began, append_forced)
        ctx.grammar.slow_steps = ctx.grammar.slow_steps + 1 if began.cpu_over_limit() else 0
        return verdict, forced

    @staticmethod
    def _advance(ctx: TextContext, began: _Began, append_forced: bool) -> tuple[Verdict | None, bool]:
        matcher = ctx.matcher
        assert matcher is not None
        end = ctx.num_final_tokens
        while ctx.grammar.grammar_idx < end:
            token = int(ctx.tokens[ctx.grammar.grammar_idx])
            if ctx.grammar.forced_next is not None:
                # The in-flight step was masked to this one token.
                if token != ctx.grammar.forced_next:
                    return Failure(f"token {token} differs from the forced token {ctx.grammar.forced_next}"), False
                ctx.grammar.forced_next = None
            if not matcher.accept_token(token):
                return _rejected(matcher, token), False
            ctx.grammar.grammar_idx += 1
            verdict = _grammar_verdict(matcher)
            if verdict is not None:
                return verdict, False
            if (slow := _too_slow(ctx, began)) is not None:
                return slow, False
        in_flight = ctx.end_idx - ctx.grammar.grammar_idx
        if in_flight > 1 or not append_forced:
            return None, False  # tokens behind a placeholder are consumed when it is realized
        room = ctx.max_length - ctx.end_idx
        usable = room + in_flight  # the in-flight position, then the room behind it
        # A request with log-probabilities gets every token from a sample, so
        # each has the model's log-probability at its position: a forced token
        # is sampled under a mask allowing only it, one a step, none appended.
        sampled_only = ctx.sampling_params.logprobs is not None
        forced = matcher.forced_tokens(max_tokens=1 if sampled_only else usable) if usable > 0 else []
        if (slow := _too_slow(ctx, began)) is not None:
            return slow, False
        # Nor is a stop token (stop_token_ids) ever appended: the run ends
        # before it, and it is sampled like the rest, so the stop rules see it.
        stops = ctx.sampling_params.stop_token_ids
        cut = next((i for i, token in enumerate(forced) if token in stops), len(forced)) if stops else len(forced)
        if forced and (in_flight == 1 or sampled_only or cut == 0):
            # The next sample (the step in flight's, at the placeholder's
            # position, or the next step's) gets a mask of exactly the first
            # forced token (a grammar may also allow other tokenizations of
            # the forced text, such as a shorter prefix), so the tokens
            # appended behind it are what follows.
            ctx.grammar.forced_next = forced[0]
            ctx.grammar.forced_positions.add(ctx.end_idx - in_flight)
            forced = [] if sampled_only or cut == 0 else forced[1:cut]
        else:
            forced = forced[:cut]
        for token in forced[:max(room, 0)]:
            ctx.jump_ahead(token)
            if in_flight == 0:
                if not matcher.accept_token(token):
                    return _rejected(matcher, token), True
                ctx.grammar.grammar_idx += 1
        if (slow := _too_slow(ctx, began)) is not None:
            return slow, bool(forced)
        return None, bool(forced)


# A grammar that allows no token at all: a dead end the compile could not see
# (a grammar is checked to accept something from its start only). The row's
# empty mask left the sampler nothing to choose; the grammar is at fault.
_DEAD_END = Failure("the grammar allows no token after this output: it cannot be completed",
                    cause="constraint")


def _stops_held_back(ctx: TextContext) -> frozenset[int]:
    """The stop tokens (stop ids and EOS, under ignore_eos too, as the
    sampler's block) a constrained row may not sample yet: its output has
    fewer than min_new_tokens tokens."""
    params = ctx.sampling_params
    if ctx.num_final_tokens - ctx.prompt_len >= params.min_new_tokens:
        return frozenset()
    return frozenset(params.stop_token_ids) | ctx.eos_token_ids


def _thought_row(ctx: TextContext) -> frozenset[int]:
    """The mask of a row whose thought is open, for the token it samples now
    (the request's first placeholder). A spent thinking budget forces the end
    marker (`forced_next`, which the caller writes); a request with a grammar
    that may not stop yet (min_new_tokens) gets its stop tokens blocked here
    (the sampler's launch-time block leaves rows with a grammar alone).
    Returns the tokens to block (empty: none)."""
    gate = ctx.grammar.gate
    assert gate is not None
    position = ctx.num_final_tokens
    if gate.budget_spent(position):
        ctx.grammar.forced_next = gate.parser.end_id
        ctx.grammar.forced_positions.add(position)
        return frozenset()
    return _stops_held_back(ctx) if ctx.matcher is not None else frozenset()


def _grammar_verdict(matcher: Matcher) -> Verdict | None:
    message = matcher.error()
    if message:
        return Failure(f"the grammar library stopped: {message}", cause="constraint")
    if matcher.is_terminated():
        # The grammar accepted a stop token: the output is complete (even with
        # ignore_eos, nothing else may follow).
        return GenerationStatus.END_OF_SEQUENCE
    return None


class _Began(NamedTuple):
    """When a request's grammar work in a step began, by the wall clock and
    by its thread's CPU clock."""

    wall: float
    cpu: float

    def cpu_over_limit(self) -> float | None:
        """CPU seconds spent since, if over GRAMMAR_STEP_LIMIT_S (else None).
        The wall clock is read first: it is cheap (the CPU clock is a system
        call, ~0.7 us, several a request a step) and never behind the CPU's."""
        if time.perf_counter() - self.wall <= GRAMMAR_STEP_LIMIT_S:
            return None
        spent = time.thread_time() - self.cpu
        return spent if spent > GRAMMAR_STEP_LIMIT_S else None


def _too_slow(ctx: TextContext, began: _Began) -> Failure | None:
    """The failure of a request whose grammar has taken over the limit in
    this step (so far) and in the steps allowed before it; None otherwise."""
    if ctx.grammar.slow_steps < SLOW_STEPS_ALLOWED:
        return None
    spent = began.cpu_over_limit()
    if spent is None:
        return None
    return Failure(f"the grammar took {spent * 1000:.0f} ms of CPU time for a step, over "
                   f"{GRAMMAR_STEP_LIMIT_S * 1000:.0f} ms for {SLOW_STEPS_ALLOWED + 1} steps in a row: "
                   "an ambiguous grammar, whose parse grows with every token, cannot be followed; write it "
                   "unambiguously or try the llguidance backend", cause="constraint")


def _rejected(matcher: Matcher, token: int) -> Failure:
    """The matcher refused a token the mask (or the grammar's forced run) had
    allowed. A library limit is the constraint's fault; anything else is a
    disagreement between mask and matcher, a server fault."""
    message = matcher.error()
    if message:
        return Failure(f"the grammar library stopped: {message}", cause="constraint")
    reason = matcher.rejection_reason(token)
    if reason:
        return Failure(f"the grammar library refused token {token}: {reason}", cause="constraint")
    if not matcher.allows_any():  # asked only here: a mask check every step costs the hot path
        return _DEAD_END
    return Failure(f"token {token} was rejected by the grammar")


def _mask_resampled(contexts: Sequence[TextContext | None], bitmask: torch.Tensor,
                    rows: Sequence[int]) -> None:
    """Rows resampling a value that broke the schema: their banned choices go
    (engine/resample.py). Kept apart from the mask fill above on purpose."""
    for i in rows:
        resampler = contexts[i].grammar.resampler  # type: ignore[union-attr]
        if resampler is not None:
            try:
                resampler.mask(contexts[i], bitmask[i])  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - a ban is a preference; the grammar's mask stands
                log.exception("masking a resampled value failed (row %d)", i)

