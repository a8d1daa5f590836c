"""gRPC status errors: the codes of the README's table, BadRequest details, no tracebacks.

Handlers raise `ServiceError`; the `rpc_guard` decorator turns it into a status
(with a `google.rpc.BadRequest` for invalid arguments) and turns anything else
into INTERNAL with a generic message, logging the traceback on the server only.
grpc would otherwise answer UNKNOWN with the exception text.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from .request_log import call_metadata

log = logging.getLogger(__name__)

# Trailing-metadata key of the rich status (google.rpc.Status), as grpcio-status reads it.
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ServiceError(Exception):
    """An error to report to the client as a gRPC status.

    `violations` are (field path, description) pairs sent as a BadRequest.
    """

    def __init__(self, code: grpc.StatusCode, message: str,
                 violations: Sequence[tuple[str, str]] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = tuple(violations)

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        if not self.violations:
            return ()
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
            for f, d in self.violations
        ])
        detail = any_pb2.Any()
        detail.Pack(bad)
        status = status_pb2.Status(code=self.code.value[0], message=self.message, details=[detail])
        return ((STATUS_DETAILS_KEY, status.SerializeToString()),)

    async def abort(self, context: grpc.aio.ServicerContext) -> NoReturn:
        # The request id goes with every failure (x-request-id), even one before any stream.
        await context.abort(self.code, self.message,
                            trailing_metadata=self.trailing_metadata() + call_metadata())
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def invalid_argument(field: str, description: str) -> ServiceError:
    """INVALID_ARGUMENT whose BadRequest names `field` (a path like "sampling.top_p")."""
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {description}",
                        [(field, description)])


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def resource_exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def internal(message: str = "internal error; see the server log") -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, message)


def bad_request_violations(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, str]]:
    """The BadRequest field violations in a call's trailing metadata (for clients and tests)."""
    for key, value in metadata or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            out = []
            for detail in status.details:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad):
                    out += [(v.field, v.description) for v in bad.field_violations]
            return out
    return []


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def rpc_guard(method: Handler) -> Handler:
    """Map a servicer method's failures to statuses: ServiceError as given, bugs to INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except ServiceError as err:
            await err.abort(context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise  # an abort already under way, or the call ended (cancel, deadline)
        except Exception:
            log.exception("internal error in %s", method.__name__)
            await internal().abort(context)

    return wrapper  # type: ignore[return-value]
