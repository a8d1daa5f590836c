"""One test per normalization rule (grammar/schema_normalize.py), plus the
keyword tables (schema_keywords.py) and the output validator (validation.py)."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from grammar import GrammarError, GrammarSpec
from grammar.schema_keywords import backend_view, disjoint
from grammar.schema_normalize import MAX_NODES, Unresolved, normalize_schema
from grammar.validation import SchemaValidator


def test_annotations_and_unknown_formats_are_dropped():
    schema = {"type": "string", "title": "t", "description": "d", "examples": ["x"],
              "default": "x", "deprecated": True, "x-vendor": 1, "$comment": "c",
              "format": "my-custom-format", "readOnly": True}
    assert normalize_schema(schema) == {"type": "string"}
    assert normalize_schema({"type": "string", "format": "date"}) == {"type": "string",
                                                                      "format": "date"}


def test_local_refs_defs_definitions_and_anchors_are_inlined():
    schema = {"$defs": {"a": {"$ref": "#/definitions/b"}},
              "definitions": {"b": {"$anchor": "int", "type": "integer"}},
              "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"$ref": "#int"},
                             "z": {"$ref": "#/definitions/b", "minimum": 3}}}
    assert normalize_schema(schema) == {"properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"},
        "z": {"type": "integer", "minimum": 3}}}


def test_recursive_refs_stay_refs_into_defs():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"}
    out = normalize_schema(schema)
    assert out["$ref"].startswith("#/$defs/")
    name = out["$ref"].rsplit("/", 1)[1]
    assert out["$defs"][name]["properties"]["next"] == {"$ref": out["$ref"]}


def test_dangling_and_uri_refs():
    with pytest.raises(GrammarError, match="points nowhere"):
        normalize_schema({"$ref": "#/$defs/missing"})
    with pytest.raises(Unresolved):  # left to the libraries' own resolvers
        normalize_schema({"$ref": "http://example.com/s.json"})


def test_exponential_ref_expansion_is_bounded():
    defs = {f"d{i}": {"type": "array", "items": [{"$ref": f"#/$defs/d{i + 1}"}] * 4}
            for i in range(12)}
    defs["d12"] = {"type": "integer"}
    defs = {k: {**v, "prefixItems": v.pop("items")} if "items" in v else v for k, v in defs.items()}
    with pytest.raises(GrammarError) as info:
        normalize_schema({"$defs": defs, "$ref": "#/$defs/d0"})
    assert info.value.reason == "too_large" and MAX_NODES < 4 ** 12


def test_all_of_of_objects_is_merged():
    schema = {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
        {"properties": {"a": {"maximum": 9}, "b": {"type": "string"}}, "required": ["b"]},
    ]}
    assert normalize_schema(schema) == {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "string"}},
        "required": ["a", "b"]}
    # additionalProperties would see other members' properties: kept as allOf.
    kept = {"allOf": [{"properties": {"a": {}}, "additionalProperties": False},
                      {"properties": {"b": {}}}]}
    assert "allOf" in normalize_schema(kept)


def test_all_of_bounds_merge_to_the_tighter_one():
    # Both members hold: the larger lower bound, the smaller upper bound.
    merged = normalize_schema({"allOf": [{"type": "integer", "minimum": 1, "maximum": 50},
                                         {"minimum": 5, "maximum": 70}]})
    assert (merged["minimum"], merged["maximum"]) == (5, 50)
    merged = normalize_schema({"allOf": [{"type": "string", "minLength": 2, "maxLength": 9},
                                         {"minLength": 4, "maxLength": 3}]})
    assert (merged["minLength"], merged["maxLength"]) == (4, 3)


def test_single_enum_becomes_const():
    assert normalize_schema({"enum": ["only"]}) == {"const": "only"}
    assert normalize_schema({"enum": [1, 2]}) == {"enum": [1, 2]}


def test_pointers_resolve_in_their_own_bundled_schema():
    # A `#/...` pointer inside a subschema with an `$id` names a node of that
    # subschema (a bundled resource), not of the document root.
    inner = {"$id": "urn:example:inner", "$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}
    outer = {"$defs": {"x": {"type": "string"}}, "type": "object",
             "properties": {"a": inner, "b": {"$ref": "#/$defs/x"},
                            "c": {"$ref": "urn:example:inner#/$defs/x"}}}
    props = normalize_schema(outer)["properties"]
    assert props["a"] == {"type": "integer"}
    assert props["b"] == {"type": "string"}
    assert props["c"] == {"type": "integer"}


def test_merging_allOf_compares_values_as_json():
    # `true` is not `1` (Python's `==` says it is).
    assert normalize_schema({"allOf": [{"enum": [True, "x"]}, {"enum": [1, "x"]}]}) == {"enum": ["x"]}
    nothing = jsonschema_rs.validator_for(normalize_schema({"allOf": [{"const": True}, {"const": 1}]}))
    assert not nothing.is_valid(True) and not nothing.is_valid(1)


def test_an_integral_const_matches_by_value():
    one = {"type": "number", "minimum": 1, "maximum": 1}
    assert normalize_schema({"const": 1}) == one
    assert normalize_schema({"enum": [1.0]}) == one
    assert normalize_schema({"type": "integer", "const": -2.0}) == {
        "type": "integer", "minimum": -2, "maximum": -2}
    # Not numbers, or not integral: literals as written.
    assert normalize_schema({"const": True}) == {"const": True}
    assert normalize_schema({"const": 0.5}) == {"const": 0.5}
    # Past 2**53 a bound would be read as a double: the literal stays.
    assert normalize_schema({"const": 12345678901234567890}) == {"const": 12345678901234567890}
    # An integer's fractional bounds, rounded inward.
    assert normalize_schema({"type": "integer", "minimum": 1.5, "exclusiveMaximum": 3.5}) == {
        "type": "integer", "minimum": 2, "maximum": 3}
    assert normalize_schema({"type": "integer", "exclusiveMinimum": 1.2, "minimum": 5}) == {
        "type": "integer", "minimum": 5}


def test_draft_04_07_spellings():
    assert normalize_schema({"minimum": 1, "exclusiveMinimum": True}) == {"exclusiveMinimum": 1}
    assert normalize_schema({"maximum": 5, "exclusiveMaximum": False}) == {"maximum": 5}
    assert normalize_schema({"dependencies": {"a": ["b"], "c": {"required": ["d"]}}}) == {
        "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"c": {"required": ["d"]}}}
    assert normalize_schema({"items": [{"type": "integer"}], "additionalItems": False}) == {
        "prefixItems": [{"type": "integer"}], "items": False}
    # Draft-04's `id` names a resource or, as "#name", an anchor.
    anchored = {"$schema": "http://json-schema.org/draft-04/schema#",
                "definitions": {"a": {"id": "#foo", "type": "integer"}}, "properties": {"x": {"$ref": "#foo"}}}
    assert normalize_schema(anchored) == {"properties": {"x": {"type": "integer"}}}
    # Before 2019-09 a $ref's siblings are ignored.
    old = {"$schema": "http://json-schema.org/draft-07/schema#",
           "definitions": {"i": {"type": "integer"}}, "$ref": "#/definitions/i", "maximum": 3}
    assert normalize_schema(old) == {"type": "integer"}


def test_integral_float_counts_and_unevaluated_without_applicators():
    assert normalize_schema({"maxLength": 2.0}) == {"maxLength": 2}
    assert normalize_schema({"properties": {"a": {}}, "unevaluatedProperties": False}) == {
        "properties": {"a": {}}, "additionalProperties": False}
    with_applicator = {"anyOf": [{"properties": {"a": {}}}], "unevaluatedProperties": False}
    assert normalize_schema(with_applicator) == with_applicator


def test_unenforced_keywords_per_backend():
    schema = normalize_schema({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "n": {"maxLength": 3}}, "required": ["tags"], "not": {"required": ["x"]}})
    llg_view, llg = backend_view(schema, "llguidance")
    _, xgr = backend_view(schema, "xgrammar")
    assert llg == ("not", "uniqueItems")
    # maxLength without a type: given to xgrammar over every type, enforced on strings.
    assert xgr == ("not", "uniqueItems")
    # Dropping a keyword only widens the schema: the rest is still there.
    assert "not" not in llg_view and llg_view["properties"]["tags"]["items"] == {"type": "string"}


def test_one_of_is_enforced_only_when_branches_are_disjoint():
    assert disjoint([{"const": 1}, {"const": 2}])
    assert disjoint([{"type": "string"}, {"type": "object"}])
    assert not disjoint([{"type": "integer"}, {"type": "number"}])
    tagged = [{"type": "object", "properties": {"k": {"const": c}}, "required": ["k"]}
              for c in ("a", "b")]
    assert disjoint(tagged)
    assert backend_view({"oneOf": tagged}, "llguidance")[1] == ()
    view, missing = backend_view({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "llguidance")
    assert missing == ("oneOf",) and "anyOf" in view


def test_auto_prefers_the_backend_that_enforces_more(compiler):
    # Pretty JSON prefers xgrammar, which leaves multipleOf unenforced;
    # llguidance enforces it, so auto takes llguidance for this schema.
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}},
                                    "required": ["a"]}, options=None)
    from grammar import GrammarOptions
    assert isinstance(spec.source, str)
    pretty = GrammarSpec.json_schema(spec.source, GrammarOptions("pretty"))
    assert compiler.backends_for(pretty)[0] == "xgrammar"
    matcher = compiler.compile(pretty)
    assert matcher.backend == "llguidance" and matcher.unenforced_keywords == ()
    assert compiler.compile(pretty, backend="xgrammar").unenforced_keywords == ("multipleOf",)


def test_validator_results():
    v = SchemaValidator({"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True}}, "required": ["tags"]})
    assert v.validate_text('{"tags":[1,2]}').valid
    bad = v.validate_text('{"tags":[1,1]}')
    assert (bad.valid, bad.instance_path, bad.keyword) == (False, "/tags", "uniqueItems")
    missing = v.validate_text("{}")
    assert missing.keyword == "required" and missing.instance_path == ""
    broken = v.validate_text('{"tags":')
    assert not broken.valid and broken.keyword == "" and "not JSON" in broken.message
    # The path is a JSON Pointer: "~" and "/" in a key are escaped, "~" first.
    odd = SchemaValidator({"properties": {"a/b~c": {"type": "array", "items": {"type": "integer"}}}})
    assert odd.validate_text('{"a/b~c":[1,"x"]}').instance_path == "/a~1b~0c/1"
    # A number past a double's range is a number (Python reads it as infinity,
    # which the validator saw as null: "not of type number").
    huge = SchemaValidator({"type": "number", "minimum": 0})
    assert huge.validate_text("1e400").valid and not huge.validate_text("-1e400").valid
    # One too small for a double is no zero either (Python reads it as 0.0:
    # `not const 0` refused it, `contains integer` took it).
    assert SchemaValidator({"type": "number", "not": {"const": 0}}).validate_text("1e-400").valid
    contains = SchemaValidator({"type": "array", "contains": {"type": "integer"}})
    assert not contains.validate_text("[1e-400]").valid and not contains.validate_text("[-2.5e-999]").valid
    assert contains.validate_text("[0e-400]").valid and contains.validate_text("[0.000e5]").valid
    with pytest.raises(ValueError):
        SchemaValidator({"$ref": "http://example.com/remote.json"})  # never fetched


def test_compiled_matchers_carry_their_validator(compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    m = compiler.compile(GrammarSpec.json_schema(schema))
    assert m.unenforced_keywords == ("uniqueItems",)
    assert m.validator is not None and not m.validator.validate_text("[1,1]").valid
    # Cached with the grammar: the next request gets the same validator.
    assert compiler.compile(GrammarSpec.json_schema(schema)).validator is m.validator


def test_ref_with_siblings_applies_in_place():
    # `unevaluatedProperties` beside a `$ref` sees what the target evaluates:
    # merged, it is `additionalProperties` over both sets of properties, the
    # siblings' own first (the order a writer of this schema reads).
    schema = {"$defs": {"bar": {"properties": {"bar": {"type": "string"}}}},
              "$ref": "#/$defs/bar", "properties": {"foo": {"type": "string"}},
              "unevaluatedProperties": False}
    out = normalize_schema(schema)
    assert out == {"properties": {"foo": {"type": "string"}, "bar": {"type": "string"}},
                   "additionalProperties": False}
    assert list(out["properties"]) == ["foo", "bar"]
    # A member's own `unevaluatedProperties` sees only that member: kept apart.
    member = {"allOf": [{"properties": {"a": {}}, "unevaluatedProperties": False},
                        {"properties": {"b": {}}}]}
    assert "allOf" in normalize_schema(member)


def test_dynamic_anchor_is_an_anchor_for_ref():
    schema = {"$defs": {"items": {"$dynamicAnchor": "items", "type": "string"}},
              "type": "array", "items": {"$ref": "#items"}}
    assert normalize_schema(schema) == {"type": "array", "items": {"type": "string"}}


def test_normalization_keeps_the_meaning_of_every_suite_schema():
    # Every JSON-Schema-Test-Suite instance is accepted by the normalized
    # schema exactly when the schema as written accepts it (remote documents
    # from a store of the suite's `_remotes`). Left out: schemas with dynamic
    # references (the normalizer does not keep their dynamic scope; the
    # grammar leaves `$dynamicRef` unenforced and the whole output is checked
    # by the schema as written) and a custom metaschema that turns validation
    # off (`vocabulary`, a known gap: BENCHMARKS.md).
    import json
    from pathlib import Path

    from grammar.schema_store import SchemaStore

    suite = Path(__file__).resolve().parents[1] / "data/json-schema-test-suite"
    if not suite.is_dir():
        pytest.skip("JSON-Schema-Test-Suite not found")
    store = SchemaStore({"http://localhost:1234/": suite / "_remotes"})
    checked = 0
    for path in sorted(suite.glob("*.json")):
        for group in json.loads(path.read_text()):
            schema = group["schema"]
            text = json.dumps(schema)
            if path.stem == "vocabulary" or "$dynamicRef" in text or "$recursiveRef" in text:
                continue
            try:
                normalized = normalize_schema(schema, store)
            except Unresolved:
                continue  # the 2020-12 metaschema, not in the store: compiled as written
            if "$dynamicRef" in json.dumps(normalized):
                continue  # dynamic references inside a document from the store
            raw = jsonschema_rs.validator_for(schema, retriever=store.retrieve)
            norm = None if isinstance(normalized, bool) else \
                jsonschema_rs.validator_for(normalized, retriever=store.retrieve)
            for test in group["tests"]:
                expected = raw.is_valid(test["data"])
                got = normalized if norm is None else norm.is_valid(test["data"])
                assert got == expected, (path.stem, group["description"], test["description"])
                checked += 1
    assert checked > 1100


def test_ref_to_a_recursive_target_beside_siblings():
    schema = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
              "$ref": "#/$defs/node", "required": ["next"]}
    out = normalize_schema(schema)
    raw, norm = jsonschema_rs.validator_for(schema), jsonschema_rs.validator_for(out)
    values: tuple[object, ...] = ({}, {"next": {}}, {"next": {"next": 1}}, {"next": {"next": {}}})
    for value in values:
        assert norm.is_valid(value) == raw.is_valid(value), value


def test_a_pointer_into_an_embedded_resource_resolves_its_refs_there():
    schema = {"$defs": {"k": {"type": "string"},
                        "x": {"$id": "https://example.com/x.json",
                              "$defs": {"k": {"type": "integer"}, "y": {"$ref": "#/$defs/k"}}}},
              "properties": {"p": {"$ref": "#/$defs/x/$defs/y"}}}
    assert normalize_schema(schema) == {"properties": {"p": {"type": "integer"}}}


def test_only_subschemas_hold_ids_and_anchors():
    # A property named `enum` is a subschema; an `$id` inside an annotation is not.
    schema = {"properties": {"enum": {"$anchor": "e", "type": "integer"},
                             "r": {"$ref": "#e"}},
              "x-doc": {"$id": "https://example.com/fake.json", "type": "null"}}
    assert normalize_schema(schema)["properties"]["r"] == {"type": "integer"}
    with pytest.raises(Unresolved):
        normalize_schema({**schema, "$ref": "https://example.com/fake.json"})


def test_old_dependencies_join_the_new_keywords_of_the_same_name() -> None:
    # `dependencies` overwrote a same-named dependentRequired entry: the
    # rewritten schema accepted {"a": 1, "b": 2}, which the original refuses.
    schema = {"dependentRequired": {"a": ["c"]}, "dependencies": {"a": ["b"], "x": {"required": ["z"]}},
              "dependentSchemas": {"x": {"required": ["y"]}}}
    out = normalize_schema(schema)
    assert out["dependentRequired"] == {"a": ["c", "b"]}
    original, rewritten = SchemaValidator(schema), SchemaValidator(out)
    for instance in ('{"a": 1, "b": 2}', '{"a": 1, "c": 2}', '{"a": 1, "b": 2, "c": 3}', '{"x": 1, "y": 2}',
                     '{"x": 1, "y": 2, "z": 3}'):
        assert original.validate_text(instance).valid == rewritten.validate_text(instance).valid, instance


def test_const_discriminated_branches_are_disjoint_only_among_objects() -> None:
    # Without "type": "object" a string or a number matches every branch.
    branches = [{"properties": {"kind": {"const": k}}, "required": ["kind"]} for k in ("a", "b")]
    assert not disjoint(branches)
    assert disjoint(branches, objects=True)
    assert disjoint([{**b, "type": "object"} for b in branches])
    view, gaps = backend_view({"oneOf": branches}, "llguidance")
    assert "oneOf" in gaps
    view, gaps = backend_view({"type": "object", "oneOf": branches}, "llguidance")
    assert "oneOf" not in gaps


def test_literal_branches_overlap_under_json_schema_equality() -> None:
    # 1 and 1.0 are one JSON value; true is not 1, nor [true] [1]; objects ignore key order.
    assert not disjoint([{"const": 1}, {"enum": [3, 1.0]}])
    assert disjoint([{"const": True}, {"const": 1}])
    assert disjoint([{"const": [True]}, {"const": [1]}])
    assert not disjoint([{"const": [1]}, {"const": [1.0]}])
    assert not disjoint([{"const": {"a": 1, "b": 2}}, {"enum": [{"b": 2, "a": 1}]}])
    assert disjoint([{"enum": ["a", "b"]}, {"enum": ["c"]}, {"const": None}])
    # A discriminator's consts too: 1 and 1.0 discriminate nothing.
    tagged = [{"type": "object", "properties": {"k": {"const": c}}, "required": ["k"]} for c in (1, 1.0)]
    assert not disjoint(tagged)
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    assert not disjoint([{"const": deep}, {"const": 1}])  # too deep to compare: not known disjoint


def test_strict_defaults_close_what_names_its_parts_as_vllm_reads_it():
    from grammar.schema_normalize import strict_defaults

    named = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    assert strict_defaults(named) == {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "object", "properties": {"b": {}}, "additionalProperties": False}}}
    assert strict_defaults({"prefixItems": [{}]}) == {"prefixItems": [{}], "items": False}
    kept: Any
    for kept in ({"type": "object"}, {"properties": {"a": {}}, "additionalProperties": True},
                 {"properties": {"a": {}}, "patternProperties": {"^x": {}}},
                 {"prefixItems": [{}], "items": {"type": "integer"}}, True):
        assert strict_defaults(kept) == kept
    # Merged subschemas stay open: closing one would refuse what a sibling allows.
    merged: dict[str, Any] = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert strict_defaults(merged) == merged
    anyof = {"anyOf": [{"properties": {"a": {}}}, {"type": "integer"}]}
    assert strict_defaults(anyof)["anyOf"][0]["additionalProperties"] is False
