"""Catching a JSON value that breaks its schema while the output is generated.

Neither grammar library enforces every keyword token by token
(`schema_keywords` lists what each leaves out): `uniqueItems` needs every
earlier item, `not` and `if`/`then`/`else` need to know the whole value, and
so on. What can be done is to notice a value that breaks one of those
keywords the moment it completes, and let the engine roll the output back to
the value's start and resample it (engine/resample.py). This module is the
noticing half, pure apart from the validator it calls:

- `WatchPlan.for_schema(schema)` knows where each schema node applies,
  following only keywords that apply to *every* instance at a location
  (`properties`, `additionalProperties`, `items`, `prefixItems`, `allOf`,
  local `$ref`): a *followed* node. A check validates a completed value
  against a followed node that applies to it, so it never rejects a value the
  schema allows. A keyword inside a branch chosen by the value (`anyOf`,
  `oneOf`, `if`, `not`, ...) is checked as part of the nearest followed node
  that holds the branch. `located(keywords)` lists the keywords whose every
  occurrence is a key of a followed node (strict mode accepts those; see
  service/structured.py).
- `ValueWatch` reads the output's bytes as they are generated (a small JSON
  scanner: containers, strings, values; the grammar guarantees the bytes are a
  JSON prefix) and reports the first completed value that breaks a checked
  node: an array item equal to an earlier item where `uniqueItems` applies
  (found per item, JSON Schema equality: `1` equals `1.0`, objects ignore key
  order, `true` is not `1`), or any value that fails a followed node holding
  a keyword of `keywords` (validated with jsonschema-rs against that node; the
  whole output against the full schema, as the client wrote it).

A value is checked when the `,`, `]` or `}` after it arrives (so a number is
known to be complete), the whole output when its last container closes or at
`finish()` (a stop token after a top-level scalar). The watch keeps the bytes
it read so `truncate` can rebuild its state at an earlier offset (a
rollback), by reading them again.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jsonschema_rs

from .json_values import canonical
from .schema_normalize import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

if TYPE_CHECKING:
    from .validation import SchemaValidator

log = logging.getLogger(__name__)

# Schema nodes that all apply to one instance location (empty: nothing tracked).
Nodes = tuple[Any, ...]
# Keywords whose subschemas apply to every instance at their location.
_FOLLOWED = ("properties", "additionalProperties", "items", "prefixItems", "additionalItems", "allOf")
# Definitions are reached through `$ref`, not by walking into them.
_DEFS = ("$defs", "definitions")
# Keywords a container can still satisfy by going on (more properties or items).
_EXTENDABLE = frozenset({"required", "dependentRequired", "minProperties",
                         "contains", "minContains", "minItems"})
# With these anywhere, a node validated apart from the root could resolve a
# reference differently: only the whole output is checked.
_SCOPED_REFERENCES = frozenset({"$id", "id", "$anchor", "$dynamicRef", "$dynamicAnchor",
                                "$recursiveRef", "$recursiveAnchor", "$schema"})


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


def _pointer_part(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


class WatchPlan:
    """Where each node of one schema applies in its instances, and the
    validators of its followed nodes.

    Built in a compile worker and pickled to the server: it carries the
    (normalized) schema as JSON text and parses it, analyses it and builds the
    node validators only when a strict request first needs them.
    """

    def __init__(self, source: str, whole_only: bool = False):
        self.source = source
        # Nodes are validated as draft 2020-12 (what the normalizer writes);
        # a schema written for another draft is checked whole, by the validator
        # of the schema as written, which reads its `$schema`.
        self.whole_only = whole_only
        self._lock = threading.Lock()
        self._root: Any = None
        self._pointers: dict[int, str] = {}
        self._validators: Any = None
        self._located: dict[frozenset[str], tuple[str, ...]] = {}
        self._needs: dict[tuple[frozenset[str], int], bool] = {}

    @staticmethod
    def for_schema(schema: Any, as_written: Any = None) -> WatchPlan | None:
        """The plan of a (normalized) schema; None for a boolean schema.
        `as_written`: the client's schema, when it declares its draft."""
        if not isinstance(schema, dict):
            return None
        declared = as_written.get("$schema") if isinstance(as_written, dict) else None
        return WatchPlan(json.dumps(schema), whole_only=declared is not None and "2020-12" not in str(declared))

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "whole_only": self.whole_only}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], state["whole_only"])  # type: ignore[misc]

    @property
    def root(self) -> Any:
        if self._root is None:
            with self._lock:
                if self._root is None:
                    root = json.loads(self.source)
                    self._pointers = self._index(root)
                    self._root = root
        return self._root

    def _index(self, root: Any) -> dict[int, str]:
        """id(node) -> its JSON pointer, for every subschema of `root`."""
        pointers: dict[int, str] = {}
        stack: list[tuple[Any, str]] = [(root, "")]
        while stack:
            node, pointer = stack.pop()
            if not isinstance(node, dict) or id(node) in pointers:
                continue
            pointers[id(node)] = pointer
            for key, value in node.items():
                base = f"{pointer}/{_pointer_part(key)}"
                if key in SUBSCHEMA:
                    if isinstance(value, list):
                        stack.extend((v, f"{base}/{i}") for i, v in enumerate(value))
                    else:
                        stack.append((value, base))
                elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
                    stack.extend((v, f"{base}/{_pointer_part(k)}") for k, v in value.items())
                elif key in SUBSCHEMA_LISTS and isinstance(value, list):
                    stack.extend((v, f"{base}/{i}") for i, v in enumerate(value))
        return pointers

    @property
    def checks_nodes(self) -> bool:
        """Whether nodes can be validated apart from the root: no `$id`,
        `$anchor` or dynamic reference changes how a reference resolves, and
        the validator reads every node. Builds the node validators."""
        return bool(self._node_validators())

    def validator(self, node: Any) -> Any:
        """A jsonschema-rs validator of one node (None when it has no pointer
        or nodes cannot be checked apart from the root)."""
        validators = self._node_validators()
        pointer = self._pointers.get(id(node))
        return validators.get("#" + pointer) if validators and pointer is not None else None

    def _node_validators(self) -> Any:
        root = self.root
        if self._validators is None:
            with self._lock:
                if self._validators is None:
                    self._validators = self._build_validators(root)
        return self._validators

    def _build_validators(self, root: Any) -> Any:
        scoped = any(isinstance(node, dict) and _SCOPED_REFERENCES & node.keys()
                     for node in self._all_nodes(root))
        if scoped or self.whole_only:
            return False
        try:
            return jsonschema_rs.validator_map_for(root, offline=True)
        except Exception:  # noqa: BLE001 - unreadable: only the whole output is checked
            log.warning("the validator cannot read a normalized schema's nodes; "
                        "strict checks only the whole output", exc_info=True)
            return False

    def _all_nodes(self, root: Any) -> list[Any]:
        seen: dict[int, Any] = {}
        stack = [root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict) and id(node) not in seen:
                seen[id(node)] = node
                stack.extend(v for _, v in _subschemas(node))
        return list(seen.values())

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
    def located(self, keywords: tuple[str, ...]) -> tuple[str, ...]:
        """The keywords of `keywords` whose every occurrence is a key of a
        followed node, so a check sees the very value each constrains."""
        wanted = frozenset(keywords)
        if wanted not in self._located:
            hidden: set[str] = set()
            self._hidden(self.root, wanted, hidden, set())
            self._located[wanted] = tuple(k for k in keywords if k not in hidden)
        return self._located[wanted]

    def holds(self, node: Any, keywords: frozenset[str], seen: set[int] | None = None) -> set[str]:
        """The keywords of `keywords` anywhere under `node`, `$ref`s followed."""
        seen = set() if seen is None else seen
        if not isinstance(node, dict) or id(node) in seen:
            return set()
        seen.add(id(node))
        found = set(keywords & node.keys())
        ref = node.get("$ref")
        if isinstance(ref, str):
            found |= self.holds(self._resolve(ref), keywords, seen)
        for _, sub in _subschemas(node, skip=_DEFS):
            found |= self.holds(sub, keywords, seen)
        return found

    def _hidden(self, node: Any, keywords: frozenset[str], hidden: set[str], seen: set[int]) -> None:
        """Adds to `hidden` the keywords reachable from `node` through a keyword
        a watch does not follow (a branch chosen by the value)."""
        if not isinstance(node, dict) or id(node) in seen:
            return
        seen.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str):
            self._hidden(self._resolve(ref), keywords, hidden, seen)
        followed = set(_FOLLOWED)
        if "patternProperties" in node:
            followed.discard("additionalProperties")
        for key, sub in _subschemas(node, skip=_DEFS):
            if key in followed:
                self._hidden(sub, keywords, hidden, seen)
            else:
                hidden |= self.holds(sub, keywords)

    def needs_check(self, node: Any, keywords: frozenset[str]) -> bool:
        """Whether values at `node` are validated against it: it holds one of
        `keywords` itself or inside a branch (not inside a followed child,
        which is checked on its own). A `uniqueItems` of the node itself is
        checked per item instead. Cached per plan: every strict request of
        the schema asks the same."""
        known = self._needs.get((keywords, id(node)))
        if known is None:
            known = self._needs[(keywords, id(node))] = self._needs_check(node, keywords)
        return known

    def _needs_check(self, node: Any, keywords: frozenset[str]) -> bool:
        if (keywords - {"uniqueItems"}) & node.keys():
            return True
        followed = set(_FOLLOWED)
        if "patternProperties" in node:
            followed.discard("additionalProperties")
        return any(key not in followed and self.holds(sub, keywords)
                   for key, sub in _subschemas(node, skip=_DEFS))

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
                 full: SchemaValidator | None = None):
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
            return self._check_slot(frame, json.loads(raw.decode("utf-8")), checked)
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
