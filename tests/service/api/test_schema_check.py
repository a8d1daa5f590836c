"""service/api/schema_check.py: which finished outputs are validated, and how a
strict request's verdict changes its finish reason."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine import GenerationStatus, RequestOutput
from grammar import GrammarSpec
from grammar.validation import SchemaValidator
from service.api.generation import _add_validation
from service.api.schema_check import check_output
from service.gen.stencil.v1 import generate_pb2 as pb

R = pb.SchemaValidation
UNIQUE = {"type": "array", "uniqueItems": True}


def _matcher(schema: dict) -> SimpleNamespace:
    return SimpleNamespace(validator=SchemaValidator(schema), validator_error=None,
                           unenforced_keywords=("uniqueItems",),
                           spec=GrammarSpec.json_schema('{"type": "array"}'))


def _final(status: GenerationStatus) -> RequestOutput:
    return RequestOutput("r", finished=True, status=status)


@pytest.mark.parametrize(("status", "text", "expected"), [
    (GenerationStatus.END_OF_SEQUENCE, "[1,2]", R.VALID),
    (GenerationStatus.END_OF_SEQUENCE, "[1,1]", R.INVALID),
    (GenerationStatus.END_OF_SEQUENCE, "[1,", R.INVALID),  # EOS promised a whole value
    (GenerationStatus.STOP_STRING, "[1,1]", R.INVALID),  # a stop right at the value's end
    (GenerationStatus.STOP_TOKEN, "[1,2]", R.VALID),
    (GenerationStatus.STOP_STRING, "[1,", R.NOT_CHECKED),  # cut short by the stop rule
    (GenerationStatus.STOP_STRING, "2", R.NOT_CHECKED),  # maybe "2" of "2024": a number is never whole
    # The limit's last token may close the value: a whole one is checked, as after a stop rule.
    (GenerationStatus.MAXIMUM_LENGTH, "[1,2]", R.VALID),
    (GenerationStatus.CONTEXT_LENGTH, "[1,1]", R.INVALID),
    (GenerationStatus.MAXIMUM_LENGTH, "[1,", R.NOT_CHECKED),
    (GenerationStatus.CONTEXT_LENGTH, "12", R.NOT_CHECKED),
    (GenerationStatus.CANCELLED, "[1,2]", R.NOT_CHECKED),
])
def test_which_outputs_are_validated(status, text, expected):
    result = asyncio.run(check_output(_matcher(UNIQUE), text, _final(status), True))  # type: ignore[arg-type]
    assert result.result == expected, result


@pytest.mark.parametrize(("status", "expected"), [
    (GenerationStatus.END_OF_SEQUENCE, R.INVALID),  # it chose to end there: no answer
    (GenerationStatus.STOP_STRING, R.INVALID),
    (GenerationStatus.MAXIMUM_LENGTH, R.NOT_CHECKED),  # cut there: the answer never began
    (GenerationStatus.CONTEXT_LENGTH, R.NOT_CHECKED),
])
def test_an_output_ending_inside_its_thought(status, expected):
    final = RequestOutput("r", finished=True, status=status, thought="unfinished")
    result = asyncio.run(check_output(_matcher(UNIQUE), "", final, True))  # type: ignore[arg-type]
    assert result.result == expected and "thought" in result.message, result


def test_strict_turns_an_invalid_stopped_output_into_a_schema_violation():
    done = pb.GenerateComplete(finish_reason=pb.GenerateComplete.STOP_STRING)
    asyncio.run(_add_validation(done, _matcher(UNIQUE), "[1,1]", _final(GenerationStatus.STOP_STRING),
                                True, strict=True))
    assert done.finish_reason == pb.GenerateComplete.SCHEMA_VIOLATION
    assert done.schema_validation.keyword == "uniqueItems"


def _kind_matcher(spec: GrammarSpec) -> SimpleNamespace:
    from grammar.output_check import OutputCheck

    return SimpleNamespace(validator=OutputCheck(spec), validator_error=None, unenforced_keywords=(), spec=spec)


@pytest.mark.parametrize(("spec", "status", "text", "expected"), [
    (GrammarSpec.regex(r"[a-z&&[^aeiou]]{4}"), GenerationStatus.END_OF_SEQUENCE, "bcdf", R.VALID),
    # What xgrammar generated for this regex before it was refused there: the verdict says so.
    (GrammarSpec.regex(r"[a-z&&[^aeiou]]{4}"), GenerationStatus.END_OF_SEQUENCE, "l]]]]", R.INVALID),
    (GrammarSpec.regex(r"[[:alpha:]]{3}"), GenerationStatus.END_OF_SEQUENCE, "l]]]", R.INVALID),
    (GrammarSpec.regex(r"[a-z]+"), GenerationStatus.STOP_STRING, "ab", R.VALID),  # a stop at a whole match
    (GrammarSpec.regex(r"[a-z]+!"), GenerationStatus.STOP_STRING, "ab", R.NOT_CHECKED),  # cut short
    (GrammarSpec.regex(r"[a-z]+"), GenerationStatus.MAXIMUM_LENGTH, "ab", R.VALID),
    (GrammarSpec.regex(r"[a-z]+!"), GenerationStatus.MAXIMUM_LENGTH, "ab", R.NOT_CHECKED),
    (GrammarSpec.choice(["yes", "no"]), GenerationStatus.END_OF_SEQUENCE, "yes", R.VALID),
    (GrammarSpec.choice(["yes", "no"]), GenerationStatus.END_OF_SEQUENCE, "ye", R.INVALID),
    (GrammarSpec.ebnf('root ::= "a" [0-9]+'), GenerationStatus.END_OF_SEQUENCE, "a12", R.VALID),
    (GrammarSpec.ebnf('root ::= "a" [0-9]+'), GenerationStatus.END_OF_SEQUENCE, "a1b", R.INVALID),
    (GrammarSpec.lark('start: "x" /[0-9]+/'), GenerationStatus.END_OF_SEQUENCE, "x7", R.VALID),
    (GrammarSpec.lark('start: "x" /[0-9]+/'), GenerationStatus.END_OF_SEQUENCE, "y7", R.INVALID),
])
def test_regex_choice_and_grammar_outputs_get_a_verdict(spec, status, text, expected):
    result = asyncio.run(check_output(_kind_matcher(spec), text, _final(status), True))  # type: ignore[arg-type]
    assert result.result == expected, result
    if expected == R.INVALID:
        assert result.message and not result.keyword and not result.instance_path
