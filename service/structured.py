"""Structured output at the edge: a request's constraint -> a compiled matcher.

Each protocol checks its own request's constraint into a `ConstraintSpec`
(stencil.v1: service/api/constraints.py; vLLM's: service/vllm_protocol/convert.py);
the compile itself runs in the engine's grammar compiler (a killable worker
process, bounded in time and cached) and is awaited here without blocking the
loop. A spec that cannot be compiled, or whose compile times out, fails only
its own request, with INVALID_ARGUMENT naming the field: the output is never
silently left unconstrained.

Compiles are queued fairly between callers (`caller_tenant`: the API key, or
the connection without keys; see grammar/_queue.py), so one client's slow
specs never hold up another's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

from engine.structured import StructuredOutput
from grammar import GrammarError, GrammarSpec, Matcher
from grammar.compiler import CompileQueueFull
from service.errors import Reason, ServiceError, invalid_argument, resource_exhausted, unavailable
from service.ops.request_log import current_call, note_compile, note_refusal
from service.security.auth import current_key

JSON_KINDS = ("json_schema", "json_object")
# The kinds whose values may be resampled: JSON, and the JSON inside structural
# tags (tool calls compile to them). Constraint.resample is set for JSON only.
_RESAMPLED_KINDS = (*JSON_KINDS, "structural_tag")


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
        # Requests (not ValidateConstraint calls) awaiting a compile now
        # (several may await one): queued requests as a router sees them, as
        # vLLM counts those waiting for their grammar. Written on the event
        # loop, read by metrics scrapes.
        self.waiting = 0

    @property
    def in_flight(self) -> int:
        """Distinct compiles queued or running now."""
        return self._structured.compiler.pending_compiles if self._started and not self._structured.closed else 0

    def resamples(self, constraint: ConstraintSpec | None) -> bool:
        """Whether a request with this constraint resamples (see Constraint.resample)."""
        return constraint is not None and constraint.resamples(self.resample)

    async def compile(self, constraint: ConstraintSpec) -> Matcher:
        """A fresh matcher for a request bound for the engine (counted among
        the `waiting` meanwhile); ServiceError if it cannot be compiled (see
        `compile_noting_cache`)."""
        matcher, _ = await self.compile_noting_cache(constraint, for_request=True)
        return matcher

    async def compile_noting_cache(self, constraint: ConstraintSpec,
                                   for_request: bool = False) -> tuple[Matcher, bool]:
        """A fresh matcher for the constraint and whether the compile cache had
        it; ServiceError if it cannot be compiled, or (INVALID_ARGUMENT) if it is
        strict and its grammar leaves schema keywords unenforced. A matcher
        for a resampling request comes with its value checks built.

        Cancellation (client gone, deadline) stops the waiting and cancels the
        compile's future: a compile nobody else waits for leaves the queue if it
        has not started, and one that has started runs on in its worker,
        bounded by the timeout, and is cached for the next request.
        """
        start = time.monotonic()
        kind = constraint.spec.kind
        cached = False
        try:
            if not self._started:
                # The first call builds the compiler (tokenizer tables, worker
                # spawn) unless the server warmed it up: not on the event loop.
                await asyncio.to_thread(lambda: self._structured.compiler)
                self._started = True
                start = time.monotonic()
            # (A compiler closed with its engine, as the server stops, raises here.)
            future = self._structured.compiler.compile_async(
                constraint.spec, constraint.backend, caller_tenant(),
                max_pending=self.max_in_flight, max_pending_per_tenant=self.max_in_flight_per_caller)
            cached = future.done()  # a cache hit (or a cached failure), or refused
            matcher = future.result() if cached else await self._wait(future, for_request)
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

    async def _wait(self, future: concurrent.futures.Future[Matcher], counted: bool) -> Matcher:
        self.waiting += counted
        try:
            # A cancelled await cancels `future` too (asyncio.wrap_future chains it).
            return await asyncio.wrap_future(future)
        finally:
            self.waiting -= counted


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
