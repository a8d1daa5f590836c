"""One structured log line per finished RPC, and the record of the call behind it.

Every RPC runs with a `CallRecord` in a context variable (set by the
telemetry interceptor, service/ops/telemetry.py): its request id (the request's
`request_id` field, else the `x-request-id` metadata, else a new one, written
back into the request so the servicer uses the same), its peer, its W3C trace
context and its start time. Code along the call adds to it without being
handed anything: the engine loop's observer links the `RequestStats` of each
engine request the call submits (`note_request`: one, or n for a vLLM n > 1
request) and keeps them up to date as outputs arrive, the constraint compiler
notes its compile (`note_compile`), an admission check the reason it refused
(`note_refusal`); a failed call's status carries the request id in its
trailing metadata (`call_metadata`).

When the call ends, however it ends (cancelled and past its deadline too), the
interceptor writes one line to the `stencild.requests` logger with what the
call consumed and produced up to then: INFO for stencil.v1 and
vllm.grpc.engine.VllmEngine RPCs, DEBUG for health checks (grpc.health.v1 and
VllmEngine/HealthCheck, which routers poll) and reflection (`level_of`).

`configure_logging(level, "text" | "json")` sets up the process's logging:
key=value text or one JSON object per line; either way every line logged
while a call runs names its request id and trace id.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.ops.tracing import TraceParent

if TYPE_CHECKING:
    from engine.context import TextContext

ACCESS_LOG = logging.getLogger("stencild.requests")
REQUEST_ID_METADATA = "x-request-id"
MAX_REQUEST_ID_LENGTH = 256
LOG_FORMATS = ("text", "json")
# Services whose calls are logged at INFO (the others, health and reflection, at DEBUG).
INFO_SERVICES = ("/stencil.v1.", "/vllm.grpc.engine.VllmEngine/")
# Polled by routers and probes: DEBUG, as grpc.health.v1's checks.
DEBUG_METHODS = frozenset({"/vllm.grpc.engine.VllmEngine/HealthCheck"})


@dataclass
class CompileNote:
    """A constraint compile awaited by the call: `outcome` is "compiled", "hit"
    (the compile cache answered) or the GrammarError reason of a failure."""

    kind: str
    backend: str | None
    start: float
    end: float
    outcome: str
    cached: bool = False


@dataclass(eq=False)
class RequestStats:
    """One engine request of a call, as its deliveries have shown it so far
    (kept by the engine loop's observer, service/ops/telemetry.py). The counts are
    the latest output's running totals, so a call that ends before its request
    finishes (cancelled, past its deadline) still reports what it produced;
    `start` is when the call began."""

    ctx: TextContext
    start: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    forced_tokens: int = 0
    finish_reason: str | None = None
    ttft: float | None = None  # seconds from the call's start to the first output token
    last_output: float | None = None
    audio_samples: int = 0
    sample_rate: int = 0
    ttfa: float | None = None  # seconds to the first audio
    # The running totals of the last output written to the client: a call
    # that ends before its request finishes reports these (what the engine
    # delivered may be ahead of what the client got, behind a paced or slow
    # stream).
    sent_completion_tokens: int = 0
    sent_forced_tokens: int = 0

    @property
    def reported_tokens(self) -> tuple[int, int]:
        """(completion, forced) tokens its call reports: all of them once the
        request finished; what the client was sent if the call left first."""
        if self.finish_reason is not None:
            return self.completion_tokens, self.forced_tokens
        return self.sent_completion_tokens, self.sent_forced_tokens

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, backend) of a constrained request."""
        matcher = self.ctx.matcher
        return (matcher.spec.kind, matcher.backend) if matcher is not None else None


@dataclass(eq=False)
class CallRecord:
    """What one RPC did, gathered while it runs (see the module docstring)."""

    method: str  # the full gRPC method: /stencil.v1.Generation/Generate
    request_id: str
    peer: str
    start: float  # time.monotonic()
    trace: TraceParent | None = None
    code: str | None = None  # status code name once ended
    end: float | None = None
    refusal: str | None = None  # why admission refused it (RESOURCE_EXHAUSTED)
    key: str | None = None  # the name of the API key it came with (with keys configured)
    compile: CompileNote | None = None
    # The engine requests the call submitted: one, or n for a vLLM n > 1 request.
    requests: list[RequestStats] = field(default_factory=list)
    span: Any = None  # the OpenTelemetry span, with tracing on
    trace_id: str | None = None  # the span's trace id, else the caller's
    span_id: str | None = None
    inputs: int | None = None  # Embed: the number of inputs
    # JSON constraints: the output's validation ("valid", "invalid",
    # "not_checked"), the failing keyword and path, the keywords left unenforced.
    schema: str | None = None
    schema_error: str | None = None
    unenforced: tuple[str, ...] = ()

    @property
    def service(self) -> str:
        return self.method.rsplit("/", 2)[-2] if self.method.count("/") >= 2 else ""

    @property
    def name(self) -> str:
        """The method's short name (Generate, Embed, ...)."""
        return self.method.rsplit("/", 1)[-1]

    @property
    def seconds(self) -> float:
        return (self.end if self.end is not None else time.monotonic()) - self.start

    @property
    def request(self) -> RequestStats | None:
        """The call's (first) engine request."""
        return self.requests[0] if self.requests else None


_CURRENT: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("stencild_call", default=None)


def current_call() -> CallRecord | None:
    """The record of the RPC this code runs for (None outside one)."""
    return _CURRENT.get()


def enter_call(record: CallRecord) -> contextvars.Token[CallRecord | None]:
    return _CURRENT.set(record)


def exit_call(token: contextvars.Token[CallRecord | None]) -> None:
    _CURRENT.reset(token)


def call_metadata() -> tuple[tuple[str, str], ...]:
    """Trailing metadata that names the current call's request (empty outside one)."""
    call = _CURRENT.get()
    return ((REQUEST_ID_METADATA, call.request_id),) if call is not None else ()


def note_request(stats: RequestStats) -> None:
    """The current call submitted an engine request, whose statistics these are."""
    call = _CURRENT.get()
    if call is not None:
        call.requests.append(stats)


def note_sent(observed: Any, output: Any) -> None:
    """The call wrote everything up to `output` (a RequestOutput) of the
    engine request whose statistics `observed` holds (a RequestStream's
    `observed`; None or anything else when telemetry is off)."""
    if isinstance(observed, RequestStats):
        observed.sent_completion_tokens = output.completion_tokens
        observed.sent_forced_tokens = output.forced_tokens


def note_key(name: str) -> None:
    """The current call came with the API key named `name` (its name only: a
    secret is never logged)."""
    call = _CURRENT.get()
    if call is not None:
        call.key = name


def note_refusal(reason: str) -> None:
    """Admission refused the current call (RESOURCE_EXHAUSTED) because of `reason`."""
    call = _CURRENT.get()
    if call is not None:
        call.refusal = reason


def note_compile(kind: str, backend: str | None, start: float, outcome: str, cached: bool) -> None:
    """The current call waited for a constraint compile from `start` until now.

    Only its first compile is the call's: the copies a multi-sequence call
    (vLLM's n) takes after it are cache hits that would hide what it waited for."""
    call = _CURRENT.get()
    if call is not None and call.compile is None:
        call.compile = CompileNote(kind, backend, start, time.monotonic(), outcome, cached)


def note_validation(result: str, keyword: str, path: str, unenforced: tuple[str, ...]) -> None:
    """The current call's output was validated against its schema."""
    call = _CURRENT.get()
    if call is not None:
        call.schema = result
        call.schema_error = f"{keyword or 'json'}@{path or '/'}" if result == "invalid" else None
        call.unenforced = tuple(unenforced)


def valid_request_id(rid: str) -> bool:
    """Whether `rid` can be a request id: it is sent as the `x-request-id` header,
    whose values gRPC allows only as visible ASCII (spaces only between them)."""
    return (0 < len(rid) <= MAX_REQUEST_ID_LENGTH and all(" " <= ch <= "~" for ch in rid)
            and rid == rid.strip(" "))


def assign_request_id(request: Any, metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The call's request id: the request's own `request_id` field, else the
    `x-request-id` metadata (as set by gateways), else a new one. An empty
    field is filled in, so the servicer and the log name the same request.

    A gateway sends one `x-request-id` with every call it makes for one of its
    own requests, so concurrent calls may share it: as the id of an engine
    request (a message with a `request_id` field) it gets a unique suffix,
    `<x-request-id>-<8 hex digits>`."""
    field = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {}).get("request_id")
    own = request.request_id if field is not None else ""
    if own:
        # An invalid id is refused by the servicer; the log needs one it can print.
        return own if valid_request_id(own) else uuid.uuid4().hex
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA and isinstance(value, str) and valid_request_id(value):
            own = value
            if field is not None:
                own = f"{value[:MAX_REQUEST_ID_LENGTH - 9].rstrip(' ')}-{uuid.uuid4().hex[:8]}"
            break
    else:
        own = uuid.uuid4().hex
    if field is not None:
        request.request_id = own
    return own


# -- log lines ------------------------------------------------------------------
def level_of(method: str) -> int:
    """The level of a call's line: INFO for the APIs, DEBUG for health and reflection."""
    return logging.INFO if method.startswith(INFO_SERVICES) and method not in DEBUG_METHODS else logging.DEBUG


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def request_fields(requests: Sequence[RequestStats]) -> dict[str, Any]:
    """What a call's engine requests consumed and produced, as log fields.

    n > 1 sequences of one prompt: `n`, the prompt (and its cache hit) once, as
    the router's usage counts it; completion and forced tokens summed; the
    first token of any sequence; the finish reason when all agree, else one
    per sequence, comma-separated ("-" for one that had not finished).
    """
    first = requests[0]
    out: dict[str, Any] = {}
    if len(requests) > 1:
        out["n"] = len(requests)
    out["prompt_tokens"] = first.prompt_tokens
    out["completion_tokens"] = sum(r.reported_tokens[0] for r in requests)
    out["cached_tokens"] = first.cached_tokens
    constraint = first.constraint
    if constraint is not None:
        out["forced_tokens"] = sum(r.reported_tokens[1] for r in requests)
        out["constraint"], out["backend"] = constraint
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    if ttfts:
        out["ttft_ms"] = _ms(min(ttfts))
    times = first.ctx.times
    if times.arrival is not None and times.scheduled is not None:
        out["queue_ms"] = _ms(times.scheduled - times.arrival)
    if first.sample_rate:
        out["audio_s"] = round(first.audio_samples / first.sample_rate, 3)
        if first.ttfa is not None:
            out["ttfa_ms"] = _ms(first.ttfa)
    reasons = [r.finish_reason for r in requests]
    if any(reasons):
        out["finish_reason"] = (reasons[0] if len(set(reasons)) == 1
                                else ",".join(r or "-" for r in reasons))
    return out


def log_fields(record: CallRecord) -> dict[str, Any]:
    """The fields of a call's log line (absent values left out)."""
    fields: dict[str, Any] = {"request_id": record.request_id,
                              "service": record.service.rsplit(".", 1)[-1], "method": record.name,
                              "status": record.code, "total_ms": _ms(record.seconds)}
    if record.requests:
        fields.update(request_fields(record.requests))
    note = record.compile
    if note is not None:
        fields["compile_ms"] = _ms(note.end - note.start)
        fields["compile"] = note.outcome
    if record.inputs is not None:
        fields["inputs"] = record.inputs
    if record.schema is not None:
        fields["schema"] = record.schema
        if record.schema_error is not None:
            fields["schema_error"] = record.schema_error
        if record.unenforced:
            fields["unenforced"] = ",".join(record.unenforced)
    if record.refusal is not None:
        fields["refused"] = record.refusal
    fields["peer"] = record.peer
    if record.key is not None:
        fields["key"] = record.key
    if record.trace_id is not None:
        fields["trace_id"] = record.trace_id
    return fields


def _value(value: Any) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text) or not text.isprintable():
        return json.dumps(text)
    return text


class KeyValues:
    """A log message of key=value pairs, rendered only if the line is written."""

    def __init__(self, fields: dict[str, Any]):
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{k}={_value(v)}" for k, v in self.fields.items())


def log_call(record: CallRecord, level: int) -> None:
    if ACCESS_LOG.isEnabledFor(level):
        fields = log_fields(record)
        ACCESS_LOG.log(level, "%s", KeyValues(fields), extra={"fields": fields})


class CallContextFilter(logging.Filter):
    """Adds the current call's request id and trace id to every log record."""

    def filter(self, record: logging.LogRecord) -> bool:
        call = _CURRENT.get()
        if call is not None and not hasattr(record, "fields"):
            record.request_id = call.request_id
            if call.trace_id is not None:
                record.trace_id = call.trace_id
        return True


class ClientGoneFilter(logging.Filter):
    """grpc logs an answer it could not send because the client had gone (it
    refused the answer's size, or left) as an ERROR with a traceback, through
    no fault of the server's: any client could fill the log with them. Such a
    record becomes one DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.name.startswith("grpc") and record.levelno >= logging.ERROR and (
                type(exc).__name__ == "ExecuteBatchError" or "ExecuteBatchError" in record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, plus the call's ids on lines logged during a call."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        # Quoted like the access line's values: an id with a space cannot fake a field.
        ids = [f"{k}={_value(getattr(record, k))}" for k in ("request_id", "trace_id") if hasattr(record, k)]
        return f"{line} [{' '.join(ids)}]" if ids else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the call's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname, "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out["message"] = "request finished"
            out.update(fields)
        else:
            out["message"] = record.getMessage()
            for key in ("request_id", "trace_id"):
                if hasattr(record, key):
                    out[key] = getattr(record, key)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a line is logged, not the one
    at set-up: a caller that swaps stderr (pytest, a daemon wrapper) and closes
    the old one must not make every later line a logging error."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure_logging(level: str | int = "INFO", fmt: str = "text") -> None:
    """Log to stderr in `fmt` ("text" or "json"), replacing any handler set before."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use text or json")
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(CallContextFilter())
    handler.addFilter(ClientGoneFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
