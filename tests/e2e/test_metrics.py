"""Prometheus metrics of a real server, scraped over HTTP during and after real requests.

Values are checked, not just names: the gauges move while requests run and
return to idle after, the token counters equal the usage the clients saw, an
abort gives its KV pages back, each refusal and status is counted.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from engine.embedding import EmbeddingConfig
from service.api.embeddings import EmbeddingOptions
from service.api.speech import SpeechOptions
from service.gen.stencil.v1 import embed_pb2, embed_pb2_grpc, speech_pb2
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc
from service.ops.telemetry import TelemetryConfig

from .helpers import (
    TIMEOUT,
    ServerHandle,
    engine_factory,
    generate,
    greedy,
    speech_factory,
    synthesize,
)
from .metrics_helpers import Scrape, metrics_url, scrape, wait_for

MODEL = {"model_name": "tiny-llama", "engine": "0"}
GENERATE = "stencil.v1.Generation/Generate"
MAX_PENDING = 4


@pytest.fixture(scope="module")
def msrv(make_module_server: Callable[..., ServerHandle]) -> ServerHandle:
    """tiny-llama at 20 ms a step, metrics on a free port, at most 4 requests in flight."""
    return make_module_server(engine_factory(slow_s=0.02), telemetry=TelemetryConfig(metrics_port=0),
                              max_pending_requests=MAX_PENDING)


def running(s: Scrape) -> float:
    return s.get("vllm:num_requests_running", **MODEL)


def kv_usage(s: Scrape) -> float:
    return s.get("vllm:kv_cache_usage_perc", **MODEL)


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def test_engine_gauges_and_cache_config(msrv: ServerHandle) -> None:
    s = wait_for(msrv, lambda s: running(s) == 0)
    assert s.types["vllm:num_requests_running"] == "gauge"
    assert s.types["vllm:kv_cache_usage_perc"] == "gauge"
    assert s.get("vllm:num_requests_waiting", **MODEL) == 0
    assert kv_usage(s) == 0.0
    num_pages = msrv.engine_call(lambda e: e.allocator.num_pages)
    [info] = s.labels_of("vllm:cache_config_info")
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == str(num_pages)
    assert s.get("vllm:cache_config_info", block_size="16") == 1.0


def test_requests_awaiting_their_compile_count_as_waiting(msrv: ServerHandle) -> None:
    wait_for(msrv, lambda s: running(s) == 0)
    constraints = msrv.server.state.constraints
    assert constraints is not None
    constraints.waiting += 2  # as two requests awaiting a compile do (tests/service/test_structured.py)
    try:
        assert scrape(msrv).get("vllm:num_requests_waiting", **MODEL) == 2
    finally:
        constraints.waiting -= 2


def test_generated_tokens_count_every_token_of_a_step_that_delivers_several(msrv: ServerHandle) -> None:
    # A constraint's forced run comes out several tokens at once: each counts.
    before = wait_for(msrv, lambda s: running(s) == 0)
    req = greedy("Say it:", max_new_tokens=40)
    req.constraint.regex = "the answer is forty two, as it was always going to be"
    result = generate(msrv.stub, req)
    usage = result[2].usage
    assert usage.forced_tokens > 1
    after = wait_for(msrv, lambda s: running(s) == 0)
    assert delta(before, after, "vllm:generation_tokens_total", **MODEL) == usage.completion_tokens


def test_running_goes_up_then_back_and_tokens_match_usage(msrv: ServerHandle) -> None:
    before = wait_for(msrv, lambda s: running(s) == 0)
    n = 3
    results: list[Any] = [None] * n

    def client(i: int) -> None:
        results[i] = generate(msrv.stub, greedy(f"story number {i}", max_new_tokens=24 + i,
                                                stopping={"ignore_eos": True}))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    during = wait_for(msrv, lambda s: running(s) >= 1)
    assert kv_usage(during) > 0.0, "running requests hold KV pages"
    for t in threads:
        t.join(TIMEOUT)
    after = wait_for(msrv, lambda s: running(s) == 0 and kv_usage(s) == 0.0)
    prompt = sum(r[2].usage.prompt_tokens for r in results)
    completion = sum(r[2].usage.completion_tokens for r in results)
    assert completion == sum(24 + i for i in range(n))
    assert delta(before, after, "vllm:prompt_tokens_total", **MODEL) == prompt
    assert delta(before, after, "vllm:generation_tokens_total", **MODEL) == completion
    assert delta(before, after, "vllm:request_success_total", finished_reason="length", **MODEL) == n
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert after.types[name] == "histogram"
        assert delta(before, after, f"{name}_count", **MODEL) == n, name
    # One inter-token observation per delivery after the first: at least one per
    # chunk the clients saw after their first, at most one per token.
    itl = delta(before, after, "vllm:inter_token_latency_seconds_count", **MODEL)
    chunks = sum(len([c for c in r[3] if c.token_ids]) for r in results)
    assert chunks - n <= itl <= completion - n
    # Each request waited at least one 20 ms step end to end.
    e2e = delta(before, after, "vllm:e2e_request_latency_seconds_sum", **MODEL)
    assert e2e >= n * 0.02
    assert delta(before, after, "stencil_rpcs_total", method=GENERATE, code="OK") == n
    assert delta(before, after, "stencil_engine_step_seconds_count", **MODEL) >= max(24 + i for i in range(n))
    assert delta(before, after, "stencil_engine_batch_size_sum", **MODEL) >= completion


def test_abort_gives_the_kv_cache_back(msrv: ServerHandle) -> None:
    idle = wait_for(msrv, lambda s: running(s) == 0)
    idle_usage = kv_usage(idle)
    call = msrv.stub.Generate(greedy("a long story", max_new_tokens=400, stopping={"ignore_eos": True}),
                              timeout=TIMEOUT)
    first = next(call)  # the request is running: its pages are held
    assert first.HasField("chunk")
    busy = wait_for(msrv, lambda s: running(s) == 1)
    assert kv_usage(busy) > idle_usage
    call.cancel()
    wait_for(msrv, lambda s: running(s) == 0 and kv_usage(s) == idle_usage)
    # The final output reaches the event loop a moment after the pages are freed.
    wait_for(msrv, lambda s: delta(idle, s, "vllm:request_success_total", finished_reason="abort",
                                   **MODEL) == 1
             and delta(idle, s, "stencil_rpcs_total", method=GENERATE, code="CANCELLED") == 1)


def test_statuses_and_refusals_are_counted(msrv: ServerHandle) -> None:
    before = scrape(msrv)
    bad = greedy("x")
    bad.sampling.temperature = -1
    with pytest.raises(grpc.RpcError) as err:
        generate(msrv.stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Fill the server, then one more is refused.
    calls = [msrv.stub.Generate(greedy(f"hold {i}", max_new_tokens=400, stopping={"ignore_eos": True}),
                                timeout=TIMEOUT) for i in range(MAX_PENDING)]
    for c in calls:
        next(c)
    with pytest.raises(grpc.RpcError) as err:
        generate(msrv.stub, greedy("one too many"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for c in calls:
        c.cancel()
    after = wait_for(msrv, lambda s: running(s) == 0
                     and delta(before, s, "stencil_rpcs_total", method=GENERATE, code="CANCELLED") == MAX_PENDING)
    assert delta(before, after, "stencil_rpcs_total", method=GENERATE, code="INVALID_ARGUMENT") == 1
    assert delta(before, after, "stencil_rpcs_total", method=GENERATE, code="RESOURCE_EXHAUSTED") == 1
    assert delta(before, after, "stencil_admission_refusals_total", reason="max_pending_requests") == 1
    msrv.wait_pending(0)


def test_constrained_requests_and_compiles(msrv: ServerHandle) -> None:
    before = scrape(msrv)
    req = greedy("Answer:", max_new_tokens=16)
    req.constraint.choice.choices.extend(["yes, certainly", "no, never"])
    outs = [generate(msrv.stub, req) for _ in range(2)]  # the second is a compile cache hit
    # A call is counted as it ends on the server, maybe just after the client saw it end.
    after = wait_for(msrv, lambda s: delta(before, s, "stencil_grammar_compile_cache_hits_total",
                                           kind="choice") == 1)
    forced = sum(o[2].usage.forced_tokens for o in outs)
    assert forced > 0
    assert outs[0][2].grammar_backend == "llguidance"
    labels = {"kind": "choice", "backend": "llguidance"}
    assert delta(before, after, "stencil_constrained_requests_total", **labels) == 2
    assert delta(before, after, "stencil_grammar_forced_tokens_total", **labels) == forced
    saved = delta(before, after, "stencil_grammar_forward_passes_saved_total", **labels)
    assert 0 < saved <= forced
    assert delta(before, after, "stencil_grammar_compile_seconds_count", **labels) == 1
    assert delta(before, after, "stencil_grammar_compile_cache_hits_total", kind="choice") == 1
    assert delta(before, after, "stencil_grammar_mask_seconds_count", **MODEL) >= 1
    # A regex that cannot compile is a failure with its reason.
    bad = greedy("x")
    bad.constraint.regex = "(unclosed"
    with pytest.raises(grpc.RpcError):
        generate(msrv.stub, bad)
    failed = wait_for(msrv, lambda s: delta(after, s, "stencil_grammar_compile_failures_total",
                                            kind="regex", reason="invalid") >= 1)
    assert delta(after, failed, "stencil_grammar_compile_failures_total", kind="regex", reason="invalid") == 1


def test_schema_validations_and_retries(msrv: ServerHandle) -> None:
    # Three unique items from three values: the random model repeats one, and
    # resampling (on by default) rolls the duplicate back.
    schema = ('{"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3, '
              '"uniqueItems": true}')
    before = scrape(msrv)
    outs = []
    for seed in range(4):
        req = greedy(f"u {seed}", max_new_tokens=40)
        req.sampling.temperature = 1.0
        req.sampling.seed = seed
        req.constraint.json_schema = schema
        outs.append(generate(msrv.stub, req))
    after = wait_for(msrv, lambda s: delta(before, s, "stencil_schema_validations_total", result="valid") == 4)
    retries = sum(o[2].usage.schema_retries for o in outs)
    assert retries > 0
    labels = {"kind": "json_schema", "backend": outs[0][2].grammar_backend}
    assert delta(before, after, "stencil_schema_retries_total", **labels) == retries
    assert delta(before, after, "stencil_schema_validations_total", result="invalid") == 0


def test_prefix_cache_counters(msrv: ServerHandle) -> None:
    before = scrape(msrv)
    prompt = "the same long prompt, " * 12  # several full pages
    for _ in range(2):
        generate(msrv.stub, greedy(prompt, max_new_tokens=2))
    after = scrape(msrv)
    queries = delta(before, after, "vllm:prefix_cache_queries_total", **MODEL)
    hits = delta(before, after, "vllm:prefix_cache_hits_total", **MODEL)
    assert hits >= 16, "the second request found the first one's pages"
    assert queries >= hits + 2


def test_thread_and_process_cpu(msrv: ServerHandle) -> None:
    before = scrape(msrv)
    generate(msrv.stub, greedy("count the cpu", max_new_tokens=16))
    after = scrape(msrv)
    assert {lab["thread"] for lab in after.labels_of("stencil_thread_cpu_seconds_total")} == \
        {"event_loop", "engine_0", "device_0"}
    for thread in ("event_loop", "engine_0", "device_0"):
        assert delta(before, after, "stencil_thread_cpu_seconds_total", thread=thread) > 0, thread
    assert after.get("process_cpu_seconds_total") >= after.get("stencil_thread_cpu_seconds_total")
    assert after.get("process_resident_memory_bytes") > 0


def test_metrics_stop_with_the_server(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(telemetry=TelemetryConfig(metrics_port=0))
    url = metrics_url(handle)
    assert "vllm:num_requests_running" in scrape(handle).text
    handle.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_no_metrics_endpoint_by_default(server: ServerHandle) -> None:
    assert server.server.telemetry.metrics is None
    assert server.server.telemetry.metrics_port is None


def test_embed_and_speech_metrics(make_server: Callable[..., ServerHandle]) -> None:
    handle = make_server(embedding=EmbeddingOptions(EmbeddingConfig()),
                         speech=SpeechOptions("demo-speech", speech_factory()),
                         telemetry=TelemetryConfig(metrics_port=0))
    before = scrape(handle)
    stub = embed_pb2_grpc.EmbeddingsStub(handle.channel)
    stub.Embed(embed_pb2.EmbedRequest(inputs=["a cat", "a kitten", "stock prices"]), timeout=TIMEOUT)
    # A router's Embed runs the same model: it was left out of these metrics.
    vpb_grpc.VllmEngineStub(handle.channel).Embed(
        vpb.EmbedRequest(tokenized=vpb.TokenizedInput(original_text="a dog")), timeout=TIMEOUT)
    chunks, _ = synthesize(handle.speech_stub, speech_pb2.SynthesizeRequest(input="Hello.", max_audio_seconds=0.5))
    embed = {"model_name": "all-MiniLM-L6-v2"}
    after = wait_for(handle, lambda s: delta(before, s, "stencil_embed_requests_total", **embed) >= 2)
    assert delta(before, after, "stencil_embed_requests_total", **embed) == 2
    assert delta(before, after, "stencil_embed_inputs_total", **embed) == 4
    assert delta(before, after, "stencil_embed_latency_seconds_count", **embed) == 2
    speech = {"model_name": "demo-speech", "engine": "1"}
    audio = chunks[-1].usage.audio_seconds
    assert delta(before, after, "stencil_speech_requests_total", **speech) == 1
    assert delta(before, after, "stencil_speech_audio_seconds_total", **speech) == pytest.approx(audio)
    assert delta(before, after, "stencil_speech_time_to_first_audio_seconds_count", **speech) == 1
    # The speech engine has a thread of its own; it shares the device thread.
    assert {lab["thread"] for lab in after.labels_of("stencil_thread_cpu_seconds_total")} == \
        {"event_loop", "engine_0", "device_0", "engine_1"}
    # The speech engine has gauges of its own.
    assert {lab["model_name"] for lab in after.labels_of("vllm:num_requests_running")} == \
        {"tiny-llama", "demo-speech"}


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "::"])
def test_an_ipv6_host_serves_grpc_metrics_and_the_cli(host: str, make_server: Callable[..., ServerHandle],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--host ::1` was glued to its port with a colon: grpc failed to bind (`::`
    even bound port 443 of another address) and the client could not connect."""
    from service.cli import main

    handle = make_server(host=host, telemetry=TelemetryConfig(metrics_host=host, metrics_port=0))
    assert handle.address == f"[::1]:{handle.port}"
    assert generate(handle.stub, greedy("Hi", max_new_tokens=2))[2].usage.completion_tokens == 2
    assert "vllm:num_requests_running" in scrape(handle).text
    assert main(["generate", "Hi", "--host", "::1", "--port", str(handle.port), "--max-new-tokens", "2"]) == 0
    assert main(["generate", "Hi", "--host", "[::1]", "--port", str(handle.port), "--max-new-tokens", "2"]) == 0


def test_host_port_brackets_ipv6_literals() -> None:
    from service.address import bare_host, host_port

    assert host_port("127.0.0.1", 1) == "127.0.0.1:1" and host_port("localhost", 2) == "localhost:2"
    assert host_port("::", 3) == "[::]:3" and host_port("[::1]", 4) == "[::1]:4"
    assert host_port("fe80::1%eth0", 5) == "[fe80::1%eth0]:5"
    assert bare_host("[::1]") == "::1" and bare_host("::1") == "::1" and bare_host("a.b") == "a.b"
