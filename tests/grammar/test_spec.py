"""GrammarSpec / GrammarOptions validation and GrammarError message hygiene."""

from __future__ import annotations

import pickle

import pytest

from grammar import GrammarError, GrammarOptions, GrammarSpec
from grammar.errors import clean_message


def test_specs_are_hashable_cache_keys():
    a = GrammarSpec.json_schema('{"type": "integer"}')
    b = GrammarSpec("json_schema", '{"type": "integer"}')
    assert a == b and hash(a) == hash(b)
    assert len({a, b, GrammarSpec.regex("a+"), GrammarSpec.choice(["x", "y"])}) == 3
    assert GrammarSpec.choice(["x", "y"]).source == ("x", "y")  # lists become tuples


def test_json_schema_from_mapping():
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"é": {"type": "string"}}})
    assert isinstance(spec.source, str) and "é" in spec.source


@pytest.mark.parametrize(
    "kind, source, fragment",
    [
        ("yaml", "a: 1", "unknown grammar kind"),
        ("json_schema", {"type": "object"}, "must be a string"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "object or a boolean"),
        ("json_schema", "   ", "empty"),
        ("regex", 42, "must be a string"),
        ("regex", "", "empty"),
        ("choice", [], "empty"),
        ("choice", "yes", "list of strings"),
        ("choice", ["a", 1], "only strings"),
        ("ebnf", None, "must be a string"),
        ("lark", b"start: x", "must be a string"),
        ("json_object", "{}", "no source"),
    ],
)
def test_invalid_specs_raise_at_construction(kind, source, fragment):
    with pytest.raises(GrammarError, match=fragment):
        GrammarSpec(kind, source)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"whitespace": "loose"}, "unknown whitespace style"),
        ({"whitespace": "flexible", "max_whitespace": 0}, "max_whitespace"),
        ({"whitespace": "flexible", "max_whitespace": 1000}, "max_whitespace"),
        ({"whitespace": "pretty", "indent": 0}, "indent"),
    ],
)
def test_invalid_options(kwargs, fragment):
    with pytest.raises(GrammarError, match=fragment):
        GrammarOptions(**kwargs)


def test_default_whitespace_is_compact_and_options_normalise():
    assert GrammarOptions().whitespace == "compact"
    # Fields a style does not use do not split the cache.
    assert GrammarOptions("compact", max_whitespace=9) == GrammarOptions()
    assert GrammarOptions("flexible", indent=7) == GrammarOptions("flexible")
    # Non-JSON kinds ignore layout options entirely.
    assert GrammarSpec("regex", "a", GrammarOptions("pretty")) == GrammarSpec.regex("a")


def test_grammar_error_is_value_error_and_pickles():
    err = GrammarError("grammar compile timed out", reason="timeout", backend="xgrammar")
    assert isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.reason, back.backend) == (str(err), "timeout", "xgrammar")
    with pytest.raises(ValueError):
        GrammarError("x", reason="nope")


def test_clean_message_strips_library_internals():
    xgr = (
        "[07:44:18] /project/cpp/json_schema_converter.cc:4950: Cannot find field nope in #/nope\n"
    )
    assert clean_message(xgr) == "Cannot find field nope in #/nope"
    llg = (
        'Parser Error: token "x" doesn\'t satisfy the grammar\n<state>\nTokens: ...\n'
        '</state><grammar>\n{"grammars": []}\n</grammar>'
    )
    assert clean_message(llg) == 'Parser Error: token "x" doesn\'t satisfy the grammar'
    lark = 'at 1(8): invalid regex "a(b" (in regex): regex parse error:\n    a(b\n     ^\nerror: unclosed group\n   1 | start: /a(b/\n              ^\n'
    msg = clean_message(lark, keep_positions=False)
    assert "\n" not in msg and "|" not in msg and "unclosed group" in msg
    assert not msg.startswith("at 1(8)")
    assert len(clean_message("x" * 5000)) <= 300


def test_a_structural_tag_nested_past_the_recursion_limit_is_a_grammar_error() -> None:
    """A tool's parameters that json.loads read (a little under its limit)
    went past it once wrapped in the tag: RecursionError, answered INTERNAL."""
    from grammar import GrammarError

    schema: dict = {}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(GrammarError, match="nested too deeply"):
        GrammarSpec.structural_tag({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}})
