"""The one line on `stencild.requests` that every finished call leaves, over both
protocols: vLLM's engine protocol (the path every routed request takes) as
well as stencil.v1, and calls cut short by their client or their deadline,
whose line reports what they had consumed and produced by then."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
import pytest

from grammar import BACKENDS
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

from .helpers import TIMEOUT, ServerHandle, engine_factory, greedy

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
PROMPT = list(range(5, 30))


def _records(caplog: pytest.LogCaptureFixture, **match: Any) -> list[logging.LogRecord]:
    """The request lines whose fields include `match`, once there is one: a
    call's line is written as it ends on the server, which may be just after
    its client saw the status."""
    deadline = time.monotonic() + 10
    while True:
        found = [r for r in caplog.records if r.name == "stencild.requests"
                 and all(r.fields.get(k) == v for k, v in match.items())]  # type: ignore[attr-defined]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def _line(caplog: pytest.LogCaptureFixture, level: int = logging.INFO, **match: Any) -> dict[str, Any]:
    [record] = _records(caplog, **match)
    assert record.levelno == level, (logging.getLevelName(record.levelno), record.getMessage())
    fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
    return fields


def _vreq(rid: str, ids: list[int], max_tokens: int = 4, stream: bool = False,
          **params: Any) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream)
    req.sampling_params.max_tokens = max_tokens
    req.sampling_params.temperature = params.pop("temperature", 0.0)
    for name, value in params.items():
        setattr(req.sampling_params, name, value)
    return req


def _stub(handle: ServerHandle) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(handle.channel)


# -- vllm.grpc.engine.VllmEngine ------------------------------------------------
def test_a_vllm_generate_leaves_a_line(server: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    [msg] = list(_stub(server).Generate(_vreq("router-7f3a", PROMPT), metadata=TRACEPARENT, timeout=TIMEOUT))
    done = msg.complete
    line = _line(caplog, request_id="router-7f3a")
    assert line["service"] == "VllmEngine" and line["method"] == "Generate" and line["status"] == "OK"
    assert line["prompt_tokens"] == len(PROMPT) == done.prompt_tokens
    assert line["completion_tokens"] == 4 == done.completion_tokens
    assert line["cached_tokens"] == done.cached_tokens
    assert line["finish_reason"] == "length" and line["ttft_ms"] > 0 and line["total_ms"] >= line["ttft_ms"]
    assert line["trace_id"] == TRACE_ID and line["peer"].startswith("ipv4:127.0.0.1:")
    assert "constraint" not in line and "n" not in line


@pytest.mark.parametrize("kind, value", [("regex", "(yes|no), [a-z]{2,4}"),
                                         ("json_schema", '{"type": "object", "properties": '
                                                         '{"a": {"type": "integer"}}, "required": ["a"]}')])
def test_a_constrained_vllm_generate_names_its_constraint(server: ServerHandle, caplog: pytest.LogCaptureFixture,
                                                          kind: str, value: str) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    rid = f"constrained-{kind}"
    constraint: dict[str, Any] = {kind: value}
    list(_stub(server).Generate(_vreq(rid, PROMPT, max_tokens=12, **constraint), timeout=TIMEOUT))
    line = _line(caplog, request_id=rid)
    assert line["status"] == "OK" and line["constraint"] == kind
    assert line["backend"] in BACKENDS
    assert line["forced_tokens"] >= 0 and "trace_id" not in line


def test_vllm_n_sequences_leave_one_line(server: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    req = _vreq("router-n3", PROMPT, max_tokens=4, temperature=1.0, seed=5, n=3)
    done = [m.complete for m in _stub(server).Generate(req, timeout=TIMEOUT)]
    assert len(done) == 3
    line = _line(caplog, request_id="router-n3")
    assert line["status"] == "OK" and line["n"] == 3
    assert line["prompt_tokens"] == len(PROMPT)
    assert line["completion_tokens"] == sum(d.completion_tokens for d in done)
    reasons = [d.finish_reason for d in sorted(done, key=lambda d: d.index)]
    assert line["finish_reason"] in ("length", ",".join("eos" if r == "stop" else r for r in reasons))


def test_vllm_unary_calls_leave_lines(server: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="stencild.requests")
    stub = _stub(server)
    stub.GetLoads(vpb.GetLoadsRequest(), metadata=(("x-request-id", "loads-1"), *TRACEPARENT), timeout=TIMEOUT)
    line = _line(caplog, request_id="loads-1")
    assert line["service"] == "VllmEngine" and line["method"] == "GetLoads" and line["status"] == "OK"
    assert line["trace_id"] == TRACE_ID
    stub.GetModelInfo(vpb.GetModelInfoRequest(), metadata=(("x-request-id", "info-1"),), timeout=TIMEOUT)
    assert _line(caplog, request_id="info-1")["method"] == "GetModelInfo"
    # Health checks, polled by routers, are at DEBUG (as grpc.health.v1's are).
    stub.HealthCheck(vpb.HealthCheckRequest(), metadata=(("x-request-id", "health-1"),), timeout=TIMEOUT)
    assert _line(caplog, logging.DEBUG, request_id="health-1")["method"] == "HealthCheck"


def test_a_refused_vllm_generate_leaves_a_line(server: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    bad = _vreq("router-bad", PROMPT, top_p=2.0)
    with pytest.raises(grpc.RpcError) as err:
        list(_stub(server).Generate(bad, timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    line = _line(caplog, request_id="router-bad")
    assert line["status"] == "INVALID_ARGUMENT" and "completion_tokens" not in line


# -- calls cut short ----------------------------------------------------------
def _long(rid: str) -> pb.GenerateRequest:
    # 20 ms per step on the slow server: 400 tokens take at least 8 s.
    req = greedy(None, max_new_tokens=400, request_id=rid)
    req.token_ids.ids.extend(PROMPT)
    req.stopping.ignore_eos = True
    return req


def _streamed_then_cut(calls: Any, tokens_of: Any, cut: Any = None) -> int:
    """Read a stream until it has given 10 tokens, cut it with `cut` (else wait
    for its deadline); the tokens it gave."""
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in calls:
            seen += tokens_of(msg)
            if seen >= 10 and cut is not None:
                cut()
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert seen >= 10
    return seen


def _settled(server: ServerHandle) -> None:
    """The cut request's abort has reached the engine: the shared slow server's
    counters are final before the next test reads them."""
    server.wait_pending(0)
    assert server.wait_no_pages() == (0, 0)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_cut_stencil_generate_logs_what_it_produced(slow_server: ServerHandle, caplog: pytest.LogCaptureFixture,
                                                      how: str) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    rid = f"cut-stencil-{how}"
    call = slow_server.stub.Generate(_long(rid), timeout=TIMEOUT if how == "cancel" else 1.5)
    seen = _streamed_then_cut(call, lambda m: len(m.chunk.token_ids), call.cancel if how == "cancel" else None)
    line = _line(caplog, request_id=rid)
    assert line["status"] == ("CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED")
    assert line["prompt_tokens"] == len(PROMPT)
    assert seen <= line["completion_tokens"] < 400
    _settled(slow_server)
    assert "cached_tokens" in line and line["ttft_ms"] > 0


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_cut_vllm_generate_logs_what_it_produced(slow_server: ServerHandle, caplog: pytest.LogCaptureFixture,
                                                   how: str) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    rid = f"cut-vllm-{how}"
    req = _vreq(rid, PROMPT, max_tokens=400, stream=True, ignore_eos=True)
    call = _stub(slow_server).Generate(req, timeout=TIMEOUT if how == "cancel" else 1.5)
    cached: list[int] = []

    def tokens_of(msg: vpb.GenerateResponse) -> int:
        cached.append(msg.chunk.cached_tokens)
        return len(msg.chunk.token_ids)

    seen = _streamed_then_cut(call, tokens_of, call.cancel if how == "cancel" else None)
    line = _line(caplog, request_id=rid)
    assert line["service"] == "VllmEngine" and line["cached_tokens"] == cached[-1]
    assert line["status"] == ("CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED")
    assert line["prompt_tokens"] == len(PROMPT)
    assert seen <= line["completion_tokens"] < 400
    _settled(slow_server)


@pytest.mark.parametrize("protocol", ["stencil.v1", "vllm"])
def test_a_cut_paced_stream_logs_the_tokens_it_was_sent(make_server, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
                                                        protocol: str) -> None:
    # One message a second: the engine runs ahead of what the client is sent.
    # The line counted every token delivered to the call, sent or not.
    caplog.set_level(logging.INFO, logger="stencild.requests")
    server = make_server(engine_factory(slow_s=0.02), stream_messages_per_s=1.0)
    rid = f"paced-{protocol}"
    if protocol == "vllm":
        call = _stub(server).Generate(_vreq(rid, PROMPT, max_tokens=400, stream=True, ignore_eos=True), timeout=2.5)
    else:
        call = server.stub.Generate(_long(rid), timeout=2.5)
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in call:
            seen += len(msg.chunk.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    line = _line(caplog, request_id=rid)
    assert line["status"] == "DEADLINE_EXCEEDED"
    assert line["completion_tokens"] == seen > 0
    server.wait_pending(0)
