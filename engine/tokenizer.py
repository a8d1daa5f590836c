"""The model's tokenizer: encode, chat template, decode and incremental decode."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from .models.config import CheckpointError


class Tokenizer:
    """A Hugging Face fast tokenizer loaded from the checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (root / name).exists():
                raise CheckpointError(f"checkpoint is missing {name} (looked in {root})")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        if not getattr(self.hf, "is_fast", False):
            raise CheckpointError("a fast tokenizer (tokenizer.json) is required")
        self.backend = self.hf.backend_tokenizer

    def __len__(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Render chat messages with the model's template and tokenize them."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template")
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        # The template already writes BOS where the model wants it.
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, prefix: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, prefix, skip_special_tokens)


class IncrementalDecoder:
    """Token-by-token decoding that never emits half a UTF-8 character.

    The last few prompt tokens are given as context so that decoders that
    depend on the preceding token (leading-space rules) decode correctly.
    """

    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int], skip_special_tokens: bool):
        self._backend = tokenizer.backend
        context = [int(t) for t in prefix[-self.CONTEXT_TOKENS:]]
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, int(token_id)) or ""
