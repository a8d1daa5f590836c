"""Structural tags (grammar/structural_tag.py): both spellings, both backends,
forced tokens inside tags, and the verdict on a finished output."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar import GrammarError, GrammarOptions, GrammarSpec
from grammar.output_check import OutputCheck
from grammar.tool_calls import CallReader, Tool, call_constraint

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
       "additionalProperties": False}
LEGACY = {"type": "structural_tag", "structures": [{"begin": "<fn=add>", "schema": ADD, "end": "</fn>"}],
          "triggers": ["<fn="]}
# The same in xgrammar's spelling.
TRIGGERED: dict[str, Any] = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<fn="], "tags": [
    {"type": "tag", "begin": "<fn=add>", "content": {"type": "json_schema", "json_schema": ADD}, "end": "</fn>"}]}}
# Calls only, at least one, separated by newlines.
CALLS_ONLY: dict[str, Any] = {"type": "structural_tag", "format": {"type": "tags_with_separator", "separator": "\n",
                                                   "at_least_one": True, "tags": TRIGGERED["format"]["tags"]}}
# Free text with at least one call in it: llguidance has no such tag.
AT_LEAST_ONE = {"type": "structural_tag", "format": {**TRIGGERED["format"], "at_least_one": True}}


@pytest.mark.parametrize("bad, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"type": "json_schema", "format": {"type": "any_text"}}', '"type" must be "structural_tag"'),
    ("{}", 'give "format"'),
    ('{"structures": [], "triggers": ["<a"]}', "non-empty list"),
    ('{"structures": [{"begin": "<b>", "schema": {}, "end": "</b>"}], "triggers": ["<a"]}',
     "starts with none of the triggers"),
    ('{"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}', "needs a string begin"),
    ('{"format": [1]}', '"format" must be an object'),
])
def test_malformed_tags_fail_when_the_spec_is_built(bad, message):
    with pytest.raises(GrammarError, match=message):
        GrammarSpec("structural_tag", bad)


@pytest.mark.parametrize("tag", [LEGACY, TRIGGERED])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_both_spellings_on_both_backends(compiler, tag, backend):
    matcher = compiler.compile(GrammarSpec.structural_tag(tag), backend=backend)
    tok = compiler.tokenizer_data
    text = 'Let me add. <fn=add>{"a": 2}</fn> Done.'
    assert matcher.accept_tokens(tok.encode(text)) == len(tok.encode(text))
    assert matcher.can_terminate()
    matcher.reset()
    bad = tok.encode('<fn=add>{"a": "two"}</fn>')
    assert matcher.accept_tokens(bad) < len(bad)


def test_formats_llguidance_cannot_express_fall_back_to_xgrammar(compiler):
    spec = GrammarSpec.structural_tag(AT_LEAST_ONE)
    with pytest.raises(GrammarError, match="llguidance cannot enforce at_least_one"):
        compiler.compile(spec, backend="llguidance")
    bounded = json.loads(json.dumps(AT_LEAST_ONE).replace('"type": "integer"', '"type": "string", "maxLength": 4'))
    for tag in (AT_LEAST_ONE, bounded):  # llguidance first for the second, which it refuses
        assert compiler.compile(GrammarSpec.structural_tag(tag)).backend == "xgrammar"


def _with_content(**options: Any) -> dict[str, Any]:
    tag = json.loads(json.dumps(TRIGGERED))
    tag["format"]["tags"][0]["content"].update(options)
    return tag


@pytest.mark.parametrize("tag", [
    {"type": "structural_tag", "format": {**TRIGGERED["format"], "excludes": ["<fn=add>"]}},
    _with_content(style="qwen_xml"),
], ids=["excludes", "xml-style-content"])
def test_what_llguidance_would_not_enforce_is_refused_there_and_goes_to_xgrammar(compiler, tag):
    # Compiled as if absent, llguidance would have let the output break them.
    spec = GrammarSpec.structural_tag(tag)
    with pytest.raises(GrammarError, match="llguidance"):
        compiler.compile(spec, backend="llguidance")
    assert compiler.compile(spec).backend == "xgrammar"


def test_a_whitespace_bound_in_a_tag_holds_on_llguidance(compiler):
    spec = GrammarSpec.structural_tag(_with_content(max_whitespace_cnt=2))
    assert _accepts(compiler, spec, '<fn=add>{"a":  1}</fn>', backend="llguidance")
    assert not _accepts(compiler, spec, '<fn=add>{"a":   1}</fn>', backend="llguidance")


SEPARATED_TEXTS = ['<fn=add>{"a":1}</fn>', '<fn=add>{"a":1}</fn>\n<fn=add>{"a":2}</fn>', "",
                   'Sure <fn=add>{"a":1}</fn>', '<fn=add>{"a":1}</fn><fn=add>{"a":2}</fn>',
                   '<fn=add>{"a": 1}</fn>', '<fn=add>{"a":"x"}</fn>', '<fn=add>{"a":1}</fn>\n']


@pytest.mark.parametrize("options", [{"at_least_one": True}, {"at_least_one": True, "stop_after_first": True},
                                     {}, {"stop_after_first": True}])
def test_tags_with_a_separator_read_alike_on_both_backends(compiler, options):
    # llguidance compiles what tool calls make of them ("required", a named
    # tool), so tool calls can run where xgrammar's masks are slow.
    fmt = {**CALLS_ONLY["format"], "at_least_one": False, **options}
    spec = GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})
    tok = compiler.tokenizer_data
    verdicts: dict[str, list[bool]] = {}
    for backend in ("xgrammar", "llguidance"):
        matcher = compiler.compile(spec, backend=backend)
        for text in SEPARATED_TEXTS:
            matcher.reset()
            ids = tok.encode(text)
            verdicts.setdefault(text, []).append(matcher.accept_tokens(ids) == len(ids) and matcher.can_terminate())
    assert all(a == b for a, b in verdicts.values()), verdicts
    assert verdicts['<fn=add>{"a":1}</fn>'] == [True, True]
    assert verdicts[""][0] == ("at_least_one" not in options)
    two = '<fn=add>{"a":1}</fn>\n<fn=add>{"a":2}</fn>'
    assert verdicts[two][0] == ("stop_after_first" not in options)


@pytest.mark.parametrize("mode", ["auto", "required", "add"])
def test_tool_calls_with_bounded_strings_go_to_llguidance_first(compiler, mode):
    # xgrammar's masks inside a maxLength string took milliseconds a row.
    def spec(parameters):
        return call_constraint([Tool("add", parameters)], mode)

    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    assert compiler.compile(spec(bounded)).backend == "llguidance"
    assert compiler.compile(spec(ADD)).backend == "xgrammar"
    pretty = GrammarOptions(whitespace="pretty")
    assert compiler.compile(GrammarSpec.json_schema(bounded, pretty)).backend == "llguidance"
    assert compiler.compile(GrammarSpec.json_schema(ADD, pretty)).backend == "xgrammar"


@pytest.mark.parametrize("pattern, backend", [("^[A-Za-z ,.]{10,200}$", "llguidance"), ("^.{129}$", "llguidance"),
                                              ("^[a-z]{300,}$", "llguidance"), ("^[a-z ]{1,128}$", "xgrammar"),
                                              ("^[A-Z]{3}-[0-9]{4}$", "xgrammar")])
def test_patterns_counting_past_128_go_to_llguidance_first(compiler, pattern, backend):
    # xgrammar unrolls a count up to 128; past it a mask took 4-11 ms a row.
    schema = {"type": "object", "properties": {"d": {"type": "string", "pattern": pattern}}, "required": ["d"]}
    pretty = GrammarOptions(whitespace="pretty")
    assert compiler.compile(GrammarSpec.json_schema(schema, pretty)).backend == backend
    assert compiler.compile(call_constraint([Tool("f", schema)], "required")).backend == backend


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_tokens_inside_a_tag(compiler, backend):
    # Once the trigger is written the rest of the only tag's begin, and the
    # schema's key, are forced.
    matcher = compiler.compile(GrammarSpec.structural_tag(LEGACY), backend=backend)
    tok = compiler.tokenizer_data
    assert matcher.forced_tokens() == []  # free text: nothing forced
    trigger = tok.encode("Ok <fn=")
    assert matcher.accept_tokens(trigger) == len(trigger)
    forced = matcher.forced_tokens()
    assert tok._encoder.decode(forced).startswith("add>")
    assert matcher.accept_tokens(forced) == len(forced)


def test_the_output_verdict():
    check = OutputCheck(GrammarSpec.structural_tag(LEGACY))
    assert check.validate_text('x <fn=add>{"a":1}</fn> y').valid
    bad = check.validate_text('x <fn=add>{"a":"1"}</fn>')
    assert bad.checked and not bad.valid and "structural tag" in (bad.message or "")
    unfinished = check.validate_text('x <fn=add>{"a":1')
    assert unfinished.checked and not unfinished.valid and "unfinished" in (unfinished.message or "")
    # A tag that names tokens cannot be read over the output's bytes.
    tokens = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": "<|im_start|>"}, {"type": "const_string", "value": "hi"}]}}
    result = OutputCheck(GrammarSpec.structural_tag(tokens)).validate_text("hi")
    assert not result.checked and "names tokens" in (result.message or "")


@pytest.mark.parametrize(("schema", "content"), [
    ({"type": "object", "properties": {"city": {"type": "string"}}}, '{"city": "Oslo", "unit": "c"}'),
    ({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}, '{"city": "Z\\u00fcrich"}'),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1, 2]"),
])
def test_the_verdict_reads_the_tag_as_its_grammar_does(compiler, schema, content):
    # The verdict built its grammar from the tag as written (xgrammar's strict
    # mode, no escapes in bounded strings): answers the generating grammar
    # wrote, valid by their schema, were INVALID.
    tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    spec = GrammarSpec.structural_tag(tag)
    text = f"<f>{content}</f>"
    ids = compiler.tokenizer_data.encode(text)
    matcher = compiler.compile(spec, backend="xgrammar")
    assert matcher.accept_tokens(ids) == len(ids) and matcher.can_terminate()
    assert OutputCheck(spec).validate_text(text).valid


def test_contents_the_verdict_cannot_find_are_not_checked():
    # A sequence's (or an empty end's) contents cannot be located: a keyword
    # the grammar leaves out (uniqueItems) went unchecked, and the verdict said VALID.
    unique = {"type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}}
    sequence = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<f>", "content": unique, "end": "</f>"}]}}
    result = OutputCheck(GrammarSpec.structural_tag(sequence)).validate_text("<f>[1, 1]</f>")
    assert not result.checked and "uniqueItems" in result.message
    enforced = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "array"}},
         "end": "</f>"}]}}
    assert OutputCheck(GrammarSpec.structural_tag(enforced)).validate_text("<f>[1, 1]</f>").checked


def test_the_spec_keeps_its_text_as_the_cache_key():
    a = GrammarSpec.structural_tag(LEGACY)
    assert a == GrammarSpec.structural_tag(json.dumps(LEGACY, ensure_ascii=False))
    assert a.kind == "structural_tag" and a.source_size > 0


WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                "unit": {"enum": ["c", "f"]}},
                               "required": ["city"], "additionalProperties": False})
TIME = Tool("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _accepts(compiler, spec, text, backend="xgrammar"):
    matcher = compiler.compile(spec, backend=backend)
    ids = compiler.tokenizer_data.encode(text)
    return matcher.accept_tokens(ids) == len(ids) and matcher.can_terminate()


def test_tool_choices_compile_to_structural_tags(compiler):
    tools = [WEATHER, TIME]
    auto = call_constraint(tools, "auto")
    required = call_constraint(tools, "required")
    named = call_constraint(tools, "get_time")
    assert call_constraint(tools, "none") is None
    assert _accepts(compiler, auto, "Let me check. " + CALL + " One moment.")
    assert _accepts(compiler, auto, "No call needed.")
    assert _accepts(compiler, auto, "x " + CALL, backend="llguidance")  # auto is triggered tags
    assert _accepts(compiler, required, CALL + "\n" + CALL.replace("Oslo", "Rome"))
    assert not _accepts(compiler, required, "Sure. " + CALL)  # calls only, from the first token
    assert not _accepts(compiler, required, "")
    assert not _accepts(compiler, named, CALL)  # not that tool
    assert _accepts(compiler, named, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert not _accepts(compiler, auto, CALL.replace('"Oslo"', "12"))  # arguments follow the schema
    with pytest.raises(GrammarError, match="no tool is named"):
        call_constraint(tools, "get_date")
    with pytest.raises(GrammarError, match="unique"):
        call_constraint([WEATHER, WEATHER], "auto")
    with pytest.raises(GrammarError, match="must be 1-128"):
        Tool("bad name")


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_tool_named_like_a_mode_is_called_by_name(compiler, name):
    # As a tool's name they switched the mode: "none" left the answer free,
    # "required" let the model call another tool.
    tools = [Tool(name, {"type": "object"}), Tool("other", {"type": "object"})]
    spec = call_constraint(tools, "auto", function=name)
    assert spec is not None
    matcher = compiler.compile(spec, backend="xgrammar")
    tok = compiler.tokenizer_data
    own = tok.encode(f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>')
    assert matcher.accept_tokens(own) == len(own) and matcher.can_terminate()
    matcher.reset()
    other = tok.encode('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert matcher.accept_tokens(other) < len(other)


def test_a_named_call_is_forced_up_to_its_arguments(compiler):
    matcher = compiler.compile(call_constraint([WEATHER, TIME], "get_weather"), backend="xgrammar")
    tok = compiler.tokenizer_data
    forced = tok._encoder.decode(matcher.forced_tokens())
    assert forced.startswith('<tool_call>\n{"name": "get_weather", "arguments":')


def test_calls_are_read_back_and_their_arguments_validated():
    reader = CallReader([WEATHER, TIME])
    text = ("Sure. " + CALL + "\n" + CALL.replace('"Oslo"', '"Oslo", "unit": "k"')
            + '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
            + "<tool_call>\n{oops}\n</tool_call>" + '<tool_call>\n{"name": "get_time", "arguments"')
    calls = reader.parse(text)
    assert [c.name for c in calls] == ["get_weather", "get_weather", "nope", ""]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and calls[0].validation.valid
    assert not calls[1].validation.valid and calls[1].validation.instance_path == "/unit"
    assert "no tool is named" in calls[2].validation.message
    assert not calls[3].validation.parsed


def test_a_call_is_read_as_json_not_up_to_the_first_end_marker(compiler):
    """An end marker inside a string of the arguments (the grammar allows it)
    cut the call there, reported as not JSON; a number too large for a double
    came back as Infinity (no JSON) and failed {"type": "number"}. The
    arguments are now the model's own text."""
    write = Tool("write_file", {"type": "object", "properties": {"path": {"type": "string"},
                                                                 "content": {"type": "string"}}})
    big = Tool("f", {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    text = ('<tool_call>\n{"name": "write_file", "arguments": {"path": "a.xml", "content": "<a></tool_call></a>"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {"x": 1e400}}\n</tool_call>')
    for tools in ([write, big],):
        matcher = compiler.compile(call_constraint(tools, "required"), backend="xgrammar")
        ids = compiler.tokenizer_data.encode(text)
        assert matcher.accept_tokens(ids) == len(ids) and matcher.can_terminate()
    first, second = CallReader([write, big]).parse(text)
    assert first.name == "write_file" and first.validation.valid
    assert json.loads(first.arguments)["content"] == "<a></tool_call></a>"
    assert second.arguments == '{"x": 1e400}' and second.validation.valid


def test_a_call_cut_inside_a_string_holding_an_end_marker_is_left_out():
    """Cut short by a length limit inside an argument string holding the end
    marker, a call was reported as a nameless INVALID one (the fallback took
    that marker for its end): a call cut short is left out."""
    reader = CallReader([WEATHER])
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x</tool_call> y'
    assert reader.parse(cut) == []
    assert [c.name for c in reader.parse(whole + cut)] == ["get_weather"]
    # One written badly, whole to its end marker, is still reported.
    [bad] = reader.parse("<tool_call>\nnot json</tool_call>")
    assert not bad.validation.parsed
    # One never ended before the next call: reported, and the next is read (it
    # was folded into one nameless call with it).
    unended, after = reader.parse(whole.replace("\n</tool_call>", "") + whole)
    assert not unended.validation.parsed and after.name == "get_weather" and after.validation.valid
    # So is one that is not JSON and never ended (its text ran to the next call's end marker).
    for junk in ("oops", 'say "hi', "it's"):  # a quote outside any JSON opens no string
        garbage, after = reader.parse(f"<tool_call>{junk}" + whole)
        assert "not JSON" in garbage.validation.message and after.name == "get_weather" and after.validation.valid
    broken, after = reader.parse('<tool_call>{"name": "get_weather" ' + whole)
    assert not broken.validation.parsed and after.validation.valid  # was taken for one cut short: none
    # A start marker inside its strings is its own text, not the next call.
    [inner] = reader.parse('<tool_call>{"name": "x", "arguments": {"a": "<tool_call>"} oops}</tool_call>')
    assert not inner.validation.parsed
    assert reader.parse('<tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call>') == []


ARG_PIECES = st.lists(st.sampled_from([*'ab "\\<>/{}:日', "</tool_call>", "<tool_call>"]), max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get_weather", "get_time", "nope"]), ARG_PIECES), min_size=1, max_size=3),
       st.text(st.sampled_from(list("ab \n.")), max_size=6), st.data())
def test_any_prefix_of_an_answer_reads_as_the_calls_it_holds_whole(calls: list[tuple[str, str]], gap: str,
                                                                   data: st.DataObject) -> None:
    # An answer cut anywhere (a length limit) gives the calls it holds whole
    # and leaves the last out; a call cut right after its JSON whose strings
    # held the end marker came back as a nameless INVALID call.
    reader = CallReader([WEATHER, TIME])
    text, ends = "", []
    for i, (name, arg) in enumerate(calls):
        body = json.dumps({"name": name, "arguments": {"city": arg}}, ensure_ascii=False)
        text += (gap if i else "") + f"<tool_call>\n{body}\n</tool_call>"
        ends.append(len(text))
    whole = reader.parse(text)
    assert [(c.name, json.loads(c.arguments)["city"]) for c in whole] == calls
    cut = data.draw(st.integers(0, len(text)))
    assert reader.parse(text[:cut]) == whole[:sum(end <= cut for end in ends)]


@pytest.mark.parametrize("tag, problem", [
    # llguidance's "<f" always fired first, so <fun=...> could never be written
    # (xgrammar refused it, and auto fell back to llguidance).
    ({"structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>"},
                     {"begin": "<fun=b>", "schema": {}, "end": "</f>"}], "triggers": ["<fun", "<f"]}, "start of"),
    # Which schema a text follows was unknown; the output's check took the first's.
    ({"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"},
                     {"begin": "<f>", "schema": {"type": "string"}, "end": "</f>"}], "triggers": ["<f"]}, "two tags"),
    # llguidance read "x<a>" as free text x, then the tag <a>; xgrammar as the tag x<a>.
    ({"structures": [{"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"},
                     {"begin": "x<a>", "schema": {"type": "string"}, "end": "</a>"}], "triggers": ["<a>", "x<a>"]},
     "inside"),
])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_tags_the_libraries_would_read_apart_are_refused(compiler, tag, problem, backend):
    with pytest.raises(GrammarError, match=problem):
        compiler.compile(GrammarSpec.structural_tag({"type": "structural_tag", **tag}), backend=backend)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
def test_triggers_given_as_a_string_are_refused(compiler, backend):
    # llguidance took the string's characters for the triggers ("<" alone)
    # and auto fell back to it.
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": "<f>", "tags": [
        {"type": "tag", "begin": "<f>", "content": {"type": "any_text"}, "end": "</f>"}]}}
    with pytest.raises(GrammarError, match="list of strings"):
        compiler.compile(GrammarSpec.structural_tag(tag), backend=backend)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_tag_contents_are_read_as_json_schema_reads_them(compiler, backend):
    """xgrammar's structural tags compile their schemas in its strict mode: a
    tool's arguments with a key its schema does not list (and allows), or an
    array past its prefixItems, were refused token by token."""
    weather = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    if backend == "xgrammar":  # llguidance takes no tags_with_separator
        assert _accepts(compiler, call_constraint([weather], "required"), call, backend)
    tag = GrammarSpec.structural_tag({"structures": [{"begin": "<f>", "schema": {"type": "array", "prefixItems": [
        {"type": "integer"}]}, "end": "</f>"}], "triggers": ["<f"]})
    assert _accepts(compiler, tag, "x <f>[1, 2]</f>", backend)
    closed = GrammarSpec.structural_tag({"structures": [{"begin": "<f>", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, "end": "</f>"}],
        "triggers": ["<f"]})
    assert not _accepts(compiler, closed, 'x <f>{"a": 1, "b": 2}</f>', backend)


INT = {"i": {"type": "integer"}}


@pytest.mark.parametrize("schema, defs, bad, good", [
    # an allOf xgrammar skips, merged by normalizing
    ({"type": "integer", "allOf": [{"minimum": 5}]}, {}, "1", "7"),
    # a $ref with a sibling keyword
    ({"$ref": "#/$defs/i", "minimum": 5}, INT, "1", "7"),
    # a $ref to an $anchor, which xgrammar reads as any value
    ({"$ref": "#int"}, {"i": {"$anchor": "int", "type": "integer"}}, '"seven"', "7"),
    # draft-04's boolean exclusiveMinimum (xgrammar refused the whole tag)
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, {}, "0", "0.5"),
])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_tag_contents_compile_from_the_normalized_schema(compiler, schema, defs, bad, good, backend):
    """A tag's schema went to the library as written while the tag's checks
    (tag_watch.TagPlan) were read from the normalized schema: where
    normalizing turns what xgrammar ignores into what it reads, the grammar
    let the violation through and nothing checked it. Both now read one
    view, as a JSON-schema spec's (schema_plan.tag_view)."""
    draft = {"$schema": "http://json-schema.org/draft-04/schema#"} if "exclusiveMinimum" in schema else {}
    tag = GrammarSpec.structural_tag({"structures": [{"begin": "<f>", "schema": {**draft, **schema, "$defs": defs},
                                                      "end": "</f>"}], "triggers": ["<f"]})
    assert _accepts(compiler, tag, f"x <f>{good}</f>", backend)
    assert not _accepts(compiler, tag, f"x <f>{bad}</f>", backend)
    args = {**draft, "type": "object", "properties": {"n": schema}, "required": ["n"], "$defs": defs}
    call = '<tool_call>\n{"name": "f", "arguments": {"n": %s}}\n</tool_call>'
    if backend == "xgrammar":  # llguidance takes no tags_with_separator
        required = call_constraint([Tool("f", args)], "required")
        assert _accepts(compiler, required, call % good, backend)
        assert not _accepts(compiler, required, call % bad, backend)


def test_a_tag_content_xgrammar_would_read_as_any_value_is_refused(compiler):
    """A `$ref` to a document the server lacks stays as written; xgrammar
    reads it as any value, so it refuses the tag as it does such a JSON schema."""
    tag = GrammarSpec.structural_tag({"structures": [{"begin": "<f>", "schema": {
        "$ref": "https://example.com/int.json"}, "end": "</f>"}], "triggers": ["<f"]})
    with pytest.raises(GrammarError, match="only local"):
        compiler.compile(tag, backend="xgrammar")


def test_too_many_tools_are_refused_before_their_tag_is_built(monkeypatch):
    # 300k tools made a 61M-character tag, json.dumps holding the GIL ~1 s
    # (every stream's event loop waiting), only to be refused as too large.
    import grammar.tool_calls as tool_calls
    from grammar.spec import MAX_SPEC_SOURCE_CHARS

    tools = [Tool(f"tool_{i}") for i in range(MAX_SPEC_SOURCE_CHARS // 180)]
    monkeypatch.setattr(tool_calls, "_tag", None)  # never called
    for choice in ("auto", "required"):
        with pytest.raises(GrammarError, match="too large"):
            call_constraint(tools, choice)
    monkeypatch.undo()
    # The bound is below each tag's real size: a tag as large as it allows builds.
    few = tools[:100]
    spec = call_constraint(few, "auto")
    assert spec is not None and isinstance(spec.source, str)
    assert len(spec.source) >= sum(len(t.name) + tool_calls._TAG_CHARS for t in few)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_closed_objects_admit_no_property_the_schema_does_not_name(compiler, backend):
    # vLLM's reading (xgrammar's strict mode), which routers build for: SMG's
    # required tool calls name their properties and say nothing of others.
    tok = compiler.tokenizer_data
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = json.loads(json.dumps(LEGACY))
    tag["structures"][0]["schema"] = schema
    cases = [(GrammarSpec.json_schema(schema, GrammarOptions(closed_objects=c)), '{"a":1,"b":2}', c)
             for c in (False, True)]
    cases += [(GrammarSpec("structural_tag", json.dumps(tag), GrammarOptions(closed_objects=c)),
               '<fn=add>{"a": 1, "b": 2}</fn>', c) for c in (False, True)]
    for spec, extra, closed in cases:
        matcher = compiler.compile(spec, backend=backend)
        ids = tok.encode(extra)
        assert (matcher.accept_tokens(ids) == len(ids)) is not closed, (spec.kind, closed)
