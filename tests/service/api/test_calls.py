"""The call registry Abort goes through: calls still preparing, a vLLM call's
other sequences, and an Abort that overtook its call."""

from __future__ import annotations

from typing import Any

import pytest

from service.api import calls
from service.api.calls import CallRegistry


class _Loop:
    """Stands in for an EngineLoop: the ids it runs, and what it was asked to abort."""

    def __init__(self, running: set[str]) -> None:
        self.running = running
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return request_id in self.running


def _loop(*running: str) -> Any:
    return _Loop(set(running))


def test_an_abort_that_overtook_its_call_aborts_it_when_it_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two calls on one connection are not ordered: an Abort sent right after
    # its Generate could come first, find nothing, and the request ran in full.
    now = [100.0]
    monkeypatch.setattr(calls.time, "monotonic", lambda: now[0])
    registry, loop = CallRegistry(), _loop()
    assert not registry.abort("r0", [loop])  # stencil.v1's: answered, nothing remembered
    assert not registry.open("r0", early=True).aborted
    assert not registry.abort("r1", [loop], remember=True)  # a router's: nothing to abort yet
    assert registry.open("r1", early=True).aborted
    assert not registry.open("r2", early=True).aborted
    registry.close("r1", registry.open("r1"))
    assert not registry.open("r1", early=True).aborted  # once only
    registry.abort("late", [loop], remember=True)
    now[0] += calls.EARLY_ABORT_S + 0.1
    assert not registry.open("late", early=True).aborted  # remembered a moment, no longer


def test_a_remembered_router_abort_leaves_a_stencil_call_alone() -> None:
    # A router's Abort that came after its call had ended was remembered, and
    # a stencil.v1 (or Synthesize) call opened under that id then ended
    # CANCELLED at once: their clients reuse ids, and nobody aborted them.
    registry, loop = CallRegistry(), _loop()
    registry.abort("z", [loop], remember=True)
    stencil = registry.open("z")
    assert not stencil.aborted
    registry.close("z", stencil)
    assert stencil.prepared.is_set()
    assert registry.open("z", early=True).aborted  # a router's call under it: as before


def test_remembered_aborts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "EARLY_ABORTS", 3)
    registry, loop = CallRegistry(), _loop()
    for i in range(10):
        registry.abort(f"r{i}", [loop], remember=True)
    assert list(registry._early) == ["r7", "r8", "r9"]


def test_an_abort_finding_its_request_running_or_its_call_preparing_remembers_nothing() -> None:
    registry, loop = CallRegistry(), _loop("running")
    assert registry.abort("running", [loop], remember=True)
    preparing = registry.open("preparing")
    assert registry.abort("preparing", [loop], remember=True) and preparing.aborted
    registry.close("preparing", preparing)
    assert not registry._early


def test_an_abort_reaches_every_sequence_of_a_call(monkeypatch: Any) -> None:
    registry, loop = CallRegistry(), _loop("n#1")
    call = registry.open("n")
    call.others, call.submitted = ["n#1", "n#2"], True
    assert registry.abort("n", [loop])
    assert loop.aborted == ["n", "n#1", "n#2"] and call.aborted


def test_an_abort_waits_for_engine_requests_not_for_a_calls_last_write() -> None:
    # A vLLM call is closed only once its handler returns, after its last
    # write, which a client that stopped reading holds up: stencil.v1's Abort
    # of it waited out its whole bound though the request had left the engine.
    import asyncio

    from service.engine_loop import RequestStream

    class Streams(_Loop):
        def __init__(self) -> None:
            super().__init__(set())
            self.streams: dict[str, RequestStream] = {}

        def stream_of(self, request_id: str) -> RequestStream | None:
            return self.streams.get(request_id)

    async def go() -> None:
        registry, loop = CallRegistry(), Streams()
        call = registry.open("v", early=True)
        waiting = asyncio.ensure_future(registry.wait_ended("v", [loop], timeout=30))  # type: ignore[list-item]
        await asyncio.sleep(0.01)
        assert not waiting.done()  # still preparing
        stream = loop.streams["v"] = RequestStream("v", 1)
        call.submit()
        await asyncio.sleep(0.01)
        assert not waiting.done()  # in the engine
        stream._end()
        del loop.streams["v"]
        await asyncio.wait_for(waiting, 1)  # the call itself is still open: its last write waits

    asyncio.run(go())
