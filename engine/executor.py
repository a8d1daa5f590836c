"""Where device work runs: inline, or on a worker thread so the host overlaps it.

With overlap on, the engine launches step N+1 and then processes step N on the
host (reads tokens, checks stops, advances grammars, detokenizes) while N+1
computes. On CPU the forward pass runs on a worker thread (torch ops and our
kernels release the GIL); on CUDA the worker also issues the kernels on its
own stream, and host copies are non-blocking with an event to wait on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class StepExecutor:
    """Runs step jobs in submission order; inline when `overlap` is False."""

    def __init__(self, device: torch.device, overlap: bool):
        self.device = device
        self.overlap = overlap
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and overlap else None
        self._queue: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if overlap:
            self._thread = threading.Thread(target=self._run, name="stencild-step", daemon=True)
            self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future | DeferredJob:
        """Run `job` after every job submitted before it; `.result()` gives its result.

        Inline (overlap off), the job runs when its result is first asked for,
        so the host can still prepare what the job waits on (grammar masks).
        """
        if self._thread is None:
            return DeferredJob(job)
        future: Future = Future()
        self._queue.put((job, future))
        return future

    def _run(self) -> None:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        with torch.inference_mode():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                job, future = item
                _run_into(job, future)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None


class DeferredJob:
    """A job run on the caller's thread at the first `result()` call."""

    def __init__(self, job: Callable[[], Any]):
        self._job: Callable[[], Any] | None = job
        self._future: Future = Future()

    def result(self) -> Any:
        if self._job is not None:
            job, self._job = self._job, None
            _run_into(job, self._future)
        return self._future.result()


def _run_into(job: Callable[[], Any], future: Future) -> None:
    try:
        with torch.inference_mode():
            future.set_result(job())
    except BaseException as e:  # noqa: BLE001 - the waiter re-raises it
        future.set_exception(e)
