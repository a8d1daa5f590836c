"""Structured output inside the engine.

Before sampling, the rows of constrained requests get their grammar's token
bitmask applied to the logits (on the device; other rows are untouched). After
a token is accepted, the matcher advances, and tokens the grammar forces are
appended at once with `TextContext.jump_ahead`: they are output, and the next
step feeds them to the model as one multi-token chunk, so a run of forced
tokens costs one forward pass instead of one per token.

A token the matcher rejects ends the request with an error: the engine never
falls back to unconstrained output.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .context import GenerationStatus, TextContext

log = logging.getLogger(__name__)

StopCheck = Callable[[TextContext, int, int], None]


class StructuredOutput:
    """The engine's grammar runtime: a lazily started compiler and per-step masking."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 backend: str = "auto", compile_timeout_s: float = 10.0):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.backend = backend
        self.compile_timeout_s = compile_timeout_s
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None

    @property
    def compiler(self) -> Any:
        """The GrammarCompiler, started on first use (it spawns a worker process)."""
        with self._lock:
            if self._compiler is None:
                from grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self._hf_tokenizer, backend=self.backend,
                                                 vocab_size=self.vocab_size,
                                                 eos_token_ids=self.eos_token_ids,
                                                 compile_timeout_s=self.compile_timeout_s)
            return self._compiler

    def compile_async(self, spec: Any, backend: str | None = None) -> Future:
        """A future matcher for `spec` (GrammarSpec); fails with GrammarError.

        Thread-safe; a cache hit is already done. `backend` overrides the
        engine's default ("auto", "xgrammar" or "llguidance").
        """
        return self.compiler.compile_async(spec, backend)

    def compile(self, spec: Any, backend: str | None = None) -> Any:
        return self.compiler.compile(spec, backend)

    def close(self) -> None:
        with self._lock:
            if self._compiler is not None:
                self._compiler.close()
                self._compiler = None

    # -- per step -------------------------------------------------------------
    def fill(self, contexts: Sequence[TextContext | None]) -> tuple[torch.Tensor, list[int]]:
        """Bitmask rows for the constrained contexts (None rows are skipped).

        Returns (bitmask, rows filled). A context whose next token is already
        decided (`forced_next`, see `advance`) gets a row allowing only it.
        """
        rows = [i for i, c in enumerate(contexts) if c is not None and c.matcher is not None]
        compiler = self.compiler
        if self._bitmask is None or self._bitmask.shape[0] < len(contexts):
            self._bitmask = compiler.allocate_bitmask(max(len(contexts), 64))
        # One buffer is enough: a step's bitmask is filled only after the
        # previous step (its last reader) has finished.
        bitmask = self._bitmask[: len(contexts)]
        free = [i for i in rows if contexts[i].forced_next is None]  # type: ignore[union-attr]
        try:
            compiler.fill_bitmasks([contexts[i].matcher for i in free], bitmask, free)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - one matcher's fault must not fail the batch
            self._fill_one_by_one([contexts[i] for i in free], bitmask, free)  # type: ignore[misc]
        for i in rows:
            token = contexts[i].forced_next  # type: ignore[union-attr]
            if token is not None:
                _allow_only(bitmask[i], token)
        return bitmask, rows

    def _fill_one_by_one(self, contexts: Sequence[TextContext], bitmask: torch.Tensor,
                         rows: Sequence[int]) -> None:
        """After a failed batch fill: each row on its own; a request whose matcher
        fails ends (its row is left as it is: its token will be discarded)."""
        for ctx, row in zip(contexts, rows, strict=True):
            try:
                self.compiler.fill_bitmasks([ctx.matcher], bitmask, [row])
            except Exception:  # noqa: BLE001
                log.exception("request %s: computing its grammar mask failed", ctx.request_id)
                ctx.fail("internal error while computing the grammar mask; see the server log")

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Mask disallowed tokens of `rows` of `logits` in place (on its device)."""
        self.compiler.apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), list(rows))

    def advance(self, ctx: TextContext, check_stop: StopCheck) -> None:
        """Feed ctx's newly known tokens to its matcher, then append forced tokens.

        The matcher only sees tokens in order, up to the first placeholder. When
        one placeholder remains (the step in flight samples the next position),
        the grammar's first forced token is what that step will sample (its
        mask allows nothing else), so only the rest are appended behind it.
        """
        matcher = ctx.matcher
        end = ctx.num_final_tokens
        while ctx.grammar_idx < end:
            token = int(ctx.tokens[ctx.grammar_idx])
            if ctx.forced_next is not None:
                # The in-flight step was masked to this one token.
                if token != ctx.forced_next:
                    ctx.fail(f"token {token} differs from the forced token {ctx.forced_next}")
                    return
                ctx.forced_next = None
            if not matcher.accept_token(token):
                _rejected(ctx, token)
                return
            ctx.grammar_idx += 1
            if self._finished_by_grammar(ctx):
                return
        in_flight = ctx.end_idx - ctx.grammar_idx
        if in_flight > 1:
            return  # tokens behind a placeholder are consumed when it is realized
        room = ctx.max_length - ctx.end_idx
        usable = room + in_flight  # the in-flight position, then the room behind it
        forced = matcher.forced_tokens(max_tokens=usable) if usable > 0 else []
        if in_flight == 1 and forced:
            # The step in flight samples the placeholder's position. Its mask is
            # narrowed to exactly the first forced token (a grammar may also
            # allow other tokenizations of the forced text, such as a shorter
            # prefix), so the tokens appended behind it are what follows.
            ctx.forced_next = forced[0]
            ctx.forced_positions.add(ctx.end_idx - 1)
            forced = forced[1:]
        for token in forced[:max(room, 0)]:
            ctx.jump_ahead(token)
            if in_flight == 0:
                if not matcher.accept_token(token):
                    _rejected(ctx, token)
                    return
                ctx.grammar_idx += 1
        if forced:
            check_stop(ctx, int(ctx.tokens[ctx.end_idx - 1]), ctx.end_idx - 1)

    @staticmethod
    def _finished_by_grammar(ctx: TextContext) -> bool:
        matcher = ctx.matcher
        message = matcher.error()
        if message:
            ctx.fail(f"the grammar library stopped: {message}", cause="constraint")
            return True
        if matcher.is_terminated():
            # The grammar accepted a stop token: the output is complete (even
            # with ignore_eos, nothing else may follow).
            ctx.finish(GenerationStatus.END_OF_SEQUENCE)
            return True
        return False


def _rejected(ctx: TextContext, token: int) -> None:
    """End `ctx`: its matcher refused a token the mask (or the grammar's forced
    run) had allowed. A library limit is the constraint's fault; anything else
    is a disagreement between mask and matcher, a server fault."""
    matcher = ctx.matcher
    message = matcher.error()
    if message:
        ctx.fail(f"the grammar library stopped: {message}", cause="constraint")
        return
    reason = matcher.rejection_reason(token)
    if reason:
        ctx.fail(f"the grammar library refused token {token}: {reason}", cause="constraint")
    else:
        ctx.fail(f"token {token} was rejected by the grammar")


def _allow_only(row: torch.Tensor, token: int) -> None:
    """Set an int32 bitmask row to allow exactly `token`."""
    row.zero_()
    bit = token % 32
    # Bit 31 is the sign bit of an int32 word.
    row[token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)
