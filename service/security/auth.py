"""API keys: who may call, how much each key may run at once, whose requests are whose.

With keys configured (`--api-key-file FILE` or `$STENCILD_API_KEYS`), every RPC
except grpc.health.v1 (and reflection, with --public-reflection) needs
`authorization: Bearer <key>` metadata. A missing or wrong key gets
UNAUTHENTICATED with the same message either way, for a method that does not
exist too (only a key holder learns which names exist). Keys are compared in
constant time (digests of equal length, every key compared) and never logged;
the log names a key by its name.

A key may cap its calls in flight (`name:max_inflight`); beyond that a call is
RESOURCE_EXHAUSTED (KEY_LIMIT_REACHED). Request ids belong to their key: the
engine sees them as `<key name>/<id>`, so one client cannot abort another's
request or learn whether an id of another key is running. The RPCs that see
or change every key's state at once (the prefix cache's events, which carry
prompt tokens, and its flush: `router_methods`) take only a key marked
`router`; others get PERMISSION_DENIED (ROUTER_KEY_REQUIRED).

Key file format, one key per line (blank lines and comments ignored: a
comment starts with `#` at the start of a line or after a space):

    SECRET                    a key named key-1, key-2, ... by its line
    SECRET NAME               a named key
    SECRET NAME:LIMIT         a named key with at most LIMIT calls in flight
    SECRET NAME[:LIMIT] router  a key a router uses (the router-only RPCs too)

`$STENCILD_API_KEYS` holds the same entries separated by commas.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from service.errors import Reason, ServiceError, resource_exhausted
from service.interceptors import rewrap
from service.ops.request_log import note_key, note_refusal

log = logging.getLogger(__name__)

API_KEYS_ENV = "STENCILD_API_KEYS"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1.ServerReflection/", "/grpc.reflection.v1alpha.ServerReflection/")

# The name of the key the current call came with ("" without API keys).
current_key: contextvars.ContextVar[str] = contextvars.ContextVar("api_key_name", default="")


def scoped_request_id(request_id: str) -> str:
    """The engine's id for a client's request id: its key's name first, when it has one."""
    key = current_key.get()
    return f"{key}/{request_id}" if key else request_id


@dataclass(frozen=True)
class ApiKey:
    """One key: its name (logged), its secret (never), an optional cap on its calls in flight."""

    name: str
    secret: str
    max_inflight: int | None = None
    router: bool = False  # may call the router-only RPCs

    def __repr__(self) -> str:  # the secret stays out of logs and tracebacks
        return f"ApiKey(name={self.name!r}, max_inflight={self.max_inflight}, router={self.router})"


def parse_keys(entries: list[str], source: str) -> list[ApiKey]:
    """Keys from entries of the form `SECRET [NAME[:LIMIT] [router]]`; ValueError names the bad one."""
    keys: list[ApiKey] = []
    for number, raw in enumerate(entries, 1):
        # A `#` inside a secret is part of it: a comment starts a line or follows a space.
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) > 3 or (len(fields) == 3 and fields[2] != "router"):
            raise ValueError(f"{source}, entry {number}: expected 'SECRET [NAME[:LIMIT] [router]]'")
        secret = fields[0]
        name, _, limit = (fields[1] if len(fields) >= 2 else f"key-{len(keys) + 1}").partition(":")
        if not name or "/" in name:
            raise ValueError(f"{source}, entry {number}: a key name must be non-empty, without '/'")
        if limit and not (limit.isdigit() and int(limit) > 0):
            raise ValueError(f"{source}, entry {number}: the limit must be a positive integer")
        keys.append(ApiKey(name, secret, int(limit) if limit else None, router=len(fields) == 3))
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: key names must be unique")
    if len({k.secret for k in keys}) != len(keys):
        raise ValueError(f"{source}: two entries have the same key")
    return keys


_COMMENT = re.compile(r"(^|\s)#.*$")


def load_keys(path: Path | None, env_value: str | None) -> list[ApiKey]:
    """The configured keys: the file's, else the environment's; neither given
    means no authentication. A file or variable given that holds no key is
    refused: serving without keys is never what it asked for (a secret that
    starts with '#' reads as a comment)."""
    if path is not None:
        # utf-8-sig: a byte-order mark (Windows editors) is not part of the first secret.
        keys, source = parse_keys(path.read_text(encoding="utf-8-sig").splitlines(), str(path)), str(path)
    elif env_value is not None:  # set, even empty (an empty Secret): never served without keys
        keys, source = parse_keys(env_value.split(","), f"${API_KEYS_ENV}"), f"${API_KEYS_ENV}"
    else:
        return []
    if not keys:
        raise ValueError(f"{source} holds no API key (a line's text after ' #' or a leading '#' is a comment); "
                         "leave it unset to serve without authentication")
    return keys


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class ApiKeyAuth(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <key>` on every call that needs it, and counts calls per key."""

    def __init__(self, keys: list[ApiKey], public_reflection: bool = False,
                 router_methods: frozenset[str] = frozenset()):
        if not keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self._keys = [(_digest(k.secret), k) for k in keys]
        self._public = (HEALTH_PREFIX, *(REFLECTION_PREFIXES if public_reflection else ()))
        self._router_methods = router_methods  # full method names only a router key may call
        self._inflight: dict[str, int] = {k.name: 0 for k in keys}

    def replace_keys(self, keys: list[ApiKey]) -> None:
        """Take these keys from the next call on (a key file read again on
        SIGHUP). Calls in flight run on, still counted under their key's name,
        so a key kept across the change keeps its count against its cap."""
        if not keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self._keys = [(_digest(k.secret), k) for k in keys]
        names = {key.name for key in keys}
        # A removed key's count goes once its calls are over (never read again).
        self._inflight = {name: n for name, n in self._inflight.items() if n or name in names}
        for name in names:
            self._inflight.setdefault(name, 0)

    def match(self, metadata: Any) -> ApiKey | None:
        """The key the metadata carries, if it is one of ours (constant time over keys)."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        # The scheme is case-insensitive (RFC 7235 2.1): gateways and clients
        # that write "bearer" were told their key was wrong.
        scheme, _, credentials = value.partition(" ") if isinstance(value, str) else ("", "", "")
        if scheme.lower() != "bearer":
            return None
        given = _digest(credentials.strip())
        found = None
        for digest, key in self._keys:
            if hmac.compare_digest(digest, given):  # no early exit: every key is compared
                found = key
        return found

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(self._public):
            return handler
        key = self.match(handler_call_details.invocation_metadata)
        if handler is None:
            # Only a caller with a key learns that a method does not exist
            # (UNIMPLEMENTED): without one every name is refused alike.
            return handler if key is not None else _REFUSE_UNKNOWN
        router_only = handler_call_details.method in self._router_methods
        # An Abort (either protocol's) frees what the key holds: a key at its
        # cap must still be able to stop its own requests. A router's KV-event
        # subscription lives as long as the router: counted, it took one of
        # its key's slots for good.
        counted = not handler_call_details.method.endswith(("/Abort", "/SubscribeKvEvents"))
        return rewrap(handler, scope=lambda _request, context: self._call(key, router_only, counted, context))

    @contextlib.asynccontextmanager
    async def _call(self, key: ApiKey | None, router_only: bool, counted: bool,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        if key is None:
            err = ServiceError(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, Reason.UNAUTHENTICATED)
            await err.abort(context)
        assert key is not None
        note_key(key.name)
        if router_only and not key.router:
            await ServiceError(grpc.StatusCode.PERMISSION_DENIED, "this RPC sees every key's requests: it needs "
                               "an API key marked 'router'", Reason.ROUTER_KEY_REQUIRED).abort(context)
        # .get: the key may have been reloaded away since the call matched it.
        if counted and key.max_inflight is not None and self._inflight.get(key.name, 0) >= key.max_inflight:
            note_refusal("key_max_inflight")
            await resource_exhausted(f"this API key has {key.max_inflight} calls in flight already; retry later",
                                     Reason.KEY_LIMIT_REACHED).abort(context)
        self._inflight[key.name] = self._inflight.get(key.name, 0) + counted
        token = current_key.set(key.name)
        try:
            yield
        finally:
            self._inflight[key.name] = self._inflight.get(key.name, 0) - counted
            # A streaming handler finalized in another context cannot reset it (ValueError).
            with contextlib.suppress(ValueError):
                current_key.reset(token)


async def _unauthenticated(_requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Any call shape: a stream-stream handler answers without reading a message."""
    await ServiceError(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, Reason.UNAUTHENTICATED).abort(context)
    yield None  # unreachable: makes this an async generator, as a stream handler must be


_REFUSE_UNKNOWN = grpc.stream_stream_rpc_method_handler(_unauthenticated)
