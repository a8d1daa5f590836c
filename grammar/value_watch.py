"""Catching a JSON value that breaks its schema while the output is generated.

Neither grammar library enforces every keyword token by token
(`schema_keywords` lists what each leaves out): `uniqueItems` needs every
earlier item, `not` and `if`/`then`/`else` need to know the whole value, and
so on. What can be done is to notice a value that breaks one of those
keywords the moment it completes, and let the engine roll the output back to
the value's start and resample it (engine/resample.py). This module is the
noticing half; `watch_plan.WatchPlan` knows where each schema node applies.

`ValueWatch` reads the output's bytes as they are generated (a small JSON
scanner: containers, strings, values; the grammar guarantees the bytes are a
JSON prefix) and reports the first completed value that breaks a checked
node: an array item equal to an earlier item where `uniqueItems` applies
(found per item, JSON Schema equality: `1` equals `1.0`, objects ignore key
order, `true` is not `1`), or any value that fails a followed node holding a
keyword of `keywords` (validated against that node; the whole output against
the full schema, as the client wrote it).

A value is checked when the `,`, `]` or `}` after it arrives (so a number is
known to be complete), the whole output when its last container closes or at
`finish()` (a stop token after a top-level scalar). The watch keeps the bytes
it read so `truncate` can rebuild its state at an earlier offset (a
rollback), by reading them again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .json_values import canonical, parse_instance
from .watch_plan import Nodes, WatchPlan

if TYPE_CHECKING:
    from .validation import OutputValidator

log = logging.getLogger(__name__)

# Keywords a container can still satisfy by going on (more properties or items).
_EXTENDABLE = frozenset({"required", "dependentRequired", "minProperties",
                         "contains", "minContains", "minItems"})


@dataclass(frozen=True)
class Violation:
    """A completed value that breaks the schema.

    start: byte offset (in what the watch read) where the value begins (after
    its `[`, `,` or `:`). end: offset of the byte that showed it complete
    (the `,`, `]` or `}` after it; for the whole output, its end).
    keyword: what it breaks (`uniqueItems` for a duplicate item).
    """

    start: int
    end: int
    keyword: str = "uniqueItems"
    # The offset of the value's closing bracket when more properties or items
    # before it could mend the value (`keyword` asks for more: see
    # _EXTENDABLE); a resampler may first take back only that bracket.
    close: int | None = None


@dataclass
class _Frame:
    """An open container while scanning."""

    is_array: bool
    nodes: Nodes
    unique: bool = False
    index: int = 0  # arrays: the current item's index
    item_start: int = 0  # the current item's (arrays) or value's (objects) first byte
    seen: set[Any] = field(default_factory=set)  # unique arrays: canonical items so far
    key: str | None = None  # objects: the key whose value comes next
    expect_key: bool = True  # objects: the next string is a key
    slot: Nodes | None = None  # nodes of the current item or value (None: not computed yet)


class ValueWatch:
    """Reads one JSON output incrementally; reports values that break the schema.

    `keywords`: the keywords the grammar does not enforce (the matcher's
    `unenforced_keywords`); values are validated only where one of them
    applies. `full`: the validator of the whole schema, for the whole output.
    """

    def __init__(self, plan: WatchPlan, keywords: tuple[str, ...] = (),
                 full: OutputValidator | None = None):
        self.plan = plan
        # Without the full schema's validator nothing can be validated (the
        # schema is unreadable to it): duplicates are still found.
        self._keywords = frozenset(keywords) if full is not None else frozenset()
        self._nodes_checked = bool(self._keywords) and plan.checks_nodes
        self._root = plan.expand((plan.root,))
        # The whole output is validated when the top-level value holds a
        # keyword itself, or when no node can be checked on its own.
        whole = bool(self._keywords) and (not self._nodes_checked
                                          or any(self._needs_check(n) for n in self._root))
        self._full = full if whole else None
        self._data = bytearray()
        self._reset()

    def _reset(self) -> None:
        self._pos = 0
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._root_start: int | None = None  # first byte of the top-level value
        self._done = False  # the whole output was checked
        self._gave_up = False  # a violation stays: nothing more is checked

    @property
    def size(self) -> int:
        """Bytes read so far."""
        return len(self._data)

    @property
    def stable(self) -> int:
        """Bytes no check can take back: up to the start of the earliest open
        value that is checked (everything, when none is open)."""
        if self._gave_up:
            return len(self._data)
        if self._full is not None and not self._done:
            return 0 if self._root_start is None else self._root_start
        for frame in self._stack:
            if frame.unique or self._slot_checked(frame):
                return frame.item_start
        return len(self._data)

    def feed(self, data: bytes) -> Violation | None:
        """Read more output; the first violation completed in it, if any.

        Reading goes on past a violation (the engine may keep the value when it
        runs out of retries); after a rollback, `truncate` the watch.
        """
        self._data += data
        first: Violation | None = None
        while self._pos < len(self._data):
            found = self._step(self._data[self._pos])
            self._pos += 1
            if found is not None and first is None and not self._gave_up:
                first = found
        return first

    def give_up(self) -> None:
        """A violation stays in the output (no retries left): check nothing
        more (the finished output fails validation anyway) and hold nothing back."""
        self._gave_up = True

    def finish(self) -> Violation | None:
        """The output ended (a stop token): the whole output's violation, if
        it was not checked when its last container closed."""
        if self._done or self._stack or self._gave_up:
            return None
        return self._check_whole(len(self._data))

    def truncate(self, size: int) -> None:
        """Forget everything read after byte `size` (the output was rolled back)."""
        kept = bytes(self._data[:size])
        self._data = bytearray()
        self._reset()
        self.feed(kept)

    # -- the scanner ----------------------------------------------------------------
    def _step(self, byte: int) -> Violation | None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif byte == 0x5C:  # backslash
                self._escaped = True
            elif byte == 0x22:  # closing quote
                self._in_string = False
                self._string_done()
            return None
        if self._root_start is None and byte not in b" \t\r\n":
            self._root_start = self._pos
        if byte == 0x22:
            self._in_string = True
            self._string_start = self._pos
        elif byte in (0x5B, 0x7B):  # [ {
            self._open(byte == 0x5B)
        elif byte == 0x3A:  # :
            if self._stack and not self._stack[-1].is_array:
                frame = self._stack[-1]
                frame.expect_key, frame.item_start, frame.slot = False, self._pos + 1, None
        elif byte == 0x2C:  # ,
            if self._stack:
                frame = self._stack[-1]
                found = self._slot_done(frame)
                if frame.is_array:
                    frame.index += 1
                    frame.item_start, frame.slot = self._pos + 1, None
                else:
                    frame.expect_key, frame.key = True, None
                return found
        elif byte in (0x5D, 0x7D) and self._stack:  # ] }
            frame = self._stack[-1]
            found = self._slot_done(frame)
            self._stack.pop()
            if found is None and not self._stack:
                found = self._check_whole(self._pos + 1)
            return found
        return None

    def _open(self, is_array: bool) -> None:
        nodes = self._root if not self._stack else self._slot_nodes(self._stack[-1])
        frame = _Frame(is_array, nodes, item_start=self._pos + 1)
        frame.unique = is_array and WatchPlan.unique(nodes)
        self._stack.append(frame)

    def _slot_nodes(self, frame: _Frame) -> Nodes:
        """The nodes of the value now being read inside `frame`."""
        if frame.slot is None:
            if frame.is_array:
                frame.slot = self.plan.item_nodes(frame.nodes, frame.index)
            elif frame.key is not None and not frame.expect_key:
                frame.slot = self.plan.property_nodes(frame.nodes, frame.key)
            else:
                return ()
        return frame.slot

    def _slot_checked(self, frame: _Frame) -> bool:
        if not self._nodes_checked or (not frame.is_array and frame.expect_key):
            return False
        return any(self._needs_check(node) for node in self._slot_nodes(frame))

    def _needs_check(self, node: Any) -> bool:
        return self.plan.needs_check(node, self._keywords)

    def _string_done(self) -> None:
        if not self._stack:
            return
        frame = self._stack[-1]
        if not frame.is_array and frame.expect_key:
            try:
                frame.key = json.loads(self._data[self._string_start:self._pos + 1].decode("utf-8"))
            except ValueError:
                frame.key = None

    def _slot_done(self, frame: _Frame) -> Violation | None:
        """The item (or property value) of `frame` just completed: check it."""
        if self._gave_up or (not frame.is_array and frame.expect_key):
            return None  # `{}` or a trailing `}` after a key: no value here
        raw = bytes(self._data[frame.item_start:self._pos]).strip()
        if not raw:
            return None  # `[]`, or whitespace before `]`
        checked = self._slot_checked(frame)
        if not (frame.unique or checked):
            return None
        try:
            # Read as the final verdict reads it (numbers past a double's range included).
            return self._check_slot(frame, parse_instance(raw.decode("utf-8")), checked)
        except Exception:  # noqa: BLE001 - not JSON, too deep, odd to the validator: the final check says
            log.debug("a value could not be checked while generating", exc_info=True)
            return None

    def _check_slot(self, frame: _Frame, value: Any, checked: bool) -> Violation | None:
        if frame.unique:
            key = canonical(value)
            if key in frame.seen:
                return Violation(frame.item_start, self._pos)
            frame.seen.add(key)
        if checked:
            for node in self._slot_nodes(frame):
                if self._needs_check(node):
                    validator = self.plan.validator(node)
                    if validator is not None and not validator.is_valid(value):
                        keyword, path = _first_error(validator, value)
                        return Violation(frame.item_start, self._pos, keyword,
                                         self._close(self._pos, keyword, path))
        return None

    def _close(self, end: int, keyword: str, path: str) -> int | None:
        """Where the container ending before byte `end` closes, when its own
        failing `keyword` asks for more content (see Violation.close)."""
        if keyword not in _EXTENDABLE or path:
            return None
        close = end - 1
        while close >= 0 and self._data[close] in b" \t\r\n":
            close -= 1
        return close if close >= 0 and self._data[close] in b"]}" else None

    def _check_whole(self, end: int) -> Violation | None:
        """The output's last container closed (or it ended): validate it whole."""
        self._done = True
        if self._full is None or self._root_start is None:
            return None
        result = self._full.validate_text(bytes(self._data[:end]).decode("utf-8", "replace"))
        if result.valid or not result.checked:
            return None
        return Violation(self._root_start, end, result.keyword,
                         self._close(end, result.keyword, result.instance_path))


def _first_error(validator: Any, value: Any) -> tuple[str, str]:
    """(schema keyword, instance path) of the first error `validator` finds in `value`."""
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return "", ""
    keyword = next((str(p) for p in reversed(error.schema_path) if isinstance(p, str)), "")
    return keyword, "".join(f"/{p}" for p in error.instance_path)
