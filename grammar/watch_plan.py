"""Where each node of a JSON schema applies in its instances.

`WatchPlan` is the schema half of the value checks behind resampling
(`value_watch.ValueWatch` reads the output): it follows only keywords that
apply to *every* instance at a location (`properties`,
`additionalProperties`, `items`, `prefixItems`, `allOf`, local `$ref`): a
*followed* node. A completed value is validated against a followed node that
applies to it, so a check never rejects a value the schema allows; a keyword
inside a branch chosen by the value (`anyOf`, `oneOf`, `if`, `not`, ...) is
checked as part of the nearest followed node that holds the branch.
`located(keywords)` lists the keywords whose every occurrence is a key of a
followed node (strict mode accepts those; see service/structured.py).

Nodes are validated with jsonschema-rs (`validator_map_for`: one validator
per node, keyed by JSON pointer), built once per schema, the first time a
resampling request needs them.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import jsonschema_rs

from .schema_normalize import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

log = logging.getLogger(__name__)

# Schema nodes that all apply to one instance location (empty: nothing tracked).
Nodes = tuple[Any, ...]
# Keywords whose subschemas apply to every instance at their location.
_FOLLOWED = ("properties", "additionalProperties", "items", "prefixItems", "additionalItems", "allOf")
# Definitions are reached through `$ref`, not by walking into them.
_DEFS = ("$defs", "definitions")
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
    node validators only when a resampling request first needs them.
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
        self._nodes: list[dict[str, Any]] = []  # every subschema, found with its pointer
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
            self._nodes.append(node)
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
    def ready(self) -> bool:
        """Whether the schema is parsed and its node validators built (a
        ValueWatch is then cheap to make)."""
        return self._root is not None and self._validators is not None

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
        scoped = any(_SCOPED_REFERENCES & node.keys() for node in self._nodes)
        if scoped or self.whole_only:
            return False
        try:
            return jsonschema_rs.validator_map_for(root, offline=True)
        except Exception:  # noqa: BLE001 - unreadable: only the whole output is checked
            log.warning("the validator cannot read a normalized schema's nodes; "
                        "strict checks only the whole output", exc_info=True)
            return False

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
        checked per item instead. Cached per plan: every resampling request of
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
