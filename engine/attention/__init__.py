"""Attention over the paged KV cache for a mixed batch, without padding.

A step's batch is a flat run of tokens: prompt chunks of some sequences and
single decode tokens (or short runs of forced tokens) of others. Each backend
turns the step's `KVCacheInputs` and spans into its own metadata once per step
(`plan`) and is then called once per layer:

- `KernelAttention` (CPU, cpu_kernel.py): a native kernel over the pages;
- `VarlenAttention` (CUDA, cuda_varlen.py): flash varlen attention over the page pool;
- `TorchAttention` (any device, torch_backend.py): per-sequence SDPA over
  gathered pages; the fallback and the tests' reference.
"""

from __future__ import annotations

import torch

from .base import AttentionBackend, SeqSpan
from .cpu_kernel import KernelAttention
from .cuda_varlen import VarlenAttention
from .torch_backend import TorchAttention

__all__ = ["AttentionBackend", "KernelAttention", "SeqSpan", "TorchAttention", "VarlenAttention",
           "make_attention"]


def make_attention(kv_blocks: torch.Tensor, num_heads: int, head_dim: int,
                   prefer: str = "auto") -> AttentionBackend:
    """Pick the attention implementation for the page tensor's device."""
    if prefer == "torch":
        return TorchAttention(num_heads, head_dim)
    if kv_blocks.device.type == "cuda":
        try:
            from torch.nn.attention import varlen  # noqa: F401
            return VarlenAttention(num_heads, head_dim)
        except ImportError:
            return TorchAttention(num_heads, head_dim)
    if kv_blocks.device.type == "cpu":
        from engine.kernels import cpu_ops

        ops = cpu_ops()
        if ops is not None:
            return KernelAttention(num_heads, head_dim, ops, kv_blocks)
    return TorchAttention(num_heads, head_dim)
