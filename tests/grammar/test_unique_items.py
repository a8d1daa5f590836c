"""Duplicate items under `uniqueItems`, found while a JSON output is read."""

from __future__ import annotations

import pytest

from grammar.unique_items import Duplicate, UniqueItemsPlan, UniqueItemsWatch

INTS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def _first_duplicate(schema: dict, text: str) -> Duplicate | None:
    plan = UniqueItemsPlan.for_schema(schema)
    assert plan is not None
    watch = UniqueItemsWatch(plan)
    found = [watch.feed(bytes([b])) for b in text.encode()]
    return next((d for d in found if d is not None), None)


def test_a_duplicate_is_found_when_its_item_completes():
    plan = UniqueItemsPlan.for_schema(INTS)
    assert plan is not None and plan.covers_all
    watch = UniqueItemsWatch(plan)
    assert watch.feed(b"[1,1") is None  # 1 could still become 10
    assert watch.stable == 3  # the open item starts after the comma
    assert watch.feed(b",") == Duplicate(3, 4)
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
    plan = UniqueItemsPlan.for_schema(schema)
    assert plan is not None and plan.covers_all


def test_branches_chosen_by_the_value_are_not_tracked():
    schema = {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "array", "uniqueItems": True}, {"type": "string"}]}}}
    plan = UniqueItemsPlan.for_schema(schema)
    assert plan is not None and not plan.covers_all  # strict refuses it
    assert _first_duplicate(schema, '{"a":[1,1]}') is None  # never a false alarm
    assert UniqueItemsPlan.for_schema({"type": "array"}) is None
