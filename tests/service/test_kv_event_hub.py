"""KvEventHub against a real engine loop: batches are numbered on the engine
thread, cross to the event loop only while someone subscribes, and a
subscriber that joins while the engine runs misses nothing."""

from __future__ import annotations

import asyncio
from typing import Any

from engine import EngineConfig, EngineCore, SamplingParams
from engine.kv_cache import wire_hash
from service.engine_loop import EngineLoop, RequestStream
from service.gen.vllm import common_pb2 as cpb
from service.vllm_protocol.kv_events import KvEventHub

TIMEOUT = 60.0


def _engine(preset) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(EngineConfig(str(preset("tiny-llama")), kv_cache_gib=0.02, page_size=4))


def _run(engine: EngineCore, body: Any) -> Any:
    async def main() -> Any:
        loop = EngineLoop(engine)
        loop.start()
        hub = KvEventHub()
        try:
            await hub.attach(loop)
            return await asyncio.wait_for(body(loop, hub), TIMEOUT)
        finally:
            await loop.stop()
    return asyncio.run(main())


def _submit(loop: EngineLoop, i: int, n: int = 24) -> RequestStream:
    engine = loop.engine
    ctx = engine.make_context(engine.tokenizer.encode(f"request number {i} with a prompt of a few pages"),
                              SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
    return loop.submit(ctx)


async def _finish(stream: RequestStream) -> None:
    while not any(o.finished for o in await stream.next_outputs()):
        pass


def _apply(state: dict[int, list[int]], batch: cpb.KvEventBatch) -> None:
    for ev in batch.events:
        if ev.HasField("stored"):
            state.update({b.block_hash: list(b.token_ids) for b in ev.stored.blocks})
        elif ev.HasField("removed"):
            for h in ev.removed.block_hashes:
                state.pop(h, None)
        elif ev.HasField("cleared"):
            state.clear()


def test_without_subscribers_batches_are_numbered_on_the_engine_thread_only(preset) -> None:  # type: ignore[no-untyped-def]
    async def body(loop: EngineLoop, hub: KvEventHub) -> None:
        published: list[int] = []
        publish = hub._publish

        def spy(number: int, events: Any) -> None:
            published.append(number)
            publish(number, events)

        hub._publish = spy  # type: ignore[method-assign]
        await _finish(_submit(loop, 0))
        assert hub.sequence > 0 and published == []
        # Nor are they kept: no router can resume yet (every stored page's
        # tokens were held, up to the history's cap, ~40 MiB).
        assert not hub._history
        # With a subscriber they cross, numbered on from there.
        sub = hub.subscribe()
        snapshot = await sub.__anext__()
        assert snapshot.HasField("snapshot") and snapshot.sequence_number == hub.sequence
        await _finish(_submit(loop, 1))
        live = await asyncio.wait_for(sub.__anext__(), TIMEOUT)
        assert live.sequence_number == snapshot.sequence_number + 1 and published[0] == live.sequence_number
        await sub.aclose()
        assert hub.num_subscribers == 0 and hub._listening == 0

    _run(_engine(preset), body)


def test_subscribers_joining_mid_run_see_every_batch_after_their_snapshot(preset) -> None:  # type: ignore[no-untyped-def]
    async def body(loop: EngineLoop, hub: KvEventHub) -> None:
        running = True

        async def traffic() -> None:  # the cache changes in (nearly) every step
            i = 0
            while running:
                await asyncio.gather(*(_finish(_submit(loop, 100 * i + j)) for j in range(4)))
                i += 1

        feeder = asyncio.ensure_future(traffic())
        try:
            for _ in range(6):
                await asyncio.sleep(0.005)
                sub = hub.subscribe()
                snapshot = await sub.__anext__()
                state: dict[int, list[int]] = {}
                _apply(state, snapshot)
                numbers = [snapshot.sequence_number]
                for _ in range(5):
                    batch = await asyncio.wait_for(sub.__anext__(), TIMEOUT)
                    numbers.append(batch.sequence_number)
                    _apply(state, batch)
                assert numbers == list(range(numbers[0], numbers[0] + 6)), numbers
                # The snapshot plus what followed is the cache as it was at
                # the last batch: checked between steps, with the stream still on.
                def now(engine: EngineCore) -> tuple[int, dict[int, list[int]]]:
                    engine.allocator.flush_events()
                    return hub.sequence, {wire_hash(p.hashes[0]): list(p.tokens[0])
                                          for p in engine.allocator.snapshot()}

                last, actual = await loop.call(now)
                while numbers[-1] < last:
                    batch = await asyncio.wait_for(sub.__anext__(), TIMEOUT)
                    numbers.append(batch.sequence_number)
                    _apply(state, batch)
                assert numbers[-1] == last and state == actual
                await sub.aclose()
        finally:
            running = False
            await feeder
        assert hub._listening == 0

    _run(_engine(preset), body)


def _actual(loop: EngineLoop, hub: KvEventHub) -> Any:
    def now(engine: EngineCore) -> tuple[int, dict[int, list[int]]]:
        engine.allocator.flush_events()
        return hub.sequence, {wire_hash(p.hashes[0]): list(p.tokens[0]) for p in engine.allocator.snapshot()}

    return loop.call(now)


def test_a_large_snapshot_comes_in_numbered_chunks(preset, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # One message for the whole cache failed past the message limits (16 MiB
    # here, 4 MiB in a router) and was built on the event loop.
    from service.vllm_protocol import kv_events

    monkeypatch.setattr(kv_events, "SNAPSHOT_CHUNK_TOKENS", 12)  # 3 pages of 4 tokens a chunk

    async def body(loop: EngineLoop, hub: KvEventHub) -> None:
        for i in range(3):
            await _finish(_submit(loop, i))
        last, actual = await _actual(loop, hub)
        assert last >= len(actual) / 3  # enough numbers below it for 3-page chunks
        sub = hub.subscribe()
        first = await sub.__anext__()
        chunks = [first] + [await sub.__anext__() for _ in range(first.snapshot.count - 1)]
        assert first.snapshot.count > 2 and first.events[0].HasField("cleared")
        assert [c.snapshot.index for c in chunks] == list(range(first.snapshot.count))
        assert [c.sequence_number for c in chunks] == list(range(last - len(chunks) + 1, last + 1))
        assert all(sum(len(e.stored.blocks) for e in c.events) <= 3 for c in chunks)
        state: dict[int, list[int]] = {}
        for c in chunks:
            _apply(state, c)
        assert state == actual and first.snapshot.blocks == len(actual)
        await sub.aclose()

    _run(_engine(preset), body)


def test_a_subscriber_resuming_from_its_cursor_gets_what_it_missed(preset, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A router that reconnects with its cursor (start_sequence_number) takes a
    # snapshot numbered past it for a gap; the batches it missed follow on.
    from service.vllm_protocol import kv_events

    async def body(loop: EngineLoop, hub: KvEventHub) -> None:
        await _finish(_submit(loop, 0))
        sub = hub.subscribe()
        state: dict[int, list[int]] = {}
        snapshot = await sub.__anext__()
        _apply(state, snapshot)
        cursor = snapshot.sequence_number
        await sub.aclose()
        await asyncio.gather(*(_finish(_submit(loop, i)) for i in range(1, 4)))  # missed
        last, actual = await _actual(loop, hub)
        assert last > cursor + 1
        resumed = hub.subscribe(cursor)
        numbers: list[int] = []
        while not numbers or numbers[-1] < last:
            batch = await asyncio.wait_for(resumed.__anext__(), TIMEOUT)
            assert not batch.HasField("snapshot")
            numbers.append(batch.sequence_number)
            _apply(state, batch)
        assert numbers == list(range(cursor + 1, last + 1)) and state == actual
        await resumed.aclose()
        # A cursor the history no longer reaches back to gets the state instead.
        monkeypatch.setattr(kv_events, "HISTORY_TOKENS", 1)
        await _finish(_submit(loop, 9))
        old = hub.subscribe(cursor)
        assert (await old.__anext__()).HasField("snapshot")
        await old.aclose()

    _run(_engine(preset), body)


def test_a_restarted_servers_numbers_never_meet_a_cursor_from_the_one_before(preset) -> None:  # type: ignore[no-untyped-def]
    # Numbered from 1 in every process, a restarted server that had stepped past
    # a router's old cursor replayed its own batches after it, as though they
    # followed the old server's state; the router's index kept stale pages.
    async def before(loop: EngineLoop, hub: KvEventHub) -> int:
        await _finish(_submit(loop, 0))
        return hub.sequence

    cursor = _run(_engine(preset), before)

    async def after(loop: EngineLoop, hub: KvEventHub) -> None:
        await asyncio.gather(*(_finish(_submit(loop, i)) for i in range(1, 5)))
        assert hub.sequence > cursor
        sub = hub.subscribe(cursor)
        first = await sub.__anext__()
        assert first.HasField("snapshot") and first.events[0].HasField("cleared")
        assert first.sequence_number > cursor
        await sub.aclose()

    _run(_engine(preset), after)


def test_a_subscriber_to_an_empty_cache_gets_a_numbered_cleared(preset) -> None:  # type: ignore[no-untyped-def]
    async def body(loop: EngineLoop, hub: KvEventHub) -> None:
        sub = hub.subscribe()
        first = await sub.__anext__()
        assert [e.WhichOneof("data") for e in first.events] == ["cleared"]
        assert first.snapshot.count == 1 and first.sequence_number == hub.sequence
        await _finish(_submit(loop, 0))
        live = await asyncio.wait_for(sub.__anext__(), TIMEOUT)
        assert live.sequence_number == first.sequence_number + 1  # no gap after the cleared
        await sub.aclose()

    _run(_engine(preset), body)
