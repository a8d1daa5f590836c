"""Structured output at the edge: `GenerateRequest.constraint` -> a compiled matcher.

The proto is validated and turned into a `grammar.GrammarSpec` (cheap, on the
event loop); the compile itself runs in the engine's grammar compiler (a
killable worker process, bounded in time and cached) and is awaited without
blocking the loop. A spec that cannot be compiled, or whose compile times out,
fails only its own request, with INVALID_ARGUMENT naming the field: the output
is never silently left unconstrained.

Compiles are queued fairly between callers (`caller_tenant`: the API key, or
the connection without keys; see grammar/_queue.py), so one client's slow
specs never hold up another's.

A request's tools (`GenerateRequest.tools`, `tool_choice`) compile into its
constraint too: a structural tag of Hermes/Qwen `<tool_call>` calls
(grammar/tool_calls.py), whose calls are read back from the finished answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass
from typing import Any

from engine.structured import StructuredOutput
from grammar import GrammarError, GrammarOptions, GrammarSpec, Matcher
from grammar.compiler import CompileQueueFull
from grammar.tool_calls import CallReader, Tool, call_constraint
from service.errors import Reason, ServiceError, invalid_argument, resource_exhausted, unavailable
from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.request_log import current_call, note_compile, note_refusal
from service.security.auth import current_key

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
_JSON_KINDS = ("json_schema", "json_object")
# The kinds whose values may be resampled: JSON, and the JSON inside structural
# tags (tool calls compile to them). Constraint.resample is set for JSON only.
_RESAMPLED_KINDS = (*_JSON_KINDS, "structural_tag")


@dataclass(frozen=True)
class ConstraintSpec:
    """A validated constraint: the spec, the backend asked for, and the field
    path that compile errors are reported against."""

    spec: GrammarSpec
    backend: str | None
    field: str
    strict: bool = False
    # Whether a value that breaks an unenforced keyword is resampled; None:
    # the server's default. Strict always resamples.
    resample: bool | None = None

    def resamples(self, default: bool) -> bool:
        """Whether this request's values are checked and resampled."""
        if self.spec.kind not in _RESAMPLED_KINDS:
            return False
        return self.strict or (default if self.resample is None else self.resample)


def _options(c: pb.Constraint, kind: str) -> GrammarOptions:
    style = WHITESPACE.get(c.whitespace)
    if style is None:
        raise invalid_argument("constraint.whitespace", f"unknown value {c.whitespace}")
    if kind not in _JSON_KINDS:
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
    if c.strict and kind not in _JSON_KINDS:
        raise invalid_argument("constraint.strict", "applies to json_schema and json_object only")
    resample = c.resample if c.HasField("resample") else None
    if resample is not None and kind not in _JSON_KINDS:
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
        if any(other.name == t.name for other in tools[:-1]):  # named where the second one is
            raise invalid_argument(f"tools[{i}].name", f"tool names must be unique: {t.name!r} again")
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


def caller_tenant() -> str:
    """Whom the current call's compiles are for, in the grammar compiler's fair
    queue: its API key (by name) when keys are on, else its connection (the
    gRPC peer, address and port: without keys nothing names a client better,
    and a host may be a whole NAT, a sidecar or every client on loopback)."""
    key = current_key.get()
    if key:
        return f"key:{key}"
    call = current_call()
    return f"peer:{call.peer}" if call is not None else ""


class ConstraintCompiler:
    """Compiles constraints for one engine without blocking the event loop.

    `max_in_flight` bounds the distinct compiles queued or running at once,
    and one caller (`caller_tenant`) may hold at most half of them, so a
    flood of slow schemas is refused with RESOURCE_EXHAUSTED instead of piling
    up, and never takes every place. A spec already compiled (or compiling)
    is never refused. `warm` says the engine's grammar compiler already exists
    (started at warm-up). `resample` is Constraint.resample's default
    (`stencild serve --no-resample`).
    """

    def __init__(self, structured: StructuredOutput, max_in_flight: int = 64, warm: bool = False,
                 resample: bool = True):
        self._structured = structured
        self.max_in_flight = max_in_flight
        self.max_in_flight_per_caller = max(1, max_in_flight // 2)
        self.resample = resample
        self._started = warm
        # Requests awaiting a compile now (several may await one): queued
        # requests as a router sees them, as vLLM counts those waiting for
        # their grammar. Written on the event loop, read by metrics scrapes.
        self.waiting = 0

    @property
    def in_flight(self) -> int:
        """Distinct compiles queued or running now."""
        return self._structured.compiler.pending_compiles if self._started else 0

    def resamples(self, constraint: ConstraintSpec | None) -> bool:
        """Whether a request with this constraint resamples (see Constraint.resample)."""
        return constraint is not None and constraint.resamples(self.resample)

    async def compile(self, constraint: ConstraintSpec) -> Matcher:
        """A fresh matcher for the constraint; ServiceError if it cannot be compiled
        (see `compile_noting_cache`)."""
        matcher, _ = await self.compile_noting_cache(constraint)
        return matcher

    async def compile_noting_cache(self, constraint: ConstraintSpec) -> tuple[Matcher, bool]:
        """A fresh matcher for the constraint and whether the compile cache had
        it; ServiceError if it cannot be compiled, or (INVALID_ARGUMENT) if it is
        strict and its grammar leaves schema keywords unenforced. A matcher
        for a resampling request comes with its value checks built.

        Cancellation (client gone, deadline) stops the waiting and cancels the
        compile's future: a compile nobody else waits for leaves the queue if it
        has not started, and one that has started runs on in its worker,
        bounded by the timeout, and is cached for the next request.
        """
        if not self._started:
            # The first call builds the compiler (tokenizer tables, worker
            # spawn) unless the server warmed it up: not on the event loop.
            await asyncio.to_thread(lambda: self._structured.compiler)
            self._started = True
        start = time.monotonic()
        kind = constraint.spec.kind
        future = self._structured.compiler.compile_async(
            constraint.spec, constraint.backend, caller_tenant(),
            max_pending=self.max_in_flight, max_pending_per_tenant=self.max_in_flight_per_caller)
        cached = future.done()  # a cache hit (or a cached failure), or refused
        try:
            matcher = future.result() if cached else await self._wait(future)
        except CompileQueueFull as err:
            note_refusal("grammar_compiles")
            raise resource_exhausted(f"{err}; retry later", Reason.COMPILE_QUEUE_FULL) from None
        except GrammarError as err:
            note_compile(kind, err.backend, start, _outcome(err), cached)
            raise compile_error(err, constraint.field) from None
        note_compile(kind, getattr(matcher, "backend", None), start, "compiled", cached)
        if self.resamples(constraint) and not matcher.checks_ready:
            # The value checks' set-up, once per schema (seconds for one of
            # hundreds of KB): on a worker thread, not on this loop, which
            # builds the request's context, nor on the engine thread.
            await asyncio.to_thread(matcher.prepare_checks)
        refused = [k for k in matcher.unenforced_keywords if k not in matcher.resampled_keywords] \
            if constraint.strict else []
        if refused:
            # Strict promises that the output stays inside the schema (token
            # by token, or by resampling a value that breaks a keyword the
            # grammar leaves out); refuse before any token is spent.
            names = ", ".join(refused)
            raise invalid_argument(
                constraint.field,
                f"strict: the {matcher.backend} grammar cannot enforce {names} token by token, "
                "and where they sit (inside a branch the value chooses) no value can be resampled "
                "for them; drop strict to have them checked on the finished output instead",
                Reason.SCHEMA_NOT_ENFORCEABLE)
        return matcher, cached

    async def _wait(self, future: concurrent.futures.Future[Matcher]) -> Matcher:
        self.waiting += 1
        try:
            # A cancelled await cancels `future` too (asyncio.wrap_future chains it).
            return await asyncio.wrap_future(future)
        finally:
            self.waiting -= 1


def _outcome(err: GrammarError) -> str:
    """A failed compile's outcome for the metrics: what the library said, or
    `busy`/`unavailable` when no worker ever compiled it (compile_error)."""
    if err.backend is None and err.reason in ("timeout", "crashed"):
        return "busy" if err.reason == "timeout" else "unavailable"
    return err.reason


def compile_error(err: GrammarError, field: str) -> ServiceError:
    """A compile's failure as the status a client gets (`field`: the constraint's)."""
    # A compile that crashed its worker is the spec's doing (and is cached as
    # such); a compiler that is closed or cannot start a worker is the server's.
    if err.reason == "crashed" and err.backend is None:
        return unavailable(f"the grammar compiler is unavailable: {err}", Reason.GRAMMAR_COMPILER_UNAVAILABLE)
    # A timeout without a backend never reached a compile worker: the server
    # was busy with other constraints, which says nothing about this one.
    if err.reason == "timeout" and err.backend is None:
        note_refusal("grammar_compiler_busy")
        return resource_exhausted(f"{err}; retry later", Reason.COMPILE_QUEUE_FULL)
    reason = {"timeout": Reason.GRAMMAR_COMPILE_TIMEOUT, "too_large": Reason.GRAMMAR_TOO_LARGE}.get(
        err.reason, Reason.GRAMMAR_INVALID)
    return invalid_argument(field, str(err), reason)
