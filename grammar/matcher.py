"""The per-request matcher interface shared by both backends.

Contract (what the engine relies on):
- `accept_token` never raises for a token the grammar rejects; it returns False
  and leaves the matcher as it was. Stop tokens are accepted only where the
  grammar may end; accepting one terminates the matcher.
- `fill_bitmask` writes one row of an int32 bitmask ([batch, ceil(vocab/32)],
  bit i of word w = token 32*w+i). Ids past the tokenizer are never allowed.
  After termination (or an internal error) the row allows only stop tokens, so
  sampling from it always ends the request.
- `forced_tokens` is a pure query: tokens the grammar allows no alternative to,
  in the tokenizer's canonical tokenization, which the engine then feeds with
  `accept_token` one by one. Stop tokens are never forced.
- `rollback(n)` undoes the last n accepted tokens (stop tokens included).

A matcher is not thread-safe; it belongs to one request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .export import CompiledExport
    from .spec import GrammarSpec
    from .tag_watch import TagPlan
    from .tokenizer import TokenizerData
    from .validation import OutputValidator
    from .watch_plan import WatchPlan


class Matcher(ABC):
    """Tracks one request's output against its compiled grammar."""

    backend: str = ""
    # Set by the compiler: for JSON specs (see grammar/schema_plan.py) the
    # schema keywords this grammar does not enforce token by token and the
    # validator of the full schema (None: outputs cannot be checked;
    # validator_error says why); for the other kinds the output check of the
    # spec's own semantics (output_check.py); and how long the compile took
    # (0 for a cache hit's first compile).
    unenforced_keywords: tuple[str, ...] = ()
    validator: OutputValidator | None = None
    validator_error: str | None = None
    compile_seconds: float = 0.0
    # Where each schema node applies (None: not a JSON schema); a resampling
    # request resamples values that break an unenforced keyword
    # (engine/resample.py).
    watch_plan: WatchPlan | None = None
    # Structural tags: the value checks of the JSON inside their tags, for
    # resampling requests too (grammar/tag_watch.py).
    tag_plan: TagPlan | None = None
    # Which of its grammar's template copies this matcher was made from
    # (llguidance with several mask threads, see CompilerConfig.mask_threads):
    # a batch fill hands each thread the rows of one copy.
    replica: int = 0
    # Its compile's result for a compiler in another process, when its
    # compiler exports them and compiled it just now (grammar/export.py).
    export: CompiledExport | None = None

    def __init__(self, spec: GrammarSpec, tokenizer: TokenizerData) -> None:
        self.spec = spec
        self._tok = tokenizer
        self._num_accepted = 0

    @property
    def tokenizer(self) -> TokenizerData:
        """The vocabulary this matcher reads tokens of."""
        return self._tok

    @property
    def checks_ready(self) -> bool:
        """Whether the value checks of a resampling request cost no more
        set-up: the schema's watch plan and the output validator are built."""
        if self.tag_plan is not None:
            return self.tag_plan.ready
        plan = self.watch_plan
        if plan is None or not self.unenforced_keywords:
            return True
        return plan.ready and (self.validator is None or self.validator.built)

    def prepare_checks(self) -> None:
        """Build what a resampling request's value checks use (the watch
        plan, the node validators, the output validator), once per schema.
        Seconds for a schema of hundreds of KB: call it off the event loop
        and the engine thread."""
        if self.tag_plan is not None:
            self.tag_plan.prepare()
        self.resampled_keywords  # noqa: B018 - parses the plan, builds the node validators
        if self.validator is not None and self.unenforced_keywords:
            self.validator.prepare()

    @property
    def resampled_keywords(self) -> tuple[str, ...]:
        """Unenforced keywords that a resampling request enforces by resampling
        instead: those whose every occurrence the value watch checks on the
        very value it constrains (grammar/watch_plan.py). Parses the schema
        and builds its node validators on first use (callers run it off the
        event loop)."""
        plan = self.watch_plan
        if plan is None or not self.unenforced_keywords:
            return ()
        located = plan.located(self.unenforced_keywords)
        if self.validator is None:
            # The validator cannot read this schema: only duplicates are found.
            return tuple(k for k in located if k == "uniqueItems")
        plan.checks_nodes  # noqa: B018 - builds the node validators now, before the request runs
        return located

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since the start (or the last reset), net of rollbacks."""
        return self._num_accepted

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Accept tokens in order until one is rejected; returns how many were accepted."""
        n = 0
        for tok in token_ids:
            if not self.accept_token(tok):
                break
            n += 1
        return n

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar rejects it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32 tensor)."""

    @abstractmethod
    def forced_tokens(self, max_tokens: int | None = None) -> list[int]:
        """Tokens that must come next whatever the model prefers (possibly empty),
        at most `max_tokens` of them."""

    def rejection_reason(self, token_id: int) -> str | None:
        """The library's own reason for refusing `token_id` now (a limit it hit),
        or None when it gives none: the token simply does not fit the grammar."""
        return None

    def allows_any(self) -> bool:
        """Whether any token may come next (False: a dead end). Fills a mask
        of its own: for the rare path after a rejection, not every step."""
        bitmask = torch.zeros((1, self._tok.bitmask_words), dtype=torch.int32)
        self.fill_bitmask(bitmask, 0)
        return bool(bitmask.any())

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True when the output so far is complete (a stop token is allowed now)."""

    @abstractmethod
    def error(self) -> str | None:
        """A user-facing message if the matcher hit an internal limit, else None."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state, as if no token had been accepted."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens < 0 or num_tokens > self._num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens; {self._num_accepted} were accepted"
            )
        if num_tokens:
            self._rollback(num_tokens)
            self._num_accepted -= num_tokens

    @abstractmethod
    def _rollback(self, num_tokens: int) -> None: ...

    @property
    @abstractmethod
    def native(self) -> Any:
        """The library's own matcher object (for batch operations)."""

    def batch_native(self) -> Any | None:
        """`native` when a batch fill may compute this matcher's row, else None
        (terminated or failed: `fill_bitmask` writes its stop-only row)."""
        return None

    def _fill_eos_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self._tok.eos_only_row)

    def _valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self._tok.vocab_size

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend} spec={self.spec!r}>"
