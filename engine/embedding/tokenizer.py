"""Tokenization for embeddings: whole inputs, or inputs cut to the model's window."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.models.config import CheckpointError


def _prepend_lowercase(tok: Any) -> None:
    """sentence_bert_config.json `do_lower_case`: lower-case in the normalizer, in
    front of the tokenizer's own, as sentence-transformers does."""
    from tokenizers import normalizers

    steps = [normalizers.Lowercase()]
    if tok.normalizer is not None:
        steps.append(tok.normalizer)
    tok.normalizer = normalizers.Sequence(steps)


class EmbeddingTokenizer:
    """The checkpoint's fast tokenizer, special tokens added as the model expects.

    Two copies of the Rust tokenizer: one never truncates (to measure inputs
    and reject over-long ones), one truncates to `max_length`. Configuring one
    object per call would mutate shared state across threads.
    """

    def __init__(self, model_dir: str | Path, max_length: int, lowercase: bool = False):
        root = Path(model_dir)
        if not (root / "tokenizer.json").exists():
            raise CheckpointError(f"checkpoint is missing tokenizer.json (looked in {root})")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        # AutoTokenizer applies tokenizer_config.json (lower-casing etc.) to the
        # backend, exactly as sentence-transformers loads it.
        hf: Any = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        if not getattr(hf, "is_fast", False):
            raise CheckpointError("a fast tokenizer (tokenizer.json) is required")
        serialized = hf.backend_tokenizer.to_str()
        self._whole = Tokenizer.from_str(serialized)
        self._whole.no_truncation()
        self._whole.no_padding()
        self._cut = Tokenizer.from_str(serialized)
        self._cut.no_padding()
        self._cut.enable_truncation(max_length)
        if lowercase:
            for tok in (self._whole, self._cut):
                _prepend_lowercase(tok)
        self.max_length = max_length

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, never truncated."""
        return [e.ids for e in self._whole.encode_batch(list(texts), add_special_tokens=True)]

    def encode_truncated(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text cut to `max_length` (special tokens kept)."""
        return [e.ids for e in self._cut.encode_batch(list(texts), add_special_tokens=True)]
