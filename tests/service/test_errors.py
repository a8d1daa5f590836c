"""Status mapping: ServiceError with BadRequest details, bugs as INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest

from service.errors import ServiceError, bad_request_violations, invalid_argument, rpc_guard


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


def call(name: str) -> FakeContext:
    ctx = FakeContext()
    with contextlib.suppress(grpc.aio.AbortError):
        asyncio.run(getattr(Servicer(), name)(None, ctx))
    return ctx


def test_invalid_argument_carries_bad_request() -> None:
    code, details, metadata = call("Bad").aborted  # type: ignore[misc]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "sampling.top_p: must be in (0, 1], got 2"
    assert bad_request_violations(metadata) == [("sampling.top_p", "must be in (0, 1], got 2")]


def test_bugs_become_internal_without_details(caplog: pytest.LogCaptureFixture) -> None:
    code, details, metadata = call("Bug").aborted  # type: ignore[misc]
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in details and "Traceback" not in details
    assert metadata == ()
    assert "secret internal detail" in caplog.text, "the server log keeps the traceback"


def test_success_passes_through() -> None:
    assert asyncio.run(Servicer().Fine(None, FakeContext())) == "ok"


def test_plain_service_error_has_no_details() -> None:
    err = ServiceError(grpc.StatusCode.UNAVAILABLE, "draining")
    assert err.trailing_metadata() == ()
    assert bad_request_violations(None) == []
