"""Read a Hugging Face checkpoint's config into the one shape our runner needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or holds something we cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (`rope_type` default or llama3)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise CheckpointError(f"unsupported rope_type {self.rope_type!r} (supported: default, llama3)")


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
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

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


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older
    # checkpoints have `rope_theta` and an optional `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    kwargs = {k: params[k] for k in known if k in params}
    if rope_type == "default":
        kwargs = {}
    return RopeConfig(theta=theta, rope_type=rope_type, **kwargs)


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
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # Sliding-window attention is not implemented; a window shorter than the
    # context would change the model, so cap the usable context at the window.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window:
        max_pos = min(max_pos, int(window))

    eos = _as_ids(cfg.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path)
        eos += [t for t in _as_ids(gen.get("eos_token_id")) if t not in eos]

    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope=_rope_config(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama-style configs say so explicitly.
        attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        eos_token_ids=tuple(eos),
        # As transformers builds them: Llama's and Qwen3's attention_bias is on
        # the output projection too (never Qwen2's or Mistral's), and Llama's
        # mlp_bias on all three MLP projections.
        output_bias=family in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
        mlp_bias=family == "llama" and bool(cfg.get("mlp_bias", False)),
        extra={"hidden_act": cfg.get("hidden_act", "silu")},
    )
