"""Token bitmasks: allocation, batch filling, and applying them to logits.

Layout (shared by xgrammar and llguidance): int32 tensor [batch, ceil(V/32)];
token t is allowed iff bit (t % 32) of word (t // 32) is set. Rows are filled on
the CPU; applying happens on the logits' device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _xgr

if TYPE_CHECKING:
    from .matcher import Matcher
    from .tokenizer import TokenizerData


def allocate_bitmask(batch_size: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An all-allowed CPU bitmask [batch_size, ceil(vocab_size/32)] (pinned if asked)."""
    if batch_size < 1 or vocab_size < 1:
        raise ValueError("batch_size and vocab_size must be positive")
    shape = (batch_size, (vocab_size + 31) // 32)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory)


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf, in place, on the logits' device (CPU or CUDA).

    logits: [batch, V] (or [V]); bitmask: [batch, W] int32, any device (copied
    to the logits' device if needed). rows: which rows to mask (the same index
    into logits and bitmask), as a sequence or an int64 tensor on any device
    (a pinned host tensor reaches CUDA logits without a synchronous copy); all
    rows when None. Tokens at or past 32*W - ids the bitmask does not cover -
    are always disallowed.

    With a pinned CPU bitmask and CUDA logits the copy is asynchronous: do not
    refill that bitmask until the stream has used it (alternate two bitmasks).
    """
    if bitmask.dtype != torch.int32:
        raise ValueError("bitmask must be int32")
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    if bitmask.dim() == 1:
        bitmask = bitmask.unsqueeze(0)
    if rows is not None and len(rows) == 0:
        return
    vocab = logits.shape[-1]
    covered = min(vocab, bitmask.shape[-1] * 32)
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        index = None
    elif isinstance(rows, torch.Tensor):
        index = rows.to(logits.device, non_blocking=True)
    else:
        index = torch.as_tensor(list(rows), device=logits.device)
    if covered < vocab:
        if index is None:
            logits[:, covered:] = float("-inf")
        else:
            logits[index, covered:] = float("-inf")
    # xgrammar's CPU kernel writes past a row of fewer than 32 logits (seen at one).
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
            and covered >= 32:
        _apply_cpu(logits, bitmask, covered, rows)
    else:
        _apply_torch(logits, bitmask, covered, index)


def _apply_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, covered: int, rows: Sequence[int] | torch.Tensor | None
) -> None:
    # xgrammar's C++ kernel: about twice as fast as the tensor version on CPU.
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits,
        bitmask,
        vocab_size=covered,
        indices=None if rows is None else rows.tolist() if isinstance(rows, torch.Tensor)
        else [int(r) for r in rows],
        backend="cpu",
    )


def _apply_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, covered: int, index: torch.Tensor | None
) -> None:
    # Plain tensor ops: runs on any device without Triton or a custom kernel.
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    masks = bitmask if index is None else bitmask.index_select(0, index)
    bits = (masks.unsqueeze(-1) >> shifts) & 1
    disallowed = bits.reshape(masks.shape[0], -1)[:, :covered] == 0
    view = logits[:, :covered]
    if index is None:
        view.masked_fill_(disallowed, float("-inf"))
    else:
        view[index] = view[index].masked_fill(disallowed, float("-inf"))


class BitmaskFiller:
    """Fills bitmask rows for many matchers at once, in parallel native code.

    xgrammar matchers go through one `BatchGrammarMatcher` call and llguidance
    matchers through one `LLExecutor` call; a backend with a single row calls
    its matcher directly (the batch machinery costs more than it saves there).
    Rows with no matcher (unconstrained requests) are set to all-allowed.
    Meant for one thread at a time (the scheduler's). Measured here:
    llguidance's executor releases the GIL while it works, xgrammar's batch
    call (through tvm_ffi) largely does not. llguidance matchers copied from
    one template share its lexer, so its threads only help across template
    copies (`Matcher.replica`): rows are handed over grouped by copy.
    """

    def __init__(self, tokenizer: TokenizerData, num_threads: int = 1) -> None:
        if num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        self._tok = tokenizer
        self._num_threads = num_threads
        self._xgr_batch: Any = None  # created on first use: each owns native threads
        self._llg_exec: Any = None
        # Per bitmask that passed `check_bitmask`: its base address, rows and
        # xgrammar's direct view of it (`_xgr.direct_target`), and those of the
        # last one used. The engine passes the same few tensor objects (a view
        # per batch size) step after step, so these (microseconds of tensor
        # attribute reads and a conversion) are made once per buffer; holding
        # the references keeps their identities meaningful.
        self._known: dict[int, tuple[torch.Tensor, int, int, Any]] = {}
        self._checked: torch.Tensor | None = None
        self._base = 0
        self._batch = 0
        self._xgr_target: Any = None

    def _check(self, bitmask: torch.Tensor) -> None:
        if bitmask is self._checked:
            return
        known = self._known.get(id(bitmask))
        if known is None or known[0] is not bitmask:
            check_bitmask(bitmask, self._tok.bitmask_words)
            if len(self._known) >= 16:  # a caller making new tensors each time
                self._known.clear()
            known = self._known[id(bitmask)] = (bitmask, bitmask.data_ptr(), bitmask.shape[0],
                                                 _xgr.direct_target(bitmask))
        self._checked, self._base, self._batch, self._xgr_target = known

    def fills_off_gil(self, matchers: Sequence[Matcher | None]) -> bool:
        """Whether `fill` of these rows spends most of its time with the GIL
        released (llguidance's executor, for two rows or more), so another
        thread's Python can run beside it."""
        return sum(1 for m in matchers if m is not None and m.backend == "llguidance") >= 2

    def row_filler(self, matcher: Matcher, bitmask: torch.Tensor, row: int) -> Callable[[], object]:
        """A call without arguments that fills `bitmask[row]` for `matcher`,
        for a caller filling the same row for the same matcher step after step
        (the engine's step with one constrained request): for xgrammar, its
        native fill bound to the row (no Python frame at all); otherwise
        `fill` for that row. The native one raises once the matcher is
        terminated (the library refuses): the caller then uses `fill`, which
        writes the stop-only row."""
        self._check(bitmask)
        if self._xgr_target is not None and type(matcher) is _xgr.XGrammarMatcher and 0 <= row < self._batch:
            return functools.partial(matcher.fill_direct, self._xgr_target, row, False)
        return functools.partial(self.fill, (matcher,), bitmask, (row,))

    def fill(
        self,
        matchers: Sequence[Matcher | None],
        bitmask: torch.Tensor,
        rows: Sequence[int] | None = None,
    ) -> None:
        """Fill `bitmask[rows[i]]` for `matchers[i]` (rows default to 0..n-1)."""
        rows = range(len(matchers)) if rows is None else rows
        if len(rows) != len(matchers):
            raise ValueError("rows and matchers differ in length")
        self._check(bitmask)
        batch = self._batch
        row_bytes = self._tok.bitmask_words * 4
        xgr_m, xgr_rows, llg_pairs, llg_copies = [], [], [], []
        for matcher, row in zip(matchers, rows, strict=True):
            if not 0 <= row < batch:
                raise IndexError(f"row {row} out of range for a bitmask of {batch} rows")
            if matcher is None:
                bitmask[row].fill_(-1)
                continue
            native = matcher.batch_native()
            if native is None:  # terminated, failed or not batchable: its own rule
                matcher.fill_bitmask(bitmask, row)
            elif matcher.backend == "xgrammar":
                xgr_m.append(native)
                xgr_rows.append(int(row))
            elif matcher.backend == "llguidance":
                llg_pairs.append((native, int(row)))
                llg_copies.append(matcher.replica)
            else:
                matcher.fill_bitmask(bitmask, row)
        if len(xgr_m) == 1:
            xgr_m[0].fill_next_token_bitmask(bitmask, xgr_rows[0])
        elif xgr_m:
            if self._xgr_batch is None:
                import xgrammar as xgr

                self._xgr_batch = xgr.BatchGrammarMatcher(max_threads=self._num_threads)
            self._xgr_batch.batch_fill_next_token_bitmask(xgr_m, bitmask, xgr_rows)
        if len(llg_pairs) == 1:
            native, row = llg_pairs[0]
            native.unsafe_compute_mask_ptr(self._base + row * row_bytes, row_bytes)
        elif llg_pairs:
            if self._llg_exec is None:
                import llguidance

                self._llg_exec = llguidance.LLExecutor(num_threads=self._num_threads)
            if self._num_threads > 1:
                # The executor splits its list into runs, one per thread: rows
                # of one template copy together, so threads seldom wait on
                # each other's lexer (CompilerConfig.mask_threads).
                order = sorted(range(len(llg_pairs)), key=llg_copies.__getitem__)
                llg_pairs = [llg_pairs[i] for i in order]
            self._llg_exec.unsafe_compute_mask_ptr(llg_pairs, self._base, row_bytes, batch)


def check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    """Refuse anything but a contiguous CPU int32 [batch, words] tensor.

    The native fills write through a raw pointer, so the layout must be exact.
    """
    if (
        bitmask.dtype != torch.int32
        or bitmask.device.type != "cpu"
        or bitmask.dim() != 2
        or bitmask.shape[1] != words
        or not bitmask.is_contiguous()
    ):
        raise ValueError(
            f"bitmask must be a contiguous CPU int32 tensor of shape [batch, {words}], "
            f"got {tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}"
        )
