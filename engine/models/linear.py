"""Linear layers on the fastest kernel the device offers.

On CPU, torch's default fp32 GEMM path (MKL) is slow for the skinny shapes of
decoding: on the 2-core bench machine a 30-layer matrix-vector pass takes 38 ms
through `F.linear` but 20 ms through oneDNN with the weight prepacked into its
blocked layout (26 ms vs 60 ms at 16 rows). So CPU weights are prepacked once
at load; other devices use `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """`y = x @ W.T + b` for 2-D `x`; the weight is prepacked where that pays off."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if prepack and _onednn_usable(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            # The packed copy is all we need; keep no second copy of the weight.
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
