"""Values that break their schema (duplicates under `uniqueItems`, keywords the
grammar does not enforce), found while a JSON output is read."""

from __future__ import annotations

import pytest

from grammar.validation import SchemaValidator
from grammar.value_watch import ValueWatch, Violation
from grammar.watch_plan import WatchPlan

INTS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def _first_duplicate(schema: dict, text: str) -> Violation | None:
    return _first_violation(schema, text, ())


def _first_violation(schema: dict, text: str, keywords: tuple[str, ...]) -> Violation | None:
    """Feeds `text` a byte at a time, then ends it: the first violation."""
    plan = WatchPlan.for_schema(schema)
    assert plan is not None
    watch = ValueWatch(plan, keywords, SchemaValidator(schema))
    found = [watch.feed(bytes([b])) for b in text.encode()] + [watch.finish()]
    return next((d for d in found if d is not None), None)


def test_of_two_violations_read_at_once_the_first_is_reported():
    # One token can complete two bad values ("1,1]"): the earlier one is rolled
    # back and resampled; naming the later one shipped the earlier.
    plan = WatchPlan.for_schema(INTS)
    assert plan is not None
    watch = ValueWatch(plan, ("uniqueItems",))
    assert watch.feed(b"[1,1,1]") == Violation(3, 4, "uniqueItems")


def test_the_stable_point_is_the_outermost_open_checked_value():
    # "[[1],[1" may still become a duplicate of "[1]": the open outer item
    # (from byte 5) can be taken back whole, not only the inner one's items.
    nested = {"type": "array", "uniqueItems": True,
              "items": {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}}
    plan = WatchPlan.for_schema(nested)
    assert plan is not None
    watch = ValueWatch(plan, ("uniqueItems",))
    assert watch.feed(b"[[1],[1") is None and watch.stable == 5
    assert watch.feed(b",2") is None and watch.stable == 5


def test_a_duplicate_is_found_when_its_item_completes():
    plan = WatchPlan.for_schema(INTS)
    assert plan is not None and plan.located(("uniqueItems",)) == ("uniqueItems",)
    watch = ValueWatch(plan, ("uniqueItems",))
    assert watch.feed(b"[1,1") is None  # 1 could still become 10
    assert watch.stable == 3  # the open item starts after the comma
    assert watch.feed(b",") == Violation(3, 4, "uniqueItems")
    watch.truncate(3)
    assert watch.size == 3 and watch.feed(b"12,2]") is None and watch.stable == watch.size


@pytest.mark.parametrize("items, duplicate", [
    ("1,1.0", True),  # JSON Schema equality: numbers by value
    ("true,1", False),  # a boolean is not a number
    ('{"a":1,"b":[2]},{"b":[2],"a":1}', True),  # key order does not matter
    ('"a,]\\"","a,]\\""', True),  # structure inside strings is text
    ('"x","y",[1],[1]', True),
    ("null,0,false,\"\"", False),
])
def test_equality_is_json_schemas(items, duplicate):
    schema = {"type": "array", "uniqueItems": True}
    assert (_first_duplicate(schema, f"[{items}]") is not None) == duplicate


def test_arrays_are_followed_through_properties_refs_and_items():
    schema = {"type": "object", "properties": {
        "t": {"$ref": "#/$defs/tags"},
        "free": {"type": "array"},
        "rows": {"type": "array", "items": {"$ref": "#/$defs/tags"}}},
        "$defs": {"tags": {"type": "array", "uniqueItems": True}}}
    assert _first_duplicate(schema, '{"free":[1,1],"t":[2,3]}') is None
    dup = _first_duplicate(schema, '{"free":[1,1],"rows":[[4],[5,6,5]]}')
    assert dup is not None
    plan = WatchPlan.for_schema(schema)
    assert plan is not None and plan.located(("uniqueItems",)) == ("uniqueItems",)


def test_branches_chosen_by_the_value_are_not_tracked():
    schema = {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "array", "uniqueItems": True}, {"type": "string"}]}}}
    plan = WatchPlan.for_schema(schema)
    assert plan is not None and plan.located(("uniqueItems",)) == ()  # strict refuses it
    assert _first_duplicate(schema, '{"a":[1,1]}') is None  # no duplicate check there
    # ... but the node holding the branch is validated whole when it completes.
    found = _first_violation(schema, '{"a":[1,1]}', ("uniqueItems",))
    assert found is not None and found.start == len('{"a":')
    assert WatchPlan.for_schema(True) is None


def test_a_value_breaking_an_unenforced_keyword_is_found_when_it_completes():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "not": {"const": 5}},
        "tags": {"type": "array", "items": {"type": "string", "not": {"pattern": "^x"}}}}}
    assert _first_violation(schema, '{"n":6,"tags":["a","b"]}', ("not",)) is None
    found = _first_violation(schema, '{"n":5,"tags":[]}', ("not",))
    assert found == Violation(len('{"n":'), len('{"n":5'), "not")
    found = _first_violation(schema, '{"n":1,"tags":["a","xy","b"]}', ("not",))
    assert found is not None and found.start == len('{"n":1,"tags":["a",')
    # Without the keyword in the unenforced list, nothing is checked.
    assert _first_violation(schema, '{"n":5}', ()) is None


def test_the_whole_output_is_checked_when_its_top_level_node_holds_a_keyword():
    schema = {"type": "object", "dependentRequired": {"a": ["b"]},
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    plan = WatchPlan.for_schema(schema)
    assert plan is not None
    watch = ValueWatch(plan, ("dependentRequired",), SchemaValidator(schema))
    assert watch.feed(b'{"a":1') is None and watch.stable == 0  # nothing may be sent yet
    # More properties could mend it: `close` says where its `}` is.
    assert watch.feed(b"}") == Violation(0, len('{"a":1}'), "dependentRequired", close=6)
    assert _first_violation(schema, '{"a":1,"b":2}', ("dependentRequired",)) is None


def test_a_top_level_scalar_is_checked_when_the_output_ends():
    schema = {"type": "integer", "not": {"multipleOf": 3}}
    plan = WatchPlan.for_schema(schema)
    assert plan is not None
    watch = ValueWatch(plan, ("not",), SchemaValidator(schema))
    assert watch.feed(b"12") is None  # 12 could still become 124
    assert watch.finish() == Violation(0, 2, "not")
    watch.truncate(0)
    assert watch.feed(b"10") is None and watch.finish() is None


def test_only_checked_values_are_held_back_from_the_stream():
    schema = {"type": "object", "properties": {
        "free": {"type": "string"},
        "n": {"type": "integer", "not": {"const": 5}}}}
    plan = WatchPlan.for_schema(schema)
    assert plan is not None
    watch = ValueWatch(plan, ("not",), SchemaValidator(schema))
    watch.feed(b'{"free":"abc')
    assert watch.stable == watch.size  # an unchecked value streams as it comes
    watch.feed(b'","n":4')
    assert watch.stable == len(b'{"free":"abc","n":')
    watch.feed(b"}")
    assert watch.stable == watch.size


def test_if_then_else_and_keywords_in_branches():
    schema = {"type": "object", "properties": {"p": {
        "if": {"properties": {"k": {"const": "num"}}},
        "then": {"properties": {"v": {"type": "number"}}},
        "else": {"properties": {"v": {"type": "string"}}}}}}
    keywords = ("else", "if", "then")
    assert _first_violation(schema, '{"p":{"k":"num","v":1}}', keywords) is None
    assert _first_violation(schema, '{"p":{"k":"str","v":"x"}}', keywords) is None
    found = _first_violation(schema, '{"p":{"k":"num","v":"x"}}', keywords)
    assert found is not None and found.start == len('{"p":')
    plan = WatchPlan.for_schema(schema)
    assert plan is not None and plan.located(keywords) == keywords
    hidden = {"anyOf": [{"type": "integer", "not": {"const": 1}}, {"type": "string"}]}
    plan = WatchPlan.for_schema(hidden)
    assert plan is not None and plan.located(("not",)) == ()
    assert _first_violation(hidden, "1", ("not",)) == Violation(0, 1, "anyOf")


def test_scoped_references_leave_only_the_whole_output_checked():
    schema = {"$id": "https://example.com/s", "type": "object",
              "properties": {"n": {"type": "integer", "not": {"const": 5}}}}
    plan = WatchPlan.for_schema(schema)
    assert plan is not None and not plan.checks_nodes
    found = _first_violation(schema, '{"n":5}', ("not",))
    assert found is not None and found.start == 0  # caught, at the top level


def test_a_plan_pickles_as_text_and_parses_on_first_use():
    import pickle

    plan = WatchPlan.for_schema(INTS)
    copy = pickle.loads(pickle.dumps(plan))
    assert copy._root is None and copy.root == INTS


def test_a_schema_for_another_draft_is_checked_whole():
    # Draft-07 has no dependentRequired: the keyword constrains nothing there.
    # Nodes are validated as 2020-12, so such a schema is only checked whole,
    # by the validator of the schema as written.
    from grammar.schema_normalize import normalize_schema

    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "properties": {"a": {"dependentRequired": {"x": ["y"]}}}}
    plan = WatchPlan.for_schema(normalize_schema(schema), schema)
    assert plan is not None and plan.whole_only and not plan.checks_nodes
    watch = ValueWatch(plan, ("dependentRequired",), SchemaValidator(schema))
    assert watch.feed(b'{"a": {"x": 1}}') is None and watch.finish() is None


@pytest.mark.parametrize("text", [
    '{"n":"\\ud800"}',  # a lone surrogate: the validator cannot take it
    '{"n":' + "[" * 3000 + "]" * 3000 + "}",  # deeper than Python's recursion limit
])
def test_a_value_that_cannot_be_checked_is_left_to_the_final_validator(text):
    schema = {"type": "object", "properties": {"n": {"not": {"const": 5}}}}
    plan = WatchPlan.for_schema(schema)
    assert plan is not None
    watch = ValueWatch(plan, ("not",), SchemaValidator(schema))
    watch.feed(text.encode())  # never raises


def test_a_violation_more_items_could_mend_says_where_its_bracket_is():
    schema = {"type": "object", "properties": {"p": {"type": "array", "contains": {"const": 5}},
                                               "q": {"type": "array", "not": {"contains": {"const": 1}}}}}
    text = '{"p":[1, 2 ] ,"q":[1]}'
    found = _first_violation(schema, text, ("contains", "not"))
    assert found == Violation(len('{"p":'), len('{"p":[1, 2 ] '), "contains", close=text.index("]"))
    # `not` is not mended by more items: the whole value is resampled.
    found = _first_violation(schema, '{"q":[1]}', ("contains", "not"))
    assert found is not None and found.keyword == "not" and found.close is None


def test_a_value_the_validator_cannot_read_is_not_checked_nor_resampled():
    # "\ud800" is JSON (a lone surrogate escape) that the validator refuses to
    # take: a verdict of INVALID would have resampled, or failed, a valid output.
    schema = {"type": "string", "not": {"const": "x"}}
    result = SchemaValidator(schema).validate_text('"\\ud800"')
    assert not result.checked
    assert _first_violation(schema, '"\\ud800"', ("not",)) is None


def test_the_watch_reads_numbers_as_the_final_verdict_does():
    # Past a double's range a number is its largest value for both (the watch
    # read infinity, the verdict the largest double: the watch let pass what
    # the verdict then refused).
    assert _first_duplicate(INTS | {"items": {"type": "number"}}, "[1e400,1.7976931348623157e308]") is not None
