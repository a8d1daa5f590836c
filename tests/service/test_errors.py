"""Status mapping: ServiceError with ErrorInfo/BadRequest/RetryInfo details, bugs as INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc._cython.cygrpc import ExecuteBatchError

from service.errors import (
    ERROR_DOMAIN,
    REQUEST_ID_METADATA,
    Reason,
    ServiceError,
    bad_request_violations,
    current_request_id,
    error_reason,
    invalid_argument,
    rpc_guard,
    status_details,
    unavailable,
)


class FakeContext:
    """Records what a handler aborts with (grpc's abort raises; so does this)."""

    def __init__(self) -> None:
        self.aborted: tuple[Any, ...] | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.aborted = (code, details, tuple(trailing_metadata))
        raise grpc.aio.AbortError()


class Servicer:
    @rpc_guard
    async def Bad(self, request: Any, context: Any) -> None:
        raise invalid_argument("sampling.top_p", "must be in (0, 1], got 2")

    @rpc_guard
    async def Bug(self, request: Any, context: Any) -> None:
        raise KeyError("secret internal detail")

    @rpc_guard
    async def Fine(self, request: Any, context: Any) -> str:
        return "ok"

    @rpc_guard
    async def Named(self, request: Any, context: Any) -> None:
        current_request_id.set("req-7")
        raise unavailable("the server is shutting down", Reason.DRAINING)

    @rpc_guard
    async def BugOnBrokenCall(self, request: Any, context: Any) -> None:
        raise KeyError("secret")


    @rpc_guard
    async def WriteToALeftClient(self, request: Any, context: Any) -> None:
        # What grpc raises from a write the client left during (flow control held it).
        raise ExecuteBatchError('Failed "execute_batch"')


class BrokenContext(FakeContext):
    """A call that already failed: grpc refuses to abort it again."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise RuntimeError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS")


def call(name: str, ctx: FakeContext | None = None) -> FakeContext:
    ctx = ctx or FakeContext()
    with contextlib.suppress(grpc.aio.AbortError):
        asyncio.run(getattr(Servicer(), name)(None, ctx))
    return ctx


def test_invalid_argument_carries_bad_request() -> None:
    code, details, metadata = call("Bad").aborted  # type: ignore[misc]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "sampling.top_p: must be in (0, 1], got 2"
    assert bad_request_violations(metadata) == [("sampling.top_p", "must be in (0, 1], got 2")]
    assert error_reason(metadata) == Reason.INVALID_FIELD
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status_details(metadata).details)  # type: ignore[union-attr]
    assert bad.field_violations[0].reason == Reason.INVALID_FIELD


def test_bugs_become_internal_without_details(caplog: pytest.LogCaptureFixture) -> None:
    code, details, metadata = call("Bug").aborted  # type: ignore[misc]
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in details and "Traceback" not in details
    assert error_reason(metadata) == Reason.INTERNAL
    assert "secret" not in str(status_details(metadata))
    assert "secret internal detail" in caplog.text, "the server log keeps the traceback"


def test_an_internal_error_on_a_broken_call_does_not_raise_again() -> None:
    asyncio.run(Servicer().BugOnBrokenCall(None, BrokenContext()))  # returns quietly


def test_a_write_to_a_client_that_left_is_a_cancellation_not_a_bug(caplog: pytest.LogCaptureFixture) -> None:
    # It was logged as an internal error with a traceback, and the call
    # counted INTERNAL, for an ordinary client cancel or deadline.
    ctx = FakeContext()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(Servicer().WriteToALeftClient(None, ctx))
    assert ctx.aborted is None
    assert "internal error" not in caplog.text


def test_success_passes_through() -> None:
    assert asyncio.run(Servicer().Fine(None, FakeContext())) == "ok"


def test_every_error_has_a_reason_and_retryable_ones_a_retry_delay() -> None:
    err = ServiceError(grpc.StatusCode.UNAVAILABLE, "draining", Reason.DRAINING)
    status = status_details(err.trailing_metadata())
    assert status is not None and status.code == grpc.StatusCode.UNAVAILABLE.value[0]
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert any(d.Unpack(info) for d in status.details) and info.domain == ERROR_DOMAIN
    assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.ToNanoseconds() > 0
    plain = status_details(ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no", Reason.NO_CHAT_TEMPLATE)
                           .trailing_metadata())
    assert plain is not None and not any(d.Unpack(retry) for d in plain.details)
    assert bad_request_violations(None) == []


def test_failures_carry_the_request_id() -> None:
    code, _, metadata = call("Named").aborted  # type: ignore[misc]
    assert code == grpc.StatusCode.UNAVAILABLE
    assert (REQUEST_ID_METADATA, "req-7") in metadata
    assert error_reason(metadata) == Reason.DRAINING


def test_every_reason_is_in_the_api_reference() -> None:
    # Clients branch on the reason: one the reference does not list is one they cannot handle.
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    reasons = [v for k, v in vars(Reason).items() if k.isupper()]
    assert len(reasons) > 20
    assert [r for r in reasons if f"`{r}`" not in reference] == []
