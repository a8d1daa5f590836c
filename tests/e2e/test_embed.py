"""The Embeddings service: vectors match sentence-transformers, errors name the
field, concurrent calls share forward passes, health and reflection list it."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine.embedding import EmbeddingConfig, default_model_path
from service.api.embeddings import EmbeddingOptions
from service.cli import main
from service.errors import bad_request_violations
from service.gen.stencil.v1 import embed_pb2 as pb
from service.gen.stencil.v1 import embed_pb2_grpc as pb_grpc
from service.gen.stencil.v1 import generate_pb2

from .helpers import TIMEOUT, ServerHandle, greedy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EMBEDDINGS = "stencil.v1.Embeddings"
GENERATION = "stencil.v1.Generation"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks, " * 6,
    "Structured output constrains every token to a grammar; a JSON schema is compiled "
    "into a token mask that is applied to the logits before sampling. " * 4,
]
LONG = "embedding " * 400  # well over all-MiniLM-L6-v2's 256 tokens


@pytest.fixture(scope="module")
def st_model() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_path()), device="cpu")


def reference(st_model: Any, texts: list[str]) -> np.ndarray:
    return st_model.encode(texts, convert_to_numpy=True, normalize_embeddings=True)


def embed(stub: pb_grpc.EmbeddingsStub, texts: list[str], **fields: Any) -> pb.EmbedResponse:
    return stub.Embed(pb.EmbedRequest(inputs=texts, **fields), timeout=TIMEOUT)


def vectors(resp: pb.EmbedResponse) -> np.ndarray:
    return np.array([list(e.values) for e in resp.embeddings], dtype=np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _error(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


@pytest.fixture
def estub(embed_server: ServerHandle) -> pb_grpc.EmbeddingsStub:
    return pb_grpc.EmbeddingsStub(embed_server.channel)


def test_single_and_batched_match_sentence_transformers(estub: pb_grpc.EmbeddingsStub,
                                                        st_model: Any) -> None:
    ref = reference(st_model, TEXTS)
    single = np.concatenate([vectors(embed(estub, [t])) for t in TEXTS])
    batched = embed(estub, TEXTS)
    assert batched.dimensions == 384 and len(batched.embeddings) == len(TEXTS)
    assert batched.model == "all-MiniLM-L6-v2"
    for got in (single, vectors(batched)):
        assert got.shape == (len(TEXTS), 384)
        assert cosines(got, ref).min() >= 0.9999, cosines(got, ref)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    lengths = [len(st_model.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert batched.usage.prompt_tokens == sum(lengths)


def test_dimensions_truncate_and_renormalize(estub: pb_grpc.EmbeddingsStub, st_model: Any) -> None:
    full = reference(st_model, TEXTS)
    resp = embed(estub, TEXTS, dimensions=64)
    got = vectors(resp)
    assert resp.dimensions == 64 and got.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert cosines(got, full[:, :64]).min() >= 0.9999
    raw = vectors(embed(estub, TEXTS, normalize=False))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3), "left as pooled"
    assert cosines(raw, full).min() >= 0.9999


def test_truncate_cuts_over_long_inputs(estub: pb_grpc.EmbeddingsStub, st_model: Any) -> None:
    err = _error(lambda: embed(estub, ["short", LONG]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["inputs[1]"]
    assert "truncate" in err.details()
    resp = embed(estub, ["short", LONG], truncate=True)
    # sentence-transformers cuts at the model's max_seq_length (256) too.
    assert cosines(vectors(resp), reference(st_model, ["short", LONG])).min() >= 0.9999
    assert resp.usage.prompt_tokens == 3 + 256


@pytest.mark.parametrize("fields, path", [
    ({"inputs": []}, "inputs"),
    ({"inputs": ["a"], "dimensions": 0}, "dimensions"),
    ({"inputs": ["a"], "dimensions": 385}, "dimensions"),
    ({"inputs": ["ok", "fine", LONG]}, "inputs[2]"),
])
def test_invalid_requests_name_the_field(estub: pb_grpc.EmbeddingsStub, fields: dict[str, Any],
                                         path: str) -> None:
    err = _error(lambda: estub.Embed(pb.EmbedRequest(**fields), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == [path]


def test_no_embedding_model_is_failed_precondition(server: ServerHandle) -> None:
    err = _error(lambda: embed(pb_grpc.EmbeddingsStub(server.channel), ["x"]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=EMBEDDINGS)).status == NOT_SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service=GENERATION)).status == SERVING


def test_concurrent_calls_share_forward_passes(embed_server: ServerHandle, estub: pb_grpc.EmbeddingsStub,
                                               st_model: Any) -> None:
    runtime = embed_server.server.embedding.runtime
    assert runtime is not None
    requests = [[f"request {i}: " + TEXTS[i % len(TEXTS)], TEXTS[(i + 1) % len(TEXTS)]] for i in range(16)]
    expected = [reference(st_model, texts) for texts in requests]
    before = runtime.forward_passes
    start = threading.Barrier(16)

    def call(texts: list[str]) -> np.ndarray:
        start.wait(TIMEOUT)
        return vectors(embed(estub, texts))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, requests))
    passes = runtime.forward_passes - before
    assert 1 <= passes < 16, f"{passes} forward passes for 16 calls"
    for got, ref in zip(results, expected, strict=True):
        assert cosines(got, ref).min() >= 0.9999


def test_model_runs_on_the_engine_device_thread(embed_server: ServerHandle,
                                                estub: pb_grpc.EmbeddingsStub) -> None:
    runtime = embed_server.server.embedding.runtime
    loop = embed_server.server.engine_loop
    assert runtime is not None and loop is not None
    device = loop.engine.executor.call(threading.current_thread)
    seen: list[threading.Thread] = []
    encoder = runtime.pipeline.encoder
    real = encoder.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    encoder.forward = spy  # type: ignore[method-assign]
    try:
        embed(estub, ["which thread?"])
    finally:
        del encoder.forward
    assert seen == [device], "the embedding model must share the generation engine's device thread"
    # Generation still works alongside.
    assert list(embed_server.stub.Generate(greedy("hi", max_new_tokens=2), timeout=TIMEOUT))


def test_health_and_reflection_list_embeddings(embed_server: ServerHandle) -> None:
    health = health_pb2_grpc.HealthStub(embed_server.channel)
    for name in ("", GENERATION, EMBEDDINGS):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == SERVING, name
    db = ProtoReflectionDescriptorDatabase(embed_server.channel)
    assert EMBEDDINGS in set(db.get_services())
    desc = db.FindFileContainingSymbol(EMBEDDINGS)
    assert desc.package == "stencil.v1"


def test_embedding_only_server(make_server: Callable[..., ServerHandle], st_model: Any) -> None:
    handle = make_server(generation=False, embedding=EmbeddingOptions(EmbeddingConfig()))
    got = vectors(embed(pb_grpc.EmbeddingsStub(handle.channel), TEXTS[:2]))
    assert cosines(got, reference(st_model, TEXTS[:2])).min() >= 0.9999
    err = _error(lambda: list(handle.stub.Generate(greedy("x"), timeout=TIMEOUT)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = _error(lambda: handle.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    health = health_pb2_grpc.HealthStub(handle.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=EMBEDDINGS)).status == SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service=GENERATION)).status == NOT_SERVING
    # Its model runs on a device thread of its own, which stops with the server.
    runtime = handle.server.embedding.runtime
    assert runtime is not None
    device = runtime.executor.call(threading.current_thread)
    assert device.name == "stencild-device"
    handle.stop()
    deadline = time.monotonic() + TIMEOUT
    while device.is_alive():
        assert time.monotonic() < deadline, "the embedding device thread outlived the server"
        time.sleep(0.02)


def test_cli_embed(embed_server: ServerHandle, capsys: pytest.CaptureFixture[str]) -> None:
    port = str(embed_server.port)
    assert main(["embed", "a cat", "a dog", "--port", port, "--dimensions", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(len(json.loads(line)) == 8 for line in lines)
    assert main(["embed", "a cat", "a kitten", "stock prices", "--port", port, "--similarity"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["[0] a cat", "[1] a kitten", "[2] stock prices"]
    matrix = [[float(x) for x in line.split("]", 1)[1].split()] for line in out[4:7]]
    assert [matrix[i][i] for i in range(3)] == [1.0, 1.0, 1.0]
    assert matrix[0][1] > matrix[0][2], "a cat is nearer a kitten than stock prices"
    assert main(["embed", LONG, "--port", port]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    # An answer over grpc's default 4 MiB client limit (the server allows 16):
    # the server did the work, then the client refused it (RESOURCE_EXHAUSTED).
    assert main(["embed", *["a b"] * 3000, "--port", port]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3000


def test_answers_over_the_message_limit_are_refused_by_name(make_server: Callable[..., ServerHandle]) -> None:
    # 384 floats a vector: 100 inputs are ~155 kB, over a 64 kB limit. Embed
    # refuses before any work, naming `inputs` (gRPC's own check came after
    # the work, as a bare RESOURCE_EXHAUSTED); fewer dimensions fit; Tokenize
    # refuses its oversized answer by name as well.
    from service.errors import error_reason

    handle = make_server(embedding=EmbeddingOptions(EmbeddingConfig()), max_message_bytes=64 * 1024)
    stub = pb_grpc.EmbeddingsStub(handle.channel)
    runtime = handle.server.embedding.runtime
    assert runtime is not None
    before = runtime.batcher.forward_passes
    err = _error(lambda: embed(stub, ["x"] * 100))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(err.trailing_metadata()) == \
        "RESPONSE_TOO_LARGE"
    [(field, text)] = bad_request_violations(err.trailing_metadata())
    assert field == "inputs" and "at most 41 inputs" in text
    assert runtime.batcher.forward_passes == before  # refused before any work
    assert len(embed(stub, ["x"] * 100, dimensions=32).embeddings) == 100
    assert len(embed(stub, ["x"] * 41).embeddings) == 41
    tokenize = generate_pb2.TokenizeRequest(text="word " * 12_000, return_offsets=True)
    err = _error(lambda: handle.stub.Tokenize(tokenize, timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["text"]
    # So does Detokenize (a couple of bytes a token in, up to hundreds out: it
    # ended in gRPC's bare RESOURCE_EXHAUSTED, after the work).
    loop = handle.server.state.engine_loop
    assert loop is not None
    tok = loop.engine.tokenizer
    longest = max(range(loop.engine.vocab_size), key=lambda i: len(tok.decode([i], skip_special_tokens=True)))
    ids = [longest] * (64 * 1024 // len(tok.decode([longest], skip_special_tokens=True)) + 1)
    err = _error(lambda: handle.stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=ids), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(err.trailing_metadata()) == \
        "RESPONSE_TOO_LARGE"
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["token_ids"]


def test_vllm_protocol_embed(embed_server: ServerHandle, st_model: Any) -> None:
    """vLLM's Embed: the input's text (original_text, else the generation
    model's ids decoded) is embedded; ids outside the vocabulary are named
    (checked in numpy: a message holds millions)."""
    from service.gen.vllm import vllm_engine_pb2 as vpb
    from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

    stub = vpb_grpc.VllmEngineStub(embed_server.channel)
    text = TEXTS[1]
    by_text = stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(original_text=text)), timeout=TIMEOUT)
    assert by_text.embedding_dim == len(by_text.embedding) == 384
    np.testing.assert_allclose(by_text.embedding, reference(st_model, [text])[0], atol=1e-5)
    loop = embed_server.server.state.engine_loop
    assert loop is not None
    engine = loop.engine
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    by_ids = stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=ids)), timeout=TIMEOUT)
    decoded = engine.tokenizer.decode(ids, skip_special_tokens=True)
    np.testing.assert_allclose(by_ids.embedding, reference(st_model, [decoded])[0], atol=1e-5)
    bad = [*ids, 5] * 20_000 + [engine.vocab_size]
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=bad)), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.value.trailing_metadata())] == [f"tokenized.input_ids[{len(bad) - 1}]"]
    # Too long for the embedding model: refused, without advice to set a truncate vLLM's request lacks.
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(original_text="word " * 5000)), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum of" in err.value.details() and "truncate" not in err.value.details()


def test_the_watchdog_reports_a_hung_embedding_pass(make_server: Callable[..., ServerHandle],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A pass that never returns left Embeddings SERVING: the watchdog only
    watched engine loops. On an embeddings-only server it is the server."""
    handle = make_server(generation=False, embedding=EmbeddingOptions(EmbeddingConfig()), watchdog_timeout_s=0.5)
    runtime = handle.server.embedding.runtime
    assert runtime is not None
    pipeline = runtime.batcher.pipeline
    release = threading.Event()
    forward = pipeline.forward

    def hung(sequences: Any) -> Any:
        assert release.wait(TIMEOUT)
        return forward(sequences)

    pipeline.forward = hung  # type: ignore[method-assign]
    health = health_pb2_grpc.HealthStub(handle.channel)

    def status(service: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status

    caplog.set_level(logging.ERROR, logger="service.ops.watchdog")
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(embed, pb_grpc.EmbeddingsStub(handle.channel), ["stuck"])
        deadline = time.monotonic() + TIMEOUT
        while status(EMBEDDINGS) != NOT_SERVING:
            assert time.monotonic() < deadline, "the watchdog never reported the hung pass"
            time.sleep(0.05)
        assert status("") == NOT_SERVING
        assert "stencild-embed" in caplog.text
        release.set()
        assert len(call.result(TIMEOUT).embeddings) == 1
    while status(EMBEDDINGS) != SERVING:
        assert time.monotonic() < deadline, "the watchdog never reported the recovery"
        time.sleep(0.05)
