"""Request log lines, their formats, request ids and W3C trace context parsing."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from types import SimpleNamespace

import pytest

from service.gen.stencil.v1 import embed_pb2
from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.request_log import (
    CallContextFilter,
    CallRecord,
    JsonFormatter,
    RequestStats,
    TextFormatter,
    assign_request_id,
    call_metadata,
    configure_logging,
    enter_call,
    exit_call,
    level_of,
    log_call,
    log_fields,
    note_compile,
    note_refusal,
    note_request,
    note_validation,
    valid_request_id,
)
from service.ops.tracing import parse_traceparent, trace_context

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize("header, ok", [
    (f"00-{TRACE}-{PARENT}-01", True),
    (f"00-{TRACE}-{PARENT}-00", True),
    (f"01-{TRACE}-{PARENT}-01-future-field", True),  # later versions may add fields
    (f"00-{TRACE}-{PARENT}-01-extra", False),  # version 00 may not
    (f"ff-{TRACE}-{PARENT}-01", False),
    (f"00-{'0' * 32}-{PARENT}-01", False),
    (f"00-{TRACE}-{'0' * 16}-01", False),
    (f"00-{TRACE.upper()}-{PARENT}-01", False),
    ("00-abc-def-01", False),
    ("", False),
])
def test_traceparent_parsing(header: str, ok: bool) -> None:
    parsed = parse_traceparent(header)
    assert (parsed is not None) == ok
    if parsed is not None:
        assert parsed.trace_id == TRACE and parsed.parent_id == PARENT
        assert parsed.sampled == header.split("-")[3].startswith("01")


def test_trace_context_reads_metadata() -> None:
    parent = trace_context((("traceparent", f"00-{TRACE}-{PARENT}-01"), ("tracestate", "a=1"),
                            ("tracestate", "b=2")))
    assert parent is not None and parent.tracestate == "a=1,b=2"
    assert trace_context((("x-other", "1"),)) is None
    # Two traceparents: invalid, a new trace starts (the last one used to win).
    good = ("traceparent", f"00-{TRACE}-{PARENT}-01")
    assert trace_context((good, ("traceparent", f"00-{'1' * 32}-{PARENT}-01"))) is None
    # A malformed tracestate is dropped, not handed on (OpenTelemetry logged a
    # warning per call echoing it); well-formed vendor members are kept.
    for bad in ("not a member", "A=1", "k=a,b", "k=" + "v" * 257, ",".join(f"k{i}=v" for i in range(33)),
                "1attacker=x"):  # a simple key starts with a letter (a tenant's may not)
        parent = trace_context((good, ("tracestate", bad)))
        assert parent is not None and parent.tracestate == "", bad
    parent = trace_context((good, ("tracestate", "congo=t61rcWkgMzE, 1tenant@rojo=00f067aa0ba902b7")))
    assert parent is not None and parent.tracestate == "congo=t61rcWkgMzE,1tenant@rojo=00f067aa0ba902b7"


def test_request_ids() -> None:
    own = pb.GenerateRequest(request_id="mine")
    assert assign_request_id(own, (("x-request-id", "gateway"),)) == "mine"
    # A gateway's id names one of its requests, not one of ours: calls that
    # share it get ids of their own (a second used to be ALREADY_EXISTS).
    empty, again = pb.GenerateRequest(), pb.GenerateRequest()
    rid = assign_request_id(empty, (("x-request-id", "gateway"),))
    assert re.fullmatch(r"gateway-[0-9a-f]{8}", rid)
    assert empty.request_id == rid, "the servicer sees the same id"
    assert assign_request_id(again, (("x-request-id", "gateway"),)) != rid
    long = "g" * 128
    assert valid_request_id(assign_request_id(pb.GenerateRequest(), (("x-request-id", long),)))
    # A call that starts no engine request keeps the gateway's id for its line.
    assert assign_request_id(pb.TokenizeRequest(), (("x-request-id", "gateway"),)) == "gateway"
    fresh = pb.GenerateRequest()
    rid = assign_request_id(fresh, ())
    assert len(rid) == 32 and fresh.request_id == rid
    # An id the servicer will refuse is left for it to refuse; the log gets a printable one.
    bad = pb.GenerateRequest(request_id="bad\nid")
    logged = assign_request_id(bad, ())
    assert logged != "bad\nid" and bad.request_id == "bad\nid"
    # Requests without a request_id field (Embed) still get an id for their log line.
    assert len(assign_request_id(embed_pb2.EmbedRequest(inputs=["a"]), ())) == 32


def _record() -> CallRecord:
    return CallRecord("/stencil.v1.Generation/Generate", "req-1", "ipv4:127.0.0.1:5000", 0.0,
                      code="INVALID_ARGUMENT", end=0.25, trace_id=TRACE)


def _capture(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(CallContextFilter())
    logger = logging.getLogger("stencild.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, out


def test_a_request_id_with_a_space_cannot_fake_a_field_on_other_lines() -> None:
    logger, out = _capture(TextFormatter())
    record = _record()
    record.request_id = "x trace_id=forged"
    token = enter_call(record)
    try:
        logging.getLogger("stencild.requests").info("a line logged during the call")
    finally:
        exit_call(token)
        logger.handlers.clear()
    assert '[request_id="x trace_id=forged" trace_id=' in out.getvalue()


def test_text_and_json_lines() -> None:
    for formatter in (TextFormatter(), JsonFormatter()):
        logger, out = _capture(formatter)
        try:
            log_call(_record(), logging.INFO)
        finally:
            logger.handlers.clear()
        text = out.getvalue().strip()
        if isinstance(formatter, JsonFormatter):
            line = json.loads(text)
            assert line["request_id"] == "req-1" and line["status"] == "INVALID_ARGUMENT"
            assert line["method"] == "Generate" and line["total_ms"] == 250.0
            assert line["trace_id"] == TRACE and line["peer"] == "ipv4:127.0.0.1:5000"
        else:
            assert ("request_id=req-1 service=Generation method=Generate status=INVALID_ARGUMENT "
                    "total_ms=250.0") in text
            assert f"trace_id={TRACE}" in text


def test_lines_logged_during_a_call_name_it() -> None:
    logger, out = _capture(JsonFormatter())
    other = logging.getLogger("stencild.requests.test")
    token = enter_call(_record())
    try:
        note_refusal("max_pending_requests")
        assert call_metadata() == (("x-request-id", "req-1"),)
        other.warning("something about %s", "this call")
    finally:
        exit_call(token)
        logger.handlers.clear()
    line = json.loads(out.getvalue())
    assert line["message"] == "something about this call"
    assert line["request_id"] == "req-1" and line["trace_id"] == TRACE
    assert call_metadata() == ()


def test_configure_logging_rejects_unknown_formats() -> None:
    with pytest.raises(ValueError):
        configure_logging("INFO", "xml")


def test_schema_validation_is_in_the_log_line() -> None:
    record = _record()
    token = enter_call(record)
    try:
        note_validation("invalid", "uniqueItems", "/tags", ("not", "uniqueItems"))
    finally:
        exit_call(token)
    fields = log_fields(record)
    assert fields["schema"] == "invalid"
    assert fields["schema_error"] == "uniqueItems@/tags"
    assert fields["unenforced"] == "not,uniqueItems"
    plain = _record()
    assert "schema" not in log_fields(plain)


def test_levels() -> None:
    for method in ("/stencil.v1.Generation/Generate", "/stencil.v1.Embeddings/Embed",
                   "/vllm.grpc.engine.VllmEngine/Generate", "/vllm.grpc.engine.VllmEngine/GetLoads"):
        assert level_of(method) == logging.INFO, method
    for method in ("/grpc.health.v1.Health/Check", "/vllm.grpc.engine.VllmEngine/HealthCheck",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert level_of(method) == logging.DEBUG, method


def _stats(prompt: int, completion: int, reason: str | None, ttft: float | None = None,
           constraint: bool = False, forced: int = 0) -> RequestStats:
    matcher = SimpleNamespace(spec=SimpleNamespace(kind="regex"), backend="xgrammar") if constraint else None
    times = SimpleNamespace(arrival=1.0, scheduled=1.5)
    return RequestStats(SimpleNamespace(matcher=matcher, times=times), 0.0,  # type: ignore[arg-type]
                        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=8,
                        forced_tokens=forced, finish_reason=reason, ttft=ttft)


def test_n_sequences_make_one_line() -> None:
    record = CallRecord("/vllm.grpc.engine.VllmEngine/Generate", "router-1", "ipv4:127.0.0.1:5000", 0.0,
                        code="OK", end=1.0)
    token = enter_call(record)
    try:
        for stats in (_stats(25, 4, "length", 0.2, True, 1), _stats(25, 2, "eos", 0.3, True, 2),
                      _stats(25, 4, "length", None, True, 0)):
            note_request(stats)
    finally:
        exit_call(token)
    fields = log_fields(record)
    assert fields["service"] == "VllmEngine" and fields["method"] == "Generate"
    assert fields["n"] == 3 and fields["prompt_tokens"] == 25 and fields["cached_tokens"] == 8
    assert fields["completion_tokens"] == 10 and fields["forced_tokens"] == 3
    assert fields["constraint"] == "regex" and fields["backend"] == "xgrammar"
    assert fields["ttft_ms"] == 200.0 and fields["queue_ms"] == 500.0
    assert fields["finish_reason"] == "length,eos,length"
    record.requests = [_stats(25, 4, "length"), _stats(25, 4, "length")]
    assert log_fields(record)["finish_reason"] == "length"
    record.requests = [_stats(25, 4, "length"), _stats(25, 1, None)]  # cut short: one still ran
    assert log_fields(record)["finish_reason"] == "length,-"
    cut = _stats(25, 3, None)  # delivered 3 tokens, of which the client was sent 2
    cut.sent_completion_tokens = 2
    record.requests = [cut]
    fields = log_fields(record)
    assert "finish_reason" not in fields and "n" not in fields and fields["completion_tokens"] == 2


def test_a_call_keeps_its_first_compile() -> None:
    """vLLM's n > 1 compiles a matcher per sequence, all but the first cache hits:
    the log line, metrics and span reported the last, a hit, for a call that
    waited for a full compile."""
    record = _record()
    token = enter_call(record)
    try:
        note_compile("json_schema", "xgrammar", time.monotonic() - 0.25, "compiled", cached=False)
        for _ in range(2):
            note_compile("json_schema", "xgrammar", time.monotonic(), "compiled", cached=True)
    finally:
        exit_call(token)
    assert record.compile is not None and not record.compile.cached
    assert log_fields(record)["compile_ms"] >= 250


def test_grpc_failing_to_answer_a_client_that_left_is_no_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    # grpc logged it at ERROR with a traceback: a client refusing a large
    # answer (its own 4 MiB limit) put one in the server's log each time.
    from grpc._cython.cygrpc import ExecuteBatchError

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("INFO", "text")
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        try:
            raise ExecuteBatchError('Failed "execute_batch"')
        except ExecuteBatchError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [Tokenize]")
        grpc_log.error("a grpc error of another kind")
        err = capsys.readouterr().err
        assert "servicer method" not in err and "Traceback" not in err
        assert "a grpc error of another kind" in err
        configure_logging("DEBUG", "text")  # kept, as one line, at DEBUG
        try:
            raise ExecuteBatchError('Failed "execute_batch"')
        except ExecuteBatchError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [Embed]")
        err = capsys.readouterr().err
        assert "servicer method [Embed]" in err and "DEBUG" in err and "Traceback" not in err
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
