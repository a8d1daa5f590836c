"""Load tensors from a checkpoint's safetensors files (one file or a sharded index)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, read_json

# Where a vision-language checkpoint keeps its text model's tensors (Gemma 3:
# transformers saves `language_model.model.`, its in-memory names are
# `model.language_model.`) and its head.
_TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
_TEXT_HEAD = "language_model.lm_head."


class WeightSource:
    """Name -> tensor lookup across all *.safetensors files of a checkpoint.

    Names are a text decoder's (`model.layers.0...`, `lm_head.weight`); in a
    vision-language checkpoint they are read from its text model's tensors
    (the vision tower's are never read)."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.exists():
            data = read_json(index)  # CheckpointError if it is not JSON
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index.name} has no weight_map of tensor names to files")
            files = sorted({root / f for f in weight_map.values()})
        else:
            files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {root}")
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"checkpoint is missing {', '.join(missing)} (listed in the index)")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                    self._where[name] = f
        self._open: dict[Path, object] = {}
        self._renames: list[tuple[str, str]] = []
        if "model.embed_tokens.weight" not in self._where:
            text = next((p for p in _TEXT_MODEL_PREFIXES if p + "embed_tokens.weight" in self._where), None)
            if text is not None:
                self._renames = [("model.", text), ("lm_head.", _TEXT_HEAD)]

    def _stored(self, name: str) -> str:
        """The name `name` is stored under."""
        for ours, theirs in self._renames:
            if name.startswith(ours):
                return theirs + name[len(ours):]
        return name

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self._where

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        name = self._stored(name)
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        handle = self._open.get(path)
        if handle is None:
            handle = safe_open(str(path), framework="pt")
            self._open[path] = handle
        tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            # float8 or integer codes read as values would be nonsense.
            raise CheckpointError(f"tensor {name!r} is stored as {tensor.dtype}: quantized checkpoints "
                                  "are not supported (use the model's bf16/fp16 weights)")
        return tensor.to(dtype)

    def close(self) -> None:
        self._open.clear()
