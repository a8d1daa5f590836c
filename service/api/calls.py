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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.engine_loop import EngineLoop


@dataclass
class CallHandle:
    """One call, registered under its scoped request id."""

    # An Abort named it: what the call starts from now on, it starts aborted.
    aborted: bool = False
    # Its first engine request was submitted (an Abort then finds it there).
    submitted: bool = False
    # Engine ids of its other sequences (a vLLM call with n > 1), started later.
    others: list[str] = field(default_factory=list)


class CallRegistry:
    """The calls an Abort may name, owned by the event loop (no lock)."""

    def __init__(self) -> None:
        self._calls: dict[str, CallHandle] = {}

    def open(self, scoped_id: str) -> CallHandle:
        """Register a call. A second call with an id already registered gets a
        handle of its own that no Abort finds: it fails at submission anyway
        (the engine refuses a duplicate id) and must not take the first's entry."""
        handle = CallHandle()
        self._calls.setdefault(scoped_id, handle)
        return handle

    def close(self, scoped_id: str, handle: CallHandle) -> None:
        if self._calls.get(scoped_id) is handle:
            del self._calls[scoped_id]

    def abort(self, scoped_id: str, loops: Sequence[EngineLoop]) -> bool:
        """Abort the call with this id wherever it is; True if it was found
        still preparing or with an engine request still running."""
        found = [loop.abort(scoped_id) for loop in loops]
        handle = self._calls.get(scoped_id)
        if handle is not None:
            handle.aborted = True
            found += [loop.abort(other) for other in handle.others for loop in loops]
            found.append(not handle.submitted)
        return any(found)
