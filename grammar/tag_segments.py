"""Finding the tags of a structural tag's output, and their contents, as text arrives.

A structural tag (structural_tag.py) is free text with tags in it: a `begin`
string, a content (here: one JSON value, or any text), an `end` string. The
grammar guarantees the shape, so the text can be cut into tag contents
without parsing it against the format: outside a tag, free text never holds a
trigger (every `begin` starts with one), so the earliest `begin` in it starts a
tag; a JSON content ends where its value does (its last bracket or quote, or
the first byte after a bare number or literal); then, after any whitespace,
comes the tag's `end`. Any-text contents end at the first `end`.

`shapes_of` reads the tags of a normalized structural tag whose tags can be
delimited so (triggered tags, tags with a separator, one tag: string begins
and ends, JSON-schema or any-text contents); `TagScanner` cuts text read in
pieces of any size into `Piece`s, the same ones whatever the pieces. The
value checks of resampling requests (tag_watch.py) and the check of finished
outputs read tag contents through it, so both read the same text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_WHITESPACE = b" \t\r\n"
_LITERALS = (b"true", b"false", b"null")
_DIGITS = frozenset(b"0123456789")
# A JSON number, as a state machine: state -> (byte class, next state). A
# byte with no move ends the number before it (so an `end` such as "-->"
# right after "2" is not read into it).
_NUMBER: dict[str, tuple[tuple[frozenset[int], str], ...]] = {
    "start": ((frozenset(b"-"), "sign"), (frozenset(b"0"), "zero"), (frozenset(b"123456789"), "int")),
    "sign": ((frozenset(b"0"), "zero"), (frozenset(b"123456789"), "int")),
    "zero": ((frozenset(b"."), "dot"), (frozenset(b"eE"), "exp")),
    "int": ((_DIGITS, "int"), (frozenset(b"."), "dot"), (frozenset(b"eE"), "exp")),
    "dot": ((_DIGITS, "frac"),),
    "frac": ((_DIGITS, "frac"), (frozenset(b"eE"), "exp")),
    "exp": ((frozenset(b"+-"), "exp_sign"), (_DIGITS, "exp_digits")),
    "exp_sign": ((_DIGITS, "exp_digits"),),
    "exp_digits": ((_DIGITS, "exp_digits"),),
}


def _number_move(state: str, byte: int) -> str | None:
    return next((to for bytes_, to in _NUMBER[state] if byte in bytes_), None)


@dataclass(frozen=True)
class TagShape:
    """One tag of the format: its strings, and whether its content is one JSON
    value (else any text up to `end`). `schema`: the content's JSON schema."""

    begin: bytes
    end: bytes
    json: bool
    schema: Any = None


def shapes_of(tag: dict[str, Any]) -> tuple[TagShape, ...] | None:
    """The tags of a normalized structural tag (`{"type", "format"}`), in order;
    None when the format is not one whose contents `TagScanner` can find."""
    fmt = tag.get("format")
    if not isinstance(fmt, dict):
        return None
    kind = fmt.get("type")
    if kind == "tag":
        items: Any = [fmt]
    elif kind in ("triggered_tags", "tags_with_separator"):
        items = fmt.get("tags")
    else:
        return None
    if not isinstance(items, list) or not items:
        return None
    shapes = []
    for item in items:
        shape = _shape(item)
        if shape is None:
            return None
        shapes.append(shape)
    return tuple(shapes)


def _shape(item: Any) -> TagShape | None:
    if not isinstance(item, dict) or item.get("type", "tag") != "tag":
        return None
    begin, end, content = item.get("begin"), item.get("end"), item.get("content")
    if not isinstance(begin, str) or not begin or not isinstance(end, str) or not end \
            or not isinstance(content, dict):
        return None
    if content.get("type") == "json_schema" and content.get("style", "json") == "json":
        return TagShape(begin.encode("utf-8"), end.encode("utf-8"), True, content.get("json_schema"))
    if content.get("type") == "any_text":
        return TagShape(begin.encode("utf-8"), end.encode("utf-8"), False)
    return None


@dataclass(frozen=True)
class Piece:
    """What a stretch of text is. `kind` "open": tag `tag`'s content starts at
    byte `at`; "content": `data` belongs to the open content; "close": the
    open content ended before byte `at`."""

    kind: str
    at: int
    tag: int = -1
    data: bytes = b""


@dataclass(frozen=True)
class Segment:
    """A tag's content: bytes [start, end) of the text (end None: still open)."""

    tag: int
    start: int
    end: int | None


class _JsonExtent:
    """Where one JSON value ends, byte by byte (the grammar made it JSON)."""

    MORE, DONE_WITH, DONE_BEFORE = 0, 1, 2

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.started = self.scalar = False
        self._scalar = bytearray()  # a bare literal so far
        self._number: str | None = None  # a bare number's state

    def step(self, byte: int) -> int:
        """MORE: `byte` is in the value, which goes on; DONE_WITH: it ends the
        value; DONE_BEFORE: the value ended just before it."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif byte == 0x5C:
                self.escaped = True
            elif byte == 0x22:
                self.in_string = False
                return self.DONE_WITH if self.depth == 0 else self.MORE
            return self.MORE
        if self.scalar:
            return self.MORE if self._continues(byte) else self.DONE_BEFORE
        if not self.started and byte in _WHITESPACE:
            return self.MORE
        self.started = True
        if byte == 0x22:
            self.in_string = True
        elif byte in (0x5B, 0x7B):
            self.depth += 1
        elif byte in (0x5D, 0x7D):
            self.depth -= 1
            if self.depth <= 0:
                return self.DONE_WITH
        elif self.depth == 0:
            self.scalar = True
            self._scalar.append(byte)
            self._number = _number_move("start", byte)
        return self.MORE

    def _continues(self, byte: int) -> bool:
        """Whether `byte` continues the bare number or literal (true, false, null)."""
        if self._number is not None:
            moved = _number_move(self._number, byte)
            if moved is not None:
                self._number = moved
            return moved is not None
        self._scalar.append(byte)
        return any(lit.startswith(self._scalar) for lit in _LITERALS)


class TagScanner:
    """Cuts a structural tag's output into free text and tag contents, read
    incrementally (`feed` any pieces: the same `Piece`s come out)."""

    def __init__(self, shapes: tuple[TagShape, ...]):
        self.shapes = shapes
        firsts = sorted({s.begin[0] for s in shapes})
        self._first = re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in firsts) + b"]")
        self._data = bytearray()
        self._pos = 0  # the next byte to read
        self._tag: int | None = None  # the open tag (its content or its end)
        self._extent: _JsonExtent | None = None  # the open JSON content's scanner
        self._in_content = False
        self.segments: list[Segment] = []

    @property
    def size(self) -> int:
        """Bytes read so far."""
        return len(self._data)

    @property
    def text(self) -> bytes:
        """Everything read so far."""
        return bytes(self._data)

    def feed(self, data: bytes) -> list[Piece]:
        """Read more text; what it is, in order."""
        self._data += data
        pieces: list[Piece] = []
        while self._pos < len(self._data):
            if self._tag is None:
                if not self._find_begin(pieces):
                    break
            elif self._in_content:
                self._read_content(pieces)
            elif not self._find_end(pieces):
                break
        return pieces

    def _find_begin(self, pieces: list[Piece]) -> bool:
        """Free text: open the next tag if its begin is known; whether it did."""
        data = self._data
        while True:
            found = self._first.search(data, self._pos)
            if found is None:
                self._pos = len(data)
                return False
            at = found.start()
            full = [i for i, s in enumerate(self.shapes) if data.startswith(s.begin, at)]
            partial = any(len(data) - at < len(s.begin) and s.begin.startswith(bytes(data[at:]))
                          for s in self.shapes)
            if partial:
                self._pos = at  # wait for more text
                return False
            if full:
                tag = max(full, key=lambda i: len(self.shapes[i].begin))
                start = at + len(self.shapes[tag].begin)
                self._tag, self._pos, self._in_content = tag, start, True
                self._extent = _JsonExtent() if self.shapes[tag].json else None
                self.segments.append(Segment(tag, start, None))
                pieces.append(Piece("open", start, tag))
                return True
            self._pos = at + 1

    def _read_content(self, pieces: list[Piece]) -> None:
        """Inside a content: pass its bytes on, and close it where its value ends."""
        extent = self._extent
        if extent is None:  # any text: it ends where the first `end` starts
            self._in_content = False
            return
        data, start = self._data, self._pos
        pos, done = start, None
        while pos < len(data):
            verdict = extent.step(data[pos])
            if verdict == _JsonExtent.DONE_BEFORE:
                done = pos
                break
            pos += 1
            if verdict == _JsonExtent.DONE_WITH:
                done = pos
                break
        if pos > start:
            pieces.append(Piece("content", start, self.segments[-1].tag, bytes(data[start:pos])))
        self._pos = pos
        if done is not None:
            self._close(pieces, done)

    def _close(self, pieces: list[Piece], at: int) -> None:
        self._in_content, self._extent = False, None
        last = self.segments[-1]
        self.segments[-1] = Segment(last.tag, last.start, at)
        pieces.append(Piece("close", at, last.tag))

    def _find_end(self, pieces: list[Piece]) -> bool:
        """After a content: skip to the end of the tag's `end`; whether it came."""
        assert self._tag is not None
        end = self.shapes[self._tag].end
        at = self._data.find(end, self._pos)
        if at < 0:
            self._pos = max(self._pos, len(self._data) - len(end) + 1)
            return False
        if self.segments[-1].end is None:  # any text ends here
            self._close(pieces, at)
        self._tag, self._pos = None, at + len(end)
        return True


def contents(shapes: tuple[TagShape, ...], text: str) -> list[tuple[int, str]]:
    """(tag index, content text) of every whole tag content in a finished output."""
    scanner = TagScanner(shapes)
    data = text.encode("utf-8")
    scanner.feed(data)
    return [(s.tag, data[s.start:s.end].decode("utf-8", "replace"))
            for s in scanner.segments if s.end is not None]
