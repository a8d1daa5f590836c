"""stencil.v1's `GenerateRequest.constraint`, `tools` and `tool_choice`, checked
into the constraint the compile service takes (service/structured.py).

A request's tools compile into its constraint too: a structural tag of
Hermes/Qwen `<tool_call>` calls (grammar/tool_calls.py), whose calls are read
back from the finished answer. Every fault is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from grammar import GrammarError, GrammarOptions, GrammarSpec
from grammar.tool_calls import CallReader, Tool, call_constraint
from service.errors import Reason, invalid_argument
from service.gen.stencil.v1 import generate_pb2 as pb
from service.structured import JSON_KINDS, ConstraintSpec

C = pb.Constraint
BACKENDS: dict[int, str | None] = {
    C.BACKEND_UNSPECIFIED: None,  # the engine's default (--grammar-backend)
    C.BACKEND_AUTO: "auto",
    C.BACKEND_XGRAMMAR: "xgrammar",
    C.BACKEND_LLGUIDANCE: "llguidance",
}
WHITESPACE: dict[int, str] = {
    C.WHITESPACE_UNSPECIFIED: "compact",
    C.WHITESPACE_COMPACT: "compact",
    C.WHITESPACE_FLEXIBLE: "flexible",
    C.WHITESPACE_PRETTY: "pretty",
}


def _options(c: pb.Constraint, kind: str) -> GrammarOptions:
    style = WHITESPACE.get(c.whitespace)
    if style is None:
        raise invalid_argument("constraint.whitespace", f"unknown value {c.whitespace}")
    if kind not in JSON_KINDS:
        given = [name for name in ("max_whitespace", "indent") if c.HasField(name)]
        if c.whitespace != C.WHITESPACE_UNSPECIFIED:
            given.insert(0, "whitespace")
        if given:
            raise invalid_argument(f"constraint.{given[0]}", "applies to json_schema and json_object only")
        return GrammarOptions()
    if c.HasField("max_whitespace") and style != "flexible":
        raise invalid_argument("constraint.max_whitespace", "applies to whitespace FLEXIBLE only")
    if c.HasField("indent") and style != "pretty":
        raise invalid_argument("constraint.indent", "applies to whitespace PRETTY only")
    kwargs: dict[str, Any] = {"whitespace": style}
    for name, lo, hi in (("max_whitespace", 1, 64), ("indent", 1, 8)):
        if c.HasField(name):
            value = getattr(c, name)
            if not lo <= value <= hi:
                raise invalid_argument(f"constraint.{name}", f"must be in [{lo}, {hi}], got {value}")
            kwargs[name] = value
    return GrammarOptions(**kwargs)


def constraint_spec(req: pb.GenerateRequest) -> ConstraintSpec | None:
    """The request's constraint as a GrammarSpec (None when unconstrained).

    Raises ServiceError (INVALID_ARGUMENT) for a malformed constraint: no kind,
    json_object false, an empty source or choice list, a schema that is not
    JSON, options that do not apply.
    """
    if not req.HasField("constraint"):
        return None
    c = req.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise invalid_argument("constraint.kind", "set one of json_schema, json_object, regex, "
                                                  "choice, ebnf, lark or structural_tag")
    backend = BACKENDS.get(c.backend, "?")
    if backend == "?":
        raise invalid_argument("constraint.backend", f"unknown value {c.backend}")
    options = _options(c, kind)
    field = "constraint.choice.choices" if kind == "choice" else f"constraint.{kind}"
    try:
        if kind == "json_object":
            if not c.json_object:
                raise invalid_argument(field, "must be true (leave the constraint unset for free text)")
            spec = GrammarSpec.json_object(options)
        elif kind == "json_schema":
            spec = GrammarSpec.json_schema(c.json_schema, options)
        elif kind == "choice":
            spec = GrammarSpec.choice(list(c.choice.choices))
        else:
            spec = GrammarSpec(kind, getattr(c, kind))
    except GrammarError as err:
        raise invalid_argument(field, str(err), Reason.GRAMMAR_INVALID) from None
    if c.strict and kind not in JSON_KINDS:
        raise invalid_argument("constraint.strict", "applies to json_schema and json_object only")
    resample = c.resample if c.HasField("resample") else None
    if resample is not None and kind not in JSON_KINDS:
        raise invalid_argument("constraint.resample", "applies to json_schema and json_object only")
    if c.strict and resample is False:
        raise invalid_argument("constraint.resample", "strict resamples: leave resample unset or true")
    return ConstraintSpec(spec, backend, field, c.strict, resample)


@dataclass(frozen=True)
class ToolsSpec:
    """A request's tools: how they may be called ("auto", "required", "none"
    or a tool's name), their constraint (None for "none") and the reader of
    the finished answer's calls (None for "none")."""

    tools: tuple[Tool, ...]
    choice: str
    constraint: ConstraintSpec | None
    reader: CallReader | None

    @property
    def template_entries(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them."""
        return [t.template_entry() for t in self.tools]


_MODES = {pb.ToolChoice.MODE_UNSPECIFIED: "auto", pb.ToolChoice.MODE_AUTO: "auto",
          pb.ToolChoice.MODE_REQUIRED: "required", pb.ToolChoice.MODE_NONE: "none"}


def tools_spec(req: pb.GenerateRequest) -> ToolsSpec | None:
    """The request's tools and tool choice, checked and compiled into a
    constraint spec (None without tools). INVALID_ARGUMENT names the field."""
    if not req.tools:
        if req.HasField("tool_choice"):
            raise invalid_argument("tool_choice", "applies with tools")
        return None
    tools = []
    names: set[str] = set()  # a set: a list's scan per tool took hours for 300k tools
    for i, t in enumerate(req.tools):
        parameters: Any = {"type": "object"}
        if t.parameters:
            try:
                parameters = json.loads(t.parameters)
            except (ValueError, RecursionError) as e:
                raise invalid_argument(f"tools[{i}].parameters", f"not JSON: {str(e).splitlines()[0][:200]}") from None
        try:
            tools.append(Tool(t.name, parameters, t.description))
        except GrammarError as e:
            field = f"tools[{i}].name" if str(e).startswith("tool name") else f"tools[{i}].parameters"
            raise invalid_argument(field, str(e)) from None
        if t.name in names:  # named where the second one is
            raise invalid_argument(f"tools[{i}].name", f"tool names must be unique: {t.name!r} again")
        names.add(t.name)
    tc = req.tool_choice
    choice = _MODES.get(tc.mode)
    if choice is None:
        raise invalid_argument("tool_choice.mode", f"unknown value {tc.mode}")
    if tc.function_name and tc.mode != pb.ToolChoice.MODE_UNSPECIFIED:
        raise invalid_argument("tool_choice.function_name", "names the one tool to call: leave mode unset")
    try:
        # A name, never a mode: a tool may be called "none" or "required".
        spec = call_constraint(tools, choice, function=tc.function_name or None)
    except GrammarError as e:
        field = "tool_choice.function_name" if "no tool is named" in str(e) else "tools"
        raise invalid_argument(field, str(e)) from None
    constraint = reader = None
    if spec is not None:
        if req.HasField("constraint"):
            raise invalid_argument("constraint", "the tools are the constraint (tool_choice is not MODE_NONE): "
                                                 "leave constraint unset")
        # auto: xgrammar first, which enforces every tool choice's tag.
        constraint = ConstraintSpec(spec, "auto", "tools")
        reader = CallReader(tools)
    return ToolsSpec(tuple(tools), choice, constraint, reader)
