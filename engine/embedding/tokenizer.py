"""Tokenization for embeddings: whole inputs, or inputs cut to the model's window."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.models.config import CheckpointError
from engine.tokenizer import telling_part


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
        # The side sentence-transformers cuts (tokenizer_config.json's truncation_side).
        self._cut.enable_truncation(max_length, direction=getattr(hf, "truncation_side", "right") or "right")
        self._cuts_left = getattr(hf, "truncation_side", "right") == "left"
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

    def encode_bounded(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Each text's token ids, at a cost bounded by the model's window rather
        than by the text: a text longer than `max_length` tokens is cut to it
        (`truncate`) or comes back with more than `max_length` ids (not all of
        them), having been tokenized only as far as needed to tell.

        A text of a few megabytes tokenized whole took gigabytes and a minute
        to be refused. A long text is measured by an ever longer prefix (x4 a
        try, up to the whole text): once a prefix has twice the window's tokens,
        its first `max_length` are the whole text's (tokenization is local: a
        cut changes the tokens next to it, never those a window earlier).
        """
        out: list[list[int]] = []
        for text in texts:
            part = self._enough_of(text)
            if part is text or not truncate:
                ids = _encode_one(self._whole, part, True)
                if len(ids) > self.max_length and truncate:
                    ids = _encode_one(self._cut, part, True)
            else:
                ids = _encode_one(self._cut, part, True)
            out.append(ids)
        return out

    def _enough_of(self, text: str) -> str:
        """`text`, or a prefix of it (suffix, cutting from the left) already
        twice the window in tokens."""
        part = telling_part(text, self.max_length, lambda part: len(_encode_one(self._whole, part, False)),
                            from_end=self._cuts_left)
        return text if part is None else part


def _encode_one(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s ids. Through `encode_batch`, which lets go of the GIL while it
    works: `encode` holds it throughout, and a long text (megabytes of one
    word, measured to its end) stalled the server's event loop for seconds."""
    return list(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
