"""What a JSON-schema grammar accepts is valid, or breaks a keyword it reports
unenforced: resampling and strict mode rely on that report. Cases where a
library reads past a keyword, checked against the schema's own validator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from grammar import GrammarCompiler, GrammarOptions, GrammarSpec

from .conftest import feed


def grammar_accepts(compiler: GrammarCompiler, matcher: Any, text: str) -> bool:
    """Every token of `text` is accepted, and the output may end there."""
    bitmask = compiler.allocate_bitmask(1)
    matcher.reset()
    return feed(matcher, compiler.tokenizer_data.encode(text), bitmask, check_eos=False) and matcher.can_terminate()


def assert_no_silent_violation(compiler: GrammarCompiler, schema: Any, text: str, backend: str = "auto",
                               options: GrammarOptions | None = None) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema(schema, options), backend=backend)
    assert matcher.validator is not None
    verdict = matcher.validator.validate_text(text)
    assert verdict.checked and not verdict.valid, "premise: the text is invalid"
    if grammar_accepts(compiler, matcher, text):
        assert verdict.keyword in matcher.unenforced_keywords, \
            f"{matcher.backend} accepts {text!r}, breaking {verdict.keyword!r}, and reports " \
            f"{matcher.unenforced_keywords} unenforced"


@pytest.mark.parametrize(("schema", "text"), [
    ({"type": "integer", "enum": [1, 2, 1.5]}, "1.5"),  # beside enum/const: the list alone
    ({"type": "integer", "minimum": 2, "enum": [1, 2]}, "1"),
    ({"type": "string", "maxLength": 1, "const": "abc"}, '"abc"'),
    ({"type": "string", "anyOf": [{"type": "string"}, {"type": "integer"}]}, "1"),  # beside anyOf
    ({"type": "string", "minLength": 2, "pattern": "^[ab]*$"}, '"a"'),  # pattern over lengths
    ({"type": "string", "format": "date", "pattern": "^x"}, '"2020-01-01"'),  # format over the rest
    ({"type": "string", "format": "date", "maxLength": 3}, '"2020-01-01"'),
])
def test_xgrammar_reports_the_keywords_it_reads_past(compiler: GrammarCompiler, schema: Any, text: str) -> None:
    assert_no_silent_violation(compiler, schema, text, backend="xgrammar")


def test_auto_falling_back_to_xgrammar_reports_them_too(compiler: GrammarCompiler) -> None:
    # llguidance refuses it (a date is never 50 long); xgrammar dropped minLength silently.
    assert_no_silent_violation(compiler, {"type": "string", "format": "date", "minLength": 50}, '"2020-01-01"')
    # xgrammar reads the enum alone beside "type": it accepts 1.5, and must say so.
    schema, pretty = {"type": "integer", "enum": [1, 2, 1.5]}, GrammarOptions(whitespace="pretty")
    assert_no_silent_violation(compiler, schema, "1.5", backend="xgrammar", options=pretty)
    matcher = compiler.compile(GrammarSpec.json_schema(schema, pretty), backend="xgrammar")
    assert grammar_accepts(compiler, matcher, "1.5")  # the case above was checked, not skipped


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_an_integer_past_2_53_is_never_read_as_its_float_neighbour(compiler: GrammarCompiler, backend: str) -> None:
    """`const: 12345678901234567890` became the float range [n, n]: both
    libraries then refused n and took 12345678901234567000 (or ...168),
    reporting nothing. The libraries read numbers as doubles: such a const is
    left to the validator, and said so."""
    matcher = compiler.compile(GrammarSpec("json_schema", '{"const": 12345678901234567890}'), backend=backend)
    assert grammar_accepts(compiler, matcher, "12345678901234567890")
    assert "const" in matcher.unenforced_keywords
    assert matcher.validator is not None and not matcher.validator.validate_text("12345678901234567000").valid


@pytest.mark.parametrize(("backend", "schema", "valid", "invalid"), [
    # llguidance read the bound as 2**53: took one below the minimum, refused the maximum itself
    ("llguidance", {"type": "integer", "minimum": 2 ** 53 + 1}, 2 ** 53 + 1, 2 ** 53),
    ("llguidance", {"type": "integer", "maximum": 2 ** 53 + 1}, 2 ** 53 + 1, 2 ** 53 + 2),
    ("xgrammar", {"type": "number", "minimum": 2 ** 53 + 1}, 2 ** 53 + 1, 2 ** 53),
    ("xgrammar", {"type": "integer", "maximum": 2 ** 64 + 1}, 5, 2 ** 64 + 2),  # refused the schema
])
def test_a_bound_past_2_53_a_library_reads_as_a_double_is_left_to_the_validator(
        compiler: GrammarCompiler, backend: str, schema: Any, valid: int, invalid: int) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema(schema), backend=backend)
    bound = next(k for k in schema if k != "type")
    assert bound in matcher.unenforced_keywords
    assert grammar_accepts(compiler, matcher, str(valid))
    assert matcher.validator is not None and not matcher.validator.validate_text(str(invalid)).valid


def test_xgrammar_reads_an_integers_64_bit_bounds_exactly(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema({"type": "integer", "minimum": 2 ** 53 + 1}),
                               backend="xgrammar")
    assert matcher.unenforced_keywords == ()
    assert grammar_accepts(compiler, matcher, str(2 ** 53 + 1)) and not grammar_accepts(compiler, matcher, str(2 ** 53))


def test_fractional_bounds_on_an_integer_compile_with_xgrammar(compiler: GrammarCompiler) -> None:
    """xgrammar refused them ("must be a whole number"); rounded inward, the same integers pass."""
    matcher = compiler.compile(GrammarSpec.json_schema({"type": "integer", "minimum": 1.5, "exclusiveMaximum": 3.5}),
                               backend="xgrammar")
    assert [grammar_accepts(compiler, matcher, n) for n in ("1", "2", "3", "4")] == [False, True, True, False]


def test_any_of_beside_one_of_compiles_with_llguidance(compiler: GrammarCompiler) -> None:
    """oneOf became anyOf only on a node without one, so llguidance refused the schema."""
    schema = {"anyOf": [{"type": "string"}, {"type": "integer"}],
              "oneOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "maximum": 5}]}
    matcher = compiler.compile(GrammarSpec.json_schema(schema), backend="llguidance")
    assert grammar_accepts(compiler, matcher, "7")
    assert not grammar_accepts(compiler, matcher, '"s"')


def test_property_counts_with_optional_properties_compile_with_llguidance(compiler: GrammarCompiler) -> None:
    """llguidance refuses min/maxProperties unless every declared property is
    required: the whole schema failed there (and under auto, with a part
    xgrammar refuses too, the request). Now they are left to the validator."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "maxProperties": 1, "minProperties": 1}
    matcher = compiler.compile(GrammarSpec.json_schema(schema), backend="llguidance")
    assert matcher.unenforced_keywords == ("maxProperties", "minProperties")
    assert grammar_accepts(compiler, matcher, '{"a":1}')
    # Where llguidance counts them (every declared property required), it still does.
    required = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": {"type": "integer"}, "maxProperties": 2}
    matcher = compiler.compile(GrammarSpec.json_schema(required), backend="llguidance")
    assert matcher.unenforced_keywords == ()
    assert grammar_accepts(compiler, matcher, '{"a":1,"b":2}')
    assert not grammar_accepts(compiler, matcher, '{"a":1,"b":2,"c":3}')
    # With a part xgrammar refuses (an optional property that can hold nothing),
    # auto had no library left.
    both = {"type": "object", "properties": {"a": {"type": "integer"}, "b": False}, "maxProperties": 1}
    assert compiler.compile(GrammarSpec.json_schema(both)).backend == "llguidance"


@pytest.mark.parametrize(("pattern", "text", "backend"), [
    ("^(?!a).*$", '"a"', "auto"),  # llguidance refused look-around; xgrammar dropped it silently
    ("^(?=a)\\w+$", '"b"', "xgrammar"),
    ("^\\A$", '"A"', "xgrammar"),  # read as the letter A
    ("^\\z$", '"z"', "xgrammar"),
    ("^[[:alpha:]]$", '"a"', "llguidance"),  # a Rust class; in ECMA-262 a class, then "]"
    ("^[a-z&&[^a]]$", '"b"', "llguidance"),  # a set operator only Rust has
    ("^a\\b", '"ab"', "llguidance"),  # a word boundary: llguidance refused the schema
])
def test_a_pattern_a_library_reads_otherwise_is_left_to_the_validator(compiler: GrammarCompiler, pattern: str,
                                                                     text: str, backend: str) -> None:
    """The validator reads `pattern` as ECMA-262; where a library would read
    it otherwise it is dropped from that library's grammar and reported."""
    assert_no_silent_violation(compiler, {"type": "string", "pattern": pattern}, text, backend=backend)
    if backend != "auto":
        names = GrammarSpec.json_schema({"type": "object", "patternProperties": {pattern: {"type": "integer"}}})
        assert "patternProperties" in compiler.compile(names, backend=backend).unenforced_keywords


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize(("pattern", "invalid", "valid"), [
    ("^a.b$", ["a\rb", "a\u2028b", "a\u2029b"], ["axb", "a\u0085b"]),  # ECMA's `.` leaves out \r, U+2028/9
    ("^.{1,20}$", ["line1\r"], ["line1"]),
    ("^\\s$", ["\u0085"], [" ", "\ufeff", "\u3000"]),  # ECMA's \s: U+FEFF in, U+0085 out
    ("^[\\s,]+$", ["\u0085"], [" ,\u3000"]),
    ("^[^\\s]$", ["\u2028"], ["x"]),
    ("^\\S$", ["\ufeff"], ["\u0085", "x"]),
])
def test_dots_and_spaces_of_a_pattern_are_ecmas(compiler: GrammarCompiler, backend: str, pattern: str,
                                                invalid: list[str], valid: list[str]) -> None:
    """The libraries read a pattern's `.` and `\\s` in the Rust syntax: `.` took
    "\\r", U+2028 and U+2029 and `\\s` took U+0085, which the validator (ECMA-262)
    refuses, with nothing reported unenforced. They are spelled out as ECMA's
    classes now, and enforced as the validator reads them."""
    matcher = compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": pattern}), backend=backend)
    assert matcher.unenforced_keywords == () and matcher.validator is not None
    for value in invalid + valid:
        text = json.dumps(value, ensure_ascii=False)
        verdict = matcher.validator.validate_text(text).valid
        assert verdict == (value in valid), f"premise: {value!r}"
        assert grammar_accepts(compiler, matcher, text) == verdict, f"{backend} on {value!r}"


def test_ecma_pattern_spells_out_dots_and_spaces() -> None:
    from grammar.regex_syntax import ecma_pattern

    assert ecma_pattern("a") == "a" and ecma_pattern("[.]\\.") == "[.]\\."  # a class's dot, an escaped one
    assert ecma_pattern("^a.b$") == "^a[^\\n\\r\\u2028\\u2029]b$"
    assert ecma_pattern("\\s").startswith("[\\t\\n") and ecma_pattern("\\S").startswith("[^\\t\\n")
    assert ecma_pattern("[a\\s]").startswith("[a\\t\\n") and ecma_pattern("[\\S]") == "[\\S]"


@pytest.mark.parametrize(("pattern", "text"), [
    ("@", '"a@b.com"'),  # JSON Schema searches; xgrammar allowed only "@"
    ("^https://", '"https://x.org"'),
    ("org$", '"x.org"'),
    ("^a|b$", '"xb"'),  # "starts with a, or ends with b"; xgrammar read ^(a|b)$
])
def test_xgrammar_leaves_a_pattern_it_would_match_whole_to_the_validator(compiler: GrammarCompiler, pattern: str,
                                                                        text: str) -> None:
    for options in (None, GrammarOptions(whitespace="pretty")):  # pretty: auto tries xgrammar first
        matcher = compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": pattern}, options),
                                   backend="xgrammar")
        assert "pattern" in matcher.unenforced_keywords
        assert grammar_accepts(compiler, matcher, text)
    anchored = compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": "^[a-z]+@x$"}),
                                backend="xgrammar")
    assert anchored.unenforced_keywords == () and not grammar_accepts(compiler, anchored, '"zz"')


@pytest.mark.parametrize(("backend", "pattern", "name"), [
    ("xgrammar", "f.o", "xfxo"),  # unanchored: xgrammar would match it whole
    ("llguidance", "^[a&&b]+$", "a&b"),  # `&&` is Rust's class intersection, ECMA's two "&"
])
def test_additional_properties_leave_with_the_patterns_a_library_misreads(
        compiler: GrammarCompiler, backend: str, pattern: str, name: str) -> None:
    """A misread `patternProperties` was left out of the library's schema
    while its `additionalProperties` stayed, which then covered the names the
    patterns had taken: a valid object was refused token by token."""
    schema = {"type": "object", "patternProperties": {pattern: {"type": "array"}},
              "additionalProperties": {"type": "integer"}}
    matcher = compiler.compile(GrammarSpec.json_schema(schema), backend=backend)
    assert {"patternProperties", "additionalProperties"} <= set(matcher.unenforced_keywords)
    text = json.dumps({name: [1]}, separators=(",", ":"))
    assert matcher.validator is not None and matcher.validator.validate_text(text).valid
    assert grammar_accepts(compiler, matcher, text)


def test_an_object_that_must_have_a_property_it_cannot_have_is_refused(compiler: GrammarCompiler) -> None:
    """llguidance saw it accepts nothing, auto fell back to xgrammar, which
    left `required` unenforced: every output was INVALID, and strict took it."""
    from grammar import GrammarError

    for schema in ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],
                    "additionalProperties": False},
                   {"type": "object", "properties": {"a": False}, "required": ["a"]}):
        with pytest.raises(GrammarError, match="accept"):
            compiler.compile(GrammarSpec.json_schema(schema))
    # Open objects, or objects of no declared type, may have it.
    assert compiler.compile(GrammarSpec.json_schema({"type": "object", "required": ["b"]}))
    assert compiler.compile(GrammarSpec.json_schema({"properties": {"a": False}, "required": ["a"]}))


@pytest.mark.parametrize(("schema", "invalid"), [
    ({"properties": {"a": {"type": "integer"}}}, '{"a":"s"}'),
    ({"additionalProperties": False}, '{"b":1}'),
    ({"items": {"type": "integer"}}, '["s"]'),
    ({"prefixItems": [{"type": "integer"}]}, '["s"]'),
    ({"minLength": 2}, '"x"'),
    ({"minimum": 0}, "-3"),
    ({"maxItems": 1}, "[1,2]"),
])
def test_xgrammar_reads_a_node_without_a_type_as_json_schema_does(compiler: GrammarCompiler, schema: Any,
                                                                  invalid: str) -> None:
    # xgrammar read an untyped node with an object's or an array's keywords
    # as that type alone (1, "x" and null, all valid, were refused) and
    # ignored the other types' keywords there. Each now applies to its own
    # type, enforced.
    matcher = compiler.compile(GrammarSpec.json_schema(schema), backend="xgrammar")
    assert matcher.validator is not None
    for text in ("1", '"xy"', "null"):
        assert matcher.validator.validate_text(text).valid
        assert grammar_accepts(compiler, matcher, text), text
    assert not grammar_accepts(compiler, matcher, invalid)
    assert matcher.unenforced_keywords == ()


@pytest.mark.parametrize(("pattern", "valid", "raw"), [
    ('^"[a-z]+"$', '"ab"', '""ab""'),
    ("^a\\nb$", "a\nb", '"a\nb"'),
    ("^C:\\\\[a-z]+$", "C:\\dir", '"C:\\dir"'),
    ('^a["]b$', 'a"b', '"a"b"'),
    ("^a[\\t-\\r]b$", "a\tb", '"a\tb"'),
])
def test_xgrammar_leaves_a_pattern_naming_an_escaped_character_to_the_validator(
        compiler: GrammarCompiler, pattern: str, valid: str, raw: str) -> None:
    # xgrammar wrote such a character into the string unescaped (not JSON) and
    # refused the escaped spelling (valid), while reporting the pattern enforced.
    matcher = compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": pattern}), backend="xgrammar")
    assert "pattern" in matcher.unenforced_keywords
    assert grammar_accepts(compiler, matcher, json.dumps(valid))
    assert not grammar_accepts(compiler, matcher, raw)


@pytest.mark.parametrize("pattern", ["^[ -~]+$", "^a[\\t ]b$", "^[^\"]+$", "^a.b$", "^\\s$"])
def test_xgrammar_keeps_a_pattern_whose_escaped_characters_it_leaves_out(compiler: GrammarCompiler,
                                                                         pattern: str) -> None:
    assert "pattern" not in compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": pattern}),
                                             backend="xgrammar").unenforced_keywords


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_length_bounded_string_takes_escapes_as_one_character(compiler: GrammarCompiler, backend: str) -> None:
    # xgrammar's bounded strings took no escape at all: `x\"y` under maxLength 5 was refused.
    matcher = compiler.compile(GrammarSpec.json_schema({"type": "string", "minLength": 2, "maxLength": 3}),
                               backend=backend)
    assert matcher.unenforced_keywords == ()
    for value in ('x"y', "\\\\\\", "a\nb", "\u00e9\t"):
        assert grammar_accepts(compiler, matcher, json.dumps(value, ensure_ascii=False)), value
    if backend == "xgrammar":  # (llguidance takes no \u escape of a character a string may hold as it is)
        assert grammar_accepts(compiler, matcher, '"\\u00e9\\t"')
    for text in ('"\\\\\\\\\\\\\\\\"', '"\\""', '"a\nb"', '"a\x01"'):  # four, one, and raw controls
        assert not grammar_accepts(compiler, matcher, text), text


def test_a_tool_argument_with_a_length_takes_escapes_on_xgrammar(compiler: GrammarCompiler) -> None:
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {
        "code": {"type": "string", "maxLength": 50}}, "required": ["code"]}, "end": "</f>"}], "triggers": ["<f>"]}
    matcher = compiler.compile(GrammarSpec.structural_tag(tag), backend="xgrammar")
    assert grammar_accepts(compiler, matcher, '<f>{"code":"print(\\"hi\\")"}</f>')
    assert not grammar_accepts(compiler, matcher, '<f>{"code":"a\nb"}</f>')
