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

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .context import GenerationStatus, TextContext

StopCheck = Callable[[TextContext, int], None]


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

    def compile_async(self, spec: Any) -> Future:
        """A future matcher for `spec` (GrammarSpec); fails with GrammarError."""
        return self.compiler.compile_async(spec)

    def compile(self, spec: Any) -> Any:
        return self.compiler.compile(spec)

    def close(self) -> None:
        with self._lock:
            if self._compiler is not None:
                self._compiler.close()
                self._compiler = None

    # -- per step -------------------------------------------------------------
    def mask(self, logits: torch.Tensor, contexts: Sequence[TextContext]) -> None:
        """Apply the grammar bitmask of every constrained row of `logits` in place."""
        rows = [i for i, c in enumerate(contexts) if c.matcher is not None]
        if not rows:
            return
        compiler = self.compiler
        if self._bitmask is None or self._bitmask.shape[0] < len(contexts):
            self._bitmask = compiler.allocate_bitmask(max(len(contexts), 64))
        bitmask = self._bitmask[: len(contexts)]
        compiler.fill_bitmasks([contexts[i].matcher for i in rows], bitmask, rows)
        compiler.apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)

    def advance(self, ctx: TextContext, token: int, check_stop: StopCheck) -> None:
        """Feed the sampled `token` to ctx's matcher, then jump ahead over forced tokens."""
        matcher = ctx.matcher
        if not matcher.accept_token(token):
            ctx.error = f"token {token} was rejected by the grammar"
            ctx.finish(GenerationStatus.ERROR)
            return
        if self._finished_by_grammar(ctx):
            return
        if ctx.is_done:
            return
        for forced in matcher.forced_tokens():
            ctx.jump_ahead(forced)
            if not matcher.accept_token(forced):
                ctx.error = f"forced token {forced} was rejected by the grammar"
                ctx.finish(GenerationStatus.ERROR)
                return
            check_stop(ctx, forced)
            if ctx.is_done or self._finished_by_grammar(ctx):
                return

    @staticmethod
    def _finished_by_grammar(ctx: TextContext) -> bool:
        matcher = ctx.matcher
        message = matcher.error()
        if message:
            ctx.error = message
            ctx.finish(GenerationStatus.ERROR)
            return True
        if matcher.is_terminated():
            # The grammar accepted a stop token: the output is complete (even
            # with ignore_eos, nothing else may follow).
            ctx.finish(GenerationStatus.END_OF_SEQUENCE)
            return True
        return False
