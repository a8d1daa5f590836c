"""Builds one step's flat token batch and runs the model forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionBackend, AttentionMetadata, SeqSpan, build_metadata
from .context import TextContext
from .kv_cache import KVCacheInputs, KVCacheManager
from .models.llama import LlamaFamilyModel


@dataclass
class ForwardBatch:
    """Device inputs of one forward pass and where each sequence sits in it."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    kv_inputs: KVCacheInputs
    spans: list[SeqSpan]


class ModelRunner:
    """Owns the model and the attention backend; runs forward passes."""

    def __init__(self, model: LlamaFamilyModel, kv_manager: KVCacheManager, attention: AttentionBackend):
        self.model = model
        self.kv_manager = kv_manager
        self.attention = attention
        self.device = model.device

    def prepare(self, contexts: Sequence[TextContext], num_steps: int = 1,
                input_ids: np.ndarray | None = None) -> ForwardBatch:
        """Inputs for running every context's next_tokens."""
        kv_inputs = self.kv_manager.inputs(contexts, num_steps)
        spans: list[SeqSpan] = []
        q_start = 0
        for i, ctx in enumerate(contexts):
            n = ctx.active_length
            spans.append(SeqSpan(i, q_start, q_start + n, ctx.start_idx))
            q_start += n
        if input_ids is None:
            input_ids = np.concatenate([ctx.next_tokens for ctx in contexts])
        positions = np.concatenate([np.arange(c.start_idx, c.active_idx) for c in contexts])
        return self._finish(spans, kv_inputs, torch.from_numpy(input_ids), positions)

    def decode_step_after(self, batch: ForwardBatch, tokens: torch.Tensor) -> ForwardBatch:
        """Inputs for the next decode step of a decode-only batch, fed with `tokens`
        sampled on the device by the previous step (no host round trip)."""
        spans = [SeqSpan(s.index, s.index, s.index + 1, s.ctx_len) for s in batch.spans]
        positions = np.array([s.cache_len for s in spans], dtype=np.int64)
        return self._finish(spans, batch.kv_inputs, tokens, positions)

    def _finish(self, spans: list[SeqSpan], kv_inputs: KVCacheInputs, input_ids: torch.Tensor,
                positions: np.ndarray) -> ForwardBatch:
        meta = build_metadata(spans, kv_inputs.host_lookup_table, self.kv_manager.page_size, self.device)
        self.attention.prepare(meta, kv_inputs.host_lookup_table)
        return ForwardBatch(
            input_ids=input_ids.to(self.device, non_blocking=True),
            positions=torch.from_numpy(positions).to(self.device, non_blocking=True),
            meta=meta,
            kv_inputs=kv_inputs,
            spans=spans,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.forward(batch.input_ids, batch.positions, self.attention, batch.meta)
