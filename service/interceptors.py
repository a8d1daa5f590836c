"""Server interceptors, and the one way they wrap an RPC's handler (`rewrap`).

`UnparsableRequests`: grpc parses a request before any handler runs, and a
payload that is not the expected message (random bytes, a truncated frame)
made grpc answer UNKNOWN with the parser's exception text and log a traceback
at ERROR for every such call: a log flood any client can trigger. Requests are
parsed here instead; one that cannot be is answered INVALID_ARGUMENT ("request
could not be parsed", reason UNPARSABLE_REQUEST), and logged in one line at
most every few seconds, with a count of the others.

The API-key check (auth.py) and the telemetry of every call (telemetry.py)
wrap handlers with `rewrap` too.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.errors import Reason, ServiceError

log = logging.getLogger(__name__)

UNPARSABLE_MESSAGE = "request could not be parsed"

# Awaited with each request message (streaming requests: each one) before the handler sees it.
Before = Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]
# An async context manager around each whole call, given its request (None
# for a stream of requests) and its context.
Scope = Callable[[Any, grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
_FACTORIES: dict[str, Callable[..., Any]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _no_scope(request: Any, context: grpc.aio.ServicerContext) -> contextlib.AbstractAsyncContextManager[None]:
    return contextlib.nullcontext()


def rewrap(handler: Any, *, before: Before | None = None, scope: Scope | None = None,
           request_deserializer: Callable[[bytes], Any] | None = None) -> Any:
    """`handler` with its behavior wrapped: `before` sees each request first and
    `scope` surrounds each call; `request_deserializer` replaces the handler's."""
    kind = next(k for k in _KINDS if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)
    enter = scope or _no_scope
    streaming_request = kind.startswith("stream")

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if before is not None:
                await before(request, context)
            yield request

    async def first(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if streaming_request:
            return checked(request, context)
        if before is not None:
            await before(request, context)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def wrapped_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with enter(None if streaming_request else request, context):
                async for item in behavior(await first(request, context), context):
                    yield item
        wrapped: Callable[..., Any] = wrapped_gen
    else:
        async def wrapped_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with enter(None if streaming_request else request, context):
                return await behavior(await first(request, context), context)
        wrapped = wrapped_call
    return _FACTORIES[kind](wrapped, request_deserializer=request_deserializer or handler.request_deserializer,
                            response_serializer=handler.response_serializer)


class RateLimitedLog:
    """At most one warning per `interval_s`, saying how many were held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self._log = logger
        self._interval = interval_s
        self._last = -float("inf")
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._interval:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        suffix = f" ({held} more since the last report)" if held else ""
        self._log.warning(message + suffix, *args)


class _Unparsable:
    """What a request that could not be parsed becomes (the handler never sees it)."""

    __slots__ = ()


async def _refuse_unparsable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Unparsable):
        err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, UNPARSABLE_MESSAGE, Reason.UNPARSABLE_REQUEST)
        await err.abort(context)


class UnparsableRequests(grpc.aio.ServerInterceptor):
    """Answer requests whose bytes are not the method's message with INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self._log = RateLimitedLog(log)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception:  # noqa: BLE001 - any parser failure is the payload's
                self._log.warning("%s: a request could not be parsed (%d bytes)", method, len(data))
                return _Unparsable()

        return rewrap(handler, before=_refuse_unparsable, request_deserializer=deserialize)
