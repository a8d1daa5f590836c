"""Mixture-of-experts MLPs (Mixtral, Granite MoE, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks `top_k` of
`num_experts` SiLU-gated MLPs per token and sums their outputs, weighted.

The experts' weights are stacked per layer (`[E, 2 * inter, hidden]` gate|up,
`[E, hidden, inter]` down). A step's tokens are grouped by expert (one sort),
and each expert that any token chose runs once over its tokens. Which experts
those are is read on the host (one small copy a layer), so a step with these
layers cannot be captured in a CUDA graph: such models decode eagerly
(`LlamaFamilyModel.capturable`); a fused kernel that groups tokens on the
device is what would lift that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], as transformers computes it: the
        router's softmax in float32, the chosen experts' weights kept in
        float32 and each expert's output scaled by them before the sum."""
        num_experts, inter = self.gate_up.shape[0], self.gate_up.shape[1] // 2
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # (token, slot) pairs grouped by expert: pair p is token p // top_k.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host read
        weights = weights.flatten()
        out = torch.zeros_like(x)
        # As transformers sums them: the routed experts, then the shared one.
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
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            size = self.shared_down.shape[1]
            gate_up = F.linear(x, self.shared_gate_up)
            shared = F.linear(F.silu(gate_up[:, :size]) * gate_up[:, size:], self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out
