"""The Llama-family decoder (Llama, Mistral, Mixtral, Qwen2/3, Phi-3, Granite, OLMo, Gemma; MoE variants).

One class covers the sixteen architectures, over a paged KV cache: they
differ only in the MLP (dense, or a mixture of experts: moe.py), q/k/v biases
(Qwen2), q/k RMSNorm (per head: Qwen3, Gemma 3; over all heads: OLMo),
where the norms sit (OLMo: on each block's output only), tied embeddings,
rope scaling (and a second rotation for sliding layers: Gemma 3, OLMo 3),
sliding windows and capped scores (the attention backend's), how the
checkpoint stores the projections (Phi-3 fuses q|k|v and gate|up), how much
of each head turns (Phi-3 may turn part of it), Granite's four multipliers
(the residual one folded into the weights of the projections it scales) and
Gemma's norm weights, GELU, scaled embedding, norms on each block's output,
and capped logits. Weights are fused at load
(q|k|v, gate|up) so a dense layer makes four GEMM calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend

from .config import CheckpointError, ModelConfig
from .linear import Linear
from .moe import SparseMLP
from .rope import apply_rotation, interleave_permutation, rotation_table, uses_long_factors
from .weights import WeightSource

log = logging.getLogger(__name__)


@dataclass
class DecoderLayer:
    """The tensors of one transformer block."""

    # The norms before the attention and before the MLP (None: OLMo 2 has none).
    input_norm: torch.Tensor | None
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor | None
    # The MLP: dense (gate|up and down), or a mixture of experts.
    gate_up: Linear | None
    down: Linear | None
    moe: SparseMLP | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Gemma 2/3, OLMo 2: RMSNorms of the attention's and the MLP's outputs, before their residual adds.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


class LlamaFamilyModel:
    """Forward pass of a Llama-family checkpoint; returns final hidden states.

    `ops` is a module of fused pointwise kernels (`add_rms_norm`, `silu_mul`,
    `rotary_embedding`): the CPU extension on CPU, the Triton kernels
    (engine/kernels/triton_ops.py) on CUDA; None takes plain torch ops. On CPU
    its small-batch GEMM serves the linear layers too (`small_batch_gemm`).
    """

    def __init__(self, config: ModelConfig, source: WeightSource, device: torch.device,
                 dtype: torch.dtype, ops: ModuleType | None = None, small_batch_gemm: bool = True,
                 max_positions: int | None = None):
        if config.hidden_act not in ("silu", "swish", "gelu_pytorch_tanh"):
            raise CheckpointError(f"unsupported hidden_act {config.hidden_act!r} (need silu or gelu_pytorch_tanh)")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.ops = ops
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # Gemma's MLP (plain torch ops)
        small = ops if small_batch_gemm and device.type == "cpu" else None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, small_batch_ops=small)

        def residual_branch(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            """A block's last projection, its output scaled by Granite's residual
            multiplier: folded into the weights, no extra kernel a layer."""
            m = config.residual_multiplier
            if m != 1.0:
                weight, bias = weight * m, None if bias is None else bias * m
            return linear(weight, bias)

        perm = interleave_permutation(config.head_dim, config.rotary_dim)

        def load(name: str, *shape: int) -> torch.Tensor:
            tensor = source.get(name, dtype)
            if tuple(tensor.shape) != shape:
                # As transformers refuses it: a config and weights that disagree
                # loaded, then failed every request (or served a wrong vocabulary).
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json "
                                      f"makes it {shape}")
            return tensor

        hidden, inter = config.hidden_size, config.intermediate_size
        q_size, kv_size = config.q_size, config.kv_size

        def norm_weight(name: str, size: int) -> torch.Tensor:
            """An RMSNorm's weight; Gemma stores (weight - 1): the 1 is added in
            float32, as its norm computes it, then cast once."""
            if not config.gemma_norms:
                return load(name, size)
            weight = source.get(name, torch.float32)
            if tuple(weight.shape) != (size,):
                raise CheckpointError(f"tensor {name!r} has shape {tuple(weight.shape)}, but config.json "
                                      f"makes it {(size,)}")
            return (weight + 1).to(dtype)

        def permute_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
            # HF rotate_half layout -> interleaved pairs (see rope.py).
            shape = t.shape
            return t.reshape(heads, config.head_dim, -1)[:, perm].reshape(shape)

        def qkv_weights(attn: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if config.fused_checkpoint:  # rows q | k | v
                qkv = load(attn + "qkv_proj.weight", q_size + 2 * kv_size, hidden)
                return qkv[:q_size], qkv[q_size:q_size + kv_size], qkv[q_size + kv_size:]
            return (load(attn + "q_proj.weight", q_size, hidden), load(attn + "k_proj.weight", kv_size, hidden),
                    load(attn + "v_proj.weight", kv_size, hidden))

        def gate_up_weight(mlp: str) -> torch.Tensor:
            if config.fused_checkpoint:  # rows gate | up, as we keep them
                return load(mlp + "gate_up_proj.weight", 2 * inter, hidden)
            return torch.cat([load(mlp + "gate_proj.weight", inter, hidden), load(mlp + "up_proj.weight", inter, hidden)])

        def sparse_mlp(p: str) -> SparseMLP:
            """A layer's router and experts, stacked (Mixtral names its
            experts' projections w1 (gate), w3 (up) and w2 (down); Granite
            stores them stacked already). The down projections take Granite's
            residual multiplier, as a dense layer's do."""
            e_inter, experts = config.moe_intermediate_size, config.num_experts
            if config.family == "granitemoe":
                block = p + "block_sparse_moe."
                router = load(block + "router.layer.weight", experts, hidden)
                gate_up = load(block + "input_linear.weight", experts, 2 * e_inter, hidden)
                down = load(block + "output_linear.weight", experts, hidden, e_inter)
            else:
                mixtral = config.family == "mixtral"
                block = p + ("block_sparse_moe." if mixtral else "mlp.")
                names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                at = [f"{block}experts.{e}." for e in range(experts)]
                router = load(block + "gate.weight", experts, hidden)
                gate_up = torch.stack([torch.cat([load(a + names[0] + ".weight", e_inter, hidden),
                                                  load(a + names[1] + ".weight", e_inter, hidden)]) for a in at])
                down = torch.stack([load(a + names[2] + ".weight", hidden, e_inter) for a in at])
            if config.residual_multiplier != 1.0:
                down = down * config.residual_multiplier
            mlp = SparseMLP(router.to(device), gate_up.to(device), down.to(device),
                            config.experts_per_token, config.norm_topk_prob)
            if config.shared_expert_intermediate_size:  # Qwen2-MoE's
                shared, size = block + "shared_expert.", config.shared_expert_intermediate_size
                mlp.shared_gate_up = torch.cat([load(shared + "gate_proj.weight", size, hidden),
                                                load(shared + "up_proj.weight", size, hidden)]).to(device)
                mlp.shared_down = load(shared + "down_proj.weight", hidden, size).to(device)
                mlp.shared_gate = load(block + "shared_expert_gate.weight", 1, hidden).to(device)
            return mlp

        self.embed = load("model.embed_tokens.weight", config.vocab_size, hidden).to(device)
        self.layers: list[DecoderLayer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            q, k, v = qkv_weights(p + "self_attn.")
            q = permute_heads(q, config.num_heads)
            k = permute_heads(k, config.num_kv_heads)
            bias = None
            if config.attention_bias:
                bias = torch.cat([
                    permute_heads(load(p + "self_attn.q_proj.bias", q_size), config.num_heads),
                    permute_heads(load(p + "self_attn.k_proj.bias", kv_size), config.num_kv_heads),
                    load(p + "self_attn.v_proj.bias", kv_size),
                ]).to(device)
            mlp = p + "mlp."
            sparse = i in config.moe_layers
            layer = DecoderLayer(
                input_norm=norm_weight(p + "input_layernorm.weight", hidden).to(device) if config.pre_norms
                else None,
                qkv=linear(torch.cat([q, k, v]).to(device), bias),
                o_proj=residual_branch(load(p + "self_attn.o_proj.weight", hidden, q_size).to(device),
                                       load(p + "self_attn.o_proj.bias", hidden).to(device)
                                       if config.output_bias else None),
                # The norm before the MLP (Gemma's sandwich names it pre_feedforward).
                post_norm=norm_weight(p + ("pre_feedforward_layernorm.weight" if config.block_out_norms
                                           else "post_attention_layernorm.weight"), hidden).to(device)
                if config.pre_norms else None,
                gate_up=None if sparse else linear(
                    gate_up_weight(mlp).to(device),
                    torch.cat([load(mlp + "gate_proj.bias", inter), load(mlp + "up_proj.bias", inter)]).to(device)
                    if config.mlp_bias else None),
                down=None if sparse else residual_branch(
                    load(mlp + "down_proj.weight", hidden, inter).to(device),
                    load(mlp + "down_proj.bias", hidden).to(device) if config.mlp_bias else None),
                moe=sparse_mlp(p) if sparse else None,
            )
            if config.qk_norm:
                layer.q_norm = norm_weight(p + "self_attn.q_norm.weight", config.head_dim)[perm].contiguous().to(device)
                layer.k_norm = norm_weight(p + "self_attn.k_norm.weight", config.head_dim)[perm].contiguous().to(device)
            if config.qk_norm_whole:  # one weight per dim of every head, permuted as the heads are
                layer.q_norm = permute_heads(norm_weight(p + "self_attn.q_norm.weight", q_size),
                                             config.num_heads).contiguous().to(device)
                layer.k_norm = permute_heads(norm_weight(p + "self_attn.k_norm.weight", kv_size),
                                             config.num_kv_heads).contiguous().to(device)
            if config.block_out_norms:
                layer.attn_out_norm = norm_weight(p + "post_attention_layernorm.weight", hidden).to(device)
                layer.mlp_out_norm = norm_weight(p + "post_feedforward_layernorm.weight", hidden).to(device)
            self.layers.append(layer)
        self.final_norm = norm_weight("model.norm.weight", hidden).to(device)
        # Tied, the head is the embedding (a stored lm_head.weight is ignored, as
        # vLLM does); untied, it must be there: a config and weights that disagree.
        if config.tie_word_embeddings:
            self.lm_head = linear(self.embed)
            # Compared as loaded, on the host: a transient copy on the GPU
            # would be held by its allocator when the KV cache is sized.
            if "lm_head.weight" in source and not torch.equal(
                    load("lm_head.weight", config.vocab_size, hidden),
                    load("model.embed_tokens.weight", config.vocab_size, hidden)):
                # A fine-tune that trained its own head and kept the base config:
                # transformers would use that head (and warn), so say which we use.
                log.warning("config.json ties the output head to the embedding, but the checkpoint's "
                            "lm_head.weight differs from it: serving the embedding as the head, as vLLM does "
                            "(set tie_word_embeddings to false to serve the stored head)")
        elif "lm_head.weight" in source:
            self.lm_head = linear(load("lm_head.weight", config.vocab_size, hidden).to(device))
        else:
            raise CheckpointError("checkpoint has no lm_head.weight, and its config says "
                                  "tie_word_embeddings is false")
        self.rotations = torch.empty(0)
        self.rotation_pairs: torch.Tensor | None = None
        # Gemma's sliding layers turn by their own rotation (`local_layers`).
        self.local_rotations: torch.Tensor | None = None
        self.local_rotation_pairs: torch.Tensor | None = None
        self.local_layers = frozenset(config.local_layers) if config.rope_local is not None else frozenset()
        self.keep_positions(min(max_positions or config.max_position_embeddings, config.max_position_embeddings))

    def keep_positions(self, count: int) -> None:
        """Rotations for positions 0..count-1 only (the context served), not
        the checkpoint's whole range (a million positions: 500 MiB)."""
        if count == self.rotations.shape[0]:
            return
        rope = self.config.rope
        if rope.rope_type == "longrope":
            log.info("longrope: the %s factors, for a context of %d positions (pretrained on %d)",
                     "long" if uses_long_factors(rope, count) else "short", count,
                     rope.original_max_position_embeddings)
        self.rotations = rotation_table(rope, self.config.head_dim, count, self.config.rotary_dim).to(self.device)
        # The kernels of `ops` read the same table as (cos, sin) float pairs.
        self.rotation_pairs = torch.view_as_real(self.rotations).flatten(1) if self.ops is not None else None
        if self.config.rope_local is not None:
            self.local_rotations = rotation_table(self.config.rope_local, self.config.head_dim, count).to(self.device)
            self.local_rotation_pairs = torch.view_as_real(self.local_rotations).flatten(1) \
                if self.ops is not None else None

    def linears(self) -> list[Linear]:
        """Every linear layer (not the experts'), the LM head last."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
                if lin is not None] + [self.lm_head]

    def sparse_mlps(self) -> list[SparseMLP]:
        """The mixture-of-experts layers' MLPs (none in a dense model)."""
        return [layer.moe for layer in self.layers if layer.moe is not None]

    @property
    def capturable(self) -> bool:
        """Whether a forward pass can be captured in a CUDA graph: not with
        experts grouped on the host's count of their tokens (moe.py)."""
        return all(mlp.grouped_on_device for mlp in self.sparse_mlps())

    # -- building blocks --------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """residual += x; return rms_norm(residual) (one kernel with `ops`), or
        without a norm (OLMo 2's blocks take the residual stream as it is)
        the residual itself, which nothing writes to before the next add."""
        if weight is None:
            return residual.add_(x)
        if self.ops is not None:
            self.ops.add_rms_norm(x, residual, weight, self.config.rms_norm_eps)
            return x
        residual.add_(x)
        return self._norm(residual, weight)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = self.config.intermediate_size
        if self.gelu:
            return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def _mlp_out(self, layer: DecoderLayer, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of `act(gate) * up`: with SiLU one kernel for a single
        row on the Triton matrix-vector kernel (a launch fewer a layer at batch 1)."""
        assert layer.down is not None
        fused = None if self.gelu else layer.down.gated_row(gate_up)
        return fused if fused is not None else layer.down(self._act_mul(gate_up))

    def _rope_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `_rotate` takes for a step, for the main rotation and the local
        one (the same without it): the positions themselves for the kernel of
        `ops`, else each token's rotation, gathered once for all layers."""
        if self.ops is not None:
            positions = positions.contiguous()
            return positions, positions
        main = self.rotations[positions]
        return main, self.local_rotations[positions] if self.local_rotations is not None else main

    def _rotate(self, x: torch.Tensor, rope: torch.Tensor, pairs: torch.Tensor | None) -> torch.Tensor:
        """Rope on `x` `[T, heads, head_dim]`: in place with `ops` (by `pairs`), else into a new tensor."""
        if self.ops is not None:
            self.ops.rotary_embedding(x, pairs, rope)
            return x
        return apply_rotation(x, rope)

    def _qkv(self, layer: DecoderLayer, x: torch.Tensor, rope: torch.Tensor, pairs: torch.Tensor | None,
             rotate: bool):
        """Queries, keys and values of a layer; q and k rotated unless `rotate` is
        False (the attention backend then rotates them as it stores the keys)."""
        c = self.config
        t = x.shape[0]
        qkv = layer.qkv(x)
        q_size, kv_size = c.q_size, c.kv_size
        v = qkv[:, q_size + kv_size:].view(t, c.num_kv_heads, c.head_dim)
        if layer.q_norm is None:
            qk = qkv[:, :q_size + kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
            if rotate:
                qk = self._rotate(qk, rope, pairs)
            return qk[:, :c.num_heads], qk[:, c.num_heads:], v
        assert layer.k_norm is not None
        if c.qk_norm_whole:  # over all heads at once, then split into heads
            q = self._norm(qkv[:, :q_size], layer.q_norm).view(t, c.num_heads, c.head_dim)
            k = self._norm(qkv[:, q_size:q_size + kv_size], layer.k_norm).view(t, c.num_kv_heads, c.head_dim)
        else:
            q = self._norm(qkv[:, :q_size].view(t, c.num_heads, c.head_dim), layer.q_norm)
            k = self._norm(qkv[:, q_size:q_size + kv_size].view(t, c.num_kv_heads, c.head_dim), layer.k_norm)
        return (self._rotate(q, rope, pairs), self._rotate(k, rope, pairs), v) if rotate else (q, k, v)

    # -- forward ----------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                meta: object) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`, for a flat token batch;
        `meta` is the attention backend's plan of the step."""
        c = self.config
        t = input_ids.shape[0]
        ropes = self._rope_inputs(positions)
        # With the Triton kernels, rotary embedding and the cache write are one kernel.
        in_write = attention.rotates_in_write and self.ops is not None
        h = F.embedding(input_ids, self.embed)
        if c.embedding_multiplier != 1.0:  # Granite's, Gemma's sqrt(hidden)
            h = h * c.embedding_multiplier
        # The embedding's output is a fresh tensor and h is rebound below, so it
        # is the residual stream itself, added to in place layer by layer.
        residual = h
        first = self.layers[0].input_norm
        x = h if first is None else self._norm(h, first)
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = self._add_norm(h, residual, layer.input_norm)
            local = i in self.local_layers
            rope = ropes[1] if local else ropes[0]
            pairs = self.local_rotation_pairs if local else self.rotation_pairs
            q, k, v = self._qkv(layer, x, rope, pairs, rotate=not in_write)
            if in_write:
                assert pairs is not None  # the ops' tables exist where ops do
                attn = attention.attend_rotating(q, k, v, i, meta, pairs, rope)
            else:
                attn = attention(q, k, v, i, meta)
            h = layer.o_proj(attn.reshape(t, c.q_size))
            if layer.attn_out_norm is not None:
                h = self._norm(h, layer.attn_out_norm)
            x = self._add_norm(h, residual, layer.post_norm)
            if layer.moe is not None:
                h = layer.moe(x)
            else:
                assert layer.gate_up is not None
                h = self._mlp_out(layer, layer.gate_up(x))
            if layer.mlp_out_norm is not None:
                h = self._norm(h, layer.mlp_out_norm)
        return self._add_norm(h, residual, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[N, vocab]` for the given hidden rows."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite divides, in the model's dtype as transformers does
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma's
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
