"""A call's span status, as OpenTelemetry's conventions for gRPC servers have it."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from service.ops.tracing import Tracer


@pytest.mark.parametrize(("code", "number", "status"), [
    ("OK", 0, StatusCode.UNSET), ("CANCELLED", 1, StatusCode.UNSET),
    ("INVALID_ARGUMENT", 3, StatusCode.UNSET), ("RESOURCE_EXHAUSTED", 8, StatusCode.UNSET),
    ("DEADLINE_EXCEEDED", 4, StatusCode.ERROR), ("INTERNAL", 13, StatusCode.ERROR),
    ("UNAVAILABLE", 14, StatusCode.ERROR), ("NOT_A_CODE", 2, StatusCode.ERROR),
])
def test_only_a_servers_fault_marks_its_span_an_error(code: str, number: int, status: StatusCode) -> None:
    # Every code but OK was an ERROR (a client's cancel, a bad request) and the
    # code was its name, where the conventions want its number.
    exporter = InMemorySpanExporter()
    tracer = Tracer(exporter, batch=False)
    now = time.monotonic()
    span = tracer.start("stencil.v1.Generation/Generate", None, now, {"rpc.system": "grpc"})
    tracer.finish(span, now + 0.01, code, [], {})
    [done] = exporter.get_finished_spans()
    assert done.attributes is not None and done.attributes["rpc.grpc.status_code"] == number
    assert done.status.status_code is status
    tracer.close()
