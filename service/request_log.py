"""One structured log line per finished RPC, and the record of the call behind it.

Every RPC runs with a `CallRecord` in a context variable (set by the
telemetry interceptor, service/telemetry.py): its request id (the request's
`request_id` field, else the `x-request-id` metadata, else a new one, written
back into the request so the servicer uses the same), its peer, its W3C trace
context and its start time. Code along the call adds to it without being
handed anything: the engine loop links the engine request's statistics
(`note_request`), the constraint compiler its compile (`note_compile`), an
admission check the reason it refused (`note_refusal`); a failed call's
status carries the request id in its trailing metadata (`call_metadata`).
When the call ends the interceptor writes one line to the `stencild.requests`
logger (INFO for stencil.v1 RPCs, DEBUG for health and reflection).

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
from dataclasses import dataclass
from typing import Any

from .tracing import TraceParent

ACCESS_LOG = logging.getLogger("stencild.requests")
REQUEST_ID_METADATA = "x-request-id"
MAX_REQUEST_ID_LENGTH = 256
LOG_FORMATS = ("text", "json")


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
    compile: CompileNote | None = None
    request: Any = None  # the engine request's statistics (service.telemetry.RequestStats)
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


def note_refusal(reason: str) -> None:
    """Admission refused the current call (RESOURCE_EXHAUSTED) because of `reason`."""
    call = _CURRENT.get()
    if call is not None:
        call.refusal = reason


def note_compile(kind: str, backend: str | None, start: float, outcome: str, cached: bool) -> None:
    """The current call waited for a constraint compile from `start` until now."""
    call = _CURRENT.get()
    if call is not None:
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
    field is filled in, so the servicer and the log name the same request."""
    field = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {}).get("request_id")
    own = request.request_id if field is not None else ""
    if own:
        # An invalid id is refused by the servicer; the log needs one it can print.
        return own if valid_request_id(own) else uuid.uuid4().hex
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA and isinstance(value, str) and valid_request_id(value):
            own = value
            break
    else:
        own = uuid.uuid4().hex
    if field is not None:
        request.request_id = own
    return own


# -- log lines ------------------------------------------------------------------
def log_fields(record: CallRecord) -> dict[str, Any]:
    """The fields of a call's log line (absent values left out)."""
    fields: dict[str, Any] = {"request_id": record.request_id, "method": record.name,
                              "status": record.code, "total_ms": round(record.seconds * 1000, 2)}
    stats = record.request
    if stats is not None:
        fields.update(stats.log_fields())
    note = record.compile
    if note is not None:
        fields["compile_ms"] = round((note.end - note.start) * 1000, 2)
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


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, plus the call's ids on lines logged during a call."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={getattr(record, k)}" for k in ("request_id", "trace_id") if hasattr(record, k)]
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
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
