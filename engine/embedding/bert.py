"""A BERT encoder over packed (unpadded) batches.

Post-LayerNorm blocks as in BERT: `x = LN(x + Attn(x)); x = LN(x + MLP(x))`.
q, k and v are fused into one projection at load, so a layer makes four GEMM
calls over all tokens of the batch; attention runs per group of equal-length
sequences (see packing.py), never over padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.config import CheckpointError
from engine.models.linear import Linear
from engine.models.weights import WeightSource

from .checkpoint import EncoderConfig
from .packing import PackedBatch

# Prefixes under which BERT checkpoints store the encoder (BertModel saves none;
# the task heads wrap it in `bert.`).
_PREFIXES = ("", "bert.", "model.")


@dataclass(frozen=True)
class LayerNorm:
    """A loaded LayerNorm's parameters, applied functionally."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class EncoderLayer:
    """The tensors of one BERT block."""

    qkv: Linear
    attn_out: Linear
    attn_norm: LayerNorm
    mlp_in: Linear
    mlp_out: Linear
    mlp_norm: LayerNorm


class BertEncoder:
    """Token embeddings -> final hidden states for a `PackedBatch`."""

    def __init__(self, config: EncoderConfig, source: WeightSource, device: torch.device,
                 dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype
        prefix = next((p for p in _PREFIXES if f"{p}embeddings.word_embeddings.weight" in source), None)
        if prefix is None:
            raise CheckpointError("checkpoint has no BERT embeddings (embeddings.word_embeddings.weight)")

        def get(name: str) -> torch.Tensor:
            return source.get(prefix + name, dtype).to(device).contiguous()

        def norm(name: str) -> LayerNorm:
            return LayerNorm(get(f"{name}.weight"), get(f"{name}.bias"), config.layer_norm_eps)

        def linear(name: str) -> Linear:
            return Linear(get(f"{name}.weight"), get(f"{name}.bias"))

        self.word_embeddings = get("embeddings.word_embeddings.weight")
        self.position_embeddings = get("embeddings.position_embeddings.weight")
        # Single-segment inputs only: every token has type 0, so fold that row
        # into the position table once instead of adding it on every call.
        self.position_embeddings += get("embeddings.token_type_embeddings.weight")[0]
        self.embed_norm = norm("embeddings.LayerNorm")

        self.layers: list[EncoderLayer] = []
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}."
            attn = p + "attention.self."
            qkv_w = torch.cat([get(f"{attn}{n}.weight") for n in ("query", "key", "value")])
            qkv_b = torch.cat([get(f"{attn}{n}.bias") for n in ("query", "key", "value")])
            self.layers.append(EncoderLayer(
                qkv=Linear(qkv_w, qkv_b),
                attn_out=linear(p + "attention.output.dense"),
                attn_norm=norm(p + "attention.output.LayerNorm"),
                mlp_in=linear(p + "intermediate.dense"),
                mlp_out=linear(p + "output.dense"),
                mlp_norm=norm(p + "output.LayerNorm"),
            ))
        act = config.hidden_act
        # oneDNN names: "gelu" with algorithm "none" (erf) or "tanh"; "relu".
        self._act, self._act_algorithm = (
            ("relu", "") if act == "relu"
            else ("gelu", "tanh" if act in ("gelu_new", "gelu_pytorch_tanh") else "none")
        )

    @classmethod
    def from_dir(cls, config: EncoderConfig, model_dir: str, device: torch.device,
                 dtype: torch.dtype) -> BertEncoder:
        source = WeightSource(model_dir)
        try:
            return cls(config, source, device, dtype)
        finally:
            source.close()

    def _mlp_in(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """`act(linear(x))`; on CPU the activation runs inside the GEMM as a oneDNN
        post-op, which saves a pass over the [T, intermediate] tensor (~6% of a layer)."""
        if linear.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, self._act, [],
                                                      self._act_algorithm)
        y = linear(x)
        return F.relu(y) if self._act == "relu" else F.gelu(y, approximate=self._act_algorithm)

    def _attention(self, qkv: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Self-attention within each sequence; `qkv` is [T, 3 * hidden]."""
        heads, head_dim = self.config.num_heads, self.config.head_dim
        out = torch.empty(qkv.shape[0], heads * head_dim, device=qkv.device, dtype=qkv.dtype)
        for g in batch.groups:
            # [count * length, 3 * hidden] -> three [count, heads, length, head_dim] views.
            x = qkv[g.start:g.end].view(g.count, g.length, 3, heads, head_dim)
            q, k, v = (x[:, :, j].transpose(1, 2) for j in range(3))
            o = F.scaled_dot_product_attention(q, k, v)
            out[g.start:g.end].view(g.count, g.length, heads, head_dim).copy_(o.transpose(1, 2))
        return out

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states, [num_tokens, hidden], in the batch's packed order."""
        x = self.word_embeddings[batch.input_ids] + self.position_embeddings[batch.position_ids]
        x = self.embed_norm(x)
        for layer in self.layers:
            attn = self._attention(layer.qkv(x), batch)
            x = layer.attn_norm(x + layer.attn_out(attn))
            h = self._mlp_in(layer.mlp_in, x)
            x = layer.mlp_norm(x + layer.mlp_out(h))
        return x
