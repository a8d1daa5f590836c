"""FairQueue, the compiler's run queue: fair between tenants, cheap jobs first,
expiry at the deadline, places held for respawns. Jobs here are plain
functions that wait on events, so the order is exact and the tests quick."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from typing import Any

import pytest

from grammar._queue import FairQueue, Job

LONG = 30.0  # a deadline never reached in these tests


class Busy(Exception):
    pass


@pytest.fixture
def make_queue() -> Iterator[Callable[..., FairQueue]]:
    made: list[FairQueue] = []

    def make(threads: int, per_tenant: int) -> FairQueue:
        made.append(FairQueue(threads, per_tenant, "test-queue"))
        return made[-1]

    yield make
    for q in made:
        q.close()


class Recorder:
    """Jobs that note when they start and, if asked, wait for a release."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.lock = threading.Lock()
        self.gates: dict[str, threading.Event] = {}

    def job(self, name: str, blocking: bool = False) -> Callable[[], str]:
        gate = self.gates.setdefault(name, threading.Event())
        if not blocking:
            gate.set()

        def run() -> str:
            with self.lock:
                self.started.append(name)
            assert gate.wait(LONG)
            return name

        return run

    def release(self, name: str) -> None:
        self.gates[name].set()

    def wait_started(self, name: str, limit: float = 5.0) -> None:
        deadline = time.monotonic() + limit
        while name not in self.started:
            assert time.monotonic() < deadline, f"{name} never started (started: {self.started})"
            time.sleep(0.002)


def submit(q: FairQueue, tenant: str, run: Callable[[], Any], cost: int = 1,
           deadline: float | None = None) -> Job:
    return q.submit(tenant, cost, time.monotonic() + LONG if deadline is None else deadline, run, Busy)


def test_one_tenants_slow_jobs_never_hold_every_thread(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=2, per_tenant=1)
    rec = Recorder()
    slow = [submit(q, "a", rec.job(f"a{i}", blocking=True), cost=1000) for i in range(5)]
    rec.wait_started("a0")
    start = time.monotonic()
    cheap = submit(q, "b", rec.job("b0"))
    assert cheap.future.result(5) == "b0"
    assert time.monotonic() - start < 0.5  # at once, not after a's jobs
    assert rec.started == ["a0", "b0"]  # a still runs one job at a time
    assert q.tenants()["a"] == (4, 1)
    for i in range(5):
        rec.release(f"a{i}")
    assert [j.future.result(5) for j in slow] == [f"a{i}" for i in range(5)]


def test_a_tenants_cheapest_job_goes_first(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=1, per_tenant=1)
    rec = Recorder()
    first = submit(q, "a", rec.job("blocker", blocking=True))
    rec.wait_started("blocker")
    jobs = [submit(q, "a", rec.job(name), cost=cost) for name, cost in
            (("big", 700_000), ("small", 40), ("medium", 5_000), ("small-too", 40))]
    rec.release("blocker")
    for job in (first, *jobs):
        job.future.result(5)
    assert rec.started == ["blocker", "small", "small-too", "medium", "big"]


def test_the_tenant_served_least_recently_goes_first(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=1, per_tenant=1)
    rec = Recorder()
    jobs = [submit(q, "a", rec.job("a0", blocking=True))]
    rec.wait_started("a0")
    jobs += [submit(q, "a", rec.job(f"a{i}")) for i in (1, 2)]
    jobs += [submit(q, "b", rec.job(f"b{i}")) for i in (0, 1)]
    jobs += [submit(q, "c", rec.job("c0"))]
    rec.release("a0")
    for job in jobs:
        job.future.result(5)
    # b and c have never been served, a just was; then in turns.
    assert rec.started == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_a_tenant_that_sends_one_job_at_a_time_keeps_its_place(make_queue: Callable[..., FairQueue]) -> None:
    """A tenant whose queue emptied was forgotten, so a client that sends,
    waits, then sends again came back as never served and overtook tenants
    served less recently (here d, waiting since before a's first job ran)."""
    q = make_queue(threads=1, per_tenant=1)
    rec = Recorder()
    jobs = [submit(q, "d", rec.job("d1", blocking=True))]
    rec.wait_started("d1")
    jobs += [submit(q, "a", rec.job("a1", blocking=True)), submit(q, "d", rec.job("d2")),
             submit(q, "b", rec.job("b1", blocking=True))]
    rec.release("d1")
    rec.wait_started("a1")
    rec.release("a1")
    rec.wait_started("b1")  # a has nothing queued now
    jobs.append(submit(q, "a", rec.job("a2")))  # a's next compile
    rec.release("b1")
    for job in jobs:
        job.future.result(5)
    assert rec.started == ["d1", "a1", "b1", "d2", "a2"]


def test_a_job_still_queued_at_its_deadline_fails_then(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=1, per_tenant=1)
    rec = Recorder()
    blocker = submit(q, "a", rec.job("blocker", blocking=True))
    rec.wait_started("blocker")
    start = time.monotonic()
    late = submit(q, "a", rec.job("late"), deadline=start + 0.2)
    with pytest.raises(Busy):
        late.future.result(5)
    assert 0.15 < time.monotonic() - start < 1.0  # at its deadline, not when the blocker ends
    assert "late" not in rec.started
    rec.release("blocker")
    assert blocker.future.result(5) == "blocker"


def test_a_job_nobody_waits_for_leaves_the_queue(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=1, per_tenant=1)
    rec = Recorder()
    blocker = submit(q, "a", rec.job("blocker", blocking=True))
    rec.wait_started("blocker")
    shared = submit(q, "a", rec.job("shared"))
    q.join(shared, "a")  # a second caller of the same tenant
    assert q.leave(shared, "a") is False  # one still waits
    assert q.leave(shared, "a") is True  # the last one: off the queue
    shared.future.cancel()
    assert q.leave(blocker, "a") is False  # running: it runs on
    rec.release("blocker")
    assert blocker.future.result(5) == "blocker"
    after = submit(q, "a", rec.job("after"))
    assert after.future.result(5) == "after"
    assert rec.started == ["blocker", "after"]
    with pytest.raises(CancelledError):
        shared.future.result(0)


def test_a_job_shared_by_two_tenants_runs_at_the_first_turn(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=2, per_tenant=1)
    rec = Recorder()
    a_busy = submit(q, "a", rec.job("a-busy", blocking=True))
    rec.wait_started("a-busy")
    shared = submit(q, "a", rec.job("shared"))  # a is at its limit: queued
    time.sleep(0.05)
    assert "shared" not in rec.started
    q.join(shared, "b")  # b asks for the same: b has a free place
    assert shared.future.result(5) == "shared"
    rec.release("a-busy")
    a_busy.future.result(5)


def test_a_held_place_is_kept_after_the_result_is_out(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=2, per_tenant=1)
    rec = Recorder()
    respawned = threading.Event()

    def killing_job() -> str:
        q.hold(lambda timeout: respawned.wait(timeout))  # as the compiler does on a kill
        return "killed"

    first = submit(q, "a", killing_job)
    assert first.future.result(5) == "killed"  # delivered at once
    second = submit(q, "a", rec.job("a1"))
    other = submit(q, "b", rec.job("b0"))
    assert other.future.result(5) == "b0"  # b is not held up
    time.sleep(0.1)
    assert "a1" not in rec.started  # a's place is held until the respawn
    respawned.set()
    assert second.future.result(5) == "a1"


def test_closing_cancels_what_is_queued(make_queue: Callable[..., FairQueue]) -> None:
    q = make_queue(threads=1, per_tenant=1)
    rec = Recorder()
    running = submit(q, "a", rec.job("running", blocking=True))
    rec.wait_started("running")
    queued = submit(q, "a", rec.job("queued"))
    q.close()
    assert queued.future.cancelled()
    rec.release("running")
    assert running.future.result(5) == "running"
    with pytest.raises(RuntimeError):
        submit(q, "a", rec.job("late"))


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        FairQueue(0, 1)
    with pytest.raises(ValueError):
        FairQueue(2, 0)
