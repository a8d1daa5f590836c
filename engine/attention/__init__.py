"""Attention over the paged KV cache for a mixed batch, without padding.

A step's batch is a flat run of tokens: prompt chunks of some sequences and
single decode tokens (or short runs of forced tokens) of others. Each backend
turns the step's `KVCacheInputs` and spans into its own metadata once per step
(`plan`, host tensors) and is then called once per layer:

- `KernelAttention` (CPU, cpu_kernel.py): a native kernel over the pages;
- `TritonAttention` (CUDA, triton_backend.py): our Triton kernels over the page
  pool, any dtype and page size, capturable in CUDA graphs;
- `TorchAttention` (any device, torch_backend.py): per-sequence SDPA over
  gathered pages; the fallback and the tests' reference;
- `DenseDecodeAttention` (paged.py): decode steps only, plain torch ops; a
  decode graph's attention when Triton cannot run.

The backend is chosen once, at start-up, by `choose_attention`, which probes
what the installed PyTorch and the device offer (never a try/except per step):
Triton's kernels are run at the model's head shape and page size and checked
against float64 math, so a GPU or Triton release they do not work on falls back
to `TorchAttention` at start-up, not at the first step. The engine logs the
choice and its reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.staging import Staging

from .base import AttentionBackend, SeqSpan
from .cpu_kernel import KernelAttention
from .paged import DenseDecodeAttention, PagedMetadata
from .torch_backend import TorchAttention

__all__ = ["ATTENTION_CHOICES", "AttentionBackend", "AttentionChoice", "DenseDecodeAttention", "KernelAttention",
           "HeadShape", "PagedMetadata", "SeqSpan", "TorchAttention", "choose_attention", "make_attention",
           "probe_triton"]

# What `EngineConfig.attention` may ask for.
ATTENTION_CHOICES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionChoice:
    """The attention backend an engine runs (`name`), and why."""

    name: str  # "cpu-kernel", "triton" or "torch"
    reason: str

    @property
    def graph_capturable(self) -> bool:
        """Whether the eager backend itself runs inside decode graphs (else
        they use DenseDecodeAttention)."""
        return self.name == "triton"


@dataclass(frozen=True)
class HeadShape:
    """What the Triton probe runs its kernels at: a model's attention heads and the cache's page size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


# The probe's shape when no model gives one: grouped heads and a partial page, tiny.
PROBE_SHAPE = HeadShape(2, 1, 16, 4)


def probe_triton(device: torch.device, dtype: torch.dtype, shape: HeadShape = PROBE_SHAPE) -> str | None:
    """Run the Triton kernels once at `shape` in `dtype` on `device` and check
    them (`triton_check.self_check`): None if they work, else why not (no
    Triton, no interpreter on a CPU, a compile error or a wrong result here)."""
    from . import triton_kernels

    if not triton_kernels.triton_available():
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels run on CUDA (or in Triton's interpreter, TRITON_INTERPRET=1)"
    try:
        from .triton_check import self_check

        self_check(device, dtype, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure means: not this backend
        return f"the Triton kernels failed on this device ({type(e).__name__}: {str(e)[:200]})"
    return None


def choose_attention(device: torch.device, dtype: torch.dtype, prefer: str = "auto", *,
                     shape: HeadShape = PROBE_SHAPE,
                     cpu_kernel: Callable[[], bool] | None = None,
                     triton: Callable[[], str | None] | None = None) -> AttentionChoice:
    """Pick the backend for an engine on `device`, once, for a model of `shape`.
    `cpu_kernel` (does the native CPU kernel build here?) and `triton`
    (probe_triton's answer) are the probes; tests pass their own."""
    if prefer not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}")
    if cpu_kernel is None:
        def cpu_kernel() -> bool:
            from engine.kernels import cpu_ops

            return cpu_ops() is not None
    if triton is None:
        def triton() -> str | None:
            return probe_triton(device, dtype, shape)
    if prefer == "torch":
        return AttentionChoice("torch", "asked for (--attention torch)")
    if prefer == "triton":
        problem = triton()
        if problem is not None:
            raise ValueError(f"--attention triton: {problem}")
        return AttentionChoice("triton", "asked for (--attention triton)")
    if device.type == "cuda":
        problem = triton()
        if problem is None:
            return AttentionChoice("triton", "CUDA with Triton: paged kernels for any dtype and page size, "
                                             "capturable in CUDA graphs")
        return AttentionChoice("torch", f"CUDA without working Triton kernels ({problem}): "
                                        "SDPA over gathered pages")
    if device.type == "cpu" and cpu_kernel():
        return AttentionChoice("cpu-kernel", "CPU: the native paged kernel built")
    return AttentionChoice("torch", "no native kernel for this device: SDPA over gathered pages")


def make_attention(choice: AttentionChoice, kv_blocks: torch.Tensor, num_heads: int,
                   head_dim: int, max_keys: int, windows: Sequence[int] = (),
                   scale: float | None = None, softcap: float = 0.0) -> AttentionBackend:
    """The chosen backend over the page tensor `kv_blocks` (`max_keys`: the
    longest context a sequence may have; `windows`: each layer's sliding
    window, 0 for none, or empty; `scale`: of the scores, None for
    1/sqrt(head_dim); `softcap`: Gemma 2's cap on them, 0 for none)."""
    staging = Staging(kv_blocks.device)
    if choice.name == "triton":
        from .triton_backend import TritonAttention

        return TritonAttention(num_heads, head_dim, staging, kv_blocks.shape[4], max_keys, windows, scale, softcap)
    if choice.name == "cpu-kernel":
        from engine.kernels import cpu_ops

        ops = cpu_ops()
        assert ops is not None
        return KernelAttention(num_heads, head_dim, ops, kv_blocks, windows, scale, softcap)
    return TorchAttention(num_heads, head_dim, staging, windows, scale, softcap)
