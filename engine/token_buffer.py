"""`TokenBuffer`: the last sampled token of every running request, on the device.

Overlap scheduling launches step N+1 before the host has read step N's tokens:
a request's next input is then a placeholder (a *future token*), which the
device fills from this buffer, where step N wrote it. Each running request owns
one row from its first launch until the scheduler frees it (finished,
preempted, aborted). A freed row can be handed out again at once: steps run in
order on the device, so a new owner's reads come after any write still in
flight for the old one.
"""

from __future__ import annotations

import torch

from .context import TextContext


class TokenBuffer:
    """Rows of a device tensor of token ids, one per running request."""

    def __init__(self, num_rows: int, device: torch.device):
        if num_rows < 1:
            raise ValueError("a token buffer needs at least one row")
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._free = list(range(num_rows - 1, -1, -1))

    def row(self, ctx: TextContext) -> int:
        """`ctx`'s row, assigned on first use."""
        if ctx.sched.buffer_row is None:
            if not self._free:
                # Rows are sized to the scheduler's cap on running requests.
                raise RuntimeError("more running requests than token buffer rows")
            ctx.sched.buffer_row = self._free.pop()
        return ctx.sched.buffer_row

    def free(self, ctx: TextContext) -> None:
        """Give `ctx`'s row back (safe to call twice)."""
        if ctx.sched.buffer_row is not None:
            self._free.append(ctx.sched.buffer_row)
            ctx.sched.buffer_row = None

    @property
    def num_free(self) -> int:
        return len(self._free)
