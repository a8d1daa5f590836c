"""The grammar mask applied to CUDA logits in one Triton kernel.

The grammar package's tensor path (`grammar.apply_token_bitmask_inplace` off
the CPU) unpacks the bitmask with shifts into a [rows, words, 32] int32
tensor, compares, gathers the rows' logits, fills and scatters them back:
about eight kernels and, over a 128k vocabulary at batch 64, ~32 MB of
temporaries, all on the device thread's path from a filled mask to the
step's sampling. Here each program reads one row's words and sets its
disallowed logits to -inf in place: one launch. Tokens the bitmask does not
cover (at or past 32 x its words) are disallowed, as there.
"""

from __future__ import annotations

import torch

from .triton_base import jit, tl, triton

__all__ = ["apply_token_bitmask"]

_BLOCK = 1024


@jit
def _mask_kernel(logits_ptr, mask_ptr, rows_ptr, stride_logits, stride_mask, vocab, covered,
                 BLOCK: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(mask_ptr + row * stride_mask + offs // 32, mask=offs < covered, other=0)
    # Bit k of a word, whatever its sign (an arithmetic shift keeps bit k at 0).
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_logits + offs, float("-inf"), mask=(offs < vocab) & ~allowed)


def probe(device: torch.device) -> str | None:
    """Run the kernel once on `device` (compiling it, at start-up rather than in
    the first constrained step) against the bitmask's definition: None if it
    agrees, else why not."""
    try:
        logits = torch.zeros(3, 40, device=device)
        bitmask = torch.tensor([[5, 0], [-1, 0], [0, 1]], dtype=torch.int32, device=device)
        apply_token_bitmask(logits, bitmask, torch.tensor([2, 0], device=device))
        allowed = [(logits[r] == 0).nonzero().flatten().tolist() for r in range(3)]
        if allowed != [[0, 2], list(range(40)), [32]]:
            return "the Triton mask kernel disagrees with its bitmask on this device"
    except Exception as e:  # noqa: BLE001 - any failure means: another path
        return f"the Triton mask kernel failed on this device ({type(e).__name__}: {str(e)[:200]})"
    return None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set `logits[r, t]` (float32 [B, V], rows contiguous) to -inf where bit t
    of `bitmask[r]` (int32 [B, W], on the logits' device) is 0, for each r in
    `rows` (int64, on the logits' device). Launch sizes come from shapes only:
    the host never reads a value."""
    assert triton is not None, "Triton is not installed"
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.stride(1) == 1
    n = rows.shape[0]
    if n == 0:
        return
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    grid = (n, triton.cdiv(vocab, _BLOCK))
    _mask_kernel[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, covered,
                       BLOCK=_BLOCK)
