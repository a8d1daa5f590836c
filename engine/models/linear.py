"""Linear layers on the fastest kernel the device offers.

On CPU, torch's default fp32 GEMM path (MKL) is slow for the skinny shapes of
decoding: on the 2-core bench machine a 30-layer matrix-vector pass takes 38 ms
through `F.linear` but 20 ms through oneDNN with the weight prepacked into its
blocked layout (26 ms vs 60 ms at 16 rows). So CPU weights are prepacked once
at load; other devices use `F.linear`.

For 1 to 16 rows (decoding), our own kernel is faster still: it streams a
second copy of the weights, in blocks of 16 output features, once per call at
the machine's full memory bandwidth (12.7 ms for that pass at 1 row, 23.6 ms
at 16). The copy doubles fp32 weight memory on CPU, so it is an engine option
(`EngineConfig.cpu_small_batch_gemm`).

On CUDA a single row (batch-1 decoding) takes our Triton matrix-vector kernel
for the weight shapes where the start-up timing found it faster than cuBLAS
(`gemv`, set by engine/kernels/triton_gemv.py `install`); a SwiGLU MLP's down
projection then also takes the activation into that kernel (`gated_row`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.kernels import triton_gemv


def _onednn_usable(weight: torch.Tensor) -> bool:
    """Whether `weight` can be prepacked for oneDNN on this CPU.

    bf16 needs AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU oneDNN's bf16
    reorder raises, so bf16 weights there take `F.linear` instead.
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return cpu_features.onednn_bf16_supported()
    return weight.dtype == torch.float32


SMALL_BATCH_ROWS = 16


class Linear:
    """`y = x @ W.T + b` for 2-D `x`; the weight is prepacked where that pays off.

    `small_batch_ops` (the CPU kernel module) adds the blocked copy used for
    1 to 16 rows of fp32 input.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True,
                 small_batch_ops: ModuleType | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.blocked: torch.Tensor | None = None
        self.ops = small_batch_ops
        # The Triton kernel's launch for one row, where it beats cuBLAS (CUDA, 16-bit).
        self.gemv: triton_gemv.GemvConfig | None = None
        if small_batch_ops is not None and weight.device.type == "cpu" and weight.dtype == torch.float32 \
                and getattr(small_batch_ops, "has_avx512", False):
            from engine.memory import empty_huge

            blocks = -(-self.out_features // 16)
            self.blocked = empty_huge((blocks * self.in_features * 16,), torch.float32)
            small_batch_ops.pack_small_gemm(weight, self.blocked)
        self.weight: torch.Tensor | None = weight
        if prepack and _onednn_usable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            # The packed copies are all we need; keep no plain copy of the weight.
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] == 1:
            assert self.weight is not None
            return triton_gemv.gemv(x if x.stride(1) == 1 else x.contiguous(), self.weight, self.bias, self.gemv)
        if self.blocked is not None and x.shape[0] <= SMALL_BATCH_ROWS and x.dtype == torch.float32:
            assert self.ops is not None
            return self.ops.small_gemm(x if x.stride(1) == 1 else x.contiguous(), self.blocked,
                                       self.out_features, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def gated_row(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """This layer applied to `silu(gate) * up` of one row `[1, 2 * in_features]`
        in one kernel, where this layer takes the Triton kernel for one row; else
        None (the caller computes the activation first). The same result as the
        Triton activation kernel's output passed to `__call__`."""
        if self.gemv is None or gate_up.shape[0] != 1:
            return None
        assert self.weight is not None
        return triton_gemv.gemv(gate_up if gate_up.stride(1) == 1 else gate_up.contiguous(), self.weight,
                                self.bias, self.gemv, gated=True)
