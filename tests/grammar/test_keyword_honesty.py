"""What a JSON-schema grammar accepts is valid, or breaks a keyword it reports
unenforced: resampling and strict mode rely on that report. Cases where a
library reads past a keyword, checked against the schema's own validator."""

from __future__ import annotations

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
    # Pretty whitespace: auto prefers xgrammar.
    assert_no_silent_violation(compiler, {"type": "integer", "enum": [1, 2, 1.5]}, "1.5",
                               options=GrammarOptions(whitespace="pretty"))
