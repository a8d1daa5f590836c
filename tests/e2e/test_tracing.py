"""Trace context and request log lines of a real server.

Spans go through the OpenTelemetry SDK to its in-memory exporter; log lines
are read from the `stencild.requests` logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from service.ops.telemetry import TelemetryConfig

from .helpers import ServerHandle, generate, greedy

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(make_module_server: Callable[..., ServerHandle], exporter: InMemorySpanExporter) -> ServerHandle:
    return make_module_server(telemetry=TelemetryConfig(span_exporter=exporter))


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "stencild.requests"]  # type: ignore[attr-defined]


def wait_lines(caplog: pytest.LogCaptureFixture, **match: Any) -> list[dict[str, Any]]:
    """The request lines with these fields, once there is one: a call's line is
    written as it ends on the server, which may be just after its client saw
    the status."""
    deadline = time.monotonic() + 10
    while True:
        found = [f for f in lines(caplog) if all(f.get(k) == v for k, v in match.items())]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_a_request_is_a_span_with_its_stages(traced: ServerHandle, exporter: InMemorySpanExporter,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    exporter.clear()
    req = greedy("Answer:", max_new_tokens=12)
    req.constraint.regex = "(yes|no), because [a-z]{3,8}"
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"), ("tracestate", "vendor=abc"))
    rid, complete = generate_with(traced, req, metadata)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["stencil.v1.Generation/Generate"]
    assert root.kind is SpanKind.SERVER
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert root.parent is not None and f"{root.parent.span_id:016x}" == PARENT_ID
    assert root.context.trace_state.get("vendor") == "abc"
    # OpenTelemetry's gRPC conventions: a success is left unset, the code is a number.
    assert root.status.status_code is StatusCode.UNSET
    attributes = root.attributes
    assert attributes is not None
    assert attributes["rpc.grpc.status_code"] == 0
    assert attributes["gen_ai.usage.output_tokens"] == complete.usage.completion_tokens
    assert attributes["stencil.constraint.kind"] == "regex"
    stages = [spans[name] for name in ("grammar_compile", "queue", "prefill", "decode")]
    root_start, root_end = _interval(root)
    for stage in stages:
        assert stage.parent is not None and stage.parent.span_id == root.context.span_id
        assert stage.context.trace_id == root.context.trace_id
        start, end = _interval(stage)
        assert root_start <= start <= end <= root_end
    compile_, queue, prefill, decode = (_interval(s) for s in stages)
    assert compile_[1] <= queue[0] + 1_000_000  # clocks agree within a millisecond
    assert queue[1] <= prefill[0] + 1_000_000 and prefill[1] <= decode[0] + 1_000_000
    # The log line names the same trace and request.
    [line] = wait_lines(caplog, method="Generate")
    assert line["trace_id"] == TRACE_ID and line["status"] == "OK"
    assert line["request_id"] == rid
    assert line["completion_tokens"] == complete.usage.completion_tokens
    assert line["forced_tokens"] == complete.usage.forced_tokens
    assert line["constraint"] == "regex" and line["backend"] == complete.grammar_backend
    assert line["finish_reason"] in ("eos", "length") and line["ttft_ms"] > 0 and line["total_ms"] > 0
    assert line["peer"].startswith("ipv4:127.0.0.1:")


def test_without_traceparent_a_new_trace_starts(traced: ServerHandle, exporter: InMemorySpanExporter,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    exporter.clear()
    generate(traced.stub, greedy("Hello", max_new_tokens=3))
    [root] = [s for s in exporter.get_finished_spans() if s.name.endswith("/Generate")]
    assert root.parent is None
    [line] = wait_lines(caplog, method="Generate")
    assert line["trace_id"] == f"{root.context.trace_id:032x}"


def test_an_unsampled_trace_exports_nothing_but_is_logged(traced: ServerHandle, exporter: InMemorySpanExporter,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    exporter.clear()
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-00"),)
    generate_with(traced, greedy("Hello", max_new_tokens=3), metadata)
    assert exporter.get_finished_spans() == ()
    [line] = wait_lines(caplog, method="Generate")
    assert line["trace_id"] == TRACE_ID


def test_a_failure_before_streaming_carries_and_logs_its_request_id(
        traced: ServerHandle, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    exporter.clear()
    for given in ("my-request-7", ""):
        bad = greedy("x", request_id=given)
        bad.sampling.top_p = 2.0
        with pytest.raises(grpc.RpcError) as err:
            generate(traced.stub, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailing = dict(err.value.trailing_metadata())
        rid = trailing["x-request-id"]
        assert rid == given or (not given and len(rid) == 32)
        assert "grpc-status-details-bin" in trailing  # the BadRequest is still there
        [line] = wait_lines(caplog, request_id=rid)
        assert line["status"] == "INVALID_ARGUMENT"
        assert "completion_tokens" not in line  # it never reached the engine
    errors = [s for s in exporter.get_finished_spans() if s.name.endswith("/Generate")]
    # A bad request is no fault of the server's: no ERROR status (OpenTelemetry's gRPC conventions).
    assert len(errors) == 2
    assert all(s.status.status_code is StatusCode.UNSET for s in errors)
    assert all(s.attributes is not None and s.attributes["rpc.grpc.status_code"] == 3 for s in errors)


def test_a_gateway_request_id_is_used(traced: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    responses = list(traced.stub.Generate(greedy("Hi", max_new_tokens=2),
                                          metadata=(("x-request-id", "from-the-gateway"),)))
    rid = responses[-1].request_id
    assert rid.startswith("from-the-gateway-")  # unique: a gateway sends one id with several calls
    assert wait_lines(caplog, request_id=rid)


def generate_with(handle: ServerHandle, req: Any, metadata: Any) -> tuple[str, Any]:
    """Run a stream with call metadata: (its request id, the complete message)."""
    last = None
    for msg in handle.stub.Generate(req, metadata=metadata, timeout=60):
        last = msg
    assert last is not None and last.HasField("complete")
    return last.request_id, last.complete


def _interval(span: ReadableSpan) -> tuple[int, int]:
    """A finished span's start and end, in nanoseconds."""
    assert span.start_time is not None and span.end_time is not None
    return span.start_time, span.end_time
