"""What clients in other languages and a hostile harness found: unparsable
payloads, request ids that cannot be a header, machine-readable errors, and a
keepalive policy that disconnected pinging clients."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.errors import (
    REQUEST_ID_METADATA,
    Reason,
    bad_request_violations,
    error_reason,
    status_details,
)
from service.gen.stencil.v1 import embed_pb2, embed_pb2_grpc
from service.gen.stencil.v1 import generate_pb2 as pb
from service.server import KeepalivePolicy

from .helpers import TIMEOUT, ServerHandle, engine_factory, generate, greedy

GARBAGE = b"\xff\xff\xff\x0f\x12garbage\x00\x01"


def raw_call(handle: ServerHandle, method: str, payload: bytes) -> grpc.RpcError:
    call = handle.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        call(payload, timeout=TIMEOUT)
    return info.value  # type: ignore[return-value]


def test_an_unparsable_request_is_invalid_argument_and_logged_once(server: ServerHandle,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="service.interceptors")
    methods = ["/stencil.v1.Generation/Tokenize", "/stencil.v1.Generation/Generate",
               "/stencil.v1.Embeddings/Embed", "/grpc.health.v1.Health/Check"]
    for i in range(20):
        err = raw_call(server, methods[i % len(methods)], GARBAGE)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details() == "request could not be parsed"
        assert error_reason(err.trailing_metadata()) == Reason.UNPARSABLE_REQUEST
    lines = [r for r in caplog.records if "could not be parsed" in r.getMessage()]
    assert 1 <= len(lines) <= 2, "one line per period, not one (and a traceback) per call"
    assert not any(r.exc_info for r in caplog.records)
    # The server is untouched.
    assert server.stub.Tokenize(pb.TokenizeRequest(text="still fine"), timeout=TIMEOUT).token_ids


@pytest.mark.parametrize("rid", ["req-é", " leading", "trailing ", "tab\there", "x" * 300])
def test_a_request_id_that_cannot_be_a_header_is_refused(server: ServerHandle, rid: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(server.stub, greedy("hi", 2, request_id=rid))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()  # type: ignore[attr-defined]
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["request_id"]  # type: ignore[attr-defined]


def test_failures_carry_their_request_id_and_reason(server: ServerHandle) -> None:
    req = greedy("hi", 2, request_id="my req 1")  # inner spaces are fine
    req.sampling.top_p = 5.0
    with pytest.raises(grpc.RpcError) as info:
        generate(server.stub, req)
    metadata = info.value.trailing_metadata()  # type: ignore[attr-defined]
    assert (REQUEST_ID_METADATA, "my req 1") in metadata
    assert error_reason(metadata) == Reason.INVALID_FIELD
    status = status_details(metadata)
    assert status is not None and status.message == info.value.details()  # type: ignore[attr-defined]


def test_errors_say_why_in_a_stable_reason(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(engine_factory(slow_s=0.05), max_pending_requests=1)
    with pytest.raises(grpc.RpcError) as info:
        embed_pb2_grpc.EmbeddingsStub(handle.channel).Embed(embed_pb2.EmbedRequest(inputs=["x"]), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert error_reason(info.value.trailing_metadata()) == Reason.NO_EMBEDDING_MODEL  # type: ignore[attr-defined]
    busy = handle.stub.Generate(greedy("busy", 200), timeout=TIMEOUT)
    next(iter(busy))
    with pytest.raises(grpc.RpcError) as info:
        generate(handle.stub, greedy("one more", 2))
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    metadata = err.trailing_metadata()  # type: ignore[attr-defined]
    assert error_reason(metadata) == Reason.QUEUE_FULL
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in status_details(metadata).details)  # type: ignore[union-attr]
    busy.cancel()


def _idle_stream_lasts(address: str, ping_every_s: float, watch_s: float) -> str | None:
    """Watch health on an idle stream from a client that pings every
    `ping_every_s` (as a mesh sidecar does); None if the stream is still open
    after `watch_s`, else how it was cut."""
    options = [("grpc.keepalive_time_ms", int(ping_every_s * 1000)), ("grpc.keepalive_timeout_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    with grpc.insecure_channel(address, options=options) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            if watch.done():
                return f"{watch.code()} {watch.details()}"
            time.sleep(0.1)
        watch.cancel()
        return None


def test_a_client_pinging_as_often_as_the_policy_allows_stays_connected(
        make_server: Callable[..., ServerHandle]) -> None:
    # grpc's default server policy (one ping per 5 minutes without data) answered
    # a client pinging every 10 s, a common mesh setting, with a too-many-pings
    # GOAWAY after about 40 s (two strikes). Ours accepts pings down to
    # min_ping_interval_s (5 s by default, under the mesh's 10). Checked at a tenth
    # of the scale: pinging every second for 8 s is eight pings against a policy of
    # one a second, four times what grpc's strikes allow.
    assert KeepalivePolicy().min_ping_interval_s <= 10
    allowed = make_server(keepalive=KeepalivePolicy(min_ping_interval_s=1.0))
    assert _idle_stream_lasts(allowed.address, ping_every_s=1.0, watch_s=8.0) is None
    # The same client against a policy five times stricter is cut within seconds:
    # what the test above would see if the server's options did not reach grpc.
    strict = make_server(keepalive=KeepalivePolicy(min_ping_interval_s=5.0))
    cut = _idle_stream_lasts(strict.address, ping_every_s=1.0, watch_s=8.0)
    assert cut is not None and "ping" in cut.lower(), cut


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_in_both_versions(server: ServerHandle, version: str) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as rpb  # v1 is the same on the wire

    call = server.channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                        request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                        response_deserializer=rpb.ServerReflectionResponse.FromString)
    requests = [rpb.ServerReflectionRequest(list_services=""),
                rpb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
                rpb.ServerReflectionRequest(file_containing_symbol="stencil.v1.Generation")]
    listed, v1_file, ours = list(call(iter(requests), timeout=TIMEOUT))
    names = {s.name for s in listed.list_services_response.service}
    assert {"stencil.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in v1_file.file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "grpc.reflection.v1" and f.service[0].name == "ServerReflection" for f in files)
    assert ours.file_descriptor_response.file_descriptor_proto
