"""`FairQueue`: the compiler's run queue, fair between tenants, cheap jobs first.

A tenant is whoever a compile is for (the service passes the caller's API key
name, or its connection without keys); the queue only compares the strings.
The rules, in order:

- each tenant runs at most `per_tenant` jobs at once, fewer than there are
  runner threads (and compile workers), so one tenant's slow compiles never
  hold every worker: another tenant's job starts as soon as it is queued;
- among tenants with a job queued and a free place, the one that started a
  job least recently goes first (a new tenant before one that has been
  served all along);
- within a tenant, the cheapest job first (`cost`: the spec's size), arrival
  order between equals; so a tenant's own small constraint passes its large
  ones;
- a job still queued at its deadline is taken off the queue and failed at
  once with its `expired` error, instead of waiting for its turn to find out;
- a job may keep its tenant's place after it ends (`hold`): the compiler holds
  it until the worker its timeout killed has been replaced, so a tenant whose
  compiles keep timing out pays for the respawns instead of emptying the pool
  for the others.

One job may be waited on by several tenants (the same spec asked for twice):
it is queued for each and runs at the first turn any of them gets, charged to
that one.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

# How long a job's place is held at most for one `hold`.
_MAX_HOLD_S = 120.0


def _ran() -> Any:
    raise RuntimeError("this job has run")


@dataclass(eq=False)
class Job:
    """One queued compile: what to run, for whom, by when."""

    run: Callable[[], Any]
    future: Future[Any]
    cost: int
    deadline: float  # time.monotonic()
    expired: Callable[[], BaseException]  # the error of a job that never started in time
    seq: int
    waiters: dict[str, int] = field(default_factory=dict)  # tenant -> callers waiting
    state: str = "queued"  # queued, running, done (or dropped)
    holds: list[Callable[[float], object]] = field(default_factory=list)


# Idle tenants whose last start is remembered (the oldest is forgotten first).
_LAST_STARTS_KEPT = 4096


@dataclass(eq=False)
class _Tenant:
    queue: list[tuple[int, int, Job]] = field(default_factory=list)  # heap of (cost, seq, job)
    running: int = 0
    last_start: float = float("-inf")


class FairQueue:
    """Runs jobs on `threads` threads, at most `per_tenant` at once per tenant."""

    def __init__(self, threads: int, per_tenant: int, name: str = "grammar-compile") -> None:
        if threads < 1 or per_tenant < 1:
            raise ValueError("threads and per_tenant must be >= 1")
        self.per_tenant = per_tenant
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # runners: a job may start
        self._timer = threading.Condition(lock)  # the reaper: the earliest deadline moved
        self._tenants: dict[str, _Tenant] = {}
        # When tenants with nothing queued last started a job (oldest first,
        # bounded): one that sends a compile at a time comes back with its
        # place, not as a tenant never served.
        self._last_starts: dict[str, float] = {}
        self._deadlines: list[tuple[float, int, Job]] = []  # heap of queued jobs; stale entries skipped
        self._seq = itertools.count()
        self._closed = False
        self._local = threading.local()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        # Expiry has a thread of its own: every runner may be busy with a job.
        self._threads.append(threading.Thread(target=self._reap, name=f"{name}-deadlines", daemon=True))
        for t in self._threads:
            t.start()

    # -- callers ---------------------------------------------------------------
    def submit(self, tenant: str, cost: int, deadline: float, run: Callable[[], Any],
               expired: Callable[[], BaseException]) -> Job:
        """Queue `run` for `tenant`; its result (or exception) completes `job.future`."""
        job = Job(run, Future(), cost, deadline, expired, next(self._seq))
        with self._cond:
            if self._closed:
                raise RuntimeError("the queue is closed")
            heapq.heappush(self._deadlines, (deadline, job.seq, job))
            if self._deadlines[0][2] is job:
                self._timer.notify()
            self._enqueue(job, tenant)
            self._cond.notify()
        return job

    def join(self, job: Job, tenant: str) -> None:
        """One more caller, of `tenant`, waits for `job`: it is queued for that tenant too."""
        with self._cond:
            if job.state == "queued":
                self._enqueue(job, tenant)
                self._cond.notify()
            else:
                job.waiters[tenant] = job.waiters.get(tenant, 0) + 1

    def leave(self, job: Job, tenant: str) -> bool:
        """A caller of `tenant` stopped waiting. True when nobody waits any more
        and the job had not started: it is off the queue, and the caller should
        cancel its future."""
        with self._cond:
            left = job.waiters.get(tenant, 0) - 1
            if left > 0:
                job.waiters[tenant] = left
            else:
                job.waiters.pop(tenant, None)
                state = self._tenants.get(tenant)
                if state is not None and job.state == "queued":
                    state.queue = [e for e in state.queue if e[2] is not job]
                    heapq.heapify(state.queue)
                    self._drop_if_idle(tenant)
            if job.waiters or job.state != "queued":
                return False
            job.state = "done"
            return True

    def hold(self, wait: Callable[[float], object]) -> None:
        """Called from a running job: keep its tenant's place after it ends until
        `wait(timeout)` returns (the thread runs it once the job's result is out)."""
        job = getattr(self._local, "job", None)
        if job is not None:
            job.holds.append(wait)

    def tenants(self) -> dict[str, tuple[int, int]]:
        """tenant -> (jobs queued, jobs running): for tests and diagnostics."""
        with self._cond:
            return {name: (sum(1 for _, _, j in t.queue if j.state == "queued"), t.running)
                    for name, t in self._tenants.items()}

    def close(self) -> None:
        """Stop taking jobs; queued ones are cancelled, running ones finish."""
        with self._cond:
            self._closed = True
            queued = [j for t in self._tenants.values() for _, _, j in t.queue if j.state == "queued"]
            for job in queued:
                job.state = "done"
            for t in self._tenants.values():
                t.queue.clear()
            self._cond.notify_all()
            self._timer.notify_all()
        for job in queued:
            job.future.cancel()

    # -- the runner threads ------------------------------------------------------
    def _enqueue(self, job: Job, tenant: str) -> None:
        first = tenant not in job.waiters
        job.waiters[tenant] = job.waiters.get(tenant, 0) + 1
        if first:
            state = self._tenants.get(tenant)
            if state is None:
                state = self._tenants[tenant] = _Tenant(last_start=self._last_starts.pop(tenant, float("-inf")))
            heapq.heappush(state.queue, (job.cost, job.seq, job))

    def _drop_if_idle(self, tenant: str) -> None:
        state = self._tenants[tenant]
        if state.running == 0 and not any(j.state == "queued" for _, _, j in state.queue):
            self._forget(tenant)

    def _forget(self, tenant: str) -> None:
        """Drop an idle tenant, keeping when it last started a job."""
        state = self._tenants.pop(tenant)
        if state.last_start > float("-inf"):
            self._last_starts[tenant] = state.last_start
            if len(self._last_starts) > _LAST_STARTS_KEPT:
                del self._last_starts[next(iter(self._last_starts))]

    def _next(self) -> tuple[Job, str] | None:
        """The job to start now, and the tenant it is charged to (under the lock)."""
        best: tuple[float, str, _Tenant] | None = None
        idle: list[str] = []
        for name, state in self._tenants.items():
            while state.queue and state.queue[0][2].state != "queued":
                heapq.heappop(state.queue)  # started for another tenant, expired or left
            if not state.queue:
                if state.running == 0:
                    idle.append(name)
                continue
            if state.running < self.per_tenant and (best is None or state.last_start < best[0]):
                best = (state.last_start, name, state)
        for name in idle:
            self._forget(name)
        if best is None:
            return None
        _, name, state = best
        _, _, job = heapq.heappop(state.queue)
        job.state = "running"
        state.running += 1
        state.last_start = time.monotonic()
        return job, name

    def _expired(self) -> list[Job]:
        """Queued jobs past their deadline, taken off the queue (under the lock)."""
        now = time.monotonic()
        out: list[Job] = []
        while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][2].state != "queued"):
            _, _, job = heapq.heappop(self._deadlines)
            if job.state == "queued":
                job.state = "done"
                out.append(job)
        for job in out:
            for tenant in job.waiters:
                if tenant in self._tenants:
                    self._drop_if_idle(tenant)
        return out

    def _wait_time(self) -> float | None:
        return max(0.0, self._deadlines[0][0] - time.monotonic()) if self._deadlines else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    picked = self._next()
                    if picked is not None:
                        break
                    self._cond.wait()
            self._run(*picked)

    def _reap(self) -> None:
        while True:
            with self._timer:
                if self._closed:
                    return
                expired = self._expired()
                if not expired:
                    self._timer.wait(self._wait_time())
                    continue
            for job in expired:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(job.expired())

    def _run(self, job: Job, tenant: str) -> None:
        try:
            if job.future.set_running_or_notify_cancel():
                self._local.job = job
                try:
                    result = job.run()
                except BaseException as e:  # delivered to the waiters, as an executor would
                    job.future.set_exception(e)
                else:
                    job.future.set_result(result)
                finally:
                    self._local.job = None
                for wait in job.holds:
                    wait(_MAX_HOLD_S)
        finally:
            job.run = _ran  # what it closed over (a spec, a given compile) is not kept with the job
            with self._cond:
                job.state = "done"
                # Off the deadline heap now, not once its deadline passes: its
                # future's callbacks hold what its waiters got (their matchers).
                self._deadlines = [e for e in self._deadlines if e[2] is not job]
                heapq.heapify(self._deadlines)
                self._tenants[tenant].running -= 1
                self._drop_if_idle(tenant)
                self._cond.notify_all()
