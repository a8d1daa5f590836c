"""Stream pacing: many streams share a message budget, so each one's tokens
go out in fewer, larger chunks; the text and tokens a client receives are the
same whatever the pacing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from service.gen.stencil.v1 import generate_pb2 as pb

from .helpers import ServerHandle, engine_factory, generate, greedy

TOKENS = 24


def _streams(server: ServerHandle, n: int) -> list[tuple[str, list[int], list]]:
    def one(i: int) -> tuple[str, list[int], list]:
        req = greedy(f"Stream number {i} says", max_new_tokens=TOKENS)
        req.stopping.ignore_eos = True
        text, ids, done, chunks = generate(server.stub, req)
        assert done.finish_reason == pb.GenerateComplete.LENGTH
        return text, ids, chunks

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture(scope="module")
def paced(make_module_server) -> ServerHandle:  # type: ignore[no-untyped-def]
    # 8 streams and 100 messages a second: each waits 80 ms after a chunk,
    # while a step takes 10 ms.
    return make_module_server(engine_factory(slow_s=0.01, max_num_seqs=8), stream_messages_per_s=100.0)


@pytest.fixture(scope="module")
def unpaced(make_module_server) -> ServerHandle:  # type: ignore[no-untyped-def]
    return make_module_server(engine_factory(slow_s=0.01, max_num_seqs=8), stream_messages_per_s=0.0)


def test_paced_streams_send_fewer_chunks_of_the_same_tokens(paced: ServerHandle, unpaced: ServerHandle) -> None:
    slow = _streams(paced, 8)
    fast = _streams(unpaced, 8)
    assert [(t, ids) for t, ids, _ in slow] == [(t, ids) for t, ids, _ in fast]
    chunks_paced = sum(len(c) for _, _, c in slow)
    chunks_unpaced = sum(len(c) for _, _, c in fast)
    assert chunks_unpaced >= 8 * (TOKENS - 2), "unpaced: about one chunk per token"
    assert chunks_paced < chunks_unpaced / 2, (chunks_paced, chunks_unpaced)
    assert all(len(c[0].token_ids) >= 1 for _, _, c in slow), "the first token is not held back"


def test_a_lone_stream_is_not_paced(paced: ServerHandle) -> None:
    [(_, ids, chunks)] = _streams(paced, 1)
    # 1 stream of a budget of 100 a second: 10 ms after each chunk, a step's worth.
    assert len(chunks) >= TOKENS // 3 and len(ids) == TOKENS


def _vllm_streams(server: ServerHandle, n: int) -> list[tuple[list[int], int]]:
    from service.gen.vllm import vllm_engine_pb2 as vpb
    from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

    stub = vpb_grpc.VllmEngineStub(server.channel)

    def one(i: int) -> tuple[list[int], int]:
        req = vpb.GenerateRequest(request_id=f"paced-{i}", tokenized=vpb.TokenizedInput(input_ids=[7 + i, 8, 9]),
                                  stream=True)
        req.sampling_params.max_tokens = TOKENS
        req.sampling_params.temperature = 0.0
        req.sampling_params.ignore_eos = True
        ids: list[int] = []
        chunks = 0
        for msg in stub.Generate(req, timeout=60):
            if msg.HasField("chunk"):
                chunks += 1
                ids += list(msg.chunk.token_ids)
        return ids, chunks

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_paced_vllm_streams_merge_their_tokens_too(paced: ServerHandle, unpaced: ServerHandle) -> None:
    # vLLM's Generate moved each step's outputs onto its queue one by one
    # while it paused, then sent them one message each, ever further behind.
    slow = _vllm_streams(paced, 8)
    fast = _vllm_streams(unpaced, 8)
    assert [ids for ids, _ in slow] == [ids for ids, _ in fast]
    assert all(len(ids) == TOKENS for ids, _ in slow)
    assert sum(c for _, c in slow) < sum(c for _, c in fast) / 2
