"""W3C trace context in, OpenTelemetry spans out.

A call's `traceparent` / `tracestate` metadata is parsed here without any
library (`parse_traceparent`), so its trace id reaches the request's log lines
whether or not OpenTelemetry is installed. With tracing on (`--otlp-endpoint`,
or a span exporter handed to the server), each RPC becomes one SERVER span,
child of the caller's span when a `traceparent` came in, and a request that
reached the engine gets child spans for its stages: `grammar_compile`, `queue`
(waiting for its first step), `prefill` (to its first output token) and
`decode` (to its last). The stage spans are built when the call ends, from the
timestamps the engine recorded (`engine.context.RequestTimes`), so tracing
adds nothing to the engine's steps.

OpenTelemetry is optional (`pip install 'stencild[otel]'`); the SDK is
imported only when tracing is on.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# version "00": 2 hex version, 32 hex trace id, 16 hex parent id, 2 hex flags.
# Later versions may append fields after a dash; the first four still read.
# The codes that mark a server span ERROR (OpenTelemetry's gRPC conventions):
# the others (a bad request, a client's cancel) are no fault of the server's.
SERVER_FAULTS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


@dataclass(frozen=True)
class TraceParent:
    """A caller's W3C trace context (https://www.w3.org/TR/trace-context/)."""

    trace_id: str  # 32 lowercase hex digits
    parent_id: str  # 16 lowercase hex digits
    flags: int
    tracestate: str = ""

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(value: str | None, tracestate: str | None = None) -> TraceParent | None:
    """The trace context of a `traceparent` header, or None if it is absent or
    malformed (then, as the spec says, the call starts a new trace)."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16), _valid_tracestate(tracestate or ""))


# A tracestate list member (W3C trace-context, section 3.3.1): key=value.
_TRACESTATE_MEMBER = re.compile(
    r"^(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$")
_TRACESTATE_MEMBERS = 32


def _valid_tracestate(value: str) -> str:
    """`value` if it is a well-formed tracestate, else "" (the spec lets a
    receiver drop one it cannot parse; OpenTelemetry would log a warning per
    call, echoing whatever the client sent)."""
    members = [m.strip() for m in value.split(",") if m.strip()]
    if len(members) > _TRACESTATE_MEMBERS or not all(_TRACESTATE_MEMBER.match(m) for m in members):
        return ""
    return ",".join(members)


def trace_context(metadata: Sequence[tuple[str, Any]] | None) -> TraceParent | None:
    """The W3C trace context of a call's invocation metadata, if it has one."""
    parents: list[Any] = []
    state = None
    for key, value in metadata or ():
        if key == TRACEPARENT:
            parents.append(value)
        elif key == TRACESTATE:
            state = value if state is None else f"{state},{value}"
    if len(parents) != 1:  # none, or several: the spec reads several as invalid
        return None
    return parse_traceparent(parents[0] if isinstance(parents[0], str) else None, state)


def check_otlp() -> None:
    """ValueError unless the OpenTelemetry SDK and an OTLP span exporter are installed."""
    import importlib.util

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            return False

    if not found("opentelemetry.sdk.trace"):
        raise ValueError("--otlp-endpoint needs OpenTelemetry: pip install 'stencild[otel]'")
    if not (found("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
            or found("opentelemetry.exporter.otlp.proto.http.trace_exporter")):
        raise ValueError("--otlp-endpoint needs an OTLP span exporter: pip install 'stencild[otel]'")


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as nanoseconds since the epoch (span timestamps)."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


@dataclass(frozen=True)
class Stage:
    """A stage of a request, as a child span: name and monotonic start/end."""

    name: str
    start: float
    end: float


class Tracer:
    """OpenTelemetry spans for RPCs, through one TracerProvider of this server's own.

    `exporter` is an OpenTelemetry `SpanExporter`: an OTLP exporter in
    production (`Tracer.otlp`), the SDK's in-memory exporter in tests. Spans
    are exported in the background (BatchSpanProcessor) unless `batch` is
    False.
    """

    def __init__(self, exporter: Any, service_name: str = "stencild", batch: bool = True):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self._tracer = self.provider.get_tracer("stencild")

    @classmethod
    def otlp(cls, endpoint: str, service_name: str = "stencild") -> Tracer:
        """Export to an OTLP collector: gRPC (`host:4317`, `http://host:4317`) with
        opentelemetry-exporter-otlp-proto-grpc, else OTLP/HTTP
        (`http://host:4318/v1/traces`) with the -proto-http exporter."""
        check_otlp()
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter: Any = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        except ImportError:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HTTPSpanExporter,
            )
            exporter = HTTPSpanExporter(endpoint=endpoint)
        return cls(exporter, service_name)

    def start(self, name: str, parent: TraceParent | None, start: float,
              attributes: dict[str, Any]) -> Any:
        """Start a call's SERVER span (child of `parent` when given)."""
        from opentelemetry import trace
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            TraceFlags,
            TraceState,
        )

        context = None
        if parent is not None:
            state = TraceState.from_header([parent.tracestate]) if parent.tracestate else None
            remote = SpanContext(int(parent.trace_id, 16), int(parent.parent_id, 16), is_remote=True,
                                 trace_flags=TraceFlags(parent.flags), trace_state=state)
            context = trace.set_span_in_context(NonRecordingSpan(remote))
        return self._tracer.start_span(name, context=context, kind=SpanKind.SERVER,
                                       start_time=wall_ns(start), attributes=attributes)

    def finish(self, span: Any, end: float, code: str, stages: Sequence[Stage],
               attributes: dict[str, Any]) -> None:
        """Add the stage spans under `span`, then end it at `end` with the
        call's gRPC status (a StatusCode name) as OpenTelemetry's gRPC server
        conventions have it: `rpc.grpc.status_code` its number, the span's
        status ERROR only for a server's fault, else left unset."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        parent = trace.set_span_in_context(span)
        for stage in stages:
            child = self._tracer.start_span(stage.name, context=parent, start_time=wall_ns(stage.start))
            child.end(end_time=wall_ns(max(stage.end, stage.start)))
        status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
        span.set_attributes({**attributes, "rpc.grpc.status_code": status.value[0]})
        if status.name in SERVER_FAULTS:
            span.set_status(Status(StatusCode.ERROR, status.name))
        span.end(end_time=wall_ns(end))

    @staticmethod
    def ids(span: Any) -> tuple[str, str] | None:
        """(trace id, span id) of a span, in hex, or None if it is not recorded."""
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return None
        return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"

    def close(self) -> None:
        """Export what is buffered and stop."""
        self.provider.shutdown()
