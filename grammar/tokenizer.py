"""What the grammar backends need to know about a tokenizer, extracted once.

`TokenizerData` holds library-neutral facts only and is immutable after
construction; it is shared by the compiler and every matcher. Each backend
builds its own tokenizer object from it (`_xgr.tokenizer_info`,
`_llg.ll_tokenizer`) and keeps it in a `PerTokenizer` cache, so this module
imports neither library.

Two corrections over the libraries' own tokenizer import:
- xgrammar reads the text of added special tokens literally, so `<|im_start|>`
  would be allowed inside a JSON string; special tokens other than the stop
  tokens are given empty text here, which xgrammar treats as never allowed.
- the model's vocabulary may be larger than the tokenizer's (padded lm_head):
  masks are sized to the model and ids past the tokenizer are never allowed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np
import torch

# What `encode_after` tokenizes a text behind: a newline is its own token (or
# byte) in every tokenizer family, and no text it precedes merges with it
# unless that text starts with whitespace.
_ANCHOR = "\n"


class TokenizerData:
    """Vocabulary facts for grammar matching, built from a `transformers` fast tokenizer.

    vocab_size: the model's vocabulary (mask width); defaults to the tokenizer's
    size and may not be smaller. eos_token_ids: the model's stop tokens (EOS is
    allowed only where the grammar may end); defaults to the tokenizer's EOS.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: list[int] | tuple[int, ...] | None = None,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("a transformers fast tokenizer (with backend_tokenizer) is required")
        self.hf_tokenizer = tokenizer  # read-only here; never modified
        vocab: dict[str, int] = tokenizer.get_vocab()
        self.tokenizer_size = max(len(tokenizer), max(vocab.values()) + 1)
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.tokenizer_size
        if self.vocab_size < self.tokenizer_size:
            raise ValueError(
                f"vocab_size {self.vocab_size} is smaller than the tokenizer ({self.tokenizer_size})"
            )
        if eos_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no EOS token; pass eos_token_ids")
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))
        if not self.eos_token_ids or not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"invalid eos_token_ids {eos_token_ids!r}")
        # Special as the Rust tokenizer's flags say, which is what decoding
        # skips: a token tokenizer_config.json lists as special but
        # tokenizer.json does not (`<tool_call>`) is text in every response,
        # and was kept out of every grammar.
        added = backend.get_added_tokens_decoder()
        special = {int(i) for i, t in added.items() if t.special}

        # The Rust tokenizer, copied so padding/truncation settings of the
        # caller's object never leak into grammar tokenization.
        self._encoder = copy.copy(backend)
        self._encoder.no_padding()
        self._encoder.no_truncation()
        self.tokenizer_json: str = self._encoder.to_str()
        self.encoded_vocab: list[str] = [""] * self.vocab_size
        for text, idx in vocab.items():
            if idx < self.vocab_size and idx not in special:
                self.encoded_vocab[idx] = text
        self._anchor_ids = self.encode(_ANCHOR)
        digest = hashlib.sha256(self.tokenizer_json.encode())
        digest.update(json.dumps([self.vocab_size, self.eos_token_ids]).encode())
        self.fingerprint = digest.hexdigest()[:16]

        words = self.bitmask_words
        eos_row = np.zeros(words * 32, dtype=np.uint8)
        eos_row[list(self.eos_token_ids)] = 1
        packed = np.packbits(eos_row.reshape(-1, 8), axis=-1, bitorder="little").reshape(-1)
        self.eos_only_row = torch.from_numpy(packed.view(np.int32).copy())

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of `text`, without special tokens added."""
        return list(self._encoder.encode(text, add_special_tokens=False).ids)

    def encode_after(self, text: str) -> list[int]:
        """Tokens of `text` written after earlier text, as a forced run is.
        SentencePiece-style tokenizers (Llama 2, Mistral) start a text with a
        space (`\u2581`) that `encode` would put first, a token the grammar
        refuses, so nothing was ever forced there: `text` is tokenized behind
        an anchor, whose tokens are then dropped. Where the anchor's tokens
        merge with the text's (never, for those tokenizers), plain `encode`."""
        ids = self.encode(_ANCHOR + text)
        if ids[:len(self._anchor_ids)] == self._anchor_ids:
            return ids[len(self._anchor_ids):]
        return self.encode(text)


T = TypeVar("T")
_UNSET: Any = object()


class _Slot(Generic[T]):
    """One TokenizerData's value; its lock makes concurrent first callers wait for one build."""

    __slots__ = ("lock", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value: T = _UNSET


class PerTokenizer(Generic[T]):
    """A value derived from a TokenizerData, built on first use and dropped with it.

    A backend's tokenizer object costs from tens of ms (8k vocabulary) to about
    a second (128k+) to build, and a deployment may use one backend only, so
    each is built lazily, once per TokenizerData. Thread-safe: concurrent first
    callers for one TokenizerData wait for a single build, while callers for
    another are not held up by it. Entries are keyed weakly (TokenizerData
    hashes by identity), so the cache never outgrows the live TokenizerData
    objects; `build` must not return anything that refers back to its argument.
    """

    def __init__(self, build: Callable[[TokenizerData], T]) -> None:
        self._build = build
        self._lock = threading.Lock()  # guards _slots only, never held while building
        self._slots: weakref.WeakKeyDictionary[TokenizerData, _Slot[T]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, data: TokenizerData) -> T:
        """The value for `data`, building it first if this is the first call for `data`."""
        with self._lock:
            slot = self._slots.get(data)
            if slot is None:
                slot = self._slots[data] = _Slot()
        with slot.lock:
            if slot.value is _UNSET:
                slot.value = self._build(data)
            return slot.value
