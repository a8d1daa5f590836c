"""Resampling a JSON value that breaks the schema in a way the grammar cannot see.

A JSON-schema request that resamples (`Constraint.resample`: on unless the
request or the server turns it off; strict always does) whose grammar leaves
a keyword unenforced gets a `Resampler`.
After each step the tokens its matcher has accepted are read by a
`grammar.value_watch.ValueWatch`; when a value completes that breaks the
schema (an item equal to an earlier one under `uniqueItems`, a value that
`not`, `if`/`then`/`else`, `dependentRequired`, ... reject), the postprocess
rolls the request back to the start of that value (postprocess.py: the
context's tokens, its matcher, its KV pages, its output stream) and the value
is generated again, with the token the model chose first inside the value
masked at that point (a *ban*: it holds only while everything before it, from
the value's start, is exactly as it was). Forced tokens at the value's start
come back the same, so the ban lands on the model's own first choice. When
more properties or items could mend the value (`Violation.close`: a missing
`dependentRequired` property, too few `contains` matches, ...), only its
closing bracket is taken back first and banned there. A stop token after a
top-level scalar that breaks the schema is handled like a completed value
(`check_end`).

Bounds: `MAX_RETRIES_PER_VALUE` rollbacks to the same position and
`MAX_RETRIES` per request. Past them, or when the whole value was forced by the
grammar (the model made no choice to mask), the value stays and the
finished output fails validation (strict: `SCHEMA_VIOLATION`). Every
rollback counts in `usage.schema_retries`.

Streaming: text that a rollback could take back is never sent. While a
checked value is open, the stream holds back from that value's start
(`stable_tokens`), so a client sees checked values only once they pass; see
output.py.

The watch reads the tokens the matcher reads: from `grammar_start`, which is
the answer's first token after a reasoning model's thought (reasoning.py).

Structural tags (and so tool calls): the JSON inside each tag whose schema
leaves keywords to checks is watched the same way (`watch_for`: a
`grammar.tag_watch.TagWatch`, which runs a ValueWatch over each such tag's
content); the free text around the tags is never checked, and the stream
holds back only an open checked value inside a tag.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from grammar.matcher import Matcher
from grammar.value_watch import ValueWatch, Violation

MAX_RETRIES_PER_VALUE = 3
MAX_RETRIES = 16


class Watch(Protocol):
    """What a Resampler reads the output with: a `ValueWatch` (a JSON answer)
    or a `grammar.tag_watch.TagWatch` (the tags of a structural tag). Offsets
    are bytes of what it read."""

    @property
    def size(self) -> int: ...

    @property
    def stable(self) -> int: ...

    def feed(self, data: bytes) -> Violation | None: ...

    def finish(self) -> Violation | None: ...

    def give_up(self) -> None: ...

    def truncate(self, size: int) -> None: ...


def watch_for(matcher: Matcher) -> Watch | None:
    """The watch of a resampling request's output, when its grammar leaves
    keywords to checks: for a JSON schema, of the answer; for a structural
    tag, of the JSON inside its tags. None when there is nothing to check."""
    if matcher.tag_plan is not None:
        return matcher.tag_plan.watch()
    if matcher.watch_plan is not None and matcher.unenforced_keywords:
        return ValueWatch(matcher.watch_plan, matcher.unenforced_keywords, matcher.validator)
    return None


class Progress(Protocol):
    """What a Resampler reads of a request's grammar state (context.GrammarState)."""

    @property
    def grammar_idx(self) -> int: ...

    @property
    def forced_positions(self) -> set[int]: ...


class Output(Protocol):
    """What a Resampler reads of a request (a TextContext; a protocol so that
    context.py can refer to this module without an import cycle)."""

    tokens: np.ndarray
    prompt_len: int

    @property
    def grammar(self) -> Progress: ...

    @property
    def num_final_tokens(self) -> int: ...

    @property
    def grammar_start(self) -> int | None: ...


@dataclass(frozen=True)
class Rollback:
    """Where a request goes back to: `position` is the first token dropped;
    `keyword` is what the dropped value broke (for the log)."""

    position: int
    keyword: str = ""


class Resampler:
    """One resampling request's value watch, bans and retry counts (engine thread only)."""

    def __init__(self, watch: Watch, token_bytes: Callable[[int], bytes]):
        self.watch = watch
        self._token_bytes = token_bytes
        # Byte offset, in what the watch read, after each generated token fed to it.
        self._ends: list[int] = []
        # (value start position, tokens from there up to the masked position) -> masked tokens.
        self._bans: dict[tuple[int, tuple[int, ...]], set[int]] = {}
        self._tries: dict[int, int] = {}  # rollbacks per value start position
        self.retries = 0

    def stable_tokens(self, ctx: Output) -> int:
        """Generated tokens no rollback can take back (the stream may send them)."""
        return _origin(ctx) - ctx.prompt_len + bisect.bisect_right(self._ends, self.watch.stable)

    def check(self, ctx: Output, floor: int) -> Rollback | None:
        """Read ctx's newly accepted tokens; the rollback to make now, if any.

        `floor`: generated tokens already sent to the client (never taken back).
        """
        first = None
        for pos in range(_origin(ctx) + len(self._ends), ctx.grammar.grammar_idx):
            found = self.watch.feed(self._token_bytes(int(ctx.tokens[pos])))
            self._ends.append(self.watch.size)
            first = first or found
        return self._roll_back(ctx, first, floor)

    def check_end(self, ctx: Output, floor: int) -> Rollback | None:
        """ctx sampled a stop token: the rollback to make instead of finishing,
        if the whole output breaks the schema and retries remain."""
        found = self.check(ctx, floor)
        return found if found is not None else self._roll_back(ctx, self.watch.finish(), floor)

    def _roll_back(self, ctx: Output, first: Violation | None, floor: int) -> Rollback | None:
        if first is None:
            return None
        value_at = _origin(ctx) + bisect.bisect_right(self._ends, first.start)
        if first.close is not None:
            # More properties or items could mend the value: first take back
            # only its closing bracket, and ban it there. Its tries count for
            # the value (the bracket moves on with each retry).
            keep = bisect.bisect_right(self._ends, first.close)
            if self._ban(ctx, keep, _origin(ctx) + keep, floor, value_at):
                return Rollback(_origin(ctx) + keep, first.keyword)
        keep = bisect.bisect_right(self._ends, first.start)
        if self._ban(ctx, keep, self._first_choice(ctx, keep, first.start, first.end), floor):
            return Rollback(_origin(ctx) + keep, first.keyword)
        self.watch.give_up()  # the value stays; validation reports it
        return None

    def _ban(self, ctx: Output, keep: int, choice: int | None, floor: int, value_at: int | None = None) -> bool:
        """Roll back to the watch's token `keep` and ban the token at `choice`
        (at or after it), if retries remain; whether it did. `floor` counts
        generated tokens (sent to the client); `value_at` is where the value's
        tries are counted (default: the rollback's position)."""
        position = _origin(ctx) + keep
        counted = position if value_at is None else value_at
        if (choice is None or choice in ctx.grammar.forced_positions or position - ctx.prompt_len < floor
                or self.retries >= MAX_RETRIES or self._tries.get(counted, 0) >= MAX_RETRIES_PER_VALUE):
            return False
        # Bans and counts past this point described tokens that are going away.
        self._bans = {k: v for k, v in self._bans.items() if k[0] <= position}
        self._tries = {k: v for k, v in self._tries.items() if k <= position}
        prefix = tuple(int(t) for t in ctx.tokens[position:choice])
        self._bans.setdefault((position, prefix), set()).add(int(ctx.tokens[choice]))
        self._tries[counted] = self._tries.get(counted, 0) + 1
        self.retries += 1
        del self._ends[keep:]
        self.watch.truncate(self._ends[-1] if self._ends else 0)
        return True

    def _first_choice(self, ctx: Output, keep: int, value_start: int, value_end: int) -> int | None:
        """Position of the first token inside the value that the model chose (not
        forced) and that says something of it: a token whose part of the value
        is only layout (whitespace, a string's opening quote, or the separator
        and quote a token like `","` brings from the item before) stays in the
        ban's prefix, else the ban would fall on layout and the model write the
        same value again. The first chosen token when the value has no other."""
        layout = None
        for i in range(keep, len(self._ends)):
            start_byte = self._ends[i - 1] if i else 0
            if start_byte >= value_end:
                break
            pos = _origin(ctx) + i
            if pos in ctx.grammar.forced_positions:
                continue
            piece = self._token_bytes(int(ctx.tokens[pos]))
            inside = piece[max(0, value_start - start_byte):max(0, value_end - start_byte)]
            if inside.strip(b' \t\r\n"'):
                return pos
            layout = pos if layout is None else layout
        return layout

    def mask(self, ctx: Output, row: torch.Tensor) -> None:
        """Clear the banned tokens for ctx's next sample from its bitmask row
        (int32, CPU), unless nothing the grammar allows would be left."""
        position = ctx.num_final_tokens  # the placeholder the step samples
        banned: set[int] = set()
        for (start, prefix), tokens in self._bans.items():
            if start + len(prefix) == position and tuple(int(t) for t in ctx.tokens[start:position]) == prefix:
                banned |= tokens
        if not banned:
            return
        words = row.numpy().view(np.uint32)
        narrowed = words.copy()
        for token in banned:
            narrowed[token >> 5] &= ~np.uint32(1 << (token & 31))
        if narrowed.any():
            words[:] = narrowed



def _origin(ctx: Output) -> int:
    """Position of the first token the watch reads (the grammar's first)."""
    start = ctx.grammar_start
    assert start is not None, "a resampler reads an answer that has started"
    return start
