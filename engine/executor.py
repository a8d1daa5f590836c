"""The device thread: every model computation runs on one dedicated thread.

Two reasons for one thread:

- Overlap. The engine launches step N+1 on this thread and then processes step
  N on the host (reads tokens, checks stops, advances grammars, detokenizes)
  while N+1 computes. Torch ops and our kernels release the GIL, so the two
  threads run at once. On CUDA the thread issues kernels on its own stream and
  host copies are non-blocking with an event to wait on.
- OpenMP. libgomp keeps a thread team per thread that runs parallel regions;
  once two threads have done so, it throttles spin-waiting (more managed
  threads than CPUs) and small GEMMs slow down by 10-35% on a 2-core machine.
  So model loading, weight prepacking and every step share this one thread,
  with overlap on or off, whichever thread drives the engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from .devices import require_present

T = TypeVar("T")


class StepExecutor:
    """Runs jobs in submission order on the device thread."""

    def __init__(self, device: torch.device):
        require_present(device)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="stencild-device", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The device thread (None once closed), for its CPU time."""
        return self._thread

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Queue `job` after every job submitted before it."""
        future: Future[T] = Future()
        with self._lock:
            # Checked under the lock so nothing is queued behind the stop marker.
            closed = self._closed
            if not closed:
                self._queue.put((job, future))
        if closed:  # completed outside the lock, like every future here
            future.set_exception(RuntimeError("the device thread has stopped"))
        return future

    def call(self, job: Callable[[], T]) -> T:
        """Run `job` on the device thread and wait for its result."""
        if threading.current_thread() is self._thread:
            return job()
        return self.submit(job).result()

    def _run(self) -> None:
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with torch.inference_mode():
                    future.set_result(job())
            except BaseException as e:  # noqa: BLE001 - the waiter re-raises it
                future.set_exception(e)
            # Drop the finished job before blocking on the next one: its
            # closure can reach the whole engine (weights, KV cache), which
            # would otherwise stay alive as long as this idle thread.
            del job, future, item

    def close(self) -> None:
        """Finish the queued jobs, then stop; later submissions fail at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
