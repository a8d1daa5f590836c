"""Tool calls in the Hermes/Qwen format: compiled into a structural tag, read back.

The format the Qwen2.5 and Qwen3 chat templates (and Hermes models) teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call's arguments must be valid against its tool's `parameters` (a JSON
schema). `call_constraint` makes the structural tag (structural_tag.py) for a
tool choice:

- "auto": free text, calls anywhere in it (`triggered_tags`, trigger
  `<tool_call>`);
- "required": calls only, at least one, newline-separated
  (`tags_with_separator`): the output starts with `<tool_call>`;
- a tool's name ("named"): exactly one call, to that tool;
- "none": no constraint (the tools may still be shown to the model in its
  chat template).

Inside a tag, everything up to the arguments is forced once `<tool_call>` is
written (and from the first token when calls are required, with one tool).
The arguments are JSON with runs of whitespace of at most
`MAX_WHITESPACE` characters. `parse_calls` reads the calls back from a
finished answer and validates each one's arguments against its tool's whole
schema (jsonschema-rs), whatever the grammar enforced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import GrammarError
from .json_values import INSTANCE_DECODER
from .spec import MAX_SPEC_SOURCE_CHARS, GrammarSpec
from .validation import SchemaValidator, ValidationResult

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
MAX_WHITESPACE = 4
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is its arguments' JSON schema."""

    name: str
    parameters: Any = field(default_factory=lambda: {"type": "object"})
    description: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise GrammarError(f"tool name {self.name!r} must be 1-128 letters, digits or _ . : -")
        if not isinstance(self.parameters, dict | bool):
            raise GrammarError(f"tool {self.name}: parameters must be a JSON schema (an object)")

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates read it: OpenAI's layout, keys in its
        order (templates that print a tool as JSON keep the order, and the
        prompt is then the one vLLM or an OpenAI client's tools give)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call read from an answer: the tool's name, its arguments as JSON
    text, and their verdict against the tool's schema."""

    name: str
    arguments: str
    validation: ValidationResult


def _tag(tool: Tool) -> dict[str, Any]:
    return {"type": "tag",
            "begin": f'{CALL_START}\n{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": tool.parameters,
                        "max_whitespace_cnt": MAX_WHITESPACE},
            "end": f"}}\n{CALL_END}"}


def call_constraint(tools: list[Tool], choice: str, function: str | None = None) -> GrammarSpec | None:
    """The structural tag of `choice` ("auto", "required", "none" or a tool's
    name) over `tools`, or of the one tool `function` names (a tool may be
    called "none" or "auto": as `function` it is a name); None for "none".
    GrammarError for a name no tool has, or calls without tools."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise GrammarError("tool names must be unique")
    mode = choice if function is None else None  # a name given as `function` is never a mode
    if mode == "none":
        return None
    if not tools:
        raise GrammarError("tool calls need at least one tool")
    # A tag per tool, whose JSON text holds at least its skeleton and its
    # tool's name: refused before it is built (300k tools made 61M
    # characters, json.dumps holding the GIL ~1 s, only to be refused).
    least = sum(len(t.name) + _TAG_CHARS for t in tools) if mode in ("auto", "required") else 0
    if least > MAX_SPEC_SOURCE_CHARS:
        raise GrammarError(f"structural_tag source is too large (at least {least} characters)")
    if mode == "auto":
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [CALL_START],
                               "tags": [_tag(t) for t in tools]}
    elif mode == "required":
        fmt = {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
               "tags": [_tag(t) for t in tools]}
    else:
        name = choice if function is None else function
        named = [t for t in tools if t.name == name]
        if not named:
            raise GrammarError(f"no tool is named {name!r}")
        fmt = {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
               "stop_after_first": True, "tags": [_tag(named[0])]}
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})


# Characters of one tag's JSON text besides its tool's name and schema.
_TAG_CHARS = len(json.dumps(_tag(Tool("f", {})), ensure_ascii=False)) - len("f") - len("{}")


class CallReader:
    """Reads the calls of finished answers for one set of tools (validators
    built on first use, then shared)."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = {t.name: t for t in tools}
        self._validators: dict[str, SchemaValidator | str] = {}

    def _validator(self, name: str) -> SchemaValidator | str:
        found = self._validators.get(name)
        if found is None:
            try:
                found = SchemaValidator(self.tools[name].parameters)
            except ValueError as e:
                found = str(e)
            self._validators[name] = found
        return found

    def parse(self, text: str) -> list[ToolCall]:
        """Every whole call in `text`, in order (a call cut short is left out).

        A call is read as JSON from its start marker, so an end marker inside
        one of its strings does not cut it; its arguments are the model's own
        text (a number too large for a double stays as written)."""
        calls = []
        pos = 0
        while (start := text.find(CALL_START, pos)) >= 0:
            body = start + len(CALL_START)
            try:
                value, members, after = _read_object(text, _skip_space(text, body))
            except (ValueError, RecursionError) as e:
                # As the model wrote it: the call runs to the next end marker,
                # or to the next call's start if that comes first (outside its
                # strings), unless its JSON is still open where the text ends
                # (an end marker inside one of its strings is no end).
                end = text.find(CALL_END, body)
                # Strings are JSON's only if the call opened an object: a stray
                # quote in other text hid the next call's start.
                opened = text.startswith("{", _skip_space(text, body))
                following = _next_start(text, body) if opened else text.find(CALL_START, body)
                if following < 0 or 0 <= end < following:
                    if end < 0 or _ends_open(text, body):
                        break  # cut short
                    following = end + len(CALL_END)
                calls.append(_unreadable(f"the call is not JSON: {str(e).splitlines()[0][:200]}"))
                pos = following
                continue
            end = _skip_space(text, after)
            if not text.startswith(CALL_END, end):
                # Its JSON is whole: the end marker is looked for after it
                # (one inside its strings is no end); none means cut short,
                # unless another call starts first: this one was never ended.
                end = text.find(CALL_END, after)
                following = text.find(CALL_START, after)
                if following >= 0 and (end < 0 or following < end):
                    calls.append(_unreadable("the call has no end marker before the next call"))
                    pos = following
                    continue
                if end < 0:
                    break
                calls.append(_unreadable("the call has text after its JSON, before its end marker"))
                pos = end + len(CALL_END)
                continue
            pos = end + len(CALL_END)
            name = value.get("name") if isinstance(value, dict) else None
            if not isinstance(name, str) or "arguments" not in members:
                calls.append(ToolCall(name if isinstance(name, str) else "", "", ValidationResult(
                    False, message='a call is {"name": ..., "arguments": ...}')))
                continue
            arguments = value["arguments"]
            text_args = members["arguments"]
            if name not in self.tools:
                calls.append(ToolCall(name, text_args, ValidationResult(False, message=f"no tool is named {name!r}")))
                continue
            validator = self._validator(name)
            if isinstance(validator, str):
                result = ValidationResult(False, message=validator, checked=False)
            else:
                result = validator.validate(arguments)
            calls.append(ToolCall(name, text_args, result))
        return calls


def _unreadable(message: str) -> ToolCall:
    return ToolCall("", "", ValidationResult(False, message=message, parsed=False))


class _OutsideStrings:
    """The characters of the JSON from `pos` that are outside its strings, as
    (index, character); once iterated, `in_string` says whether the text ended
    inside one."""

    def __init__(self, text: str, pos: int) -> None:
        self.text, self.pos = text, pos
        self.in_string = False

    def __iter__(self) -> Iterator[tuple[int, str]]:
        escaped = False
        for i in range(self.pos, len(self.text)):
            ch = self.text[i]
            if self.in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            else:
                yield i, ch


def _ends_open(text: str, pos: int) -> bool:
    """Whether the JSON from `pos` is still inside a string, object or array
    where the text ends (its call was cut short, not written badly)."""
    depth = 0
    chars = _OutsideStrings(text, pos)
    for _, ch in chars:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return False
    return chars.in_string or depth > 0


def _next_start(text: str, pos: int) -> int:
    """Where the next call's start marker is from `pos`, outside the strings of
    the JSON there (-1: none): a marker inside a string is the model's text."""
    for i, ch in _OutsideStrings(text, pos):
        if ch == CALL_START[0] and text.startswith(CALL_START, i):
            return i
    return -1


def _skip_space(text: str, pos: int) -> int:
    m = _SPACE.match(text, pos)
    return m.end() if m is not None else pos


def _read_object(text: str, pos: int) -> tuple[Any, dict[str, str], int]:
    """The JSON value at `pos` (ValueError if none), the source text of each
    member when it is an object, and where it ends."""
    value, end = INSTANCE_DECODER.raw_decode(text, pos)
    members: dict[str, str] = {}
    if not isinstance(value, dict):
        return value, members, end
    i = _skip_space(text, pos + 1)  # past "{"
    while text[i] != "}":
        key, i = INSTANCE_DECODER.raw_decode(text, i)
        i = _skip_space(text, _skip_space(text, i) + 1)  # past ":"
        _, after = INSTANCE_DECODER.raw_decode(text, i)
        members[key] = text[i:after]
        i = _skip_space(text, after)
        if text[i] == ",":
            i = _skip_space(text, i + 1)
    return value, members, end
