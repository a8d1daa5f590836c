"""Catching a duplicate array item while a JSON output is generated (`uniqueItems`).

Neither grammar library can enforce `uniqueItems` token by token: whether an
item is allowed depends on every earlier item, which no context-free grammar
can express. What can be done is to notice a duplicate the moment its item
completes, and let the engine roll the output back to the item's start and
resample it (engine/resample.py). This module is the noticing half, pure and
library-free:

- `UniqueItemsPlan.for_schema(schema)` finds where in an instance
  `uniqueItems: true` applies, following only keywords that apply to *every*
  instance at a location (`properties`, `additionalProperties`, `items`,
  `prefixItems`, `allOf`, local `$ref`). A `uniqueItems` that is reachable
  only through `anyOf`/`oneOf`/`if`/`not`/... is not tracked (whether it
  applies depends on which branch the value matches), so watching never
  rejects an item the schema allows; `covers_all` says whether every
  `uniqueItems` of the schema is tracked (strict mode relies on it).
- `UniqueItemsWatch` reads the output's bytes as they are generated (a small
  JSON scanner: containers, strings, item boundaries; the grammar guarantees
  the bytes are a JSON prefix) and reports the first item of a tracked array
  that equals an earlier item of the same array, with the byte offset where
  that item starts. Equality is JSON Schema's: `1` equals `1.0`, objects
  ignore key order, `true` is not `1`.

An item is checked when the `,` or `]` after it arrives, so a number is known
to be complete. The watch keeps the bytes it read so `truncate` can rebuild
its state at an earlier offset (a rollback), by reading them again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .schema_normalize import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

# Schema nodes that all apply to one instance location (empty: nothing tracked).
Nodes = tuple[Any, ...]
# Keywords whose subschemas apply to every instance at their location.
_FOLLOWED = ("properties", "additionalProperties", "items", "prefixItems", "additionalItems", "allOf")
# Definitions are reached through `$ref`, not by walking into them.
_DEFS = ("$defs", "definitions")


def _subschemas(node: dict[str, Any], skip: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """(keyword, subschema) pairs directly under a schema node."""
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        if key in skip:
            continue
        if key in SUBSCHEMA:
            out.extend((key, v) for v in (value if isinstance(value, list) else [value]))
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            out.extend((key, v) for v in value.values())
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            out.extend((key, v) for v in value)
    return out


@dataclass(frozen=True)
class UniqueItemsPlan:
    """Where `uniqueItems` applies in instances of one schema.

    root: the schema (normalized, or as written). covers_all: every
    `uniqueItems: true` in it is tracked by a watch (none hides behind a
    branch whose choice depends on the value).
    """

    root: Any
    covers_all: bool

    @staticmethod
    def for_schema(schema: Any) -> UniqueItemsPlan | None:
        """The plan of `schema`, or None when it has no `uniqueItems: true` at all."""
        probe = UniqueItemsPlan(schema, covers_all=False)
        if not probe._contains_unique(schema, set()):
            return None
        return UniqueItemsPlan(schema, covers_all=not probe._hidden_unique(schema, set()))

    # -- following an instance ----------------------------------------------
    def expand(self, nodes: Nodes) -> Nodes:
        """`nodes` plus what applies along with them: `allOf` members and `$ref` targets."""
        out: list[Any] = []
        seen: set[int] = set()
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = self._resolve(ref)
                if target is not None:
                    stack.append(target)
            members = node.get("allOf")
            if isinstance(members, list):
                stack.extend(members)
        return tuple(out)

    def item_nodes(self, nodes: Nodes, index: int) -> Nodes:
        """The schema nodes of item `index` of an array matched by `nodes`."""
        out: list[Any] = []
        for node in nodes:
            prefix = node.get("prefixItems")
            items = node.get("items")
            if isinstance(items, list):  # draft-07 tuple form, left as written
                prefix, items = items, node.get("additionalItems")
            if isinstance(prefix, list) and index < len(prefix):
                out.append(prefix[index])
            elif isinstance(items, dict):
                out.append(items)
        return self.expand(tuple(out))

    def property_nodes(self, nodes: Nodes, key: str) -> Nodes:
        """The schema nodes of property `key` of an object matched by `nodes`."""
        out: list[Any] = []
        for node in nodes:
            props = node.get("properties")
            if isinstance(props, dict) and key in props:
                out.append(props[key])
            elif "patternProperties" not in node and isinstance(node.get("additionalProperties"), dict):
                # With patternProperties, whether additionalProperties applies
                # depends on the key's match: not followed.
                out.append(node["additionalProperties"])
        return self.expand(tuple(out))

    @staticmethod
    def unique(nodes: Nodes) -> bool:
        return any(node.get("uniqueItems") is True for node in nodes)

    # -- coverage ---------------------------------------------------------------------
    def _contains_unique(self, node: Any, seen: set[int]) -> bool:
        """Whether a `uniqueItems: true` lies anywhere under `node`, `$ref`s followed."""
        if not isinstance(node, dict) or id(node) in seen:
            return False
        seen.add(id(node))
        if node.get("uniqueItems") is True:
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and self._contains_unique(self._resolve(ref), seen):
            return True
        return any(self._contains_unique(sub, seen) for _, sub in _subschemas(node, skip=_DEFS))

    def _hidden_unique(self, node: Any, seen: set[int]) -> bool:
        """Whether a `uniqueItems: true` is reachable from `node` through a keyword
        a watch does not follow (a branch chosen by the value)."""
        if not isinstance(node, dict) or id(node) in seen:
            return False
        seen.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and self._hidden_unique(self._resolve(ref), seen):
            return True
        followed = set(_FOLLOWED)
        if "patternProperties" in node:
            followed.discard("additionalProperties")
        for key, sub in _subschemas(node, skip=_DEFS):
            if key in followed:
                if self._hidden_unique(sub, seen):
                    return True
            elif self._contains_unique(sub, set()):
                return True
        return False

    def _resolve(self, ref: str) -> Any:
        """A local JSON pointer (`#/$defs/x`); None for anything else."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node


@dataclass(frozen=True)
class Duplicate:
    """An array item equal to an earlier item of its array.

    start: byte offset (in what the watch read) where the item begins, just
    after its `[` or `,`. end: offset of the `,` or `]` that completed it.
    """

    start: int
    end: int


@dataclass
class _Frame:
    """An open container while scanning."""

    is_array: bool
    nodes: Nodes
    unique: bool = False
    index: int = 0  # arrays: the current item's index
    item_start: int = 0  # arrays: where the current item begins
    seen: set[Any] = field(default_factory=set)  # unique arrays: canonical items so far
    key: str | None = None  # objects: the key whose value comes next
    expect_key: bool = True  # objects: the next string is a key


class UniqueItemsWatch:
    """Reads one JSON output incrementally; reports duplicate items of tracked arrays."""

    def __init__(self, plan: UniqueItemsPlan):
        self.plan = plan
        self._root = plan.expand((plan.root,))
        self._data = bytearray()
        self._reset()

    def _reset(self) -> None:
        self._pos = 0
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escaped = False
        self._string_start = 0

    @property
    def size(self) -> int:
        """Bytes read so far."""
        return len(self._data)

    @property
    def stable(self) -> int:
        """Bytes that no duplicate can take back: up to the start of the
        earliest open item of a tracked array (everything, when none is open)."""
        for frame in self._stack:
            if frame.unique:
                return frame.item_start
        return len(self._data)

    def feed(self, data: bytes) -> Duplicate | None:
        """Read more output; the first duplicate item completed in it, if any.

        Reading goes on past a duplicate (the engine may keep it when it runs
        out of retries); after a rollback, `truncate` the watch.
        """
        self._data += data
        first: Duplicate | None = None
        while self._pos < len(self._data):
            found = self._step(self._data[self._pos])
            self._pos += 1
            if found is not None and first is None:
                first = found
        return first

    def truncate(self, size: int) -> None:
        """Forget everything read after byte `size` (the output was rolled back)."""
        kept = bytes(self._data[:size])
        self._data = bytearray()
        self._reset()
        self.feed(kept)

    # -- the scanner ----------------------------------------------------------------
    def _step(self, byte: int) -> Duplicate | None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif byte == 0x5C:  # backslash
                self._escaped = True
            elif byte == 0x22:  # closing quote
                self._in_string = False
                self._string_done()
            return None
        if byte == 0x22:
            self._in_string = True
            self._string_start = self._pos
        elif byte in (0x5B, 0x7B):  # [ {
            self._open(byte == 0x5B)
        elif byte == 0x3A:  # :
            if self._stack and not self._stack[-1].is_array:
                self._stack[-1].expect_key = False
        elif byte == 0x2C:  # ,
            if self._stack:
                frame = self._stack[-1]
                if frame.is_array:
                    found = self._item_done(frame)
                    frame.index += 1
                    frame.item_start = self._pos + 1
                    return found
                frame.expect_key, frame.key = True, None
        elif byte in (0x5D, 0x7D) and self._stack:  # ] }
            frame = self._stack.pop()
            if frame.is_array:
                return self._item_done(frame)
        return None

    def _open(self, is_array: bool) -> None:
        nodes: Nodes
        if not self._stack:
            nodes = self._root
        else:
            parent = self._stack[-1]
            if parent.is_array:
                nodes = self.plan.item_nodes(parent.nodes, parent.index)
            elif parent.key is not None:
                nodes = self.plan.property_nodes(parent.nodes, parent.key)
            else:
                nodes = ()
        if not is_array:
            self._stack.append(_Frame(False, nodes))
            return
        self._stack.append(_Frame(True, nodes, unique=UniqueItemsPlan.unique(nodes),
                                  item_start=self._pos + 1))

    def _string_done(self) -> None:
        if not self._stack:
            return
        frame = self._stack[-1]
        if not frame.is_array and frame.expect_key:
            try:
                frame.key = json.loads(self._data[self._string_start:self._pos + 1].decode("utf-8"))
            except ValueError:
                frame.key = None

    def _item_done(self, frame: _Frame) -> Duplicate | None:
        if not frame.unique:
            return None
        raw = bytes(self._data[frame.item_start:self._pos]).strip()
        if not raw:
            return None  # `[]`, or whitespace before `]`
        try:
            value = canonical(json.loads(raw.decode("utf-8")))
        except ValueError:
            return None  # not JSON after all: nothing to compare (the validator will say)
        if value in frame.seen:
            return Duplicate(frame.item_start, self._pos)
        frame.seen.add(value)
        return None


def canonical(value: Any) -> Any:
    """A hashable form of a JSON value under JSON Schema equality."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)  # 1 == 1.0, with equal hashes
    if isinstance(value, str):
        return ("s", value)
    if value is None:
        return ("z",)
    if isinstance(value, list):
        return ("a", tuple(canonical(v) for v in value))
    return ("o", frozenset((k, canonical(v)) for k, v in value.items()))
