"""A request whose client cancels, disconnects or runs out of time is aborted in
the engine and its KV pages freed; Abort does the same by id."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.ops.telemetry import TelemetryConfig

from .helpers import TIMEOUT, ServerHandle, generate, greedy, hold_compiles
from .metrics_helpers import wait_for

Finish = pb.GenerateComplete.FinishReason


def _long_request(text: str, **fields: object) -> pb.GenerateRequest:
    # 20 ms per step on the slow server: 400 tokens take at least 8 s.
    req = greedy(text, max_new_tokens=400, **fields)
    req.stopping.ignore_eos = True
    return req


def _assert_aborted(server: ServerHandle, cancelled_before: int) -> None:
    assert server.wait_no_pages() == (0, 0), "the aborted request still holds KV pages"
    server.wait_pending(0)
    assert server.finished.get("cancelled", 0) == cancelled_before + 1, \
        "the request was not aborted in the engine"
    server.engine_call(lambda e: e.allocator.check_consistency())


def test_cancel_mid_stream_frees_pages(slow_server: ServerHandle) -> None:
    before = slow_server.finished.get("cancelled", 0)
    call = slow_server.stub.Generate(_long_request("cancel me"), timeout=TIMEOUT)
    next(call)
    next(call)
    assert slow_server.pages_in_use() != (0, 0), "the request holds pages while it runs"
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    _assert_aborted(slow_server, before)


def test_deadline_expiry_frees_pages(slow_server: ServerHandle) -> None:
    before = slow_server.finished.get("cancelled", 0)
    call = slow_server.stub.Generate(_long_request("too slow"), timeout=3.0)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_aborted(slow_server, before)


def test_client_disconnect_frees_pages(slow_server: ServerHandle) -> None:
    before = slow_server.finished.get("cancelled", 0)
    channel = grpc.insecure_channel(slow_server.address)
    call = pb_grpc.GenerationStub(channel).Generate(_long_request("going away"), timeout=TIMEOUT)
    next(call)
    channel.close()  # the connection goes away with the stream still open
    _assert_aborted(slow_server, before)


def test_abort_by_id(slow_server: ServerHandle) -> None:
    stub = slow_server.stub
    before = slow_server.finished.get("cancelled", 0)
    call = stub.Generate(_long_request("abort me", request_id="abort-me-1"), timeout=TIMEOUT)
    first = next(call)
    assert first.request_id == "abort-me-1"
    resp = stub.Abort(pb.AbortRequest(request_ids=["abort-me-1", "no-such-request", "abort-me-1"]))
    assert list(resp.aborted_request_ids) == ["abort-me-1"]  # once, though named twice
    rest = list(call)
    assert rest[-1].HasField("complete")
    assert rest[-1].complete.finish_reason == Finish.CANCELLED
    assert rest[-1].complete.usage.completion_tokens < 400
    _assert_aborted(slow_server, before)


def test_an_id_may_be_used_again_as_soon_as_abort_answers(slow_server: ServerHandle) -> None:
    # Abort answered while the aborted request was still in the engine (it
    # leaves at the next step): a retry under its id got ALREADY_EXISTS.
    stub = slow_server.stub
    for attempt in range(3):
        call = stub.Generate(_long_request("abort then retry", request_id="retried"), timeout=TIMEOUT)
        next(call)
        resp = stub.Abort(pb.AbortRequest(request_ids=["retried"]), timeout=TIMEOUT)
        assert list(resp.aborted_request_ids) == ["retried"]
        _, tokens, done, _ = generate(stub, greedy("the retry", max_new_tokens=2, request_id="retried"))
        assert done.finish_reason == Finish.LENGTH and len(tokens) == 2, attempt
        assert list(call)[-1].complete.finish_reason == Finish.CANCELLED
    assert slow_server.wait_no_pages() == (0, 0)


def test_abort_with_server_assigned_id(slow_server: ServerHandle) -> None:
    stub = slow_server.stub
    call = stub.Generate(_long_request("abort me too"), timeout=TIMEOUT)
    rid = dict(call.initial_metadata())["x-request-id"]
    assert list(stub.Abort(pb.AbortRequest(request_ids=[rid])).aborted_request_ids) == [rid]
    assert list(call)[-1].complete.finish_reason == Finish.CANCELLED
    slow_server.wait_pending(0)
    assert slow_server.wait_no_pages() == (0, 0)
    # Aborting a finished request is a no-op.
    assert list(stub.Abort(pb.AbortRequest(request_ids=[rid])).aborted_request_ids) == []
    generate(stub, greedy("still serving", max_new_tokens=2))


def test_abort_while_the_constraint_compiles(make_server) -> None:  # type: ignore[no-untyped-def]
    # A router's Abort right after its Generate found no stream while the
    # constraint compiled: it answered [] and the request ran in full.
    server = make_server()
    compiling, release = hold_compiles(server)
    req = _long_request("compile me", request_id="early-abort")
    req.constraint.regex = "[a-z ]+"
    with ThreadPoolExecutor(2) as pool:
        call = pool.submit(lambda: list(server.stub.Generate(req, timeout=TIMEOUT)))
        assert compiling.wait(TIMEOUT)
        abort = pool.submit(server.stub.Abort, pb.AbortRequest(request_ids=["early-abort"]), timeout=TIMEOUT)
        time.sleep(0.1)
        release.set()  # the Abort answers once the call has left the engine
        assert list(abort.result(TIMEOUT).aborted_request_ids) == ["early-abort"]
        msgs = call.result(TIMEOUT)
    assert msgs[-1].complete.finish_reason == Finish.CANCELLED
    assert msgs[-1].complete.usage.completion_tokens < 400
    assert server.wait_no_pages() == (0, 0)
    generate(server.stub, greedy("still serving", max_new_tokens=2))


def test_a_cancel_while_a_write_waits_on_flow_control_is_no_internal_error(
        make_server, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    # A client that stops reading, then cancels: the server's blocked write
    # failed with grpc's batch error, which was logged as an internal error and
    # counted INTERNAL.
    server = make_server(telemetry=TelemetryConfig(metrics_port=0))
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]  # a 1 KiB window
    with grpc.insecure_channel(server.address, options=options) as channel:
        req = _long_request("slow " * 50, request_id="never-read")
        req.response.logprobs = 20
        req.response.prompt_logprobs = 20  # messages far over the window
        call = pb_grpc.GenerationStub(channel).Generate(req, timeout=TIMEOUT)
        # The engine runs ahead while the server's writes wait for the client.
        wait_for(server, lambda s: s.get("vllm:generation_tokens_total") >= 40)
        call.cancel()
    method = "stencil.v1.Generation/Generate"
    after = wait_for(server, lambda s: s.get("stencil_rpcs_total", method=method) >= 1)
    assert after.get("stencil_rpcs_total", method=method, code="CANCELLED") == 1
    assert "internal error" not in caplog.text
    assert server.wait_no_pages() == (0, 0)
