"""A server's telemetry: metrics, per-request log lines and trace spans, in one place.

Three hooks feed it, none of which does I/O on the path of a request:

- `CallInterceptor` (a grpc.aio server interceptor) wraps every RPC: it sets
  the call's `CallRecord` (service/ops/request_log.py) before the handler runs
  and, when the call ends, counts it, writes its log line and ends its span.
- `EngineObserver` (one per EngineLoop) sees each engine request admitted,
  each output delivered (on the event loop) and each step (on the engine
  thread): it links each request's `RequestStats` (request_log.py: tokens,
  time to first token, finish reason) to the call that submitted it, keeps
  them for the log line and updates vLLM's request metrics.
- The engine gauges are read at scrape time (metrics.EngineCollector).

With metrics off (`metrics_port` None) no registry exists and only the log
lines' statistics are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from service.address import host_port
from service.interceptors import rewrap
from service.ops.metrics import VLLM_FINISH_REASONS, EngineSource, MetricsServer, ServerMetrics
from service.ops.request_log import (
    CallRecord,
    RequestStats,
    assign_request_id,
    current_call,
    enter_call,
    exit_call,
    level_of,
    log_call,
    note_request,
    request_fields,
)
from service.ops.tracing import Stage, Tracer, trace_context

if TYPE_CHECKING:
    from engine import EngineCore, RequestOutput
    from engine.context import TextContext
    from service.engine_loop import RequestStream

log = logging.getLogger(__name__)

STENCIL_PREFIX = "/stencil.v1."
EMBED_METHOD = "/stencil.v1.Embeddings/Embed"
VLLM_EMBED_METHOD = "/vllm.grpc.engine.VllmEngine/Embed"  # the same model, a router's way in


@dataclass(frozen=True)
class TelemetryConfig:
    """Where metrics are served and spans exported.

    metrics_port: None serves no metrics, 0 picks a free port (`stencild
    serve` maps its `--metrics-port 0` to None). span_exporter: an
    OpenTelemetry SpanExporter to send spans to (tests pass the SDK's
    in-memory one); otlp_endpoint: an OTLP collector to build one for.
    """

    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    otlp_endpoint: str | None = None
    span_exporter: Any = None
    service_name: str = "stencild"

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")


class Telemetry:
    """Metrics registry and HTTP endpoint, tracer and log lines of one server."""

    def __init__(self, config: TelemetryConfig | None = None):
        self.config = config = config or TelemetryConfig()
        self.metrics = ServerMetrics() if config.metrics_port is not None else None
        self._http = (MetricsServer(self.metrics.registry, config.metrics_host, config.metrics_port)
                      if self.metrics is not None and config.metrics_port is not None else None)
        self.tracer: Tracer | None = None
        if config.span_exporter is not None:
            self.tracer = Tracer(config.span_exporter, config.service_name, batch=False)
        elif config.otlp_endpoint:
            self.tracer = Tracer.otlp(config.otlp_endpoint, config.service_name)
        self.embedding_model = ""
        self.interceptor = CallInterceptor(self)

    @property
    def metrics_port(self) -> int | None:
        return self._http.port if self._http is not None else None

    def start(self) -> None:
        """Serve /metrics (OSError if its port cannot be bound)."""
        if self._http is not None:
            port = self._http.start()
            log.info("metrics on http://%s/metrics", host_port(self.config.metrics_host, port))

    def close(self) -> None:
        """Stop serving metrics and flush the spans not exported yet."""
        if self._http is not None:
            self._http.stop()
        if self.tracer is not None:
            self.tracer.close()

    def observer(self, engine: EngineCore, model_name: str, index: int = 0,
                 waiting_outside: Callable[[], int] = lambda: 0) -> EngineObserver:
        """The observer for an EngineLoop of `engine`; registers its gauges
        (`waiting_outside`: its requests waiting before they reach it)."""
        labels = (model_name, str(index))
        if self.metrics is not None:
            self.metrics.engines.add(EngineSource(engine, model_name, str(index), waiting_outside))
        rate = engine.audio.decoder_sample_rate if engine.audio is not None else 0
        return EngineObserver(self.metrics, labels, rate)

    def watch_thread(self, label: str, thread: threading.Thread | None) -> None:
        """Export `thread`'s CPU time as stencil_thread_cpu_seconds{thread=label}."""
        if self.metrics is not None:
            self.metrics.threads.add(label, thread)

    def watch_cpu(self, label: str, read: Callable[[], float | None]) -> None:
        """Export `read()`, a thread's CPU seconds read elsewhere (an engine
        process's), as stencil_thread_cpu_seconds{thread=label}."""
        if self.metrics is not None:
            self.metrics.threads.add_reading(label, read)

    # -- calls ----------------------------------------------------------------------
    def begin(self, method: str, request: Any, context: grpc.aio.ServicerContext,
              metadata: Any) -> CallRecord:
        start = time.monotonic()
        record = CallRecord(method, assign_request_id(request, metadata), context.peer(), start,
                            trace_context(metadata))
        if record.trace is not None:
            record.trace_id = record.trace.trace_id
        if self.tracer is not None and record.method.startswith(STENCIL_PREFIX):
            record.span = self.tracer.start(record.method.lstrip("/"), record.trace, start,
                                            {"rpc.system": "grpc", "rpc.service": record.service,
                                             "rpc.method": record.name,
                                             "stencil.request_id": record.request_id})
            ids = Tracer.ids(record.span)
            if ids is not None:
                record.trace_id, record.span_id = ids
        if method == EMBED_METHOD:
            record.inputs = len(getattr(request, "inputs", ()))
        elif method == VLLM_EMBED_METHOD:
            record.inputs = 1  # a router's Embed carries one input
        return record

    def finish(self, record: CallRecord) -> None:
        """Count the call, log its line, end its span. Never raises."""
        try:
            record.end = time.monotonic()
            self._count(record)
            log_call(record, level_of(record.method))
            if record.span is not None and self.tracer is not None:
                stages = _stages(record)
                self.tracer.finish(record.span, record.end, record.code or "UNKNOWN", stages,
                                   _span_attributes(record))
        except Exception:  # noqa: BLE001 - telemetry must never fail a call
            log.exception("telemetry failed for %s", record.method)

    def _count(self, record: CallRecord) -> None:
        m = self.metrics
        if m is None:
            return
        code = record.code or "UNKNOWN"
        m.rpcs.labels(record.method.lstrip("/"), code).inc()
        if code == "RESOURCE_EXHAUSTED":
            m.refusals.labels(record.refusal or "other").inc()
        note = record.compile
        if note is not None:
            if note.cached:
                m.compile_cache_hits.labels(note.kind).inc()
            if note.outcome == "compiled" and not note.cached:
                m.compile_seconds.labels(note.backend or "", note.kind).observe(note.end - note.start)
            # A constraint refused because no worker was free ("busy", an
            # admission refusal) or none could start is no failure of its own.
            elif note.outcome not in ("compiled", "hit", "busy", "unavailable"):
                m.compile_failures.labels(note.kind, note.outcome).inc()
                if note.outcome == "timeout":
                    m.compile_timeouts.labels(note.kind).inc()
        if record.schema is not None:
            m.schema_validations.labels(record.schema).inc()
        if record.method in (EMBED_METHOD, VLLM_EMBED_METHOD) and code == "OK":
            name = self.embedding_model
            m.embed_requests.labels(name).inc()
            m.embed_inputs.labels(name).inc(record.inputs or 0)
            m.embed_latency.labels(name).observe(record.seconds)


# A call's usage fields (request_log.request_fields) -> the span attributes they become.
SPAN_ATTRIBUTES = {"prompt_tokens": "gen_ai.usage.input_tokens", "completion_tokens": "gen_ai.usage.output_tokens",
                   "cached_tokens": "stencil.cached_tokens", "constraint": "stencil.constraint.kind",
                   "backend": "stencil.constraint.backend", "forced_tokens": "stencil.forced_tokens"}


def _span_attributes(record: CallRecord) -> dict[str, Any]:
    """The span attributes of what the call's engine requests consumed and produced."""
    if not record.requests:
        return {}
    fields = request_fields(record.requests)
    out = {name: fields[key] for key, name in SPAN_ATTRIBUTES.items() if key in fields}
    if "finish_reason" in fields:
        out["gen_ai.response.finish_reasons"] = tuple(fields["finish_reason"].split(","))
    return out


def _stages(record: CallRecord) -> list[Stage]:
    """The child spans of a call: its compile and its request's stages in the engine."""
    stages = []
    note = record.compile
    if note is not None:
        stages.append(Stage("grammar_compile", note.start, note.end))
    stats = record.request
    if stats is not None:
        times = stats.ctx.times
        end = times.finished if times.finished is not None else record.end or time.monotonic()
        if times.arrival is not None:
            stages.append(Stage("queue", times.arrival, times.scheduled or end))
        if times.scheduled is not None:
            stages.append(Stage("prefill", times.scheduled, times.first_token or end))
        if times.first_token is not None:
            stages.append(Stage("decode", times.first_token, end))
    return stages


# -- the interceptor ------------------------------------------------------------------
class CallInterceptor(grpc.aio.ServerInterceptor):
    """Runs every unary-request RPC inside a CallRecord (streams of requests,
    such as reflection, pass through untouched)."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        return rewrap(handler, scope=lambda request, context: self._call(method, metadata, request, context))

    @contextlib.asynccontextmanager
    async def _call(self, method: str, metadata: Any, request: Any,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        telemetry = self.telemetry
        record = telemetry.begin(method, request, context, metadata)
        token = enter_call(record)
        try:
            yield
            record.code = _code(context)
        except (asyncio.CancelledError, GeneratorExit):
            record.code = _cancelled_code(context)
            raise
        except BaseException:
            record.code = _code(context, failed=True)
            raise
        finally:
            with contextlib.suppress(ValueError):  # a generator closed in another context
                exit_call(token)
            telemetry.finish(record)


def _code(context: grpc.aio.ServicerContext, failed: bool = False) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if failed else "OK"


# A client's deadline expires before the server's copy of it (set when the call
# arrived): a call cancelled this close to its deadline ran out of time.
DEADLINE_SLACK_S = 0.25


def _cancelled_code(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


# -- engine requests ---------------------------------------------------------------------
class EngineObserver:
    """Told by an EngineLoop about its requests and steps (see engine_loop.LoopObserver).

    `submitted` and `delivered` run on the event loop, `stepped` on the engine
    thread (a few histogram observations: prometheus_client takes a lock of
    its own for microseconds, no I/O).
    """

    def __init__(self, metrics: ServerMetrics | None, labels: tuple[str, str], sample_rate: int = 0):
        self.metrics = metrics
        self.labels = labels
        self.sample_rate = sample_rate
        if metrics is not None:
            # Labelled children bound once: observing is then a lock and a few adds.
            self._ttft = metrics.ttft.labels(*labels)
            self._itl = metrics.itl.labels(*labels)
            self._e2e = metrics.e2e.labels(*labels)
            self._queue = metrics.queue_time.labels(*labels)
            self._prompt = metrics.prompt_tokens.labels(*labels)
            self._generation = metrics.generation_tokens.labels(*labels)
            self._step = metrics.step_seconds.labels(*labels)
            self._batch = metrics.batch_size.labels(*labels)
            self._mask = metrics.mask_seconds.labels(*labels)

    def submitted(self, ctx: TextContext, stream: RequestStream) -> None:
        call = current_call()
        stats = RequestStats(ctx, call.start if call is not None else time.monotonic(),
                             prompt_tokens=ctx.prompt_len,
                             sample_rate=0 if ctx.produces_text else self.sample_rate)
        stream.observed = stats
        note_request(stats)
        if self.metrics is not None and stats.constraint is not None:
            self.metrics.constrained_requests.labels(*stats.constraint).inc()

    def delivered(self, stream: RequestStream, out: RequestOutput) -> None:
        stats = stream.observed
        if not isinstance(stats, RequestStats):
            return
        try:
            self._delivered(stats, out)
        except Exception:  # noqa: BLE001 - telemetry must never break a delivery
            log.exception("telemetry failed for request %s", out.request_id)

    def _delivered(self, stats: RequestStats, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        # Running totals: a call that ends before its request finishes
        # (cancelled, past its deadline) logs what was delivered to it.
        stats.prompt_tokens = out.prompt_tokens
        stats.completion_tokens = out.completion_tokens
        stats.cached_tokens = out.cached_prompt_tokens
        stats.forced_tokens = out.forced_tokens
        if out.token_ids:
            if stats.ttft is None:
                first = stats.ctx.times.first_token
                stats.ttft = (first if first is not None else now) - stats.start
                if m is not None:
                    self._ttft.observe(stats.ttft)
                    self._prompt.inc(out.prompt_tokens)
            elif m is not None and stats.last_output is not None:
                self._itl.observe(now - stats.last_output)
            stats.last_output = now
            if m is not None:
                self._generation.inc(len(out.token_ids))
        if out.audio is not None and out.audio.size:
            stats.audio_samples += int(out.audio.size)
            if stats.ttfa is None:
                stats.ttfa = now - stats.start
                if m is not None:
                    m.ttfa.labels(*self.labels).observe(stats.ttfa)
        if out.finished:
            self._finished(stats, out, now)

    def _finished(self, stats: RequestStats, out: RequestOutput, now: float) -> None:
        stats.finish_reason = out.status.value
        m = self.metrics
        if m is None:
            return
        times = stats.ctx.times
        reason = VLLM_FINISH_REASONS.get(out.status.value, out.status.value)
        m.request_success.labels(*self.labels, reason).inc()
        self._e2e.observe((times.finished if times.finished is not None else now) - stats.start)
        if times.arrival is not None and times.scheduled is not None:
            self._queue.observe(times.scheduled - times.arrival)
        constraint = stats.constraint
        if constraint is not None:
            m.forced_tokens.labels(*constraint).inc(out.forced_tokens)
            m.passes_saved.labels(*constraint).inc(stats.ctx.grammar.num_jumped)
            if out.schema_retries:
                m.schema_retries.labels(*constraint).inc(out.schema_retries)
        if stats.sample_rate:
            m.speech_requests.labels(*self.labels, out.status.value).inc()
            m.audio_seconds.labels(*self.labels).inc(stats.audio_samples / stats.sample_rate)

    def stepped(self, engine: EngineCore) -> None:
        """After each step, on the engine thread."""
        if self.metrics is None:
            return
        step = engine.last_step
        try:
            if step.batch_size:
                self._step.observe(step.seconds)
                self._batch.observe(step.batch_size)
            if step.mask_seconds is not None:
                self._mask.observe(step.mask_seconds)
        except Exception:  # noqa: BLE001 - never take the engine thread down
            log.exception("telemetry failed after a step")
