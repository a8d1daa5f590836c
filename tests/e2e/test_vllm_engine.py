"""vllm.grpc.engine.VllmEngine on the same server as stencil.v1: generate, validation,
n > 1, abort on cancel, KV events, flush, info RPCs, tokenizer bundle, health;
each with the engine on a thread of the server and in an engine process."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import EngineCore
from service.errors import Reason, bad_request_violations, error_reason
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.vllm import common_pb2 as cpb
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

from .helpers import TIMEOUT, engine_factory, generate, greedy, hold_compiles, process_factory


def _num_cached(engine: EngineCore) -> int:
    return engine.allocator.num_cached


@pytest.fixture(scope="module", params=["engine thread", "engine process"])
def vllm(make_module_server, request):  # type: ignore[no-untyped-def]
    factory = process_factory if request.param == "engine process" else engine_factory
    handle = make_module_server(factory(page_size=4))
    return handle, vpb_grpc.VllmEngineStub(handle.channel)


def _req(rid: str, ids: list[int], max_tokens: int = 6, stream: bool = False, **params) -> vpb.GenerateRequest:  # type: ignore[no-untyped-def]
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream)
    req.sampling_params.max_tokens = max_tokens
    req.sampling_params.temperature = params.pop("temperature", 0.0)
    for name, value in params.items():
        if name == "choice":
            req.sampling_params.choice.choices.extend(value)
        elif isinstance(value, list):
            getattr(req.sampling_params, name).extend(value)
        else:
            setattr(req.sampling_params, name, value)
    return req


def test_generate_stream_and_unary_agree(vllm) -> None:  # type: ignore[no-untyped-def]
    _, stub = vllm
    prompt = list(range(5, 30))
    streamed = list(stub.Generate(_req("s1", prompt, stream=True), timeout=TIMEOUT))
    chunks = [m.chunk for m in streamed if m.HasField("chunk")]
    done = streamed[-1].complete
    assert streamed[-1].HasField("complete") and done.finish_reason == "length"
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 6 and all(c.prompt_tokens == len(prompt) for c in chunks)
    unary = list(stub.Generate(_req("u1", prompt), timeout=TIMEOUT))
    assert len(unary) == 1 and list(unary[0].complete.output_ids) == tokens
    assert unary[0].complete.completion_tokens == 6 and unary[0].complete.prompt_tokens == len(prompt)
    # Streaming, each message counts its own tokens (a router adds them up):
    # the closing one its last delta, not the whole output.
    assert done.completion_tokens == len(done.output_ids)
    assert sum(c.completion_tokens for c in chunks) == 6
    # Prompt log-probabilities come with the first chunk, once.
    with_prompt = list(stub.Generate(_req("s2", prompt, stream=True, prompt_logprobs=1), timeout=TIMEOUT))
    first = with_prompt[0].chunk
    assert with_prompt[0].HasField("chunk") and len(first.input_logprobs.token_logprobs) == len(prompt)


def test_text_input_stop_token_and_logprobs(vllm) -> None:  # type: ignore[no-untyped-def]
    _, stub = vllm
    first = list(stub.Generate(_req("t0", [7, 8, 9], max_tokens=3), timeout=TIMEOUT))[0].complete
    stop_at = first.output_ids[1]
    req = _req("t1", [7, 8, 9], max_tokens=3, stop_token_ids=[stop_at], logprobs=2, prompt_logprobs=1)
    done = list(stub.Generate(req, timeout=TIMEOUT))[0].complete
    assert done.finish_reason == "stop" and done.WhichOneof("matched_stop") == "matched_token_id"
    assert done.matched_token_id == stop_at
    assert list(done.output_logprobs.token_ids) == list(done.output_ids)
    assert all(len(top.token_ids) == 2 for top in done.output_logprobs.top_logprobs)
    assert not done.input_logprobs.token_logprobs[0].HasField("value")  # the first prompt token has none
    assert len(done.input_logprobs.token_ids) == 3
    # prompt_logprobs 0: each prompt token's value and, as vLLM, no top lists
    # (there was one empty list a token).
    zero = list(stub.Generate(_req("t3", [7, 8, 9], max_tokens=1, prompt_logprobs=0), timeout=TIMEOUT))[0].complete
    assert len(zero.input_logprobs.token_logprobs) == 3 and len(zero.input_logprobs.top_logprobs) == 0
    text = vpb.GenerateRequest(request_id="t2", text="Hello there", stream=False)
    text.sampling_params.max_tokens = 2
    assert list(stub.Generate(text, timeout=TIMEOUT))[0].complete.prompt_tokens > 0


def test_the_models_other_eos_ids_are_matched_stop_tokens_as_vllm_has_them(vllm) -> None:  # type: ignore[no-untyped-def]
    # vLLM makes generation_config's EOS ids, but the tokenizer's, stop tokens:
    # ending on one names it (matched_token_id); it named nothing here.
    handle, stub = vllm
    engine = handle.engine
    tokenizer_eos = engine.tokenizer.eos_token_id
    [other] = sorted(engine.eos_token_ids - {tokenizer_eos})
    for eos, matched in ((other, other), (tokenizer_eos, None)):
        req = _req(f"eos-{eos}", [5, 6, 7], max_tokens=4)
        req.sampling_params.logit_bias[eos] = 100.0
        done = list(stub.Generate(req, timeout=TIMEOUT))[0].complete
        assert done.finish_reason == "stop" and list(done.output_ids) == [eos]
        assert (done.matched_token_id if done.HasField("matched_token_id") else None) == matched


def test_n_sequences_share_the_prompt(vllm) -> None:  # type: ignore[no-untyped-def]
    handle, stub = vllm
    prompt = list(range(40, 61))  # 5 full pages of 4 and one more token
    req = _req("n1", prompt, max_tokens=4, temperature=1.0, seed=11, n=3)
    out = [m.complete for m in stub.Generate(req, timeout=TIMEOUT)]
    assert sorted(c.index for c in out) == [0, 1, 2]
    assert len({tuple(c.output_ids) for c in out}) > 1, "seeded samples differ per sequence"
    later = [c for c in out if c.index > 0]
    assert all(c.cached_tokens >= 20 for c in later), "the later sequences reuse the prompt's pages"


def _three_running(stub: vpb_grpc.VllmEngineStub, rid: str) -> Any:
    """A streamed n=3 call of `rid`, read until each of its sequences has sent a chunk."""
    req = _req(rid, list(range(5, 30)), max_tokens=400, stream=True, temperature=1.0, ignore_eos=True, n=3)
    call = stub.Generate(req, timeout=TIMEOUT)
    seen: set[int] = set()
    for msg in call:
        seen.add(msg.chunk.index)
        if seen == {0, 1, 2}:
            break
    return call


def test_abort_ends_every_sequence_of_an_n_request(vllm) -> None:  # type: ignore[no-untyped-def]
    # The other sequences start with the first one's first output: an Abort
    # that came before (it found only the first) must end them too.
    handle, stub = vllm
    req = _req("na", list(range(5, 30)), max_tokens=400, temperature=1.0, ignore_eos=True, n=3)
    call = stub.Generate(req, timeout=TIMEOUT)
    call.initial_metadata()  # the first sequence is submitted
    stub.Abort(vpb.AbortRequest(request_ids=["na"]), timeout=TIMEOUT)
    out = [m.complete for m in call]
    assert sorted((c.index, c.finish_reason) for c in out) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert handle.wait_no_pages() == (0, 0)
    # And once every sequence runs, an Abort finds each of them.
    call = _three_running(stub, "nb")
    stub.Abort(vpb.AbortRequest(request_ids=["nb"]), timeout=TIMEOUT)
    finals = [m.complete for m in call if m.HasField("complete")]
    assert sorted((c.index, c.finish_reason) for c in finals) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert handle.wait_no_pages() == (0, 0)


@pytest.mark.parametrize("protocol", ["vllm", "stencil.v1"])
@pytest.mark.parametrize("n", [1, 3])
def test_an_abort_while_the_constraint_compiles_ends_the_call(make_server, protocol: str, n: int) -> None:  # type: ignore[no-untyped-def]
    # A vLLM call has nothing in the engine while its constraint compiles: an
    # Abort then (a router's, right after its Generate) was lost and the
    # request ran to max_tokens.
    handle = make_server(engine_factory(page_size=4))
    stub = vpb_grpc.VllmEngineStub(handle.channel)
    compiling, release = hold_compiles(handle)
    req = _req("early", list(range(5, 30)), max_tokens=400, temperature=1.0, ignore_eos=True, n=n, regex="[a-z ]+")
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(lambda: list(stub.Generate(req, timeout=TIMEOUT)))
        assert compiling.wait(TIMEOUT)
        if protocol == "vllm":
            stub.Abort(vpb.AbortRequest(request_ids=["early"]), timeout=TIMEOUT)
        else:
            answer = handle.stub.Abort(pb.AbortRequest(request_ids=["early"]), timeout=TIMEOUT)
            assert list(answer.aborted_request_ids) == ["early"]
        release.set()
        finals = [m.complete for m in call.result(TIMEOUT)]
    assert sorted((c.index, c.finish_reason) for c in finals) == [(i, "abort") for i in range(n)]
    assert all(c.completion_tokens < 400 for c in finals)
    assert handle.wait_no_pages() == (0, 0)


def test_an_abort_that_overtakes_its_generate_still_ends_it(vllm) -> None:  # type: ignore[no-untyped-def]
    # Two calls are not ordered: a router's Abort sent right after its
    # Generate may reach the server first, found nothing, and the request ran in full.
    handle, stub = vllm
    stub.Abort(vpb.AbortRequest(request_ids=["overtaken"]), timeout=TIMEOUT)
    req = _req("overtaken", list(range(5, 30)), max_tokens=400, temperature=1.0, ignore_eos=True, n=2)
    finals = [m.complete for m in stub.Generate(req, timeout=TIMEOUT)]
    assert sorted((c.index, c.finish_reason) for c in finals) == [(0, "abort"), (1, "abort")]
    assert handle.wait_no_pages() == (0, 0)


def test_a_late_router_abort_leaves_a_stencil_call_under_its_id_alone(vllm) -> None:  # type: ignore[no-untyped-def]
    # The router's Abort came after its call had ended, found nothing and was
    # remembered; a stencil.v1 Generate under that id then ended CANCELLED.
    handle, stub = vllm
    list(stub.Generate(_req("reused", list(range(5, 30)), max_tokens=2), timeout=TIMEOUT))
    stub.Abort(vpb.AbortRequest(request_ids=["reused"]), timeout=TIMEOUT)
    _, tokens, done, _ = generate(handle.stub, greedy("mine", max_new_tokens=3, request_id="reused"))
    assert done.finish_reason == pb.GenerateComplete.FinishReason.LENGTH and len(tokens) == 3


def test_a_stencil_abort_ends_every_sequence_of_a_vllm_n_request(vllm) -> None:  # type: ignore[no-untyped-def]
    # Both protocols share one engine and its ids: stencil.v1's Abort answered
    # the id as aborted but stopped only the first sequence.
    handle, stub = vllm
    call = _three_running(stub, "nc")
    answer = handle.stub.Abort(pb.AbortRequest(request_ids=["nc"]), timeout=TIMEOUT)
    assert list(answer.aborted_request_ids) == ["nc"]
    finals = [m.complete for m in call if m.HasField("complete")]
    assert sorted((c.index, c.finish_reason) for c in finals) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert handle.wait_no_pages() == (0, 0)


def test_an_abort_after_the_first_sequence_ended_ends_the_others(vllm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The others start when the first sequence's first output comes; when
    # that output also ended it, an Abort handled just before found no stream
    # at all (the first had finished, the others were not submitted), and
    # they then ran to their own end.
    from service.vllm_protocol import servicer

    handle, stub = vllm
    prompt = list(range(5, 30))
    probe = [m.complete for m in stub.Generate(_req("probe", prompt, max_tokens=1, temperature=1.0, seed=3, n=2),
                                               timeout=TIMEOUT)]
    first = {c.index: c.output_ids[0] for c in probe}
    assert first[0] != first[1]
    real = servicer.next_outputs
    aborted: list[bool] = []

    async def abort_in_the_gap(stream, field=None):  # type: ignore[no-untyped-def]
        outputs, final = await real(stream, field)
        if final is not None and stream.request_id == "gap" and not aborted:
            # The Abort RPC, handled on the server's loop before the call sees this output.
            async with grpc.aio.insecure_channel(handle.address) as channel:
                await vpb_grpc.VllmEngineStub(channel).Abort(vpb.AbortRequest(request_ids=["gap"]), timeout=TIMEOUT)
            aborted.append(True)
        return outputs, final

    monkeypatch.setattr(servicer, "next_outputs", abort_in_the_gap)
    # The first sequence stops at its first token (a stop id); the second would run on.
    req = _req("gap", prompt, max_tokens=200, temperature=1.0, seed=3, n=2, ignore_eos=True,
               stop_token_ids=[first[0]])
    out = sorted((m.complete.index, m.complete.finish_reason) for m in stub.Generate(req, timeout=TIMEOUT))
    assert aborted and out == [(0, "stop"), (1, "abort")]
    assert handle.wait_no_pages() == (0, 0)


def test_an_n_request_is_admitted_whole(make_server) -> None:  # type: ignore[no-untyped-def]
    # Each sequence without max_tokens costs the whole context (512 tokens): a
    # budget of two is refused n=3 at once while busy, and an idle server
    # takes the call whole (before, its first sequence was taken and the call
    # failed "retry later" when the others came, on every retry).
    from service.engine_loop import AdmissionLimits

    handle = make_server(engine_factory(page_size=4), admission=AdmissionLimits(max_pending_tokens=1100))
    stub = vpb_grpc.VllmEngineStub(handle.channel)
    req = _req("whole", list(range(5, 30)), temperature=1.0, n=3)
    req.sampling_params.ClearField("max_tokens")
    req.sampling_params.seed = -7  # a signed int32 in vLLM's proto, taken as vLLM does
    assert sorted(m.complete.index for m in stub.Generate(req, timeout=TIMEOUT)) == [0, 1, 2]
    busy = stub.Generate(_req("busy", [5, 6, 7], max_tokens=200, stream=True, ignore_eos=True), timeout=TIMEOUT)
    next(busy)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_req("refused", list(range(5, 30)), max_tokens=400, temperature=1.0, n=3),
                           timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    busy.cancel()
    assert handle.wait_no_pages() == (0, 0)


def test_max_tokens_past_the_context_ends_there_as_vllm_does(vllm) -> None:  # type: ignore[no-untyped-def]
    # vLLM's engine takes it and stops at the context ("length"); it was refused.
    handle, stub = vllm
    room = 12
    prompt = [5 + i % 200 for i in range(handle.engine.max_model_len - room)]
    done = list(stub.Generate(_req("past", prompt, max_tokens=10**6, ignore_eos=True), timeout=TIMEOUT))[0].complete
    assert (done.finish_reason, done.completion_tokens) == ("length", room)


@pytest.mark.parametrize("mutate, field", [
    (lambda r: setattr(r.sampling_params, "top_p", 1.5), "sampling_params.top_p"),
    (lambda r: setattr(r.sampling_params, "logprobs", -1), "sampling_params.logprobs"),
    (lambda r: setattr(r.sampling_params, "min_tokens", 10), "sampling_params.min_tokens"),  # over max_tokens
    (lambda r: r.tokenized.input_ids.append(10**6), "tokenized.input_ids[3]"),
    (lambda r: setattr(r.sampling_params, "structural_tag", "{}"), "sampling_params.structural_tag"),
    (lambda r: setattr(r.sampling_params, "json_schema", "{not json"), "sampling_params.json_schema"),
    (lambda r: setattr(r.sampling_params, "n", 1000), "sampling_params.n"),
    (lambda r: setattr(r, "data_parallel_rank", 2), "data_parallel_rank"),
])
def test_bad_requests_name_the_field(vllm, mutate, field) -> None:  # type: ignore[no-untyped-def]
    _, stub = vllm
    req = _req("bad", [5, 6, 7])
    mutate(req)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.value.trailing_metadata())] == [field]


def test_constraints_go_through_the_grammar_path(vllm) -> None:  # type: ignore[no-untyped-def]
    _, stub = vllm
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    handle, _ = vllm
    tok = handle.server.state.engine_loop.engine.tokenizer
    cases: list[tuple[str, Any]] = [("json_schema", json.dumps(schema)), ("regex", "[a-c]{3}"), ("choice", ["yes", "no"]),
             ("grammar", 'root ::= "x" | "y"'), ("json_object", True),
             # No ::= rule: Lark, as vLLM reads its grammar field (it was refused as bad EBNF).
             ("grammar", 'start: "x" | "y"  // either\n')]
    for kind, value in cases:
        req = _req(f"c-{kind}-{len(str(value))}", [5, 6, 7], max_tokens=40, **{kind: value})
        done = list(stub.Generate(req, timeout=TIMEOUT))[0].complete
        text = tok.decode(list(done.output_ids), skip_special_tokens=True)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), schema)
        elif kind == "regex":
            assert len(text) == 3 and set(text) <= set("abc")
        elif kind == "choice":
            assert text in ("yes", "no")
        elif kind == "grammar":
            assert text in ("x", "y")
        else:  # json_object: an object, whole when it stopped (else cut at max_tokens)
            assert text.lstrip().startswith("{"), text
            if done.finish_reason == "stop":
                assert isinstance(json.loads(text), dict)


def test_cancel_aborts_and_abort_is_idempotent(vllm) -> None:  # type: ignore[no-untyped-def]
    handle, stub = vllm
    call = stub.Generate(_req("c1", [5, 6, 7], max_tokens=500, stream=True, ignore_eos=True), timeout=TIMEOUT)
    next(call)
    call.cancel()
    assert handle.wait_no_pages() == (0, 0)
    stub.Abort(vpb.AbortRequest(request_ids=["c1", "never-seen"]), timeout=TIMEOUT)
    # Abort ends a running request with finish_reason "abort".
    call = stub.Generate(_req("c2", [5, 6, 7], max_tokens=500, stream=True, ignore_eos=True), timeout=TIMEOUT)
    next(call)
    threading.Timer(0.05, lambda: stub.Abort(vpb.AbortRequest(request_ids=["c2"]), timeout=TIMEOUT)).start()
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort"


def test_kv_events_snapshot_then_live_then_flush(vllm) -> None:  # type: ignore[no-untyped-def]
    handle, stub = vllm
    stub.FlushCache(cpb.FlushCacheRequest(), timeout=TIMEOUT)
    events = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=TIMEOUT)
    prompt = list(range(100, 113))  # 3 full pages of 4
    list(stub.Generate(_req("kv1", prompt, max_tokens=1), timeout=TIMEOUT))
    stored: dict[int, list[int]] = {}
    seqs = []
    for batch in events:
        seqs.append(batch.sequence_number)
        for ev in batch.events:
            if ev.HasField("stored"):
                stored.update({b.block_hash: list(b.token_ids) for b in ev.stored.blocks})
            elif ev.HasField("cleared"):
                stored.clear()
        if [prompt[0:4], prompt[4:8], prompt[8:12]] == [t for t in stored.values()][:3]:
            break
    assert seqs == sorted(seqs)
    flushed = stub.FlushCache(cpb.FlushCacheRequest(), timeout=TIMEOUT)
    assert flushed.success
    for batch in events:
        if any(ev.HasField("cleared") or ev.HasField("removed") for ev in batch.events):
            break
    events.cancel()
    assert handle.engine_call(_num_cached) == 0


def test_kv_events_without_a_prefix_cache_say_so(make_server) -> None:  # type: ignore[no-untyped-def]
    # The reason was NO_GENERATION_MODEL, from a server that serves one.
    handle = make_server(engine_factory(page_size=4, enable_prefix_caching=False))
    stub = vpb_grpc.VllmEngineStub(handle.channel)
    with pytest.raises(grpc.RpcError) as err:
        next(stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert error_reason(err.value.trailing_metadata()) == Reason.PREFIX_CACHING_OFF  # type: ignore[attr-defined]


def test_info_loads_tokenizer_and_health(vllm) -> None:  # type: ignore[no-untyped-def]
    handle, stub = vllm
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=TIMEOUT)
    engine = handle.server.state.engine_loop.engine
    assert info.served_model_name == "tiny-llama" and info.max_context_length == engine.max_model_len
    assert list(info.eos_token_ids) == sorted(engine.eos_token_ids) and info.tokenizer_path
    loads = stub.GetLoads(vpb.GetLoadsRequest(), timeout=TIMEOUT)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == engine.config.max_num_seqs
    assert 0.0 <= loads.loads[0].token_usage <= 1.0
    server = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.block_size == 4 and server.uptime_seconds > 0
    chunks = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=TIMEOUT))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    health = health_pb2_grpc.HealthStub(handle.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine"), timeout=TIMEOUT)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    # No profiler: UNIMPLEMENTED, with the ErrorInfo and request id every error carries.
    from service.errors import REQUEST_ID_METADATA, error_reason

    for call in (lambda: stub.StartProfile(cpb.StartProfileRequest(), timeout=TIMEOUT),
                 lambda: stub.StopProfile(cpb.StopProfileRequest(), timeout=TIMEOUT)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        trailers = err.value.trailing_metadata()  # type: ignore[attr-defined]
        assert error_reason(trailers) == "NOT_IMPLEMENTED"
        assert dict(trailers).get(REQUEST_ID_METADATA)


def test_answers_over_the_message_limit_are_refused_by_name(make_server) -> None:  # type: ignore[no-untyped-def]
    # A long prompt's top-20 log-probabilities (or a unary answer's): INVALID_ARGUMENT
    # naming the field, as stencil.v1 does, not gRPC's bare RESOURCE_EXHAUSTED
    # after the write; nothing is left running and the pages are freed.
    from service.errors import error_reason

    handle = make_server(max_message_bytes=4096)
    stub = vpb_grpc.VllmEngineStub(handle.channel)
    ids = list(range(5, 205))
    for stream, field, params in ((False, "sampling_params.prompt_logprobs", {"prompt_logprobs": 20}),
                                  (True, "sampling_params.prompt_logprobs", {"prompt_logprobs": 20}),
                                  (False, "sampling_params.logprobs", {"logprobs": 20})):
        req = _req(f"big-{stream}-{field}", ids, max_tokens=40, stream=stream, ignore_eos=True, **params)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=TIMEOUT))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert error_reason(err.value.trailing_metadata()) == "RESPONSE_TOO_LARGE"
        assert [f for f, _ in bad_request_violations(err.value.trailing_metadata())] == [field]
    # The same answers streamed without prompt log-probabilities fit.
    assert list(stub.Generate(_req("small", ids, max_tokens=40, stream=True, ignore_eos=True, logprobs=20),
                              timeout=TIMEOUT))
    assert handle.wait_no_pages() == (0, 0)


def test_an_abort_of_too_many_ids_is_refused(vllm) -> None:  # type: ignore[no-untyped-def]
    # Millions of ids in one message kept the event loop busy for seconds,
    # every stream and health probe waiting behind it.
    from service.api.convert import MAX_ABORT_IDS
    from service.gen.stencil.v1 import generate_pb2 as pb

    handle, stub = vllm
    ids = [f"r{i}" for i in range(MAX_ABORT_IDS + 1)]
    for call in (lambda: stub.Abort(vpb.AbortRequest(request_ids=ids), timeout=TIMEOUT),
                 lambda: handle.stub.Abort(pb.AbortRequest(request_ids=ids), timeout=TIMEOUT)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in bad_request_violations(err.value.trailing_metadata())] == ["request_ids"]
    stub.Abort(vpb.AbortRequest(request_ids=ids[:MAX_ABORT_IDS]), timeout=TIMEOUT)


def test_a_kv_event_subscriber_that_stops_reading_is_ended(make_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A router that stops reading blocks the server's write; its queue reached
    # the limit and it was dropped, but the drop waited behind the blocked
    # write: the stream stayed open, its handler and queue held for good.
    import asyncio

    from service.vllm_protocol import kv_events
    from service.vllm_protocol.servicer import VllmEngineServicer

    monkeypatch.setattr(kv_events, "MAX_QUEUED", 4)
    handlers: list[asyncio.Task[Any]] = []
    real = VllmEngineServicer.SubscribeKvEvents

    async def recorded(self, request, context):  # type: ignore[no-untyped-def]
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        return await real(self, request, context)

    monkeypatch.setattr(VllmEngineServicer, "SubscribeKvEvents", recorded)
    handle = make_server(engine_factory(page_size=4, kv_cache_gib=0.2))
    stub = vpb_grpc.VllmEngineStub(handle.channel)
    hub = handle.server.kv_events
    # A window of 64 KiB that never grows: the server's writes block soon.
    channel = grpc.insecure_channel(handle.address, options=[("grpc.http2.bdp_probe", 0)])
    events = vpb_grpc.VllmEngineStub(channel).SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=TIMEOUT)
    first = next(events)  # subscribed; read nothing more
    assert first.HasField("snapshot")
    with ThreadPoolExecutor(8) as pool:
        for round_ in range(40):
            if hub.num_subscribers == 0:
                break
            prompts = [[(7 * round_ + 13 * i + k) % 900 + 5 for k in range(120)] for i in range(8)]
            list(pool.map(lambda p: list(stub.Generate(_req(f"r{p[0]}-{p[1]}", p, max_tokens=2),
                                                       timeout=TIMEOUT)), prompts))
    assert hub.num_subscribers == 0, "never dropped: the writes did not block"
    # Its handler ends now, not when the router reads again.
    deadline = time.monotonic() + TIMEOUT
    while not all(task.done() for task in handlers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(handlers) == 1 and handlers[0].done(), "the dropped subscriber's handler still runs"
    assert hub._listening == 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in events:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert error_reason(err.value.trailing_metadata()) == Reason.QUEUE_FULL  # type: ignore[attr-defined]
    channel.close()
