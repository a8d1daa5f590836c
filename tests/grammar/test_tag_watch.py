"""Tag contents found in a structural tag's output (tag_segments.py) and the
value checks run inside them (tag_watch.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from grammar import GrammarSpec, structural_tag
from grammar.output_check import OutputCheck
from grammar.tag_segments import Segment, TagScanner, TagShape, contents, shapes_of
from grammar.tag_watch import TagPlan
from grammar.tool_calls import Tool, call_constraint
from grammar.value_watch import Violation

UNIQUE = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                  "uniqueItems": True}},
          "required": ["xs"], "additionalProperties": False}
NOT_ONE = {"type": "integer", "not": {"const": 1}}
SHAPES = (
    TagShape(b'<tool_call>\n{"name": "f", "arguments": ', b"}\n</tool_call>", True),
    TagShape(b'<tool_call>\n{"name": "g", "arguments": ', b"}\n</tool_call>", True),
    TagShape(b"<note>", b"</note>", False),
)
# Free text (a bracket, a quote, a begin cut short), a call whose strings hold
# brackets, quotes and the end string, an any-text tag holding a trigger, a
# call with a bare number, and an open call.
TEXT = (b'So [1, 1] "x" <tool_c> - <tool_call>\n{"name": "f", "arguments": {"xs": [1, "]}\\"\\n</tool_call>"]}}'
        b'\n</tool_call> then <note>hi <tool_call></note><tool_call>\n{"name": "g", "arguments": 12}\n</tool_call>'
        b' end <tool_call>\n{"name": "f", "arguments": {"xs": [')


def _tool_plan(*tools: Tool, choice: str = "auto") -> TagPlan:
    spec = call_constraint(list(tools), choice)
    assert spec is not None
    return TagPlan(str(spec.source), "xgrammar")


def test_segments_of_free_text_and_tags():
    scanner = TagScanner(SHAPES)
    scanner.feed(TEXT)
    found = [(s.tag, TEXT[s.start:s.end].decode()) for s in scanner.segments[:-1]]
    assert found == [(0, '{"xs": [1, "]}\\"\\n</tool_call>"]}'), (2, "hi <tool_call>"), (1, "12")]
    last = scanner.segments[-1]
    assert last.tag == 0 and last.end is None and TEXT[last.start:] == b'{"xs": ['


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=40))
def test_any_split_of_the_text_gives_the_same_segments(cuts):
    whole = TagScanner(SHAPES)
    whole_pieces = whole.feed(TEXT)
    split = TagScanner(SHAPES)
    pieces = []
    bounds = [0, *sorted(cuts), len(TEXT)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        pieces += split.feed(TEXT[a:b])
    assert split.segments == whole.segments
    assert [(p.kind, p.at, p.tag) for p in pieces if p.kind != "content"] == \
        [(p.kind, p.at, p.tag) for p in whole_pieces if p.kind != "content"]
    assert b"".join(p.data for p in pieces) == b"".join(p.data for p in whole_pieces)


def test_a_longer_begin_waits_for_the_text_to_decide():
    shapes = (TagShape(b"<f=a>", b"</f>", True), TagShape(b"<f=ab>", b"</f>", True))
    scanner = TagScanner(shapes)
    scanner.feed(b"x <f=a")
    assert scanner.segments == []
    scanner.feed(b"b>[1]</f>")
    assert scanner.segments == [Segment(1, 8, 11)]


def test_shapes_of_the_formats_read():
    legacy = structural_tag.normalize(json.dumps({"structures": [
        {"begin": "<f>", "schema": NOT_ONE, "end": "</f>"}], "triggers": ["<f"]}))
    assert shapes_of(legacy) == (TagShape(b"<f>", b"</f>", True, NOT_ONE),)
    spec = call_constraint([Tool("f", UNIQUE)], "required")
    assert spec is not None and len(shapes_of(structural_tag.normalize(str(spec.source))) or ()) == 1
    # A format whose contents cannot be delimited by their strings: nothing is read.
    assert shapes_of({"type": "structural_tag", "format": {"type": "regex", "pattern": "a+"}}) is None
    assert shapes_of({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
        {"type": "tag", "begin": "<r>", "content": {"type": "regex", "pattern": "a+"}, "end": "</r>"}]}}) is None


def test_a_duplicate_inside_a_call_is_found_at_the_call_offset():
    plan = _tool_plan(Tool("f", UNIQUE), Tool("g", {"type": "object"}))
    assert set(plan.checks) == {0} and plan.resampled_keywords == ("uniqueItems",)
    watch = plan.watch()
    assert watch is not None
    head = 'Sure [1, 1]. <tool_call>\n{"name": "f", "arguments": '
    assert watch.feed(head.encode()) is None and watch.stable == len(head)  # free text is never checked
    assert watch.feed(b'{"xs": [1, 1') is None
    assert watch.stable == len(head) + len('{"xs": [1,')  # only the open item is held back
    found = watch.feed(b"]")
    assert found == Violation(len(head) + len('{"xs": [1,'), len(head) + len('{"xs": [1, 1'), "uniqueItems")
    watch.truncate(found.start)
    assert watch.feed(b' 2]}}\n</tool_call> ok') is None and watch.stable == watch.size


def test_a_bare_scalar_is_checked_when_its_tag_ends():
    plan = TagPlan(json.dumps({"structures": [{"begin": "<n>", "schema": NOT_ONE, "end": "</n>"}],
                               "triggers": ["<n"]}), "xgrammar")
    watch = plan.watch()
    assert watch is not None
    assert watch.feed(b"a <n>1") is None and watch.stable == len("a <n>")
    assert watch.feed(b"<") == Violation(5, 6, "not")
    watch.truncate(5)
    assert watch.feed(b"2</n> 1") is None and watch.stable == watch.size


def test_giving_up_keeps_one_tag_and_checks_the_next():
    watch = _tool_plan(Tool("f", UNIQUE)).watch()
    assert watch is not None
    call = '<tool_call>\n{"name": "f", "arguments": {"xs": [3, 3]}}\n</tool_call>'
    assert watch.feed(call[:-len("]}}\n</tool_call>")].encode()) is None
    assert watch.feed(b"]") is not None
    watch.give_up()
    assert watch.feed(b"}}\n</tool_call>\n") is None and watch.stable == watch.size
    second = watch.feed(call.encode())
    assert second is not None and second.start > len(call)
    # A rollback into the second call keeps the first one given up.
    watch.truncate(second.start)
    assert watch.feed(b" 4]}}\n</tool_call>") is None


def test_violations_of_two_tags_read_in_one_step_are_resolved_oldest_first():
    # A step's forced run can close two checked calls before the resampler
    # looks: it acts on the first. Before, giving that one up marked the
    # second call's tag instead, and the second call's violation was lost.
    watch = _tool_plan(Tool("f", UNIQUE)).watch()
    assert watch is not None
    call = '<tool_call>\n{"name": "f", "arguments": {"xs": [3, 3]}}\n</tool_call>'
    first = watch.feed(call.encode())
    assert first is not None and first.end <= len(call)
    assert watch.feed(call.encode()) == first  # the oldest stays the one to resolve
    watch.give_up()
    second = watch.feed(b"")
    assert second is not None and second.start > len(call) and second.keyword == "uniqueItems"
    assert watch.stable == second.start  # held back until it is resolved
    # Rolled back into the second call: the first stays given up, the second is checked again.
    watch.truncate(second.start)
    again = watch.feed(b"3]}}\n</tool_call>")
    assert again is not None and (again.start, again.keyword) == (second.start, second.keyword)
    watch.truncate(second.start)
    assert watch.feed(b"4]}}\n</tool_call>") is None and watch.stable == watch.size
    # The output's end reports what is still unresolved.
    assert watch.feed(call.encode()) is not None
    assert watch.finish() is not None
    watch.give_up()
    assert watch.finish() is None


def test_unchecked_tags_and_keywords_the_grammar_enforces_give_no_watch():
    assert _tool_plan(Tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}})).watch() is None
    # llguidance refuses unimplemented keywords, so what it compiled has none left.
    spec = call_constraint([Tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}})], "auto")
    assert spec is not None and TagPlan(str(spec.source), "llguidance").watch() is None


def test_contents_of_a_finished_output():
    text = 'a <tool_call>\n{"name": "f", "arguments": {"xs": [1]}}\n</tool_call> b'
    plan = _tool_plan(Tool("f", UNIQUE))
    assert plan.shapes is not None and contents(plan.shapes, text) == [(0, '{"xs": [1]}')]


def test_the_output_verdict_checks_each_tag_content_against_its_whole_schema():
    # The grammar (xgrammar) ignores uniqueItems: the verdict reads the same
    # contents as the value checks and validates each against its schema.
    spec = call_constraint([Tool("f", UNIQUE)], "auto")
    assert spec is not None
    check = OutputCheck(spec)
    assert check.validate_text("free [1, 1] " + _CALL.format('{"xs": [1, 2]}')).valid
    bad = check.validate_text("free " + _CALL.format('{"xs": [1, 2]}') + " " + _CALL.format('{"xs": [3, 3]}'))
    assert bad.checked and not bad.valid and bad.keyword == "uniqueItems" and bad.instance_path == "/xs"
    assert "<tool_call>" in bad.message
    legacy = OutputCheck(GrammarSpec.structural_tag({"structures": [
        {"begin": "<n>", "schema": NOT_ONE, "end": "</n>"}], "triggers": ["<n"]}))
    assert legacy.validate_text("1 <n>2</n>").valid
    assert legacy.validate_text("<n>1</n> x").keyword == "not"


_CALL = '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>'


def test_a_bare_number_ends_where_a_number_cannot_go_on() -> None:
    """Any of "0-9+-.eE" continued a bare number, so the end "-->" right after
    "2" was read into it: the valid output's verdict was "not JSON", the next
    tag was never found, and a valid value was resampled."""
    source = json.dumps({"structures": [{"begin": "<!--n ", "schema": {"type": "integer", "not": {"const": 1}},
                                         "end": "-->"}], "triggers": ["<!--n"]})
    text = "a <!--n 2--> b <!--n -3.5e+2--> c <!--n true-->"
    shapes = shapes_of(structural_tag.normalize(source))
    assert shapes is not None
    assert contents(shapes, text) == [(0, "2"), (0, "-3.5e+2"), (0, "true")]
    verdict = OutputCheck(GrammarSpec("structural_tag", source)).validate_text("a <!--n 2--> b <!--n 3-->")
    assert verdict.valid, verdict
    watch = TagPlan(source, "xgrammar").watch()
    assert watch is not None
    assert not any(watch.feed(bytes([b])) for b in b"a <!--n 2--> b <!--n 3-->") and watch.finish() is None
