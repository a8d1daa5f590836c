"""Continuous batching with chunked prefill, FCFS admission and preemption.

Each step the scheduler hands out tokens under a budget: running requests
first (in admission order: their decode token, forced tokens, or the next
prompt chunk), then waiting requests in arrival order while the budget, the
cap on running requests and free pages allow. When a running request cannot
get a page, the most recently admitted request is preempted by recompute: its
pages are released (full pages stay in the prefix cache), its context reset,
and it goes back to the front of the queue.

A *suspect* request (one that was in a step that failed) is scheduled alone
until a step of its own succeeds, so a request that breaks steps is found
without failing the others that shared its batch (see EngineCore.step).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .context import Failure, TextContext
from .kv_cache import KVCacheManager
from .token_buffer import TokenBuffer

# A request alone in its step computes a forced run at least this long in one
# eager pass rather than one graph replay per token (see _shape_for_graphs).
LONG_FORCED_RUN = 8


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_seq_len: int = 2048
    num_steps: int = 1  # decode steps per scheduled decode-only batch
    # With overlap, a constrained request whose last token is still in flight
    # may be scheduled speculatively (the step then samples the first forced
    # token, and the rest of a forced run follows a step later), or wait one
    # step and run its whole forced run in one pass (the default).
    speculative_constrained: bool = False
    # Decode graphs run the model (graphs.py): a step whose requests all decode,
    # some with a run of grammar-forced tokens, feeds those runs one token per
    # step (no sample until a run's last token) so the step replays a graph;
    # off: a forced run is computed in one multi-token (eager) pass.
    decode_shaped: bool = False
    # Admission keeps this share of pages free so running requests can grow.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.num_steps < 1:
            raise ValueError("num_steps must be >= 1")


@dataclass
class SchedulerOutput:
    """One step's batch: contexts with next_tokens set, and how many decode steps."""

    contexts: list[TextContext]
    num_steps: int


class Scheduler:
    """Decides which requests run in the next step and with how many tokens.

    It owns the queues, and frees what a request holds (its KV pages, its
    token-buffer row) when the request leaves them: finished, aborted or
    preempted.
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, token_buffer: TokenBuffer):
        self.config = config
        self.kv = kv_manager
        self.token_buffer = token_buffer
        self.waiting: deque[TextContext] = deque()
        self.running: list[TextContext] = []
        # Requests that ended without running a step (aborted, or can never fit);
        # the engine drains this to send their final outputs.
        self.dropped: list[TextContext] = []
        self.num_preemptions = 0
        # Prefix-cache lookups of admitted requests, in tokens (vLLM's
        # prefix_cache_queries / prefix_cache_hits): tokens looked up, tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queue management ---------------------------------------------------
    def add(self, ctx: TextContext) -> None:
        self.waiting.append(ctx)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> TextContext | None:
        for ctx in self.running:
            if ctx.request_id == request_id:
                return ctx
        for ctx in self.waiting:
            if ctx.request_id == request_id:
                return ctx
        return None

    def _release(self, ctx: TextContext) -> None:
        self.kv.release(ctx)
        self.token_buffer.free(ctx)

    def remove(self, ctx: TextContext) -> None:
        """Drop `ctx` from the queues and free its pages (finished or aborted)."""
        if ctx in self.running:
            self.running.remove(ctx)
        elif ctx in self.waiting:
            self.waiting.remove(ctx)
        self._release(ctx)

    def abort(self, ctx: TextContext) -> None:
        """End `ctx` now: free its pages and report it as dropped."""
        self.remove(ctx)
        self.dropped.append(ctx)

    def take_dropped(self) -> list[TextContext]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def requeue(self, ctx: TextContext) -> None:
        """Send `ctx` back to the front of the queue to be recomputed from scratch
        (its work in flight is discarded, its pages freed)."""
        if ctx in self.running:
            self.running.remove(ctx)
        elif ctx in self.waiting:
            self.waiting.remove(ctx)
        self._release(ctx)
        ctx.reset()
        self.waiting.appendleft(ctx)

    # -- scheduling ---------------------------------------------------------
    def _preempt(self, victim: TextContext) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.reset()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput | None:
        suspect = next((c for c in (*self.running, *self.waiting) if c.sched.suspect), None)
        if suspect is not None:
            return self._schedule_alone(suspect)
        budget = self.config.max_num_batched_tokens
        scheduled: list[TextContext] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            ctx = self.running[i]
            if ctx.end_idx >= min(ctx.max_length, self.config.max_seq_len):
                i += 1  # nothing left to compute; waiting for in-flight tokens
                continue
            if ctx.constrained and ctx.pending_futures and not self.config.speculative_constrained \
                    and ctx.sampling_params.logprobs is None:
                # Its forced tokens are known once the in-flight token is. (A
                # thought is sampled freely: it runs on, its mask decided when
                # the step's grammar mask is filled. A request with
                # log-probabilities has no forced runs to wait for: each
                # forced token is sampled, step_masks.StepMasks.advance.)
                i += 1
                continue
            n = min(ctx.end_idx - ctx.start_idx, budget)
            while not self.kv.reserve(ctx, ctx.start_idx + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is ctx:
                    break
            if ctx.is_done or ctx not in self.running:
                continue  # ctx itself was preempted; nothing after it remains
            ctx.set_chunk(n)
            scheduled.append(ctx)
            budget -= n
            i += 1
        if not preempted:
            self._admit(scheduled, budget)
        if not scheduled:
            return None
        if self.config.decode_shaped:
            self._shape_for_graphs(scheduled)
        return SchedulerOutput(scheduled, self._num_steps(scheduled))

    @staticmethod
    def _shape_for_graphs(scheduled: list[TextContext]) -> None:
        """Cut forced-token runs to one token each when that makes the step a
        graph replay: one eager pass costs several replays (launch-bound: about
        5x on an H200 for a 1.1B model), and it would be paid by every row of
        the batch. A step with a prompt chunk is eager anyway, as is one
        recomputing tokens already generated (after a preemption, past the
        prompt): its chunks stay whole, else the recompute took a step a
        token. A request alone with a long run keeps it whole."""
        if any(c.start_idx < c.prompt_len for c in scheduled):
            return
        runs = [c for c in scheduled if c.active_length > 1]
        if not runs or (len(scheduled) == 1 and runs[0].active_length >= LONG_FORCED_RUN):
            return
        if not all(_forced_run(c) for c in runs):
            return
        for ctx in runs:
            ctx.set_chunk(1)

    def _schedule_alone(self, ctx: TextContext) -> SchedulerOutput | None:
        """A step of `ctx` and nothing else (None while its last step is in flight).

        Other requests are preempted if that is what it takes to give it pages.
        """
        budget = self.config.max_num_batched_tokens
        if ctx in self.waiting:
            self.waiting.remove(ctx)
            self.waiting.appendleft(ctx)  # admission takes it first
            while True:
                scheduled: list[TextContext] = []
                self._admit(scheduled, budget, limit=1)
                if scheduled:
                    return SchedulerOutput(scheduled, 1)
                if ctx not in self.waiting or not self.running:
                    return None  # dropped: it can never fit
                self._preempt(self.running[-1])
                self.waiting.remove(ctx)
                self.waiting.appendleft(ctx)
        if ctx.end_idx >= min(ctx.max_length, self.config.max_seq_len) or ctx.pending_futures:
            return None
        n = min(ctx.end_idx - ctx.start_idx, budget)
        while not self.kv.reserve(ctx, ctx.start_idx + n):
            others = [c for c in self.running if c is not ctx]
            if not others:
                self._preempt(ctx)  # it does not fit even alone; it is retried from the queue
                return None
            self._preempt(others[-1])
        ctx.set_chunk(n)
        return SchedulerOutput([ctx], 1)

    def _admit(self, scheduled: list[TextContext], budget: int, limit: int | None = None) -> None:
        reserve_pages = int(self.config.watermark * self.kv.allocator.num_pages)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and (limit is None or len(scheduled) < limit):
            ctx = self.waiting[0]
            # Requests asking for prompt log-probabilities need every prompt position computed.
            lookup = ctx.sampling_params.prompt_logprobs is None
            queried = ctx.end_idx
            hit = self.kv.claim(ctx, use_prefix_cache=lookup)
            n = min(ctx.end_idx - ctx.start_idx, budget)
            pages_needed = -(-(ctx.start_idx + n) // self.kv.page_size) - self.kv.num_pages_held(ctx.request_id)
            if pages_needed > self.kv.allocator.num_free - (reserve_pages if self.running else 0) \
                    or not self.kv.reserve(ctx, ctx.start_idx + n):
                self._release(ctx)
                if hit:
                    ctx.reset()  # an undone prefix hit: computed from the start
                if not self.running and not scheduled:
                    # Nothing runs and it still does not fit: it never will.
                    self.waiting.popleft()
                    ctx.fail(Failure("request does not fit in the KV cache"))
                    self.dropped.append(ctx)
                    continue
                break
            self.waiting.popleft()
            self.running.append(ctx)
            if ctx.output.times.scheduled is None:
                # As vLLM: a request's cached prompt tokens (and the cache's
                # hit rate) are those of its first admission; a preempted
                # request finding its own pages again is no cache hit.
                ctx.output.times.scheduled = time.monotonic()
                ctx.sched.num_cached_prompt_tokens = min(hit, ctx.prompt_len)
                if lookup and self.kv.allocator.enable_prefix_caching:
                    self.prefix_cache_queries += queried
                    self.prefix_cache_hits += hit
            ctx.set_chunk(n)
            scheduled.append(ctx)
            budget -= n

    def _num_steps(self, scheduled: list[TextContext]) -> int:
        steps = self.config.num_steps
        if steps == 1 or not all(c.can_multi_step() for c in scheduled):
            return 1
        steps = min([steps] + [c.compute_num_available_steps(self.config.max_seq_len) for c in scheduled])
        if steps <= 1:
            return 1
        # Pages for the extra tokens; fall back to a single step if they are short.
        for ctx in scheduled:
            if not self.kv.reserve(ctx, ctx.start_idx + steps):
                return 1
        return steps


def _forced_run(ctx: TextContext) -> bool:
    """Whether ctx's chunk is its last token and a run the grammar forced
    after it (not tokens computed before, being recomputed)."""
    forced = ctx.grammar.forced_positions
    return all(p in forced for p in range(ctx.start_idx + 1, ctx.active_idx))
