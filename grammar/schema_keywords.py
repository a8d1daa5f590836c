"""Which JSON-schema keywords each grammar library enforces token by token.

Neither library implements the whole of JSON Schema. llguidance refuses a
schema with a keyword it does not implement (`lenient: false`); xgrammar
silently ignores one. Either way an output could satisfy the grammar and still
break the schema, so at compile time the compiler asks `backend_view` for

- the schema the library gets: the normalized schema without the keywords the
  library cannot enforce. Dropping a keyword only ever widens what a schema
  accepts (each keyword is one more condition), so the grammar still accepts
  every valid instance; the output validator checks the rest;
- the keywords left unenforced, which the request reports
  (`complete.unenforced_keywords`), strict mode refuses, and `auto` minimizes.

The tables come from each library's documented support (llguidance's JSON
schema notes, xgrammar's JSON schema converter), checked against the
JSON-Schema-Test-Suite: tests/grammar/test_schema_keywords.py asserts that a
suite schema reported as fully enforced has every invalid instance rejected
token by token. xgrammar applies a type's keywords only where the node declares
that type (`{"maxLength": 2}` alone is ignored), hence the per-type scopes.
"""

from __future__ import annotations

from typing import Any

from .json_values import canonical
from .regex_syntax import ecma_pattern, json_pattern_misread
from .schema_normalize import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS, map_subschemas
from .validation import readable_pattern

# Keywords that never need enforcing (structure, not conditions).
_STRUCTURAL = frozenset({"$defs", "definitions", "$ref", "$schema", "$id", "$anchor"})

# llguidance 1.x: everything else it implements (it refuses these).
_LLG_UNSUPPORTED = frozenset({
    "not", "uniqueItems", "if", "then", "else", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "propertyNames", "unevaluatedItems",
    "unevaluatedProperties", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor",
})

# xgrammar 0.2: enforced wherever they appear...
_XGR_ANYWHERE = frozenset({"type", "enum", "const", "anyOf"})
# ... and these only where the node's `type` is exactly the type they belong to.
_XGR_SCOPED = {
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
    "exclusiveMaximum": "number",
    "minItems": "array", "maxItems": "array", "items": "array", "prefixItems": "array",
    "properties": "object", "required": "object", "additionalProperties": "object",
}
# A node without a `type` that has some of those keywords is given to xgrammar
# with every type listed: alone, `items`, `prefixItems`, `properties` or
# `additionalProperties` made it read the node as that type only
# (`{"properties": {...}}` refused 1, "x" and null), and the others it
# ignored; over a list of types it applies each keyword to its own type, as
# JSON Schema does. Not where xgrammar reads a node's other keywords alone.
_EVERY_TYPE = ["null", "boolean", "object", "array", "number", "string"]
_XGR_READ_ALONE = frozenset({"enum", "const", "anyOf", "oneOf", "allOf", "$ref", "not"})
# Property names xgrammar mishandles (it does not escape them in its grammar).
_NEEDS_ESCAPE = frozenset('"\\') | {chr(i) for i in range(0x20)}
# What xgrammar is not given at all: keywords it would ignore anyway, and
# references it cannot read.
_XGR_DROPPED = _LLG_UNSUPPORTED


def backend_view(schema: Any, backend: str) -> tuple[Any, tuple[str, ...]]:
    """(the schema `backend` compiles, the keywords it leaves unenforced, sorted).

    `schema` is a normalized schema (see `schema_normalize`); not modified.
    """
    unenforced: set[str] = set()
    if backend == "llguidance":
        view = _strip(schema, _LLG_UNSUPPORTED, unenforced, backend, one_of_to_any=True)
    else:
        view = _strip(schema, _XGR_DROPPED, unenforced, backend, one_of_to_any=False)
        _xgrammar_gaps(view, unenforced)
    return view, tuple(sorted(unenforced))


def _strip(node: Any, drop: frozenset[str], dropped: set[str], backend: str, *, one_of_to_any: bool) -> Any:
    if not isinstance(node, dict):
        return node
    kept: dict[str, Any] = {}
    for key, value in node.items():
        if key in drop or (key in ("const", "enum") and not _exact_as_double(value)) \
                or _misread_bound(key, value, node, backend) or _misread_patterns(key, value, backend):
            dropped.add(key)
        else:
            kept[key] = _ecma_patterns(key, value)
    if "patternProperties" in node and "patternProperties" not in kept and kept.get("additionalProperties", True) \
            is not True:
        # additionalProperties applies to the names no pattern matches: without
        # the patterns it would apply to theirs too, refusing valid instances.
        dropped.add("additionalProperties")
        del kept["additionalProperties"]
    counts = [key for key in ("minProperties", "maxProperties") if key in kept]
    if backend == "llguidance" and counts and isinstance(kept.get("properties"), dict) \
            and not set(kept["properties"]) <= set(kept.get("required") or ()):
        # llguidance counts properties only when every declared one is
        # required: otherwise it refuses the whole schema.
        for key in counts:
            dropped.add(key)
            del kept[key]
    if backend == "xgrammar" and "type" not in kept and not _XGR_READ_ALONE & kept.keys() \
            and any(key in _XGR_SCOPED for key in kept):
        kept["type"] = list(_EVERY_TYPE)
    out = map_subschemas(kept, lambda sub: _strip(sub, drop, dropped, backend, one_of_to_any=one_of_to_any))
    if one_of_to_any and isinstance(out.get("oneOf"), list) and isinstance(out.get("allOf", []), list):
        # llguidance has no oneOf. As anyOf it is exact when at most one branch
        # can match any instance; otherwise "exactly one" goes unenforced.
        if not disjoint(out["oneOf"], _only_objects(out)):
            dropped.add("oneOf")
        branches = out.pop("oneOf")
        if "anyOf" not in out:
            out["anyOf"] = branches
        else:  # both on one node: the node's anyOf, and this one beside it
            out["allOf"] = [*out.get("allOf", []), {"anyOf": branches}]
    return out


def _xgrammar_gaps(node: Any, gaps: set[str]) -> None:
    if not isinstance(node, dict):
        return
    declared = node.get("type")
    ignored = _xgr_ignored_siblings(node)
    for key, value in node.items():
        if key in ignored:
            gaps.add(key)
        elif key in _STRUCTURAL or key in _XGR_ANYWHERE:
            pass
        elif key == "oneOf" and isinstance(value, list) and disjoint(value, _only_objects(node)):
            pass  # xgrammar reads oneOf as anyOf: exact for disjoint branches
        elif key in _XGR_SCOPED:
            scope = _XGR_SCOPED[key]
            if not _declares(declared, scope) or key in ("properties", "required") and any(
                    set(str(name)) & _NEEDS_ESCAPE
                    for name in (value if isinstance(value, dict | list) else ())):
                gaps.add(key)
            elif key == "required" and isinstance(value, list) and not set(value) <= set(
                    node.get("properties") or ()):
                gaps.add(key)  # xgrammar only requires names that `properties` declares
        else:
            gaps.add(key)  # oneOf (read as anyOf), allOf, multipleOf, patternProperties, ...
        if key in SUBSCHEMA:
            _xgrammar_gaps(value, gaps)
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _xgrammar_gaps(sub, gaps)
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for sub in value:
                _xgrammar_gaps(sub, gaps)


def _declares(declared: Any, scope: str) -> bool:
    """Whether a node's `type` (a name or a list) includes the type `scope`."""
    names = declared if isinstance(declared, list) else [declared]
    return scope in names or (scope == "number" and "integer" in names)


def _misread_patterns(key: str, value: Any, backend: str) -> bool:
    """Whether `backend` would read a regex of this `pattern` or
    `patternProperties` otherwise than the validator (ECMA-262) does, even
    as `ecma_pattern` spells it: it is then left to the validator rather
    than enforced wrong. A regex that is no regex stays, for the library to
    refuse the schema."""
    def misread(pattern: str) -> bool:
        return json_pattern_misread(ecma_pattern(pattern), backend) is not None and readable_pattern(pattern)

    if key == "pattern" and isinstance(value, str):
        return misread(value)
    if key == "patternProperties" and isinstance(value, dict):
        return any(misread(str(name)) for name in value)
    return False


def _ecma_patterns(key: str, value: Any) -> Any:
    """A kept `pattern` or `patternProperties` with its regexes as `ecma_pattern` spells them."""
    if key == "pattern" and isinstance(value, str):
        return ecma_pattern(value)
    if key == "patternProperties" and isinstance(value, dict):
        return {ecma_pattern(str(name)): sub for name, sub in value.items()}
    return value


def _exact_as_double(value: Any) -> bool:
    """Whether every number in `value` survives a round trip through a double,
    as both libraries read a schema's numbers: an integer past 2**53 does not
    (their grammar would take its float neighbour instead)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) <= 2 ** 53
    if isinstance(value, list):
        return all(_exact_as_double(v) for v in value)
    if isinstance(value, dict):
        return all(_exact_as_double(v) for v in value.values())
    return True


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def _misread_bound(key: str, value: Any, node: dict, backend: str) -> bool:
    """Whether `backend` would read this numeric bound as another number: an
    integer past 2**53 becomes its float neighbour (llguidance; xgrammar for a
    `number`, while it reads an `integer`'s bounds as 64-bit integers and
    refuses larger ones). Left to the validator, the bound only widens."""
    if key not in _BOUNDS or _exact_as_double(value) or isinstance(value, bool):
        return False
    if backend == "xgrammar" and node.get("type") == "integer":
        return not -2 ** 63 <= value < 2 ** 63
    return True


def _xgr_ignored_siblings(node: dict) -> set[str]:
    """Keywords of `node` xgrammar 0.2 reads past: beside enum or const it
    takes the list alone (`type` too), beside anyOf (or oneOf) the branches
    alone; a string's format wins over its pattern and lengths, and its
    pattern over its lengths."""
    keep = set(_STRUCTURAL)
    if "enum" in node or "const" in node:
        keep |= {"enum", "const"}
    elif "anyOf" in node or "oneOf" in node:
        keep |= {"anyOf", "oneOf"}
    else:
        if "format" in node:
            return {k for k in ("pattern", "minLength", "maxLength") if k in node}
        if "pattern" in node:
            return {k for k in ("minLength", "maxLength") if k in node}
        return set()
    return {k for k in node if k not in keep}


_JSON_TYPES = ("null", "boolean", "object", "array", "string", "integer", "number")


def _only_objects(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" or node.get("type") == ["object"]


def disjoint(branches: list[Any], objects: bool = False) -> bool:
    """True when no instance can match two of `branches` (a cheap, sound test:
    distinct literal values, distinct types, or a required property whose
    `const` differs per branch, where every instance is an object: `objects`
    (the node says so) or each branch's type)."""
    if len(branches) < 2:
        return True
    literals = [_literals(b) for b in branches]
    if all(lit is not None for lit in literals):
        # Canonical forms in a set: linear in the values (compared pairwise, a
        # oneOf of 60 enums of 100 took seconds to plan and timed out).
        seen: set[Any] = set()
        for lit in literals:
            assert lit is not None
            forms = _canonical_set(lit)
            if forms is None or not forms.isdisjoint(seen):
                return False
            seen |= forms
        return True
    types = [_types(b) for b in branches]
    if all(t is not None for t in types):
        seen_t: set[str] = set()
        overlap = False
        for t in types:
            assert t is not None
            overlap = overlap or bool(t & seen_t)
            seen_t |= t
        if not overlap:
            return True
    return _discriminated(branches, objects)


def _literals(branch: Any) -> list[Any] | None:
    if isinstance(branch, dict):
        if "const" in branch:
            return [branch["const"]]
        if isinstance(branch.get("enum"), list):
            return list(branch["enum"])
    return None


def _canonical_set(values: list[Any]) -> set[Any] | None:
    """The values' canonical forms (None for one nested too deep to compare)."""
    try:
        return {canonical(v) for v in values}
    except RecursionError:
        return None


def _types(branch: Any) -> set[str] | None:
    if not isinstance(branch, dict) or "type" not in branch:
        return None
    t = branch["type"]
    names = set(t) if isinstance(t, list) else {t}
    if "number" in names:
        names.add("integer")  # a number branch overlaps an integer one
    if "integer" in names:
        names.add("number")
    return names if names <= set(_JSON_TYPES) else None


def _discriminated(branches: list[Any], objects: bool) -> bool:
    """Every branch is an object requiring a property `p` whose const differs
    (a branch that does not say it is an object also takes any non-object)."""
    if not all(isinstance(b, dict) and (objects or _only_objects(b)) for b in branches):
        return False
    common: set[str] | None = None
    for b in branches:
        props = b.get("properties") if isinstance(b.get("properties"), dict) else {}
        required = set(b.get("required", [])) if isinstance(b.get("required"), list) else set()
        keys = {k for k, v in props.items() if isinstance(v, dict) and "const" in v and k in required}
        common = keys if common is None else common & keys
    for key in sorted(common or ()):
        forms = _canonical_set([b["properties"][key]["const"] for b in branches])
        if forms is not None and len(forms) == len(branches):  # every const differs
            return True
    return False
