"""The engine thread and its asyncio bridge, against a real tiny engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from engine import EngineConfig, EngineCore, RequestOutput, SamplingParams
from service.engine_loop import AdmissionLimits, EngineFailed, EngineLoop, RequestStream
from service.errors import ServiceError

TIMEOUT = 60.0


@pytest.fixture
def engine(preset) -> EngineCore:
    return EngineCore(EngineConfig(str(preset("tiny-llama")), kv_cache_gib=0.02))


def run(engine: EngineCore, body: Callable[[EngineLoop], Awaitable[Any]], **kwargs: Any) -> Any:
    """Run `body` with a started EngineLoop; stop it afterwards."""
    async def main() -> Any:
        loop = EngineLoop(engine, **kwargs)
        loop.start()
        try:
            return await asyncio.wait_for(body(loop), TIMEOUT)
        finally:
            await loop.stop()
    return asyncio.run(main())


def ctx(engine: EngineCore, text: str = "hello", n: int = 8, rid: str | None = None):  # type: ignore[no-untyped-def]
    return engine.make_context(engine.tokenizer.encode(text),
                               SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), rid)


async def drain(stream: RequestStream) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while not (outs and outs[-1].finished):
        outs += await stream.next_outputs()
    return outs


async def pages(loop: EngineLoop) -> tuple[int, int]:
    return await loop.call(lambda e: (e.allocator.num_used, e.kv_manager.num_active))


def test_requests_stream_to_completion(engine: EngineCore) -> None:
    async def body(loop: EngineLoop) -> None:
        streams = [loop.submit(ctx(engine, f"prompt {i}", n=5 + i)) for i in range(3)]
        assert loop.num_pending == 3
        results = await asyncio.gather(*(drain(s) for s in streams))
        for i, outs in enumerate(results):
            assert sum(len(o.token_ids) for o in outs) == 5 + i
            assert outs[-1].finish_reason == "length"
        assert loop.num_pending == 0 and loop.pending_tokens == 0
        assert await pages(loop) == (0, 0)
        assert loop.stats.finished["length"] == 3
    run(engine, body)


def test_abort_frees_pages_and_ends_the_stream(engine: EngineCore) -> None:
    async def body(loop: EngineLoop) -> None:
        stream = loop.submit(ctx(engine, n=400, rid="a"))
        await stream.next_outputs()
        assert loop.abort("a") and loop.abort("a"), "repeated aborts are harmless"
        assert not loop.abort("unknown")
        outs = await drain(stream)
        assert outs[-1].finish_reason == "cancelled"
        assert await pages(loop) == (0, 0)
    run(engine, body)


def test_admission_limits(engine: EngineCore) -> None:
    async def body(loop: EngineLoop) -> None:
        first = loop.submit(ctx(engine, n=300))
        second = loop.submit(ctx(engine, n=300))
        with pytest.raises(ServiceError) as info:
            loop.submit(ctx(engine, n=4))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(ServiceError) as info:
            loop.submit(ctx(engine, n=4, rid=first.request_id))
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        for s in (first, second):
            loop.abort(s.request_id)
            await drain(s)
        assert loop.stats.rejected == 1
    run(engine, body, limits=AdmissionLimits(max_pending_requests=2))


def test_a_multi_sequence_call_holds_room_for_the_sequences_it_submits_later(engine: EngineCore) -> None:
    # vLLM's n: a call admitted with room for its n sequences submits the
    # others later, past the limits. The room was not held, so concurrent such
    # calls each saw one request in flight (six n=4 calls ran 20 against 8).
    def spec(rid: str) -> Any:
        return engine.requests.check(engine.tokenizer.encode("hello"),
                                     SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True), rid)

    async def body(loop: EngineLoop) -> None:
        first = loop.submit_request(spec("a"), room_for=3)
        with pytest.raises(ServiceError) as info:  # two held for a's others + this one's three > 4
            loop.submit_request(spec("b"), room_for=3)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        others = [loop.submit_request(spec(f"a{i}"), admitted=True) for i in (1,)]  # takes its share
        with pytest.raises(ServiceError):  # one still held for a's third
            loop.submit_request(spec("c"), room_for=2)
        loop.release(1, first.cost)  # a ended before its third started
        last = loop.submit_request(spec("c"))  # 2 running + 1 = 3 of 4
        for s in (first, *others, last):
            loop.abort(s.request_id)
            await drain(s)
        assert loop.num_pending == 0 and loop.pending_tokens == 0
        loop.submit_request(spec("d"), room_for=4)  # all the room is free again
    run(engine, body, limits=AdmissionLimits(max_pending_requests=4))


def test_the_token_room_of_sequences_that_never_started_comes_back_whole(engine: EngineCore) -> None:
    # An n=3 call that ends before its other two start gives back the tokens
    # held for both, not for one: the rest stayed held for good.
    def spec(rid: str) -> Any:
        return engine.requests.check(engine.tokenizer.encode("hello"),
                                     SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True), rid)

    cost = spec("probe").max_length

    async def body(loop: EngineLoop) -> None:
        first = loop.submit_request(spec("a"), room_for=3)
        assert first.cost == cost
        loop.release(2, first.cost)
        second = loop.submit_request(spec("b"), room_for=2)  # a's one + b's two: the whole budget
        for s in (first, second):
            loop.abort(s.request_id)
            await drain(s)
        loop.release(1, second.cost)
        assert loop.pending_tokens == 0
    run(engine, body, limits=AdmissionLimits(max_pending_requests=100, max_pending_tokens=3 * cost))


def test_token_budget(engine: EngineCore) -> None:
    async def body(loop: EngineLoop) -> None:
        big = loop.submit(ctx(engine, n=400))  # over budget, but the server is idle
        with pytest.raises(ServiceError) as info:
            loop.submit(ctx(engine, n=4))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "token budget" in info.value.message
        loop.abort(big.request_id)
        await drain(big)
        await drain(loop.submit(ctx(engine, n=4)))
    run(engine, body, limits=AdmissionLimits(max_pending_tokens=100))


def test_a_request_the_link_could_not_take_holds_nothing(engine: EngineCore) -> None:
    # Handing a request to the engine failed (the link raised): it was
    # registered with its token cost and nothing would ever have released them.
    async def body(loop: EngineLoop) -> None:
        add = loop._link.add

        def failing(*args: Any) -> None:
            raise RuntimeError("the link broke")

        loop._link.add = failing  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError):
            loop.submit(ctx(engine, rid="lost"))
        assert loop.num_pending == 0 and loop.pending_tokens == 0
        loop._link.add = add  # type: ignore[method-assign]
        await drain(loop.submit(ctx(engine, rid="lost")))  # the id is free again
    run(engine, body)


def test_engine_failure_fails_requests_and_calls_back(engine: EngineCore) -> None:
    failures: list[BaseException] = []

    def boom() -> list[RequestOutput]:
        raise RuntimeError("simulated engine bug")

    engine.step = boom  # type: ignore[method-assign]

    async def body(loop: EngineLoop) -> None:
        stream = loop.submit(ctx(engine))
        with pytest.raises(EngineFailed):
            await drain(stream)
        assert failures and not loop.alive
        with pytest.raises(ServiceError) as info:
            loop.submit(ctx(engine))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(EngineFailed):
            await loop.call(lambda e: None)
    run(engine, body, on_failure=failures.append)


def test_stop_ends_streams_still_registered(engine: EngineCore) -> None:
    async def main() -> None:
        loop = EngineLoop(engine)
        loop.start()
        stream = loop.submit(ctx(engine, n=400))
        await stream.next_outputs()
        await loop.stop()
        with pytest.raises(ServiceError) as info:
            await drain(stream)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_pacing_never_holds_back_a_streams_end(engine: EngineCore) -> None:
    # A budget of one message every 5 s for the lone stream: each pause would
    # outlast the whole request. The last output ends the pause at once.
    async def body(loop: EngineLoop) -> tuple[float, int]:
        stream = loop.submit(ctx(engine, "paced", n=12))
        start = asyncio.get_running_loop().time()
        messages = tokens = 0
        while True:
            outs = await stream.next_outputs()
            messages += 1
            tokens += sum(len(o.token_ids) for o in outs)
            if outs[-1].finished:
                assert tokens == 12
                return asyncio.get_running_loop().time() - start, messages
            await loop.pace(stream)

    elapsed, messages = run(engine, body, stream_messages_per_s=0.2)
    assert messages == 2, "the first message, then everything else once the request ended"
    assert elapsed < 2.5, elapsed


def test_a_pause_ends_on_failure_and_is_skipped_once_finished(engine: EngineCore) -> None:
    async def body(loop: EngineLoop) -> None:
        stream = RequestStream("r", cost=1)
        pause = asyncio.ensure_future(stream.pause(30.0))
        await asyncio.sleep(0)
        stream._push(EngineFailed("the engine failed"))
        await asyncio.wait_for(pause, 1.0)
        stream.finished = True
        await asyncio.wait_for(stream.pause(30.0), 1.0)

    run(engine, body)
