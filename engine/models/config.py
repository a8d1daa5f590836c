"""Read a Hugging Face checkpoint's config into the one shape our runner needs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Vision-language models whose text model is served (text in, text out;
    # the vision tower is not loaded): Gemma 3 from 4b up is published only
    # so, and Qwen2-VL's and Qwen2.5-VL's text models are Qwen2's.
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
}
# The vision-language architectures above, and what transformers' text
# config class gives a key their `text_config` leaves out (gemma-3-4b-it's
# holds five). Qwen2-VL's config.json is the text model's, with its
# `vision_config` inside (or, re-saved by transformers 5, a `text_config`).
TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "Gemma3ForConditionalGeneration": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    },
    "Qwen2VLForConditionalGeneration": {},
    "Qwen2_5_VLForConditionalGeneration": {},
}
_FLAT_TEXT_CONFIGS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or holds something we cannot run."""


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: plain, or scaled as transformers' `rope_type`
    linear, dynamic (plain up to the checkpoint's positions, all we serve),
    llama3, yarn or longrope."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and kept frequencies, and the scale
    # of cos/sin (None: from factor, mscale and mscale_all_dim, as transformers does).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope (Phi-3's long-context rotation): each pair's wavelength
    # stretched by its own factor, the short ones for a context within the
    # pretraining length, the long ones past it.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(f"unsupported rope_type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.rope_type != "default" and not self.factor > 0:
            raise CheckpointError(f"rope scaling factor must be positive, got {self.factor}")

    @property
    def magnitude(self) -> float:
        """What cos and sin are scaled by (yarn's and longrope's attention factor; 1 otherwise)."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.rope_type == "longrope":
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

        def scale(mscale: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * mscale * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return scale(self.mscale) / scale(self.mscale_all_dim)
        return scale(1.0)

    def positions(self, max_position_embeddings: int) -> int:
        """The context the scaled model is meant for, as vLLM derives it: linear
        stretches the checkpoint's positions, yarn its original ones."""
        if self.rope_type == "linear":
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts of a decoder-only Llama-family checkpoint."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # on the q, k and v projections
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    output_bias: bool = False  # on the attention's output projection
    mlp_bias: bool = False  # on the gate, up and down projections
    # The checkpoint stores q|k|v as one `qkv_proj` and gate|up as one
    # `gate_up_proj` (Phi-3), not a tensor each.
    fused_checkpoint: bool = False
    # Granite's scalings: the embedding's output, each block's output before
    # the residual add, the attention scores (None: 1/sqrt(head_dim)), and the
    # logits (divided by it).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # The MLP's activation of its gate: SiLU, or Gemma's GELU (tanh).
    hidden_act: str = "silu"
    # Gemma: every RMSNorm weight stored as (weight - 1). Gemma 2 and 3: an
    # RMSNorm on each block's output before its residual add too
    # (`block_out_norms`); logits soft-capped (c * tanh(logits / c)), and
    # Gemma 2's attention scores too. Gemma 3 (and OLMo 3): the layers in
    # `local_layers` (the sliding ones) rotated by `rope_local`.
    gemma_norms: bool = False
    block_out_norms: bool = False
    # OLMo 2 and 3: no norm before the attention or the MLP (their outputs
    # are normed: block_out_norms), and q/k RMSNorms over the whole
    # projection, all heads at once, not per head (`qk_norm`). OLMo 3's
    # sliding layers turn by `rope_local` (its scaling the full layers' only).
    pre_norms: bool = True
    qk_norm_whole: bool = False
    rope_local: RopeConfig | None = None
    local_layers: tuple[int, ...] = ()
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Phi-3's partial rotation: how many of each head's leading dims turn (None: all).
    rotary_dim: int | None = None
    # Mixture-of-experts MLPs (Mixtral, Qwen3-MoE) on the layers in
    # `moe_layers` (the others dense, of `intermediate_size`): `num_experts`
    # SiLU-gated experts of `moe_intermediate_size`, `experts_per_token` of
    # them per token, their weights rescaled to sum to 1 if `norm_topk_prob`.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE: beside the routed experts, a shared one of this size on
    # every token, its output scaled by a sigmoid gate (0: none).
    shared_expert_intermediate_size: int = 0
    # Per layer, the keys a query sees: the last `w` positions up to its own
    # (0: all of them). Empty: no layer slides.
    sliding_windows: tuple[int, ...] = ()
    # generation_config.json's sampling values (vLLM reads the same keys):
    # what a request that leaves them unset samples with (--generation-config).
    sampling_defaults: dict[str, float] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, with CheckpointError naming a missing or broken file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint is missing {path.name} (looked in {path.parent})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# What each scaled rotation must name, as transformers requires (yarn may
# name its factor as null: then it is the ratio of the two context lengths).
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
GEMMAS = ("gemma", "gemma2", "gemma3")
OLMOS = ("olmo2", "olmo3")
MOES = ("mixtral", "granitemoe", "qwen2_moe", "qwen3_moe", "olmoe")
# Whose attention_bias config key puts biases on q, k, v and the output projection.
_ATTENTION_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "granite", "granitemoe", "olmoe", *OLMOS, *GEMMAS)
# Phi-3's older names for its longrope, as transformers' Phi-3 config renames them.
_PHI3_LONGROPE_ALIASES = ("su", "yarn")


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's rotary parameters, from either form: transformers >= 5
    writes `rope_parameters` (theta inside); older checkpoints have
    `rope_theta` and an optional `rope_scaling`. With both, `rope_scaling`
    wins, as transformers reads it: a model card's long-context block added to
    a re-saved checkpoint. (transformers then forgets the theta that
    `rope_parameters` held; we keep it, unless the block or the top level names one.)"""
    new = dict(cfg.get("rope_parameters") or {})
    params = dict(cfg.get("rope_scaling") or {}) or new
    if params is not new and "rope_theta" not in params and "rope_theta" not in cfg and "rope_theta" in new:
        params["rope_theta"] = new["rope_theta"]
    return params


def _rope_config(cfg: dict[str, Any], pairs: int | None = None, family: str = "") -> RopeConfig:
    """The rotation config.json describes; `pairs`: how many pairs of each
    head turn (what longrope's factor lists must cover)."""
    params = _rope_params(cfg)
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if family == "phi3" and rope_type in _PHI3_LONGROPE_ALIASES:
        rope_type = "longrope"
    # Qwen2-VL's multimodal rotation turns each pair by one of a token's three
    # position ids (time, height, width); a text token's three are its
    # position, so on text it is the plain rotation (transformers renames it so).
    if rope_type == "mrope":
        rope_type = "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    for key in _ROPE_REQUIRED.get(rope_type, ()):
        if params.get(key) is None and not (key == "factor" and rope_type == "yarn" and key in params):
            raise CheckpointError(f"rope_type {rope_type!r} needs a number for {key} in its rope parameters, "
                                  f"got {'null' if key in params else 'none'}")
    max_pos = cfg.get("max_position_embeddings", 2048)
    # The pretraining length, as transformers reads it: a top-level value wins
    # (Phi-3's form) for the types that use it, else the block's, else the checkpoint's length.
    top = cfg.get("original_max_position_embeddings")
    if top is not None and rope_type in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = top
    elif params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = top or max_pos
    # yarn's null factor, and longrope's absent one: the ratio of the two lengths.
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    floats = {"factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
              "attention_factor", "mscale", "mscale_all_dim"}
    kwargs: dict[str, Any] = {k: float(params[k]) for k in floats if params.get(k) is not None}
    kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if "truncate" in params:
        kwargs["truncate"] = bool(params["truncate"])
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            kwargs[key] = _pair_factors(params.get(key), key, pairs)
    return RopeConfig(theta=theta, rope_type=rope_type, **kwargs)


def _pair_factors(value: Any, key: str, pairs: int | None) -> tuple[float, ...]:
    """longrope's `short_factor` or `long_factor`: a positive number per turning pair."""
    ok = isinstance(value, list) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < float("inf") for v in value)
    if not ok or (pairs is not None and len(value) != pairs):
        size = f"{pairs} " if pairs is not None else ""
        raise CheckpointError(f"longrope's {key} must list {size}positive numbers, one for each pair of a head's "
                              f"rotated dims, got {value!r}")
    return tuple(float(v) for v in value)


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_INT_DEFAULTS = ("top_k", "max_new_tokens")


def _sampling_defaults(gen: dict[str, Any]) -> dict[str, float]:
    """The sampling values generation_config.json sets (numbers only; a value
    a request could not send is dropped when the engine checks them)."""
    out: dict[str, float] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = gen.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = int(value) if key in _INT_DEFAULTS else float(value)
    return out


def _sliding_windows(cfg: dict[str, Any], family: str, num_layers: int, max_pos: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: it attends to the whole context; empty:
    no layer slides), read as transformers reads it: Mistral's applies to every
    layer (as Phi-3's, when its config gives one); Qwen's is off unless
    `use_sliding_window`, and then only on the layers `layer_types` names, or
    else those from `max_window_layers` (28 by default) on; Gemma's on the
    layers `layer_types` names, or else all but each `sliding_window_pattern`-th
    (Gemma 3; Gemma 2: every second);
    Llama has none of its own (a `layer_types` that names one is honoured, as
    vLLM does). A window as long as the context never binds and is dropped."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise CheckpointError(f"config.json's layer_types must list the kind of each of the {num_layers} "
                                  f"layers, got {layer_types!r}")
        unknown = sorted(set(map(str, layer_types)) - {"full_attention", "sliding_attention"})
        if unknown:
            raise CheckpointError(f"unsupported layer_types {', '.join(unknown)} "
                                  "(supported: full_attention, sliding_attention)")
    if family == "qwen3_moe" and not cfg.get("use_sliding_window", False):
        return ()
    if family in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        # Mixtral's and Qwen3-MoE's (with use_sliding_window) too, on every
        # layer, as their transformers attention reads it.
        window = cfg.get("sliding_window", 4096 if family in ("mistral", "qwen3_moe") else None)
        layer_types = ["sliding_attention"] * num_layers
    elif family in ("gemma2", "gemma3", "olmo3"):
        window = cfg.get("sliding_window", 4096)
        layer_types = _patterned_layer_types(cfg, family, num_layers)
    else:
        if family in ("qwen2", "qwen3", "qwen2_moe"):
            if not cfg.get("use_sliding_window", False):
                return ()
            window = cfg.get("sliding_window", 4096)
        else:
            window = cfg.get("sliding_window")
        if layer_types is None and family == "qwen2_moe":
            # Its own rule: every second layer, from the first, below max_window_layers.
            first = cfg.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int):
                raise CheckpointError(f"config.json's max_window_layers must be an integer, got {first!r}")
            layer_types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
                           for i in range(num_layers)]
        if layer_types is None and family in ("qwen2", "qwen3"):
            first = cfg.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int):
                raise CheckpointError(f"config.json's max_window_layers must be an integer, got {first!r}")
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not window or not layer_types:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"config.json's sliding_window must be a positive integer, got {window!r}")
    if window >= max_pos:
        return ()
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    return windows if any(windows) else ()


def _granite_scalings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers (transformers' defaults: 1.0), positive numbers."""
    out: dict[str, Any] = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        value = cfg.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            raise CheckpointError(f"config.json's {key} must be a positive number, got {value!r}")
        out[key] = float(value)
    return out


def _layer_type_ropes(cfg: dict[str, Any], family: str, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's and OLMo 3's two rotations, as transformers reads them: the
    full-attention layers' (any scaling) and the sliding layers', per layer
    type in `rope_parameters`, or from the older `rope_theta`/`rope_scaling`
    keys (the scaling the full layers' only). Theta by default: Gemma 3's
    full layers 1e6 and sliding ones `rope_local_base_freq` (1e4); OLMo 3's
    both `rope_theta` (5e5)."""
    per_type = cfg.get("rope_parameters") or {}
    if not isinstance(per_type, dict) or not set(per_type) <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"{family}'s rope_parameters must be given per layer type "
                              "(full_attention, sliding_attention)")
    if family == "gemma3":
        full_theta, local_theta = cfg.get("rope_theta", 1_000_000.0), cfg.get("rope_local_base_freq", 10_000.0)
    else:
        full_theta = local_theta = cfg.get("rope_theta", 500_000.0)
    full = {"rope_theta": full_theta, **(per_type.get("full_attention") or {}), **(cfg.get("rope_scaling") or {})}
    local = {"rope_theta": local_theta, **(per_type.get("sliding_attention") or {})}
    context = {"max_position_embeddings": cfg.get("max_position_embeddings", 131072)}
    return (_rope_config({**context, "rope_parameters": full}, head_dim // 2),
            _rope_config({**context, "rope_parameters": local}, head_dim // 2))


def _patterned_layer_types(cfg: dict[str, Any], family: str, num_layers: int) -> list[str]:
    """`layer_types` (checked by _sliding_windows), else every layer slides but
    each `sliding_window_pattern`th (Gemma 3, 6 by default; Gemma 2: each
    second; OLMo 3: each fourth), as transformers derives them."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 6) if family == "gemma3" else 2 if family == "gemma2" else 4
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise CheckpointError(f"config.json's sliding_window_pattern must be a positive integer, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _gemma_settings(cfg: dict[str, Any], family: str, hidden: int, rope_local: RopeConfig | None,
                    num_layers: int) -> dict[str, Any]:
    """What sets Gemma apart from Llama (see ModelConfig), with transformers'
    defaults (Gemma 2 caps scores at 50 and logits at 30, Gemma 3 neither);
    refused: bidirectional attention, which ours is not."""
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError("use_bidirectional_attention is not supported")
    if family == "gemma":  # norms and the embedding's scale only
        return {"gemma_norms": True, "embedding_multiplier": hidden ** 0.5}
    scalar = cfg.get("query_pre_attn_scalar", 256)
    caps = {key: cfg.get(key, default if family == "gemma2" else None)
            for key, default in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0))}
    for key, value, optional in (("query_pre_attn_scalar", scalar, False), *((k, v, True) for k, v in caps.items())):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            raise CheckpointError(f"config.json's {key} must be a positive number, got {value!r}")
    settings: dict[str, Any] = {
        "gemma_norms": True, "block_out_norms": True, "embedding_multiplier": hidden ** 0.5,
        "attention_multiplier": float(scalar) ** -0.5,
        **{key: None if value is None else float(value) for key, value in caps.items()}}
    if family == "gemma3":
        settings.update(rope_local=rope_local, local_layers=_sliding_layers(cfg, family, num_layers))
    return settings


def _olmo_settings(cfg: dict[str, Any], family: str, rope_local: RopeConfig | None,
                   num_layers: int) -> dict[str, Any]:
    """What sets OLMo 2 and 3 apart from Llama (see ModelConfig)."""
    settings: dict[str, Any] = {"pre_norms": False, "block_out_norms": True}
    if family == "olmo3":
        settings.update(rope_local=rope_local, local_layers=_sliding_layers(cfg, family, num_layers))
    return settings


def _sliding_layers(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[int, ...]:
    """The layers that slide (and turn by the local rotation)."""
    return tuple(i for i, kind in enumerate(_patterned_layer_types(cfg, family, num_layers))
                 if kind == "sliding_attention")


def _experts(cfg: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """Mixtral's, OLMoE's and Qwen3-MoE's experts, with transformers'
    defaults: Mixtral routes every layer to 2 of 8 experts of
    `intermediate_size`, weights always rescaled; OLMoE every layer to 8 of
    64 of `intermediate_size`, rescaled per `norm_topk_prob`; Qwen3-MoE to 8
    of 128 of `moe_intermediate_size`, on each `decoder_sparse_step`-th layer
    not in `mlp_only_layers`."""
    if family in ("mixtral", "granitemoe"):  # Granite's softmax over the top-k logits: the same weights
        experts, inter, renormalize = cfg.get("num_local_experts", 8), cfg.get("intermediate_size"), True
        layers = list(range(num_layers))
    elif family == "olmoe":
        experts = next((v for v in (cfg.get("num_experts"), cfg.get("num_local_experts")) if v is not None), 64)
        inter, renormalize = cfg.get("intermediate_size"), cfg.get("norm_topk_prob", False)
        layers = list(range(num_layers))
    else:
        # transformers 5 writes the count as num_local_experts (num_experts: null).
        experts = next((v for v in (cfg.get("num_experts"), cfg.get("num_local_experts")) if v is not None),
                       60 if family == "qwen2_moe" else 128)
        inter = cfg.get("moe_intermediate_size", 1408 if family == "qwen2_moe" else 768)
        renormalize = cfg.get("norm_topk_prob", False)
        step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1 or not isinstance(dense, list):
            raise CheckpointError(f"config.json's decoder_sparse_step must be a positive integer and "
                                  f"mlp_only_layers a list, got {step!r} and {dense!r}")
        layers = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0] if experts else []
    top_k = cfg.get("num_experts_per_tok", {"mixtral": 2, "granitemoe": 2, "qwen2_moe": 4}.get(family, 8))
    shared = cfg.get("shared_expert_intermediate_size", 5632) if family == "qwen2_moe" else 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise CheckpointError(f"config.json's shared_expert_intermediate_size must be an integer >= 0, got {shared!r}")
    for key, value in (("experts", experts), ("num_experts_per_tok", top_k), ("expert intermediate size", inter)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"config.json's {key} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise CheckpointError(f"num_experts_per_tok ({top_k}) is more than the {experts} experts")
    return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": inter,
            "norm_topk_prob": bool(renormalize), "moe_layers": tuple(layers),
            "shared_expert_intermediate_size": shared}


def _hidden_act(cfg: dict[str, Any], family: str) -> str:
    """The MLP's activation: Gemma's `hidden_activation` (GELU, tanh by
    default; Gemma 1's `hidden_act` is not read, as vLLM reads it: its first
    configs said "gelu" where the model was trained with the tanh
    approximation), else `hidden_act` (SiLU by default)."""
    if family in GEMMAS:
        return str(cfg.get("hidden_activation") or "gelu_pytorch_tanh")
    return str(cfg.get("hidden_act", "silu"))


def _required(cfg: dict[str, Any], key: str) -> int:
    """A config.json number every supported architecture has."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CheckpointError(f"config.json needs a positive number for {key!r}, got {value!r}")
    return int(value)


def _rotary_dim(cfg: dict[str, Any], family: str, head_dim: int) -> int | None:
    """How many of each head's leading dims turn (None: all of them). Only
    Phi-3 rotates part of a head (Phi-4-mini: 3/4), as only its transformers
    model does; another architecture's partial factor would serve a
    different model, and is refused."""
    params = _rope_params(cfg)
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor is None or (not isinstance(factor, bool) and factor == 1.0):
        return None
    if family != "phi3":
        raise CheckpointError(f"partial_rotary_factor {factor} is not supported for {family} (only 1.0)")
    number = isinstance(factor, int | float) and not isinstance(factor, bool)
    dims = int(head_dim * factor) if number and 0 < factor < 1 else 0
    if dims < 2 or dims % 2:
        raise CheckpointError(f"config.json's partial_rotary_factor must turn an even number of a head's "
                              f"{head_dim} dims, got {factor!r}")
    return dims


def _text_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """A vision-language config's `text_config` as a text model's config.json:
    transformers' defaults for what it leaves out, the outer config's
    end-of-sequence ids and quantization where it names none of its own, and
    its tie of the head to the embedding (what transformers ties by)."""
    text = cfg.get("text_config")
    if text is None and arch in _FLAT_TEXT_CONFIGS:
        text = {key: value for key, value in cfg.items() if key != "vision_config"}
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json of a {arch} needs a text_config object, got {text!r}")
    outer = {key: cfg[key] for key in ("eos_token_id", "quantization_config", "compression_config") if key in cfg}
    tie = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}
    return {**TEXT_CONFIGS[arch], **outer, **text, **tie}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse config.json (+ generation_config.json) of an HF checkpoint directory."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    cfg = read_json(root / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {', '.join(archs) or '(none given)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if arch in TEXT_CONFIGS:
        cfg = _text_config(cfg, arch)
    quantized = cfg.get("quantization_config") or cfg.get("compression_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise CheckpointError(f"quantized checkpoints are not supported (quant_method={method}); "
                              "use the model's bf16/fp16 weights")
    if cfg.get("clip_qkv") is not None:
        # OLMoE's option (null in its released configs) to clamp q, k and v.
        raise CheckpointError("clip_qkv is not supported")
    num_heads = _required(cfg, "num_attention_heads")
    hidden = _required(cfg, "hidden_size")
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    num_layers = _required(cfg, "num_hidden_layers")
    rotary_dim = _rotary_dim(cfg, family, head_dim)
    rope = _rope_config(cfg, (rotary_dim or head_dim) // 2, family)
    max_pos = rope.positions(int(cfg.get("max_position_embeddings", 2048)))
    rope_local = None
    if family == "gemma3":
        # Its max_position_embeddings is the scaled context already (131072
        # beside a linear x8 on its full layers): not scaled again.
        rope, rope_local = _layer_type_ropes(cfg, family, head_dim)
        max_pos = int(cfg.get("max_position_embeddings", 131072))
    elif family == "olmo3":
        rope, rope_local = _layer_type_ropes(cfg, family, head_dim)
        max_pos = rope.positions(int(cfg.get("max_position_embeddings", 2048)))
    windows = _sliding_windows(cfg, family, num_layers, max_pos)

    eos = _as_ids(cfg.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else {}
    eos += [t for t in _as_ids(gen.get("eos_token_id")) if t not in eos]

    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=_required(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_required(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        sliding_windows=windows,
        rope=rope,
        rotary_dim=rotary_dim,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (Qwen2-MoE unless qkv_bias is false), Mistral and Phi-3 never;
        # the others as their attention_bias says.
        attention_bias=family == "qwen2" or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
        or (family in _ATTENTION_BIAS_FAMILIES and bool(cfg.get("attention_bias", False))),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        # OLMo's over all heads (OLMoE's too, beside Llama's norms before the attention and the MLP).
        qk_norm_whole=family in (*OLMOS, "olmoe"),
        eos_token_ids=tuple(eos),
        # As transformers builds them: attention_bias is on the output
        # projection too (never Qwen2's or Mistral's), and Llama's and
        # Granite's mlp_bias on all three MLP projections.
        output_bias=family in _ATTENTION_BIAS_FAMILIES and bool(cfg.get("attention_bias", False)),
        mlp_bias=family in ("llama", "granite") and bool(cfg.get("mlp_bias", False)),
        fused_checkpoint=family == "phi3",
        **(_granite_scalings(cfg) if family in ("granite", "granitemoe") else {}),
        **(_experts(cfg, family, num_layers) if family in MOES else {}),
        **(_olmo_settings(cfg, family, rope_local, num_layers) if family in OLMOS else {}),
        **(_gemma_settings(cfg, family, hidden, rope_local, num_layers) if family in GEMMAS else {}),
        sampling_defaults=_sampling_defaults(gen),
        hidden_act=_hidden_act(cfg, family),
    )
