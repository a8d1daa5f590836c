"""gRPC status errors: stable reasons, google.rpc error details, no tracebacks.

Handlers raise `ServiceError`; the `rpc_guard` decorator turns it into a
status and turns anything else into INTERNAL with a generic message, logging
the traceback on the server only (grpc would otherwise answer UNKNOWN with the
exception text). Every non-OK status carries a `google.rpc.Status` in the
trailing metadata with:

- an `ErrorInfo` whose `reason` is a stable, machine-readable code (the
  `Reason` constants below; domain "stencil.dev"), for clients to branch on
  instead of parsing messages;
- a `BadRequest` naming the field(s) for INVALID_ARGUMENT, each violation with
  its reason;
- a `RetryInfo` for RESOURCE_EXHAUSTED and UNAVAILABLE (both are worth a retry);

and the call's `x-request-id`, when it has one, as trailing metadata too.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

# What grpc raises from an operation on a call whose client has gone. Not in
# grpc's public API, but grpcio is pinned, and grpc's own server loop reads it so.
from grpc._cython.cygrpc import ExecuteBatchError

from service.ops.request_log import REQUEST_ID_METADATA, current_call

log = logging.getLogger(__name__)

# Trailing-metadata key of the rich status (google.rpc.Status), as grpcio-status reads it.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "stencil.dev"
# How long a client should wait before retrying a RESOURCE_EXHAUSTED or UNAVAILABLE call.
RETRY_AFTER_S = 1.0


class Reason:
    """The stable `ErrorInfo.reason` of every error the server returns."""

    INVALID_FIELD = "INVALID_FIELD"  # a field's value (BadRequest names it)
    UNPARSABLE_REQUEST = "UNPARSABLE_REQUEST"  # the request bytes are not the message
    RESPONSE_TOO_LARGE = "RESPONSE_TOO_LARGE"  # the answer would be over the message limit
    GRAMMAR_INVALID = "GRAMMAR_INVALID"  # the constraint does not compile
    GRAMMAR_TOO_LARGE = "GRAMMAR_TOO_LARGE"  # ... or is too large for the limits
    GRAMMAR_COMPILE_TIMEOUT = "GRAMMAR_COMPILE_TIMEOUT"  # ... or did not compile in time
    GRAMMAR_LIMIT = "GRAMMAR_LIMIT"  # the grammar library gave up while generating
    # a strict constraint whose schema has keywords the grammar cannot enforce
    SCHEMA_NOT_ENFORCEABLE = "SCHEMA_NOT_ENFORCEABLE"
    NO_GENERATION_MODEL = "NO_GENERATION_MODEL"
    NO_EMBEDDING_MODEL = "NO_EMBEDDING_MODEL"
    NO_SPEECH_MODEL = "NO_SPEECH_MODEL"
    NO_CHAT_TEMPLATE = "NO_CHAT_TEMPLATE"
    PREFIX_CACHING_OFF = "PREFIX_CACHING_OFF"  # KV events from a server without a prefix cache
    DUPLICATE_REQUEST_ID = "DUPLICATE_REQUEST_ID"
    QUEUE_FULL = "QUEUE_FULL"  # too many requests in flight
    TOKEN_BUDGET_FULL = "TOKEN_BUDGET_FULL"  # too many tokens in flight
    EMBEDDING_QUEUE_FULL = "EMBEDDING_QUEUE_FULL"
    COMPILE_QUEUE_FULL = "COMPILE_QUEUE_FULL"  # too many constraints compiling
    KEY_LIMIT_REACHED = "KEY_LIMIT_REACHED"  # the API key's own in-flight limit
    MODEL_LOADING = "MODEL_LOADING"
    DRAINING = "DRAINING"  # the server is shutting down
    ENGINE_STOPPED = "ENGINE_STOPPED"  # the engine is not running (it failed)
    GRAMMAR_COMPILER_UNAVAILABLE = "GRAMMAR_COMPILER_UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"  # a missing or wrong API key
    ROUTER_KEY_REQUIRED = "ROUTER_KEY_REQUIRED"  # a router-only RPC with another key
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"  # a method of a protocol we serve that this server does not do
    INTERNAL = "INTERNAL"  # a server bug; details in the server log


# The request id of the call being handled (set by the servicers once known).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def _request_id() -> str | None:
    call = current_call()
    return current_request_id.get() or (call.request_id if call is not None else None)


# A status travels in trailers, its message up to three times (grpc-message,
# the Status, a violation), and clients refuse trailers over their metadata
# limit (8 KiB by default): a message echoing client input (a tool's name, a
# pattern) is cut to this many characters, so the client still gets its status.
MAX_MESSAGE_CHARS = 512


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 1] + "…"


class ServiceError(Exception):
    """An error to report to the client as a gRPC status.

    `reason` is the ErrorInfo reason (a `Reason` constant). `violations` are
    (field path, description) pairs sent as a BadRequest, with `reason` as each
    violation's reason. RESOURCE_EXHAUSTED and UNAVAILABLE carry a RetryInfo.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str,
                 violations: Sequence[tuple[str, str]] = ()):
        message = _clip(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.violations = tuple((field, _clip(text)) for field, text in violations)

    def status(self) -> status_pb2.Status:
        """The google.rpc.Status this error is reported as."""
        details = [error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN)]
        if self.violations:
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d, reason=self.reason)
                for f, d in self.violations
            ]))
        if self.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(RETRY_AFTER_S * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        packed = []
        for detail in details:
            item = any_pb2.Any()
            item.Pack(detail)
            packed.append(item)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)

    def trailing_metadata(self, request_id: str | None = None) -> tuple[tuple[str, str | bytes], ...]:
        metadata: tuple[tuple[str, str | bytes], ...] = ((STATUS_DETAILS_KEY, self.status().SerializeToString()),)
        if request_id:
            metadata += ((REQUEST_ID_METADATA, request_id),)
        return metadata

    async def abort(self, context: grpc.aio.ServicerContext) -> NoReturn:
        # The request id goes with every failure (x-request-id), even one before
        # the servicer checked it: then it is the one the call's log line names.
        await context.abort(self.code, self.message,
                            trailing_metadata=self.trailing_metadata(_request_id()))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def invalid_argument(field: str, description: str, reason: str = Reason.INVALID_FIELD) -> ServiceError:
    """INVALID_ARGUMENT whose BadRequest names `field` (a path like "sampling.top_p")."""
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {description}", reason,
                        [(field, description)])


def response_too_large(field: str, size: int, limit: int, advice: str) -> ServiceError:
    """INVALID_ARGUMENT (RESPONSE_TOO_LARGE) naming `field`, for an answer of
    `size` bytes over the server's message `limit`; `advice` says what to ask
    for instead."""
    return invalid_argument(field, f"the answer would be {size} bytes, over the server's message limit "
                                   f"of {limit}; {advice}", Reason.RESPONSE_TOO_LARGE)


def unavailable(message: str, reason: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, reason)


def resource_exhausted(message: str, reason: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason)


def failed_precondition(message: str, reason: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message, reason)


def internal(message: str = "internal error; see the server log") -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, message, Reason.INTERNAL)


def status_details(metadata: Sequence[tuple[str, Any]] | None) -> status_pb2.Status | None:
    """The google.rpc.Status in a call's trailing metadata (for clients and tests)."""
    for key, value in metadata or ():
        if key == STATUS_DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None


def error_reason(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The ErrorInfo reason in a call's trailing metadata."""
    status = status_details(metadata)
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return None


def bad_request_violations(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, str]]:
    """The BadRequest field violations in a call's trailing metadata."""
    status = status_details(metadata)
    out = []
    for detail in status.details if status else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def rpc_guard(method: Handler) -> Handler:
    """Map a servicer method's failures to statuses: ServiceError as given, bugs to INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = current_request_id.set(None)
        try:
            return await method(self, request, context)
        except ServiceError as err:
            await err.abort(context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise  # an abort already under way, or the call ended (cancel, deadline)
        except ExecuteBatchError:
            # A write (or another call operation) failed because the client
            # left while it was under way (cancel, deadline, connection gone;
            # grpc's own handler loop reads it so): not a bug, nothing to send.
            raise asyncio.CancelledError() from None
        except Exception:
            log.exception("internal error in %s (request %s)", method.__name__, current_request_id.get())
            try:
                await internal().abort(context)
            except grpc.aio.AbortError:
                raise
            except Exception:  # noqa: BLE001 - the call is already broken: nothing more to send
                log.debug("could not report the internal error: the call had already ended")
        finally:
            current_request_id.reset(token)

    return wrapper  # type: ignore[return-value]
