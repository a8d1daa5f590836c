"""Decode steps replayed from CUDA graphs captured at start-up.

A decode step of a small model on a GPU is bound by its kernel launches, not
by the GPU (hundreds of launches, each a few microseconds of host time). So
decode-only batches (every sequence one token, one step: no prompt chunks, no
forced-token runs, no prompt log-probabilities) replay a graph captured once
per batch-size bucket, over static buffers (with graphs on, the scheduler feeds
forced runs a token per step, so constrained batches replay graphs too):

- buckets 1, 2, 4, 8, then every 16 up to the largest batch (`max_num_seqs`);
  a batch runs in the smallest bucket that holds it;
- static tensors: token ids, positions, each token's KV write row, query
  offsets, lengths, and a block table of fixed width (the pages of the
  longest context); before a replay the step's host data is copied into them
  in place (`refresh`), on the device thread's stream;
- rows past the batch (padding) write their keys and values to a dummy page
  that no request owns, and attend over it alone;
- the graph ends at the logits: the grammar mask and sampling run after it,
  eagerly, so masks filled while the graph runs are applied as before.

The same module runs without CUDA: `capture=False` replays a bucket by calling
the very function a graph would have captured, over the same static buffers
(the padding, the refresh and the bucket choice included). That is how CPU
tests check the path; on CUDA only the capture and `replay` differ.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionBackend, PagedMetadata, SeqSpan
from .attention.base import CacheRows
from .attention.paged import paged_plan
from .kv_cache import KVCacheInputs
from .staging import Staging

log = logging.getLogger(__name__)


# Dense decode attention (the graphs' attention where Triton cannot run) reads
# every slot of the static block table's full width for every row, whatever
# the sequences' lengths: graphs are captured only for batches whose rows x
# width stay within this many slots (batch 64 over 4k tokens, batch 2 over
# 128k); a larger decode batch runs eagerly, reading only its own keys.
DENSE_GRAPH_SLOTS = 1 << 18


def dense_graph_batch(max_batch: int, max_len: int) -> int:
    """The largest batch decode graphs over dense attention are captured for (0: none)."""
    return min(max_batch, DENSE_GRAPH_SLOTS // max(max_len, 1))


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16, and max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


@dataclass(frozen=True)
class GraphStats:
    """What capturing the graphs cost at start-up."""

    buckets: tuple[int, ...]
    seconds: float
    bytes: int  # device memory the graphs' pool took


class DecodeGraphs:
    """Static buffers and one graph (or, without capture, one replay function)
    per bucket, for the decode steps of one model.

    `model(input_ids, positions, attention, meta)` -> hidden states and
    `model.logits(hidden)` -> float32 logits are the step model's calls;
    `attention` reads `PagedMetadata` (TritonAttention, DenseDecodeAttention).
    `dummy_page` is a page id of `kv_blocks` that no request is ever given.
    """

    def __init__(self, model: object, attention: AttentionBackend, kv_blocks: torch.Tensor, dummy_page: int,
                 max_batch: int, max_pages: int, vocab_size: int, capture: bool):
        self.model = model
        self.attention = attention
        self.rows = CacheRows(kv_blocks)
        self.buckets = graph_buckets(max_batch)
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.capture = capture
        device = kv_blocks.device
        self.device = device
        n = max_batch
        self.dummy_page = dummy_page
        self.dummy_row = dummy_page * 2 * self.rows.layers * self.rows.page_size  # its slot 0, layer-0 key row
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.write_rows = torch.full((n,), self.dummy_row, dtype=torch.int64, device=device)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.full((n, max_pages), dummy_page, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self._meta = {b: PagedMetadata(self.rows, self.write_rows[:b], self.cu_q[:b + 1], self.seq_lens[:b],
                                       self.block_table[:b], 1) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._used = 0  # rows [0, _used) hold a step's data; the rest the dummy's
        self.replays: Counter[int] = Counter()  # per bucket

    # -- engine thread ----------------------------------------------------------
    def bucket(self, batch: int) -> int | None:
        """The bucket a batch of `batch` decode tokens runs in (None: too large)."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def plan(self, spans: Sequence[SeqSpan], table: np.ndarray, kv: KVCacheInputs,
             staging: Staging) -> PagedMetadata | None:
        """The step's host metadata if it can replay a graph (one token per
        sequence, a bucket that holds it, a table no wider than the static one),
        else None."""
        if self.bucket(len(spans)) is None or table.shape[1] > self.max_pages \
                or any(s.q_len != 1 for s in spans):
            return None
        return paged_plan(list(spans), table, kv, staging)

    # -- device thread ------------------------------------------------------------
    def _forward(self, b: int) -> None:
        """What a bucket's graph holds: the forward pass and the logits of `b` rows."""
        hidden = self.model.forward(self.input_ids[:b], self.positions[:b], self.attention,  # type: ignore[attr-defined]
                                    self._meta[b])
        self.logits[:b].copy_(self.model.logits(hidden))  # type: ignore[attr-defined]

    def capture_all(self) -> GraphStats:
        """Capture every bucket's graph (largest first, one shared memory pool);
        without `capture`, run each bucket once instead (a warm-up)."""
        start = time.perf_counter()
        # The driver's free memory, not the caching allocator's figures: the
        # graphs' private pool and the warm-ups' frees would skew those.
        # (Capturing empties the allocator's cache, so measure from an empty one.)
        if self.capture:
            torch.cuda.empty_cache()
        before = torch.cuda.mem_get_info(self.device)[0] if self.capture else 0
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for b in reversed(self.buckets):
            self._forward(b)  # warm-up: kernels compiled and autotuned outside the capture
            if self.capture:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream(self.device)):
                    self._forward(b)
                self._graphs[b] = graph
        if self.capture:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        used = before - torch.cuda.mem_get_info(self.device)[0] if self.capture else 0
        return GraphStats(tuple(self.buckets), time.perf_counter() - start, used)

    def refresh(self, meta: PagedMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> int:
        """Copy a step's host data into the static buffers; returns its bucket."""
        n = int(meta.seq_lens.shape[0])
        b = self.bucket(n)
        assert b is not None
        width = int(meta.block_table.shape[1])
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.write_rows[:n].copy_(meta.write_rows, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:n, :width].copy_(meta.block_table, non_blocking=True)
        if n < self._used:
            # Rows a larger batch left behind: back to the dummy page, so a
            # padded row never writes into a page a request owns.
            self.input_ids[n:self._used].zero_()
            self.positions[n:self._used].zero_()
            self.write_rows[n:self._used].fill_(self.dummy_row)
            self.seq_lens[n:self._used].fill_(1)
            self.block_table[n:self._used, 0].fill_(self.dummy_page)
        self._used = n
        return b

    def run(self, b: int) -> None:
        """Replay bucket `b` (after `refresh`); its logits are `self.logits[:b]`."""
        self.replays[b] += 1
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._forward(b)


def graphs_mode(setting: str, device: torch.device, capturable: bool = True) -> str | None:
    """How decode steps run for `EngineConfig.cuda_graphs`: "capture" (CUDA
    graphs), "emulate" (the static buffers, no capture) or None (eager). A
    model whose forward pass reads the device on the host (`capturable`
    False: experts chosen per layer) decodes eagerly, emulated or not."""
    if setting == "off" or not capturable:
        return None
    if setting == "emulate":
        return "emulate"
    return "capture" if device.type == "cuda" else None
