"""Mixture-of-experts MLPs (Mixtral, Granite MoE, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks `top_k` of
`num_experts` SiLU-gated MLPs per token and sums their outputs, weighted.

The experts' weights are stacked per layer (`[E, 2 * inter, hidden]` gate|up,
`[E, hidden, inter]` down). A step's (token, slot) pairs are grouped by
expert, and each expert runs once over its pairs, in one of two ways:

- on the host's count (the default, and a CPU's): one sort, then which
  experts got tokens is read on the host (one small copy a layer), and each
  runs as two linear layers over its tokens. A forward pass with such reads
  cannot be captured in a CUDA graph: the model decodes eagerly.
- on the device (`grouped_on_device`, set by `group_on_device` where the
  Triton kernels of engine/kernels/triton_moe.py run and agree with the
  first way): the routing (softmax, top-k) with the grouping, and both
  projections, are kernels sized by the shapes alone, nothing is read back,
  and decode graphs capture the layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import triton_moe


@dataclass
class SparseMLP:
    """One layer's router and experts."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 * inter, hidden], rows gate | up
    down: torch.Tensor  # [E, hidden, inter]
    top_k: int
    # Whether the chosen experts' weights are rescaled to sum to 1 (Mixtral
    # always; Qwen3-MoE as `norm_topk_prob` says).
    renormalize: bool
    # Qwen2-MoE's shared expert (gate|up [2 * s, hidden], down [hidden, s]),
    # on every token, scaled by sigmoid(x . shared_gate) ([1, hidden]).
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    # Group the pairs by expert in Triton kernels, reading nothing back (module docstring).
    grouped_on_device: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], as transformers computes it: the
        router's softmax in float32, the chosen experts' weights kept in
        float32 and each expert's output scaled by them before the sum."""
        logits = F.linear(x, self.router)
        if self.grouped_on_device:  # routed in the kernels too
            out = triton_moe.fused_experts(x, self.gate_up, self.down, logits, self.top_k, self.renormalize)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = probs.topk(self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            out = self._grouped_on_host(x, weights, chosen)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            size = self.shared_down.shape[1]
            gate_up = F.linear(x, self.shared_gate_up)
            shared = F.linear(F.silu(gate_up[:, :size]) * gate_up[:, size:], self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out

    def _grouped_on_host(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, each expert over its tokens as
        the host's count of them says."""
        num_experts, inter = self.gate_up.shape[0], self.gate_up.shape[1] // 2
        # (token, slot) pairs grouped by expert: pair p is token p // top_k.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host read
        weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            gate_up = F.linear(x[tokens], self.gate_up[expert])
            y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down[expert])
            out.index_add_(0, tokens, (y * weights[pairs, None]).to(x.dtype))
        return out


def group_on_device(mlps: Iterable[SparseMLP], device: torch.device, dtype: torch.dtype) -> str:
    """Set every layer of `mlps` to group its experts on the device if the
    Triton kernels run here and agree with the host-grouped path on a small
    layer (checked once); a line for the start-up log either way."""
    mlps = list(mlps)
    problem = _device_grouping_problem(device, dtype)
    if problem is not None:
        return f"experts: grouped on the host ({problem}); decode graphs off"
    for mlp in mlps:
        mlp.grouped_on_device = True
    return "experts: grouped on the device (Triton), nothing read back; decode graphs capture them"


def _device_grouping_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        gen = torch.Generator().manual_seed(0)
        experts, hidden, inter = 4, 48, 40
        mlp = SparseMLP(torch.randn(experts, hidden, generator=gen).to(device, dtype),
                        (torch.randn(experts, 2 * inter, hidden, generator=gen) / 7).to(device, dtype),
                        (torch.randn(experts, hidden, inter, generator=gen) / 6).to(device, dtype),
                        top_k=2, renormalize=True)
        x = torch.randn(5, hidden, generator=gen).to(device, dtype)
        want = mlp(x)
        mlp.grouped_on_device = True
        got = mlp(x)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            return "the Triton expert kernels disagree with torch here"
    except Exception as e:  # noqa: BLE001 - any failure means: group them on the host
        return f"the Triton expert kernels failed here ({type(e).__name__}: {str(e)[:200]})"
    return None
