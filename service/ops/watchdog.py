"""The watchdog: an engine that has work but completes no step is reported.

A step can hang without failing (a native call that never returns, a lock
never released, a device that stopped answering). While work is pending and no
step has completed for `timeout_s`, the services that engine serves turn
NOT_SERVING, so load balancers and probes stop sending it traffic, and the log
shows what the engine thread and the device thread are doing. When steps
complete again, the services turn SERVING again (unless the server is
draining by then). The embedding model is watched the same way: a forward
pass that runs past `timeout_s` turns its service NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from service.ops.health import NOT_SERVING, SERVING, HealthState

log = logging.getLogger(__name__)


class Stallable(Protocol):
    """What the watchdog reads of a model's runner (an EngineLoop, an EmbeddingRuntime)."""

    @property
    def alive(self) -> bool: ...

    def stalled_for(self) -> float: ...

    @property
    def threads(self) -> list[threading.Thread | None]: ...


@dataclass(frozen=True)
class Watched:
    """An engine loop (or the embedding model) and the health services that depend on it."""

    loop: Stallable
    services: tuple[str, ...]


def thread_stacks(threads: Sequence[threading.Thread | None]) -> str:
    """The current Python stacks of `threads`, formatted for a log record."""
    frames = sys._current_frames()
    parts = []
    for thread in threads:
        if thread is None or thread.ident is None or thread.ident not in frames:
            continue
        stack = "".join(traceback.format_stack(frames[thread.ident]))
        parts.append(f"thread {thread.name}:\n{stack}")
    return "\n".join(parts) or "(no stack available)"


class Watchdog:
    """Checks every engine loop a few times per `timeout_s` and flips health."""

    def __init__(self, timeout_s: float, watched: Callable[[], Sequence[Watched]],
                 health: HealthState, draining: Callable[[], bool]):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.timeout_s = timeout_s
        self._watched = watched
        self._health = health
        self._draining = draining
        self._stalled: set[int] = set()  # id() of stalled loops

    @property
    def interval_s(self) -> float:
        return max(0.05, self.timeout_s / 4)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()

    async def check(self) -> None:
        for item in self._watched():
            if not item.loop.alive:
                continue  # a dead engine is the server's to report (it shuts down)
            key = id(item.loop)
            stalled_for = item.loop.stalled_for()
            if stalled_for > self.timeout_s and key not in self._stalled:
                self._stalled.add(key)
                log.error("engine stalled: work pending and no step completed for %.1f s; "
                          "reporting %s NOT_SERVING. What it is doing:\n%s", stalled_for,
                          ", ".join(item.services) or "nothing", thread_stacks(item.loop.threads))
                for name in item.services:
                    await self._health.set(name, NOT_SERVING)
            elif stalled_for <= self.timeout_s and key in self._stalled:
                self._stalled.discard(key)
                if self._draining():
                    continue
                log.warning("engine recovered: steps complete again; reporting %s SERVING",
                            ", ".join(item.services))
                for name in item.services:
                    await self._health.set(name, SERVING)
