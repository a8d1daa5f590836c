"""Generate and Synthesize calls by request id, across both protocols: what an Abort must reach.

A Generate call (stencil.v1's or vLLM's) is known to the engine only once its
prompt is tokenized and its constraint compiled, a Synthesize once its text is
tokenized; before that an Abort that asked only the engine found nothing, and
the request then ran in full (a router sends its Abort right after its
Generate when its own client leaves).
A vLLM call with n > 1 runs as several engine requests, started one after the
other. Both Abort RPCs therefore go through one registry, which the servicers
fill while their calls prepare (and, for n > 1, while they run): an Abort marks
the call, so whatever it starts from then on starts aborted, and aborts every
engine request it already runs.

Two calls on one connection are not ordered: a router's Abort sent right after
its Generate may reach the server first, and find nothing. So a router's
Abort (vLLM's protocol, whose Abort answers nothing and whose ids are the
router's own, never reused) that finds nothing is remembered for
`EARLY_ABORT_S`: a vLLM call opened under that id meanwhile starts aborted (at
most `EARLY_ABORTS` ids are remembered; a stencil.v1 or Synthesize call under
that id is another client's and is left alone). stencil.v1's Abort answers
which ids it found, and a client may retry a request under its id once Abort
has answered: it remembers nothing, and answers once what it aborted has left
the engine (`wait_ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.engine_loop import EngineLoop

EARLY_ABORT_S = 2.0
EARLY_ABORTS = 4096


@dataclass
class CallHandle:
    """One call, registered under its scoped request id."""

    # An Abort named it: what the call starts from now on, it starts aborted.
    aborted: bool = False
    # Its first engine request was submitted (an Abort then finds it there).
    submitted: bool = False
    # Engine ids of its other sequences (a vLLM call with n > 1), started later.
    others: list[str] = field(default_factory=list)
    # Set once it is done preparing: its first engine request submitted, or
    # the call failed or ended before.
    prepared: asyncio.Event = field(default_factory=asyncio.Event)

    def submit(self) -> None:
        """Its first engine request is submitted: an Abort finds it there now."""
        self.submitted = True
        self.prepared.set()


class CallRegistry:
    """The calls an Abort may name, owned by the event loop (no lock)."""

    def __init__(self) -> None:
        self._calls: dict[str, CallHandle] = {}
        self._early: OrderedDict[str, float] = OrderedDict()  # ids an Abort found nothing for, oldest first

    def open(self, scoped_id: str, early: bool = False) -> CallHandle:
        """Register a call; `early` (a router's call): aborted already if an
        Abort of its id came just before it. A second call with an id already
        registered gets a handle of its own that no Abort finds: it fails at
        submission anyway (the engine refuses a duplicate id) and must not take
        the first's entry."""
        handle = CallHandle()
        if self._calls.setdefault(scoped_id, handle) is handle and early:
            when = self._early.pop(scoped_id, None)
            handle.aborted = when is not None and time.monotonic() - when <= EARLY_ABORT_S
        return handle

    def close(self, scoped_id: str, handle: CallHandle) -> None:
        if self._calls.get(scoped_id) is handle:
            del self._calls[scoped_id]
        handle.prepared.set()

    async def wait_ended(self, scoped_id: str, loops: Sequence[EngineLoop], timeout: float) -> None:
        """Wait, at most `timeout` seconds, until the call with this id has
        left every engine: done preparing (a stencil.v1 call submits in the
        same moment it closes) and each of its engine requests ended (not
        until its last message is written: a client may have stopped reading)."""
        handle = self._calls.get(scoped_id)

        async def ended() -> None:
            if handle is not None:
                await handle.prepared.wait()
            ids = [scoped_id, *(handle.others if handle is not None else ())]
            for stream in [loop.stream_of(rid) for rid in ids for loop in loops]:
                if stream is not None:
                    await stream.ended()

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended(), timeout)

    def abort(self, scoped_id: str, loops: Sequence[EngineLoop], remember: bool = False) -> bool:
        """Abort the call with this id wherever it is; True if it was found
        still preparing or with an engine request still running. `remember`:
        if not found, abort a call opened under the id in the next moments."""
        found = [loop.abort(scoped_id) for loop in loops]
        handle = self._calls.get(scoped_id)
        if handle is not None:
            handle.aborted = True
            found += [loop.abort(other) for other in handle.others for loop in loops]
            found.append(not handle.submitted)
        elif remember and not any(found):
            self._remember_early(scoped_id)
        return any(found)

    def _remember_early(self, scoped_id: str) -> None:
        now = time.monotonic()
        self._early[scoped_id] = now
        self._early.move_to_end(scoped_id)
        while self._early and (len(self._early) > EARLY_ABORTS
                               or now - next(iter(self._early.values())) > EARLY_ABORT_S):
            self._early.popitem(last=False)
