"""Checking a finished constrained output against its whole constraint.

JSON outputs are validated against the full schema; regex, choice and grammar
outputs get a verdict from a matcher of the spec's own semantics
(grammar/output_check.py), so no answer breaks its constraint silently.

Where: here, in the service layer, once the request's final output has reached
the event loop - never on the engine thread, whose every millisecond delays
the next step of every running request. The grammar already guaranteed most of
the schema token by token, so this check is one pass of a compiled Rust
validator (jsonschema-rs) over one JSON value: microseconds for a typical
output (BENCHMARKS.md). An output larger than `OFF_LOOP_CHARS` is validated on
a worker thread instead, so a huge answer cannot hold up the other streams on
the loop either.

An output that ended with EOS is complete. One that a stop string, a stop
token or a length limit ended is validated when what it returned is a whole
JSON value (the stop, or the last token the limit allowed, may fall right at
the value's end): JSON, and not a number, which could be the start of a longer
one; for the other kinds, when it is a whole match. Otherwise it is
NOT_CHECKED, as is one cancelled. A strict request whose output is INVALID
ends with finish reason SCHEMA_VIOLATION instead.

With a reasoning parser the answer is what is checked, never the thought. An
output that stopped inside the thought (EOS, a stop token or string) has no
answer: INVALID, saying so; one a length limit cut there is NOT_CHECKED.

A request with tools gets each call of its answer read back, its arguments
validated against its tool's schema (`tool_calls`).
"""

from __future__ import annotations

import asyncio

from engine import GenerationStatus, RequestOutput
from grammar import Matcher
from grammar.spec import JSON_KINDS
from grammar.tool_calls import CallReader
from grammar.validation import ValidationResult
from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.request_log import note_validation

R = pb.SchemaValidation
# Above this many characters the validation runs on a worker thread.
OFF_LOOP_CHARS = 16 * 1024
# A JSON number starts with one of these (every other value with { [ " t f n).
_NUMBER_START = frozenset("-0123456789")
# Finishes the output itself chose (the model, or a stop rule of the request):
# it may be a whole value, and one ending inside a thought has no answer.
_ENDED = (GenerationStatus.END_OF_SEQUENCE, GenerationStatus.STOP_STRING, GenerationStatus.STOP_TOKEN)
# Finishes a limit imposed: the output may still be a whole value (the value's
# last token was the last one allowed), so it is checked when it is.
_CUT = (GenerationStatus.MAXIMUM_LENGTH, GenerationStatus.CONTEXT_LENGTH)


def wants_validation(matcher: Matcher | None) -> bool:
    """Whether the request's output gets a schema_validation (every constrained one)."""
    return matcher is not None


async def check_output(matcher: Matcher, text: str, final: RequestOutput,
                       enabled: bool) -> pb.SchemaValidation:
    """The SchemaValidation of a finished constrained request (also noted for its log line)."""
    keywords = matcher.unenforced_keywords
    if not enabled:
        result = R(result=R.NOT_CHECKED, message="output validation is off on this server")
    elif final.status not in _ENDED and final.status not in _CUT:
        result = R(result=R.NOT_CHECKED, message="the output is incomplete")
    elif final.thought == "unfinished" and final.status in _CUT:
        result = R(result=R.NOT_CHECKED, message="a length limit ended the output inside the model's thought")
    elif final.thought == "unfinished":
        result = R(result=R.INVALID, message="the output ended inside the model's thought: there is no answer")
    elif matcher.validator is None:
        result = R(result=R.NOT_CHECKED, message=matcher.validator_error or "no validator")
    else:
        validator = matcher.validator
        outcome: ValidationResult
        if len(text) > OFF_LOOP_CHARS or not validator.built:  # a first use builds it
            outcome = await asyncio.to_thread(validator.validate_text, text)
        else:
            outcome = validator.validate_text(text)
        if not outcome.checked:
            result = R(result=R.NOT_CHECKED, message=outcome.message)
        elif final.status is not GenerationStatus.END_OF_SEQUENCE and _maybe_cut(matcher, text, outcome):
            result = R(result=R.NOT_CHECKED, message="the output is incomplete (a stop rule or length limit ended it)")
        elif outcome.valid:
            result = R(result=R.VALID)
        else:
            result = R(result=R.INVALID, instance_path=outcome.instance_path,
                       keyword=outcome.keyword, message=outcome.message)
    note_validation(R.Result.Name(result.result).lower(), result.keyword, result.instance_path,
                    keywords)
    return result


async def tool_calls(reader: CallReader, answer: str) -> list[pb.ToolCall]:
    """The calls of a finished answer, their arguments validated (off the
    loop for a large answer)."""
    calls = await asyncio.to_thread(reader.parse, answer) if len(answer) > OFF_LOOP_CHARS else reader.parse(answer)
    return [pb.ToolCall(name=c.name, arguments=c.arguments, validation=_verdict(c.validation)) for c in calls]


def _verdict(outcome: ValidationResult) -> pb.SchemaValidation:
    if not outcome.checked:
        return R(result=R.NOT_CHECKED, message=outcome.message)
    if outcome.valid:
        return R(result=R.VALID)
    return R(result=R.INVALID, instance_path=outcome.instance_path, keyword=outcome.keyword,
             message=outcome.message)


def _maybe_cut(matcher: Matcher, text: str, outcome: ValidationResult) -> bool:
    """Whether a stop rule or limit may have cut the output short of a whole answer: for
    JSON, what is left is not JSON, or is a number that may be the start of a
    longer one ("2" of "2024"); for the other kinds, it does not match (yet)."""
    if matcher.spec.kind in JSON_KINDS:
        return not outcome.parsed or text.lstrip()[:1] in _NUMBER_START
    return not outcome.valid
