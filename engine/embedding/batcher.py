"""Merge embedding requests from many concurrent callers into shared forward passes.

Futures are completed only outside the batcher's lock: a future runs its
callbacks as it completes, on the completing thread, and a callback may call
back into the batcher.

Callers (threads or asyncio tasks) submit; a request is validated and
tokenized in the caller's thread, so a bad request fails only its caller and
never reaches the queue. One worker thread owns the model: each time it wakes
it takes queued sequences in arrival order up to `max_batch_tokens` (a large
request may span several passes), runs one forward pass, and completes every
request whose sequences are all done. There is no waiting window: while one
pass runs, new requests pile up and go together into the next.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from .pipeline import EmbeddingPipeline, EmbedRequest

EmbedResult = tuple[np.ndarray, int]
# Above this many characters, `embed` tokenizes off the event loop (~1 ms of work).
INLINE_TOKENIZE_CHARS = 16_384
# What one input weighs against that, whatever its length (about 10 us of tokenizer work).
INPUT_CHARS = 64


class BatcherClosed(RuntimeError):
    """The batcher is shut down (or shutting down without draining)."""


class BatcherOverloaded(RuntimeError):
    """Accepting the request would exceed `max_pending_tokens`."""


@dataclass(eq=False)
class _Job:
    request: EmbedRequest
    future: Future[EmbedResult]
    next_seq: int = 0  # first sequence not yet handed to a forward pass
    pooled: list[torch.Tensor] = field(default_factory=list)  # outputs, in sequence order
    started: bool = False
    abandoned: bool = False  # its caller went away (set under the batcher's lock)

    @property
    def num_seqs(self) -> int:
        return len(self.request.token_ids)


class EmbeddingBatcher:
    """Runs EmbeddingPipeline requests from many callers on one worker thread.

    `submit` returns a concurrent Future; `embed_sync` blocks on it and
    `await embed(...)` awaits it. Results are `(float32 array [n, d], prompt
    tokens)`, as from `EmbeddingPipeline.embed`. Use `close()` (or `with`).
    """

    def __init__(self, pipeline: EmbeddingPipeline, max_batch_tokens: int | None = None,
                 max_pending_tokens: int | None = None):
        self.pipeline = pipeline
        self.max_batch_tokens = max_batch_tokens or pipeline.config.max_batch_tokens
        if self.max_batch_tokens < pipeline.max_length:
            raise ValueError(f"max_batch_tokens must be >= the model's max length ({pipeline.max_length})")
        if max_pending_tokens is not None and max_pending_tokens < pipeline.max_length:
            raise ValueError(f"max_pending_tokens must be >= the model's max length ({pipeline.max_length})")
        self.max_pending_tokens = max_pending_tokens
        self._queue: deque[_Job] = deque()
        self._pending_tokens = 0
        self._cond = threading.Condition()
        self._closing = False
        self._forward_passes = 0
        self._pass_started: float | None = None  # time.monotonic() of the pass in flight
        self._thread = threading.Thread(target=self._run, name="stencild-embed", daemon=True)
        self._thread.start()

    @property
    def forward_passes(self) -> int:
        """Forward passes this batcher has run."""
        return self._forward_passes

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    @property
    def thread(self) -> threading.Thread:
        """The worker thread (it waits for the device thread during a pass)."""
        return self._thread

    def stalled_for(self) -> float:
        """Seconds the forward pass in flight has run (0 when none runs)."""
        started = self._pass_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    # -- caller side ---------------------------------------------------------------

    def submit(self, texts: Iterable[str], normalize: bool | None = None, dimensions: int | None = None,
               truncate: bool = False) -> Future[EmbedResult]:
        """Validate and queue a request; raises InvalidRequest, BatcherClosed, BatcherOverloaded.

        A request of more than `max_pending_tokens` tokens is invalid: it could
        never be queued beside another."""
        return self._submit(texts, normalize, dimensions, truncate).future

    def _submit(self, texts: Iterable[str], normalize: bool | None, dimensions: int | None, truncate: bool) -> _Job:
        if self._closing:
            raise BatcherClosed("the embedding batcher is shut down")
        limit = self.max_pending_tokens
        request = self.pipeline.prepare(texts, normalize, dimensions, truncate, max_tokens=limit)
        job = _Job(request, Future())
        tokens = request.prompt_tokens
        with self._cond:
            if self._closing:
                raise BatcherClosed("the embedding batcher is shut down")
            # An idle batcher takes any request within the limit, however large:
            # it would never fit otherwise.
            if limit is not None and self._pending_tokens and self._pending_tokens + tokens > limit:
                raise BatcherOverloaded(
                    f"{self._pending_tokens} tokens already queued; this request adds {tokens} "
                    f"(limit {limit})"
                )
            self._queue.append(job)
            self._pending_tokens += tokens
            self._cond.notify()
        return job

    def embed_sync(self, texts: Iterable[str], normalize: bool | None = None, dimensions: int | None = None,
                   truncate: bool = False, timeout: float | None = None) -> EmbedResult:
        return self.submit(texts, normalize, dimensions, truncate).result(timeout)

    async def embed(self, texts: Iterable[str], normalize: bool | None = None, dimensions: int | None = None,
                    truncate: bool = False) -> EmbedResult:
        """Asyncio API; cancelling the awaiting task drops what of the request
        has not run (whether it is being tokenized, queued or part way through
        its forward passes).

        Small requests are tokenized on the event loop (tens of microseconds);
        large ones in a helper thread, so the loop never stalls for long.
        """
        if not isinstance(texts, (str, bytes)) and isinstance(texts, Iterable):
            texts = list(texts)
            # Each input costs the tokenizer a call of its own: many short (or
            # empty) ones weigh as much as long text.
            chars = sum(len(t) for t in texts if isinstance(t, str)) + INPUT_CHARS * len(texts)
            if chars > INLINE_TOKENIZE_CHARS:
                submitting = asyncio.ensure_future(
                    asyncio.to_thread(self._submit, texts, normalize, dimensions, truncate))
                try:
                    job = await asyncio.shield(submitting)
                except asyncio.CancelledError:
                    # The thread queues the job anyway: drop it once it has.
                    submitting.add_done_callback(self._abandon_submitted)
                    raise
                return await self._result(job)
        return await self._result(self._submit(texts, normalize, dimensions, truncate))

    async def _result(self, job: _Job) -> EmbedResult:
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self._abandon(job)
            raise

    def _abandon_submitted(self, submitting: asyncio.Future[_Job]) -> None:
        if not submitting.cancelled() and submitting.exception() is None:
            self._abandon(submitting.result())

    def _abandon(self, job: _Job) -> None:
        """Its caller went away: unqueue what of `job` has not run (the worker
        drops the rows of a pass in flight)."""
        with self._cond:
            job.abandoned = True
            if job in self._queue:
                self._queue.remove(job)
                self._pending_tokens -= sum(len(t) for t in job.request.token_ids[job.next_seq:])
        job.future.cancel()  # a job not started yet; a started one's future just stays unfinished

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish the queued ones (drain) or fail them with BatcherClosed."""
        dropped: list[_Job] = []
        with self._cond:
            self._closing = True
            if not drain:
                while self._queue:
                    job = self._queue.popleft()
                    self._pending_tokens -= sum(len(t) for t in job.request.token_ids[job.next_seq:])
                    if job.started or job.future.set_running_or_notify_cancel():
                        dropped.append(job)
            self._cond.notify_all()
        # Outside the lock: a future's callbacks run as it completes, and may call back in.
        for job in dropped:
            job.future.set_exception(BatcherClosed("the embedding batcher shut down"))
        self._thread.join(timeout)

    def __enter__(self) -> EmbeddingBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker side ---------------------------------------------------------------

    def _take(self) -> list[tuple[_Job, int, int]] | None:
        """Under the lock: the next pass's (job, first seq, end seq) slices; None to exit."""
        while True:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            taken = self._take_budget()
            if taken:
                return taken
            # Every queued job had been cancelled: wait for real work.

    def _take_budget(self) -> list[tuple[_Job, int, int]]:
        budget = self.max_batch_tokens
        taken: list[tuple[_Job, int, int]] = []
        while self._queue:
            job = self._queue[0]
            if not job.started:
                # False if the caller cancelled while the job was queued.
                if not job.future.set_running_or_notify_cancel():
                    self._queue.popleft()
                    self._pending_tokens -= job.request.prompt_tokens
                    continue
                job.started = True
            ids = job.request.token_ids
            end = job.next_seq
            while end < job.num_seqs and len(ids[end]) <= budget:
                budget -= len(ids[end])
                end += 1
            if end > job.next_seq:
                taken.append((job, job.next_seq, end))
                self._pending_tokens -= sum(len(t) for t in ids[job.next_seq:end])
                job.next_seq = end
            if end < job.num_seqs:
                break  # budget spent; the rest of this job goes first next time
            self._queue.popleft()
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                taken = self._take()
            if taken is None:
                return
            sequences = [s for job, a, b in taken for s in job.request.token_ids[a:b]]
            self._pass_started = time.monotonic()
            try:
                pooled = self.pipeline.forward(sequences)
                self._forward_passes += 1
            except Exception as e:  # noqa: BLE001 - reported to the callers, the worker lives on
                if len(taken) == 1:
                    self._fail([taken[0][0]], e)
                else:
                    self._forward_each(taken)
                continue
            finally:
                self._pass_started = None
            row = 0
            for job, a, b in taken:
                rows, row = pooled[row:row + b - a], row + b - a
                if job.abandoned:
                    job.pooled.clear()
                    continue
                job.pooled.append(rows)
                if b == job.num_seqs and not job.future.done():
                    self._complete(job)

    def _forward_each(self, taken: list[tuple[_Job, int, int]]) -> None:
        """After a merged pass failed: each request's sequences on their own, so
        only the request that breaks a pass fails."""
        for job, a, b in taken:
            if job.abandoned:
                job.pooled.clear()
                continue
            try:
                pooled = self.pipeline.forward(job.request.token_ids[a:b])
                self._forward_passes += 1
            except Exception as e:  # noqa: BLE001
                self._fail([job], e)
                continue
            job.pooled.append(pooled)
            if b == job.num_seqs and not job.future.done():
                self._complete(job)

    def _complete(self, job: _Job) -> None:
        try:
            # Joined by the pipeline, not here: on CUDA this thread's stream is
            # not the one the passes ran on.
            result = (self.pipeline.finish(tuple(job.pooled), job.request), job.request.prompt_tokens)
        except Exception as e:  # noqa: BLE001
            job.future.set_exception(e)
        else:
            job.future.set_result(result)
        job.pooled.clear()

    def _fail(self, jobs: list[_Job], error: Exception) -> None:
        with self._cond:
            for job in jobs:
                if job in self._queue:  # partly run: drop its remaining sequences
                    self._queue.remove(job)
                    self._pending_tokens -= sum(len(t) for t in job.request.token_ids[job.next_seq:])
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)
            job.pooled.clear()
