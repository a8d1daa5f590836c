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
