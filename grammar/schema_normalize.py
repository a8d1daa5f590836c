"""Rewriting a JSON schema into an equivalent one both grammar libraries read.

Real schemas are written for validators, not for grammar compilers: they use
draft-04/07 spellings, chains of `$ref`, `allOf` to compose objects, custom
`format`s and vendor keywords. Each of those made one library or the other
refuse the schema (or misread it) although the schema says nothing a grammar
cannot express. `normalize_schema` rewrites them, keeping the set of accepted
instances the same (draft 2020-12 semantics), rule by rule:

- annotations: keywords that constrain nothing (`title`, `description`,
  `examples`, `default`, `deprecated`, `x-*`, any keyword outside the JSON
  Schema vocabulary, ...) are dropped, and so is a `format` the libraries do not
  know (in 2020-12 a format is an annotation unless a validator opts in);
- references: every `$ref` (`#`, a JSON pointer, `#/definitions/...`, an
  `$anchor` or `$dynamicAnchor`, a URI relative to the nearest `$id`, a
  bundled `$id`, a document in the schema store) is resolved; a non-recursive
  target is inlined, a recursive one lives in the root `$defs` and is
  referred to as `#/$defs/<name>`; a `$ref` is an in-place applicator, so
  with siblings it becomes the first member of their `allOf`;
- `allOf` whose members can be merged key by key (properties, required, type,
  bounds, ...) becomes one schema;
- a single-item `enum` becomes `const`; an integral number `const` becomes
  the range [n, n] (so `1.0` matches `const: 1`, as JSON Schema says);
  integral floats in count keywords (`maxLength: 2.0`) become integers;
- draft-04/07: `exclusiveMinimum: true` (with `minimum`), `dependencies`,
  array-form `items` with `additionalItems`, `definitions`, `id`;
- size: inlining is bounded (`MAX_NODES`), so a schema whose references expand
  exponentially is refused instead of exhausting memory; recursion is never
  unrolled (it stays a `$ref`, which both libraries handle lazily).

What the libraries then cannot enforce is the business of `schema_keywords`.
Everything here is pure Python on plain JSON values (no library calls), and
raises `GrammarError` for a schema it cannot rewrite (a dangling `$ref`).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urldefrag, urljoin

from .errors import GrammarError
from .json_values import same
from .schema_store import SchemaStore

# Keywords that constrain instances (draft 2020-12 plus older spellings that
# are rewritten below). Anything else is an annotation or unknown: dropped.
SCHEMA_KEYWORDS = frozenset({
    "type", "enum", "const",
    "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "dependentRequired",
    "dependentSchemas", "unevaluatedProperties",
    "items", "prefixItems", "additionalItems", "contains", "minContains", "maxContains",
    "minItems", "maxItems", "uniqueItems", "unevaluatedItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "$ref", "$defs", "definitions", "dependencies",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
    "$id", "$anchor", "$schema", "$vocabulary", "id",
})
# Formats llguidance enforces (and xgrammar either enforces or ignores). Any
# other format is an annotation: llguidance refuses an unknown one outright.
KNOWN_FORMATS = frozenset({
    "date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
    "uuid", "uri", "unknown",
})
# Keywords whose value is one subschema / a map of subschemas / a list of them.
SUBSCHEMA = ("additionalProperties", "propertyNames", "unevaluatedProperties", "items",
             "additionalItems", "contains", "unevaluatedItems", "not", "if", "then", "else")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
# Inlined nodes beyond this are refused: `$ref` chains can expand exponentially.
MAX_NODES = 200_000
_DRAFT_OLD = re.compile(r"draft-0[3-7]")


class Unresolved(Exception):
    """A `$ref` to a document that is neither in the schema nor in the schema
    store: the schema is left as written."""


def normalize_schema(schema: Any, store: SchemaStore | None = None) -> Any:
    """A schema accepting the same instances, in the subset both libraries read.

    `schema` is a parsed JSON schema (dict or bool); it is not modified.
    `store`: documents a `$ref` may name by URI (never fetched otherwise).
    Raises GrammarError for a local `$ref` that points nowhere or a schema that
    grows past MAX_NODES when references are inlined, and `Unresolved` for a
    `$ref` to a document it does not have (the caller then compiles the
    schema as written).
    """
    if not isinstance(schema, dict):
        return schema
    out = _Normalizer(schema, store).run()
    # An object whose required name nothing admits accepts no instance. Both
    # libraries then refuse `false`; llguidance sees it itself, but `auto`
    # would fall back to xgrammar, which drops the name and compiles.
    return False if isinstance(out, dict) and _no_object_fits(out) else out


def _no_object_fits(node: dict[str, Any]) -> bool:
    """Whether `node`, an object-only schema, requires a property it cannot
    have (left out with additionalProperties false, or `false` itself)."""
    required, props = node.get("required"), node.get("properties", {})
    if node.get("type") != "object" or not isinstance(required, list) or not isinstance(props, dict):
        return False
    closed = node.get("additionalProperties") is False and "patternProperties" not in node \
        and not any(k in node for k in ("anyOf", "oneOf", "allOf", "$ref", "if", "dependentSchemas",
                                         "unevaluatedProperties"))
    return any(props.get(name) is False or (closed and name not in props) for name in required
               if isinstance(name, str))


def _join(base: str, ref: str) -> str:
    """`ref` resolved against the base URI `base` (RFC 3986), without fragment."""
    if not base or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", ref):
        joined = ref  # absolute (http:, urn:, ...) or nothing to resolve against
    elif base.startswith("urn:") and not ref.startswith("#"):
        joined = ref  # a URN has no path a relative reference could extend
    else:
        joined = urljoin(base, ref)
    return urldefrag(joined)[0]


class _Normalizer:
    def __init__(self, root: dict[str, Any], store: SchemaStore | None = None) -> None:
        self.root = root
        self.store = store
        self.old_draft = bool(_DRAFT_OLD.search(str(root.get("$schema", ""))))
        # Schema resources (the root, each subschema with an `$id`, each
        # document from the store): absolute URI -> resource, and per
        # resource (by id) its base URI and its anchors.
        self.resources: dict[str, dict[str, Any]] = {}
        self.bases: dict[int, str] = {}
        self.anchors: dict[int, dict[str, Any]] = {}
        self._documents: list[Any] = []  # keeps loaded documents (their ids) alive
        # Without a `$dynamicRef` a `$dynamicAnchor` is a plain anchor (dropped
        # once its references are inlined).
        self.dynamic = False
        self._index(root, "")
        # The schema resource being walked: the innermost node with an `$id`
        # (a bundled schema) or the document a `$ref` led to, against which a
        # `#...` pointer and a relative reference resolve.
        self.resource: dict[str, Any] = root
        self.defs: dict[str, Any] = {}  # name -> normalized body of a recursive target
        self.def_names: dict[str, str] = {}  # ref key -> name in the root $defs
        self.nodes = 0

    # -- references ------------------------------------------------------------
    def _index(self, document: dict[str, Any], uri: str) -> None:
        """Record the resources and anchors of `document`, retrieved from `uri`."""
        stack: list[tuple[Any, dict[str, Any], str]] = [(document, document, uri)]
        root_id = self._id_of(document)
        self.bases[id(document)] = _join(uri, root_id) if root_id is not None else uri
        if self.bases[id(document)]:
            self.resources.setdefault(self.bases[id(document)], document)
        if uri:
            self.resources.setdefault(uri, document)
        while stack:
            item, resource, base = stack.pop()
            if not isinstance(item, dict):
                continue
            own_id = self._id_of(item)
            if item is not document and own_id is not None:
                if own_id.startswith("#"):  # draft-06/07: `$id: "#name"` is an anchor
                    self.anchors.setdefault(id(resource), {}).setdefault(own_id[1:], item)
                else:
                    base = _join(base, own_id)
                    resource = item
                    self.bases[id(item)] = base
                    self.resources.setdefault(base, item)
            elif item is document:
                base = self.bases[id(document)]
            self.dynamic = self.dynamic or "$dynamicRef" in item or "$recursiveRef" in item
            # A `$dynamicAnchor` is also a plain anchor for `$ref`.
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(item.get(key), str):
                    self.anchors.setdefault(id(resource), {}).setdefault(item[key], item)
            # Only subschemas: an `$id` or `$anchor` inside an annotation, a
            # `const` or a property named like a keyword is no resource.
            stack.extend((sub, resource, base) for sub in _subschemas(item))

    def _id_of(self, item: dict[str, Any]) -> str | None:
        """A node's `$id`, or under draft-04 and older its `id` (the keyword's old name)."""
        for key in ("$id", "id") if self.old_draft else ("$id",):
            if isinstance(item.get(key), str):
                return str(item[key])
        return None

    def _resolve(self, ref: str) -> tuple[str, Any, dict[str, Any]]:
        """The key of `ref` (unique across resources), the node it names, and
        the resource that node's own references resolve in."""
        here = self.bases.get(id(self.resource), "")
        base, _, frag = ref.partition("#")
        if not base:
            resource = self.resource
        else:
            uri = _join(here, base)
            found = self.resources.get(uri)
            resource = found if found is not None else self._load(uri, ref)
        # The root's own pointers keep their short form (names in `$defs`).
        key = f"#{frag}" if resource is self.root else f"{self.bases.get(id(resource), '')}#{frag}"
        if not frag:
            return key, resource, resource
        node, inner = self._in_resource(resource, ref, frag)
        return key, node, inner

    def _load(self, uri: str, ref: str) -> dict[str, Any]:
        document = self.store.get(uri) if self.store is not None else None
        if not isinstance(document, dict):
            # Not bundled and not in the store: the libraries get the schema
            # as written (and refuse it, or resolve what they can).
            raise Unresolved(ref)
        self._documents.append(document)
        self._index(document, uri)
        return document

    def _in_resource(self, resource: dict[str, Any], ref: str, frag: str) -> tuple[Any, dict[str, Any]]:
        """The node `frag` names in `resource`, and the innermost resource
        around it (a pointer may lead into an embedded `$id` resource, whose
        own references resolve there)."""
        if not frag.startswith("/"):
            anchors = self.anchors.get(id(resource), {})
            if frag in anchors:
                return anchors[frag], resource
            raise GrammarError(f"cannot compile JSON schema: $ref {ref[:80]!r} names no $anchor")
        node: Any = resource
        for raw in frag.split("/")[1:]:
            part = _unescape(raw)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GrammarError(f"cannot compile JSON schema: $ref {ref[:80]!r} points nowhere")
            if isinstance(node, dict) and id(node) in self.bases:
                resource = node
        return node, resource

    # -- the walk --------------------------------------------------------------
    def run(self) -> Any:
        out = self.node(self.root, ())
        if self.defs:
            if out is True:
                out = {}
            if isinstance(out, dict):
                out = dict(out)
                out["$defs"] = {**out.get("$defs", {}), **self.defs}
            else:  # `false` with definitions: still false
                return out
        return out

    def node(self, schema: Any, active: tuple[str, ...]) -> Any:
        """Normalize one subschema; `active` are the refs being inlined above it."""
        if not (isinstance(schema, dict) and id(schema) in self.bases) or schema is self.resource:
            return self._node(schema, active)
        outer, self.resource = self.resource, schema  # a bundled schema: its own pointers
        try:
            return self._node(schema, active)
        finally:
            self.resource = outer

    def _node(self, schema: Any, active: tuple[str, ...]) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise GrammarError("JSON schema is too large once its $refs are expanded",
                               reason="too_large")
        if not isinstance(schema, dict):
            return schema
        s = dict(schema)
        ref = s.pop("$ref", None)
        target: Any = None  # the normalized `$ref` target, applied beside the siblings
        if isinstance(ref, str) and "$recursiveRef" not in s and "$dynamicRef" not in s:
            target = self._inline(ref, active)
            # Before 2019-09 a $ref's siblings are ignored.
            if not s or self.old_draft or not any(
                    k in SCHEMA_KEYWORDS and k not in ("$defs", "definitions", "$schema", "$id", "$anchor", "id")
                    for k in s):
                return target
        elif ref is not None:
            s["$ref"] = ref
        out: dict[str, Any] = {}
        self._old_spellings(s)
        for key, value in s.items():
            if key not in SCHEMA_KEYWORDS or key in ("$defs", "definitions", "$schema", "$id",
                                                      "$anchor", "id", "$vocabulary"):
                continue  # annotations; definitions are reached through $ref only
            if key in ("$dynamicAnchor", "$recursiveAnchor") and not self.dynamic:
                continue
            if key == "format" and value not in KNOWN_FORMATS:
                continue
            if key in SUBSCHEMA:
                out[key] = self.node(value, active)
            elif key in SUBSCHEMA_MAPS:
                out[key] = {k: self.node(v, active) for k, v in value.items()} \
                    if isinstance(value, dict) else value
            elif key in SUBSCHEMA_LISTS:
                out[key] = [self.node(v, active) for v in value] if isinstance(value, list) else value
            elif key in _COUNTS and isinstance(value, float) and value.is_integer():
                out[key] = int(value)
            else:
                out[key] = copy.deepcopy(value)
        if target is not None:
            # `$ref` applies in place, as an `allOf` member would: the siblings
            # stay the outer schema (so `unevaluated*` sees what the target
            # evaluates, and the siblings' properties come first). The target
            # is normalized already (it may be a `$ref` into the new `$defs`).
            others = out.get("allOf", [])
            if isinstance(others, list):
                out["allOf"] = [target, *others]
            else:  # a malformed allOf stays as written, for the libraries to refuse
                out = {"allOf": [target, out]}
        enum = out.get("enum")
        if isinstance(enum, list) and len(enum) == 1 and "const" not in out:
            out["const"] = out.pop("enum")[0]
        _numbers_by_value(out)
        if isinstance(out.get("allOf"), list):
            out = merge_all_of(out)
        if isinstance(out, dict) and not any(k in out for k in _APPLICATORS):
            _unevaluated_as_additional(out)
        if isinstance(out, dict):
            _whole_bounds(out)
        return out

    def _inline(self, ref: str, active: tuple[str, ...]) -> Any:
        """The normalized target of `ref`: inlined, or `{"$ref": "#/$defs/name"}` when
        it refers to itself (directly or through others)."""
        key, target, resource = self._resolve(ref)
        if key in active or key in self.def_names:
            return {"$ref": f"#/$defs/{self._def_name(key)}"}
        outer, self.resource = self.resource, resource
        try:
            body = self.node(target, (*active, key))
        finally:
            self.resource = outer
        if key in self.def_names:  # recursion found below: it lives in $defs
            self.defs[self.def_names[key]] = body
            return {"$ref": f"#/$defs/{self.def_names[key]}"}
        return body

    def _def_name(self, ref: str) -> str:
        name = self.def_names.get(ref)
        if name is None:
            base = re.sub(r"[^A-Za-z0-9_]+", "_", ref.strip("#/")) or "root"
            name = base
            while name in self.def_names.values():
                name += "_"
            self.def_names[ref] = name
        return name

    def _old_spellings(self, s: dict[str, Any]) -> None:
        """Draft-04/07 keywords rewritten in place to their 2020-12 forms."""
        for bound, strict in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            flag = s.get(strict)
            if isinstance(flag, bool):
                del s[strict]
                if flag and bound in s:
                    s[strict] = s.pop(bound)
        deps = s.pop("dependencies", None)
        if isinstance(deps, dict):
            required = {k: v for k, v in deps.items() if isinstance(v, list)}
            schemas = {k: v for k, v in deps.items() if not isinstance(v, list)}
            # Beside a dependentRequired/dependentSchemas entry of the same
            # name both apply: required names joined, schemas in an allOf.
            if required:
                merged = dict(s.get("dependentRequired", {}))
                for name, names in required.items():
                    merged[name] = list(dict.fromkeys([*merged.get(name, []), *names]))
                s["dependentRequired"] = merged
            if schemas:
                merged = dict(s.get("dependentSchemas", {}))
                for name, sub in schemas.items():
                    merged[name] = {"allOf": [merged[name], sub]} if name in merged else sub
                s["dependentSchemas"] = merged
        items = s.get("items")
        if isinstance(items, list):  # tuple validation before 2020-12
            s["prefixItems"] = s.pop("items")
            if "additionalItems" in s:
                s["items"] = s.pop("additionalItems")
        elif "additionalItems" in s and (self.old_draft or "prefixItems" not in s):
            s.pop("additionalItems")  # without a tuple form it constrains nothing


# Keywords that evaluate properties or items of the instance in place, so that
# `unevaluated*` sees more than its siblings.
_APPLICATORS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
                "$recursiveRef", "dependentSchemas")


def _unevaluated_as_additional(out: dict[str, Any]) -> None:
    """Without in-place applicators, `unevaluatedProperties` means
    `additionalProperties` and `unevaluatedItems` means `items` (2020-12), which
    both libraries enforce."""
    if "unevaluatedProperties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = out.pop("unevaluatedProperties")
    if "unevaluatedItems" in out and "items" not in out and "contains" not in out:
        out["items"] = out.pop("unevaluatedItems")


def map_subschemas(schema: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A copy of `schema` with each subschema directly inside it (in keyword
    positions) replaced by `fn(subschema)`; other values kept."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in SUBSCHEMA:
            out[key] = fn(value)
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: fn(v) for k, v in value.items()}
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [fn(v) for v in value]
        else:
            out[key] = value
    return out


def _subschemas(schema: dict[str, Any]) -> list[Any]:
    """The subschemas directly inside `schema` (in keyword positions)."""
    out: list[Any] = []
    for key, value in schema.items():
        if key in SUBSCHEMA or key in SUBSCHEMA_LISTS:
            out.extend(value if isinstance(value, list) else [value])  # `items` may be a list (old drafts)
        elif (key in SUBSCHEMA_MAPS or key == "dependencies") and isinstance(value, dict):
            out.extend(value.values())
    return out


def _unescape(part: str) -> str:
    from urllib.parse import unquote

    return unquote(part).replace("~1", "/").replace("~0", "~")


# -- allOf ---------------------------------------------------------------------
_MAX_OF = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_MIN_OF = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
# Keywords whose meaning depends on sibling keywords: merging them with another
# member's properties would change what they apply to.
_UNEVALUATED = ("unevaluatedProperties", "unevaluatedItems")
_SIBLING_DEPENDENT = ("additionalProperties", "patternProperties", "unevaluatedProperties",
                      "items", "prefixItems", "unevaluatedItems", "additionalItems", "contains",
                      "minContains", "maxContains", "if", "then", "else")


def merge_all_of(schema: dict[str, Any]) -> Any:
    """`schema` with its `allOf` merged into it where that keeps its meaning;
    unchanged otherwise."""
    members = [m for m in schema["allOf"] if m is not True and m != {}]
    if any(m is False for m in members):
        return False
    rest = {k: v for k, v in schema.items() if k != "allOf"}
    parts = [rest, *members]
    if not all(isinstance(p, dict) for p in parts):
        return schema
    if any("$ref" in p for p in parts):
        return schema
    # The outer schema's `unevaluated*` already sees what its `allOf` members
    # evaluate: merged, it sees the same keywords beside it. Anywhere else a
    # sibling-dependent keyword would see more than before.
    dependent = [p for p in parts if any(k in p for k in _SIBLING_DEPENDENT
                                         if p is not rest or k not in _UNEVALUATED)]
    # One member may carry sibling-dependent keywords if no other declares
    # properties/items they would now see (directly or through an applicator).
    seen_by_dependent = ("properties", "prefixItems", "items", "patternProperties",
                         *_APPLICATORS)
    if len(dependent) > 1 or (dependent and any(
            p is not dependent[0] and any(k in p for k in seen_by_dependent) for p in parts)):
        return schema
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value
                continue
            combined = _merge_key(key, merged[key], value)
            if combined is _CONFLICT:
                return schema
            merged[key] = combined
    if isinstance(merged.get("type"), list) and not merged["type"]:
        return False
    return merged


_CONFLICT = object()


def _merge_key(key: str, a: Any, b: Any) -> Any:
    if same(a, b):  # JSON equality: `true` is not `1`
        return a
    if key == "required" and isinstance(a, list) and isinstance(b, list):
        return list(dict.fromkeys(a + b))
    if key == "properties" and isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for name, sub in b.items():
            out[name] = merge_all_of({"allOf": [out[name], sub]}) if name in out else sub
        return out
    if key in _MAX_OF and _is_number(a) and _is_number(b):
        return max(a, b)
    if key in _MIN_OF and _is_number(a) and _is_number(b):
        return min(a, b)
    if key == "type":
        ta = set(a) if isinstance(a, list) else {a}
        tb = set(b) if isinstance(b, list) else {b}
        both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb)
                            or ("number" in ta and "integer" in tb) else set())
        return sorted(both) if len(both) != 1 else both.pop()
    if key == "enum" and isinstance(a, list) and isinstance(b, list):
        return [x for x in a if any(same(x, y) for y in b)]
    if key in ("anyOf", "oneOf", "not"):
        return _CONFLICT  # two of these cannot share one key; keep the allOf
    return _CONFLICT


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _integral(value: Any) -> int | None:
    """An integral JSON number as an int (1 and 1.0 alike); None otherwise, and
    for one past 2**53, which the libraries would read back as a float bound
    (a range [n, n] then rejects n and accepts its float neighbours)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if abs(value) <= 2 ** 53 else None


def _whole_bounds(out: dict[str, Any]) -> None:
    """An integer's fractional bounds rounded inward (`minimum: 1.5` is 2,
    `exclusiveMaximum: 3.5` is `maximum: 3`): the same integers pass, and
    xgrammar refuses a fractional bound on an integer."""
    if out.get("type") != "integer":
        return
    rounded = {"minimum": lambda v: math.ceil(v), "maximum": lambda v: math.floor(v),
               "exclusiveMinimum": lambda v: math.floor(v) + 1, "exclusiveMaximum": lambda v: math.ceil(v) - 1}
    for key, whole in rounded.items():
        value = out.get(key)
        if not (isinstance(value, float) and math.isfinite(value) and not value.is_integer()):
            continue
        del out[key]
        inclusive = key.removeprefix("exclusive").lower()  # minimum / maximum
        n: float = int(whole(value))
        have = out.get(inclusive)
        if isinstance(have, int | float) and _is_number(have):
            n = max(n, float(have)) if inclusive == "minimum" else min(n, float(have))
        out[inclusive] = int(n) if float(n).is_integer() else n


def _numbers_by_value(out: dict[str, Any]) -> None:
    """An integral `const` number matches by value: `const: 1` accepts `1.0`
    too. Libraries match a literal's text, so it becomes the range [n, n]
    (`{"type": "number", "minimum": n, "maximum": n}`; xgrammar then accepts
    `1.0`, llguidance still only `1`). An `enum` of several values is left as
    written: a range per number would cost more grammar than it gains."""
    n = _integral(out.get("const")) if "const" in out else None
    if n is None:
        return
    del out["const"]
    literal = _number_range(n)
    out["allOf"] = [*out["allOf"], literal] if isinstance(out.get("allOf"), list) else [literal]


def _number_range(n: int) -> dict[str, Any]:
    return {"type": "number", "minimum": n, "maximum": n}


# Where a subschema is merged with its siblings rather than standing for a
# value of its own: closing its objects would refuse what a sibling allows.
_MERGED = ("allOf", "not", "if", "then", "else", "dependentSchemas")


def strict_defaults(schema: Any, _close: bool = True) -> Any:
    """`schema` as vLLM reads it by default (xgrammar's strict mode): an
    object that names its properties admits no others, and an array of
    `prefixItems` no more items, unless the schema says otherwise. A subset
    of what JSON Schema allows, so every output still validates against the
    schema as given. Subschemas merged with others (`allOf`, `if`/`then`/
    `else`, `not`, `dependentSchemas`) are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        close = _close and key not in _MERGED
        if key in SUBSCHEMA:
            out[key] = strict_defaults(value, close)
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: strict_defaults(v, close) for k, v in value.items()}
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [strict_defaults(v, close) for v in value]
        else:
            out[key] = value
    if not _close:
        return out
    if isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf")):
        out["additionalProperties"] = False
    if isinstance(out.get("prefixItems"), list) and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out
