"""Server interceptors that wrap every RPC's handler.

`UnparsableRequests`: grpc parses a request before any handler runs, and a
payload that is not the expected message (random bytes, a truncated frame)
made grpc answer UNKNOWN with the parser's exception text and log a traceback
at ERROR for every such call: a log flood any client can trigger. Requests are
parsed here instead; one that cannot be is answered INVALID_ARGUMENT ("request
could not be parsed", reason UNPARSABLE_REQUEST), and logged in one line at
most every few seconds, with a count of the others.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from .errors import Reason, ServiceError

log = logging.getLogger(__name__)

UNPARSABLE_MESSAGE = "request could not be parsed"


class _Unparsable:
    """What a request that could not be parsed becomes (the handler never sees it)."""

    __slots__ = ("method",)

    def __init__(self, method: str):
        self.method = method


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
                return _Unparsable(method)

        kind, behavior = _behavior(handler)
        wrap = _WRAPPERS[kind]
        return _HANDLER_FACTORIES[kind](wrap(behavior), request_deserializer=deserialize,
                                        response_serializer=handler.response_serializer)


async def _refuse(context: grpc.aio.ServicerContext) -> None:
    err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, UNPARSABLE_MESSAGE, Reason.UNPARSABLE_REQUEST)
    await err.abort(context)


def _behavior(handler: Any) -> tuple[str, Callable[..., Any]]:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return kind, behavior
    raise ValueError("a method handler without a behavior")


def _wrap_unary_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Unparsable):
                await _refuse(context)
            async for item in behavior(request, context):
                yield item
        return gen

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Unparsable):
            await _refuse(context)
        return await behavior(request, context)
    return call


def _wrap_stream_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Unparsable):
                await _refuse(context)
            yield request

    if inspect.isasyncgenfunction(behavior):
        async def gen(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behavior(checked(requests, context), context):
                yield item
        return gen

    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(checked(requests, context), context)
    return call


_WRAPPERS = {"unary_unary": _wrap_unary_request, "unary_stream": _wrap_unary_request,
             "stream_unary": _wrap_stream_request, "stream_stream": _wrap_stream_request}
_HANDLER_FACTORIES: dict[str, Callable[..., Any]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}
