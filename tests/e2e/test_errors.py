"""Status codes at the edge: INVALID_ARGUMENT with BadRequest, RESOURCE_EXHAUSTED,
ALREADY_EXISTS, UNAVAILABLE, INTERNAL (never UNKNOWN, never a traceback)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from service.errors import bad_request_violations
from service.gen.stencil.v1 import generate_pb2 as pb

from .helpers import TIMEOUT, ServerHandle, engine_factory, generate, greedy


def _rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def _generate_error(stub, req: pb.GenerateRequest) -> grpc.RpcError:
    return _rpc_error(lambda: list(stub.Generate(req, timeout=TIMEOUT)))


def _set(path: str, value: object) -> Callable[[pb.GenerateRequest], None]:
    def apply(req: pb.GenerateRequest) -> None:
        *parents, name = path.split(".")
        msg = req
        for p in parents:
            msg = getattr(msg, p)
        field = getattr(msg, name)
        if isinstance(value, list):
            field.extend(value)
        else:
            setattr(msg, name, value)
    return apply


def _ids(ids: list[int]) -> Callable[[pb.GenerateRequest], None]:
    def apply(req: pb.GenerateRequest) -> None:
        req.token_ids.ids.extend(ids)
    return apply


def _clear_input(req: pb.GenerateRequest) -> None:
    req.ClearField("text")


def _empty_chat(req: pb.GenerateRequest) -> None:
    req.chat.SetInParent()


def _logit_bias(req: pb.GenerateRequest) -> None:
    req.sampling.logit_bias[9000] = 1.0


INVALID = {
    "negative temperature": (_set("sampling.temperature", -0.5), "sampling.temperature"),
    "top_p zero": (_set("sampling.top_p", 0.0), "sampling.top_p"),
    "top_p above one": (_set("sampling.top_p", 1.5), "sampling.top_p"),
    "top_k below -1": (_set("sampling.top_k", -2), "sampling.top_k"),
    "min_p above one": (_set("sampling.min_p", 1.5), "sampling.min_p"),
    "min_p negative": (_set("sampling.min_p", -0.1), "sampling.min_p"),
    "repetition_penalty zero": (_set("sampling.repetition_penalty", 0.0), "sampling.repetition_penalty"),
    "seed too large": (_set("sampling.seed", 2**63), "sampling.seed"),
    "logit_bias outside vocab": (_logit_bias, "sampling.logit_bias"),
    "token ids outside vocab": (_ids([5, 6, 8192, 7]), "token_ids.ids[2]"),
    "empty token ids": (_ids([]), "token_ids.ids"),
    "empty text": (_set("text", ""), "text"),
    "no input": (_clear_input, "input"),
    "empty chat": (_empty_chat, "chat.messages"),
    "prompt + max_new_tokens beyond context": (_set("stopping.max_new_tokens", 100_000),
                                               "stopping.max_new_tokens"),
    "max_new_tokens zero": (_set("stopping.max_new_tokens", 0), "stopping.max_new_tokens"),
    "min above max new tokens": (_set("stopping.min_new_tokens", 50), "stopping.min_new_tokens"),
    "too many stop strings": (_set("stopping.stop", [f"s{i}" for i in range(17)]), "stopping.stop"),
    "empty stop string": (_set("stopping.stop", [""]), "stopping.stop"),
    "stop token outside vocab": (_set("stopping.stop_token_ids", [10**6]), "stopping.stop_token_ids"),
    # Scanned on every token: 4M copies of one id cost 27 ms a token of every step.
    "too many stop token ids": (_set("stopping.stop_token_ids", [5] * 1025), "stopping.stop_token_ids"),
    "logprobs above 20": (_set("response.logprobs", 21), "response.logprobs"),
    "prompt_logprobs above 20": (_set("response.prompt_logprobs", 50), "response.prompt_logprobs"),
    "request id too long": (_set("request_id", "x" * 300), "request_id"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_argument_names_the_field(stub, case: str) -> None:
    mutate, field = INVALID[case]
    req = greedy("hello", max_new_tokens=8)
    if field.startswith(("token_ids", "chat", "input")):
        req.ClearField("text")
    mutate(req)
    err = _generate_error(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    violations = bad_request_violations(err.trailing_metadata())
    assert [f for f, _ in violations] == [field], violations
    assert field in err.details()
    assert "Traceback" not in err.details()


def test_an_error_echoing_long_input_still_arrives_as_its_status(stub) -> None:
    # The message names the client's 20 kB tool name; sent whole (three times
    # in the trailers) the client saw RESOURCE_EXHAUSTED about metadata size.
    req = pb.GenerateRequest(text="hi")
    req.tools.add(name="x" * 20_000)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(field, text)] = bad_request_violations(info.value.trailing_metadata())
    assert field == "tools[0].name" and len(text) <= 512 and len(info.value.details()) <= 512


def test_prompt_longer_than_context(stub, server: ServerHandle) -> None:
    req = greedy(max_new_tokens=1)
    req.token_ids.ids.extend([7] * server.engine.max_model_len)
    err = _generate_error(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["token_ids.ids"]


def test_long_text_prompt_is_tokenized_and_rejected(stub) -> None:
    # Over 32 KiB: tokenized on a worker thread, then too long for the context.
    err = _generate_error(stub, greedy("lorem ipsum " * 4000, max_new_tokens=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["text"]
    assert len(stub.Tokenize(pb.TokenizeRequest(text="lorem ipsum " * 4000)).token_ids) > 512


def test_chat_role_and_detokenize_errors_name_the_field(stub) -> None:
    req = greedy(max_new_tokens=4)
    req.chat.messages.add(role="", content="no role")
    err = _generate_error(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(err.trailing_metadata())[0][0] == "chat.messages[0].role"

    err = _rpc_error(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 99999])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(err.trailing_metadata())[0][0] == "token_ids[1]"
    err = _rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_duplicate_request_id_while_running(slow_server: ServerHandle) -> None:
    stub = slow_server.stub
    req = greedy("duplicate", max_new_tokens=300, request_id="dup-1")
    req.stopping.ignore_eos = True
    first = stub.Generate(req, timeout=TIMEOUT)
    next(first)
    err = _generate_error(stub, req)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    slow_server.wait_pending(0)
    # Once finished, the id may be used again.
    generate(stub, greedy("again", max_new_tokens=2, request_id="dup-1"))


def test_admission_limit_rejects_with_resource_exhausted(make_server) -> None:
    server = make_server(engine_factory(slow_s=0.02), max_pending_requests=1)
    req = greedy("long", max_new_tokens=300)
    req.stopping.ignore_eos = True
    first = server.stub.Generate(req, timeout=TIMEOUT)
    next(first)
    err = _generate_error(server.stub, greedy("second", max_new_tokens=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.cancel()
    server.wait_pending(0)
    generate(server.stub, greedy("third", max_new_tokens=2))  # room again


def test_unavailable_while_loading_then_serving(make_server) -> None:
    gate = threading.Event()
    factory = engine_factory()

    def gated():  # type: ignore[no-untyped-def]
        assert gate.wait(TIMEOUT)
        return factory()

    server = make_server(gated, wait=False)
    err = _generate_error(server.stub, greedy("too early"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == "the model is still loading"
    gate.set()
    server.wait_ready()
    generate(server.stub, greedy("now", max_new_tokens=2))


class _Exploding:
    """A model whose forward raises once `armed` is set."""

    def __init__(self, real, armed: threading.Event):  # type: ignore[no-untyped-def]
        self._real = real
        self._armed = armed

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self._armed.is_set():
            raise RuntimeError("boom: simulated engine bug")
        return self._real.forward(*args, **kwargs)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._real, name)


def test_engine_failure_is_internal_then_unavailable(make_server) -> None:
    from engine import EngineConfig, EngineCore
    from engine.postprocess import MAX_FAILED_STEPS
    from engine.presets import ensure_preset
    from service.server import FAILURE_HOLD_S

    path = ensure_preset("tiny-llama")
    armed = threading.Event()
    server = make_server(lambda: EngineCore(EngineConfig(str(path), kv_cache_gib=0.05),
                                            wrap_model=lambda real: _Exploding(real, armed)))
    armed.set()
    # A failing step ends only the request in it; the engine goes on...
    err = _generate_error(server.stub, greedy("explode", max_new_tokens=4))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "boom" not in err.details() and "Traceback" not in err.details()
    assert server.server.engine_loop is not None and server.server.engine_loop.alive
    # ...until steps keep failing whatever runs in them: then it is broken.
    codes = [_generate_error(server.stub, greedy(f"explode {i}", max_new_tokens=4)).code()
             for i in range(MAX_FAILED_STEPS)]
    assert codes == [grpc.StatusCode.INTERNAL] * MAX_FAILED_STEPS
    # The server itself refuses the calls that follow (not a closed port, nor a
    # call cancelled as the server stops) for a while before it goes away.
    # (Calls are sent for half the hold, so a slow machine cannot outrun it.)
    deadline, sent = time.monotonic() + FAILURE_HOLD_S / 2, 0
    while sent == 0 or time.monotonic() < deadline:
        err = _generate_error(server.stub, greedy(f"after {sent}", max_new_tokens=4))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details() in ("the server is shutting down", "the engine is not running")
        sent += 1
        time.sleep(FAILURE_HOLD_S / 20)
    assert server.server.health.status() == health_pb2.HealthCheckResponse.NOT_SERVING
    server.runner.run(server.server.wait_stopped())
