"""One client's slow constraints never hold up another client's simple ones.

A client sends schemas that take xgrammar far longer than the compile
timeout (deeply nested anyOf); a second client's regex and small schema,
sent while those queue, compile and start streaming within a second. The
second client is told apart by its API key, or without keys by its
connection."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from service.errors import Reason, error_reason
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.security.auth import ApiKey

from .helpers import TIMEOUT, ServerHandle, engine_factory
from .test_structured import constrained, nested_any_of

C = pb.Constraint
MALLORY, BOB = "sk-mallory-0123456789", "sk-bob-9876543210"
COMPILE_TIMEOUT = 2.0
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}


def bearer(secret: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),) if secret else ()


@pytest.fixture(scope="module")
def keyed(make_module_server: Callable[..., ServerHandle]) -> ServerHandle:
    return make_module_server(engine_factory(grammar_compile_timeout_s=COMPILE_TIMEOUT), warmup_grammar=True,
                              api_keys=(ApiKey("mallory", MALLORY), ApiKey("bob", BOB)))


@pytest.fixture(scope="module")
def open_server(make_module_server: Callable[..., ServerHandle]) -> ServerHandle:
    return make_module_server(engine_factory(grammar_compile_timeout_s=COMPILE_TIMEOUT), warmup_grammar=True)


def first_chunk_after(stub: Any, req: pb.GenerateRequest, metadata: tuple[tuple[str, str], ...]) -> float:
    """Seconds from sending `req` to its first chunk; the call must then end well."""
    start = time.monotonic()
    first = None
    for msg in stub.Generate(req, timeout=TIMEOUT, metadata=metadata):
        if first is None and msg.HasField("chunk"):
            first = time.monotonic() - start
    assert first is not None
    return first


def bombard(stub: Any, metadata: tuple[tuple[str, str], ...], count: int,
            answers: list[tuple[float, grpc.StatusCode, str | None]]) -> list[threading.Thread]:
    salt = f"{time.time_ns()}"
    requests = [constrained("bomb", max_new_tokens=4, backend=C.BACKEND_XGRAMMAR,
                            json_schema=json.dumps(nested_any_of(7, salt=f"{salt}-{i}-")))
                for i in range(count)]

    def one(req: pb.GenerateRequest) -> None:
        start = time.monotonic()
        try:
            list(stub.Generate(req, timeout=TIMEOUT, metadata=metadata))
            answers.append((time.monotonic() - start, grpc.StatusCode.OK, None))
        except grpc.RpcError as err:
            answers.append((time.monotonic() - start, err.code(),  # type: ignore[attr-defined]
                            error_reason(err.trailing_metadata())))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    return threads


def check_fair(bomber: Any, bomber_key: str | None, other: Any, other_key: str | None) -> None:
    answers: list[tuple[float, grpc.StatusCode, str | None]] = []
    threads = bombard(bomber, bearer(bomber_key), 6, answers)
    time.sleep(0.5)  # one bomb compiles, the others queue behind it
    salt = f"{time.time_ns() % 100000}"
    regex = constrained("code", max_new_tokens=12, regex=f"r{salt}-[A-Z]{{3}}")
    schema = constrained("n", max_new_tokens=12, json_schema=json.dumps({**SMALL, "title": salt}))
    for req in (regex, schema):  # new to the server: compiled, not cached
        ttft = first_chunk_after(other, req, bearer(other_key))
        assert ttft < 1.0, f"the other client waited {ttft:.2f} s for {req.constraint.WhichOneof('kind')}"
    for t in threads:
        t.join(TIMEOUT)
    # The bombs themselves are answered at about their deadline, as before:
    # the first times out compiling, the others mostly while still queued (one
    # that got the replaced worker just before its own deadline times out
    # compiling too: on a loaded machine its queue wait was longer).
    codes = sorted((code.name, reason) for _, code, reason in answers)
    timeout, queued = ("INVALID_ARGUMENT", Reason.GRAMMAR_COMPILE_TIMEOUT), ("RESOURCE_EXHAUSTED",
                                                                            Reason.COMPILE_QUEUE_FULL)
    assert len(codes) == 6 and codes[0] == timeout and set(codes) <= {timeout, queued}, codes
    assert codes.count(queued) >= 3, codes
    assert max(seconds for seconds, _, _ in answers) < COMPILE_TIMEOUT + 1.5


def test_another_keys_simple_constraints_are_served_beside_slow_ones(keyed: ServerHandle) -> None:
    check_fair(keyed.stub, MALLORY, keyed.stub, BOB)  # one connection: the key tells them apart


def test_without_keys_another_connection_is_served_beside_slow_ones(open_server: ServerHandle) -> None:
    # Its own connection, not the shared subchannel of the same target.
    with grpc.insecure_channel(open_server.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        check_fair(open_server.stub, None, pb_grpc.GenerationStub(ch), None)
