"""API keys: who may call, per-key limits, request ids that belong to their key,
keys that never reach the log, and what a client learns of the server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.presets import ensure_preset
from service.cli import build_parser, main
from service.cli.serve import ServePlan, plan_serve
from service.errors import Reason, error_reason
from service.gen.stencil.v1 import generate_pb2 as pb
from service.security.auth import ApiKey, load_keys

from .helpers import TIMEOUT, ServerHandle, engine_factory, greedy

ALICE, BOB, CAROL, ROUTER = "sk-alice-0123456789", "sk-bob-9876543210", "sk-carol-limited", "sk-router-42"
CAPPED_ROUTER = "sk-router-capped-7"
KEYS = (ApiKey("alice", ALICE), ApiKey("bob", BOB), ApiKey("carol", CAROL, max_inflight=1),
        ApiKey("smg", ROUTER, router=True), ApiKey("smg-capped", CAPPED_ROUTER, max_inflight=1, router=True))


def bearer(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


def code_and_reason(fn: Callable[..., object], *args: Any) -> tuple[grpc.StatusCode, str | None, str]:
    """The status code, reason and details of the gRPC error `fn(*args)` raises."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    err = info.value
    return err.code(), error_reason(err.trailing_metadata()), err.details()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def keyed(make_module_server: Callable[..., ServerHandle]) -> ServerHandle:
    return make_module_server(engine_factory(slow_s=0.02), api_keys=KEYS)


def tokenize(handle: ServerHandle, metadata: tuple[tuple[str, str], ...] = ()) -> list[int]:
    return list(handle.stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=TIMEOUT).token_ids)


def test_every_rpc_but_health_needs_a_key(keyed: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert tokenize(keyed, bearer(ALICE))
    answers = {code_and_reason(tokenize, keyed, m) for m in
               [(), bearer("sk-wrong"), bearer(ALICE + "x"), (("authorization", ALICE),), bearer("")]}
    assert answers == {(grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, "missing or invalid API key")}
    health = health_pb2_grpc.HealthStub(keyed.channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no key
    code, _, _ = code_and_reason(lambda: list(keyed.channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", request_serializer=None,
        response_deserializer=None)(iter([b"\x3a\x00"]), timeout=TIMEOUT)))
    assert code == grpc.StatusCode.UNAUTHENTICATED  # reflection too, unless --public-reflection
    assert all(secret not in caplog.text for secret in (ALICE, BOB, CAROL, "sk-wrong"))
    # Each call's line names its key (it named none: the log could not say whose a call was).
    lines = [r.getMessage() for r in caplog.records if r.name == "stencild.requests" and "Tokenize" in r.getMessage()]
    assert any("key=alice" in line for line in lines)


def test_a_key_may_cap_its_calls_in_flight(keyed: ServerHandle) -> None:
    running = keyed.stub.Generate(greedy("long", 100), metadata=bearer(CAROL), timeout=TIMEOUT)
    next(iter(running))
    code, reason, _ = code_and_reason(lambda: tokenize(keyed, bearer(CAROL)))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.KEY_LIMIT_REACHED)
    assert tokenize(keyed, bearer(ALICE)), "other keys are not limited by it"
    running.cancel()
    keyed.wait_pending(0)
    assert tokenize(keyed, bearer(CAROL))


def test_a_key_at_its_cap_may_still_abort_its_requests(keyed: ServerHandle) -> None:
    # The request holding the key's only slot is the one to stop: its Abort
    # was refused RESOURCE_EXHAUSTED, and it ran to max_new_tokens.
    running = keyed.stub.Generate(greedy("long", 500, request_id="mine"), metadata=bearer(CAROL), timeout=TIMEOUT)
    stream = iter(running)
    next(stream)
    keyed.stub.Abort(pb.AbortRequest(request_ids=["mine"]), metadata=bearer(CAROL), timeout=TIMEOUT)
    last = list(stream)[-1]
    assert last.complete.finish_reason == pb.GenerateComplete.CANCELLED
    keyed.wait_pending(0)


def test_request_ids_belong_to_their_key(keyed: ServerHandle) -> None:
    alice = keyed.stub.Generate(greedy("alice's", 100, request_id="same"), metadata=bearer(ALICE),
                                timeout=TIMEOUT)
    next(iter(alice))
    # Bob can neither abort Alice's request nor learn that her id is taken.
    done = keyed.stub.Abort(pb.AbortRequest(request_ids=["same"]), metadata=bearer(BOB), timeout=TIMEOUT)
    assert list(done.aborted_request_ids) == []
    bob = list(keyed.stub.Generate(greedy("bob's", 3, request_id="same"), metadata=bearer(BOB), timeout=TIMEOUT))
    assert bob[0].request_id == "same" and bob[-1].complete.finish_reason == pb.GenerateComplete.LENGTH
    # Alice aborts her own.
    done = keyed.stub.Abort(pb.AbortRequest(request_ids=["same"]), metadata=bearer(ALICE), timeout=TIMEOUT)
    assert list(done.aborted_request_ids) == ["same"]
    last = list(alice)[-1]
    assert last.request_id == "same" and last.complete.finish_reason == pb.GenerateComplete.CANCELLED


def test_only_a_router_key_sees_every_keys_cache(keyed: ServerHandle) -> None:
    """The prefix cache's events carry every key's prompt tokens, and its flush
    touches every key's pages: a tenant's key gets PERMISSION_DENIED (any key
    could read another's prompts); the router's key is served."""
    from service.gen.vllm import common_pb2 as cpb
    from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

    stub = vpb_grpc.VllmEngineStub(keyed.channel)
    for call in (lambda m: next(iter(stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=m,
                                                            timeout=TIMEOUT))),
                 lambda m: stub.FlushCache(cpb.FlushCacheRequest(), metadata=m, timeout=TIMEOUT)):
        code, reason, _ = code_and_reason(call, bearer(BOB))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.ROUTER_KEY_REQUIRED)
    assert stub.FlushCache(cpb.FlushCacheRequest(), metadata=bearer(ROUTER), timeout=TIMEOUT).success
    events = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=bearer(ROUTER), timeout=TIMEOUT)
    try:
        events.initial_metadata()  # sent once the subscription is taken
    finally:
        events.cancel()


def test_cli_clients_send_the_key(keyed: ServerHandle, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["generate", "Hi", "--port", str(keyed.port), "--max-new-tokens", "2", "--temperature", "0"]
    assert main([*args, "--api-key", BOB]) == 0
    monkeypatch.setenv("STENCILD_API_KEY", ALICE)
    assert main(args) == 0
    monkeypatch.delenv("STENCILD_API_KEY")
    assert main(args) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_clients_see_a_model_name_not_a_server_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = ensure_preset("tiny-llama")

    def plan(*args: str) -> ServePlan:
        made = plan_serve(build_parser().parse_args(["serve", "--model", str(model), "--no-speech-model",
                                                     "--no-embedding-model", *args]))
        assert isinstance(made, ServePlan), made
        return made

    assert plan().model_name == model.name and "/" not in plan().model_name
    # A link is named as given (it was named by where it led: a Hugging Face
    # cache snapshot's commit hash), and a snapshot by its repository.
    snapshot = tmp_path / "hub" / "models--team--llama-small" / "snapshots" / ("ab12" * 10)
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(model, target_is_directory=True)
    (tmp_path / "my-llama").symlink_to(snapshot, target_is_directory=True)

    def named(path: Path) -> str:
        made = plan_serve(build_parser().parse_args(["serve", "--model", str(path), "--no-speech-model",
                                                     "--no-embedding-model"]))
        assert isinstance(made, ServePlan), made
        return made.model_name

    assert named(tmp_path / "my-llama") == "my-llama"
    assert named(snapshot) == "team/llama-small"
    assert named(tmp_path / "hub" / ".." / "my-llama") == "my-llama"
    assert plan("--served-model-name", "team/llama-small").model_name == "team/llama-small"
    keys = tmp_path / "keys"
    keys.write_text(f"# team keys\n{ALICE} alice:4\n{BOB}\n")
    assert [(k.name, k.max_inflight) for k in plan("--api-key-file", str(keys)).config.api_keys] == \
        [("alice", 4), ("key-2", None)]


def test_a_routers_event_subscription_takes_none_of_its_keys_calls(keyed: ServerHandle) -> None:
    # The subscription lives as long as the router: counted, it held one of
    # the key's MAX_INFLIGHT slots for good (here the only one).
    from service.gen.vllm import common_pb2 as cpb
    from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

    events = vpb_grpc.VllmEngineStub(keyed.channel).SubscribeKvEvents(
        cpb.SubscribeKvEventsRequest(), metadata=bearer(CAPPED_ROUTER), timeout=TIMEOUT)
    try:
        events.initial_metadata()  # the subscription is taken
        assert tokenize(keyed, bearer(CAPPED_ROUTER))
    finally:
        events.cancel()


@pytest.mark.parametrize("method", ["/stencil.v1.Generation/NoSuchMethod", "/no.such.Service/Call"])
def test_without_a_key_no_method_name_is_told_apart(keyed: ServerHandle, method: str) -> None:
    # An unknown method answered UNIMPLEMENTED to anyone: probing told which names exist.
    unary = keyed.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    streaming = keyed.channel.stream_stream(method, request_serializer=None, response_deserializer=None)
    without = code_and_reason(lambda: unary(b"", timeout=TIMEOUT))
    assert without[:2] == code_and_reason(tokenize, keyed)[:2] == \
        (grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED)
    assert code_and_reason(lambda: list(streaming(iter([]), timeout=TIMEOUT)))[0] == grpc.StatusCode.UNAUTHENTICATED
    # A caller with a key is told the truth.
    assert code_and_reason(lambda: unary(b"", metadata=bearer(ALICE), timeout=TIMEOUT))[0] == grpc.StatusCode.UNIMPLEMENTED


def test_sighup_reads_the_key_file_again(make_server: Callable[..., ServerHandle], tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Rotating a key needed a restart (SIGHUP reloaded only the TLS files).
    path = tmp_path / "keys.txt"
    path.write_text(f"{ALICE} alice\n")
    handle = make_server(engine_factory(), api_keys=tuple(load_keys(path, None)), api_key_file=path)
    assert tokenize(handle, bearer(ALICE))
    path.write_text(f"{BOB} bob\n")
    handle.runner.run(_on_loop(handle.server.reload))  # on the event loop, as the SIGHUP handler runs
    assert tokenize(handle, bearer(BOB))
    assert code_and_reason(tokenize, handle, bearer(ALICE))[0] == grpc.StatusCode.UNAUTHENTICATED
    # A file that holds no key (or is gone) keeps the current keys: never served without keys.
    path.write_text("# nothing\n")
    assert not handle.runner.run(_on_loop(handle.server.reload_keys))
    path.unlink()
    assert not handle.runner.run(_on_loop(handle.server.reload_keys))
    assert tokenize(handle, bearer(BOB))
    assert code_and_reason(tokenize, handle)[0] == grpc.StatusCode.UNAUTHENTICATED


async def _on_loop(fn: Callable[[], Any]) -> Any:
    return fn()
