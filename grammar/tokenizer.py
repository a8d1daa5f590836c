"""What the grammar backends need to know about a tokenizer, extracted once.

`TokenizerData` is immutable after construction and shared by the compiler,
every matcher and (through `worker_payload`) the compile worker processes.

Two corrections over the libraries' own tokenizer import:
- xgrammar reads the text of added special tokens literally, so `<|im_start|>`
  would be allowed inside a JSON string; special tokens other than the stop
  tokens are given empty text here, which xgrammar treats as never allowed.
- the model's vocabulary may be larger than the tokenizer's (padded lm_head):
  masks are sized to the model and ids past the tokenizer are never allowed.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import threading
from typing import Any

import numpy as np
import torch


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
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        special |= set(getattr(tokenizer, "all_special_ids", []) or [])
        self.special_token_ids = frozenset(special - set(self.eos_token_ids))

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
        digest = hashlib.sha256(self.tokenizer_json.encode())
        digest.update(json.dumps([self.vocab_size, self.eos_token_ids]).encode())
        self.fingerprint = digest.hexdigest()[:16]

        words = self.bitmask_words
        eos_row = np.zeros(words * 32, dtype=np.uint8)
        eos_row[list(self.eos_token_ids)] = 1
        packed = np.packbits(eos_row.reshape(-1, 8), axis=-1, bitorder="little").reshape(-1)
        self.eos_only_row = torch.from_numpy(packed.view(np.int32).copy())

        self._lock = threading.Lock()
        self._xgr_info: Any = None
        self._llg_tokenizer: Any = None
        self._sorted: tuple[list[bytes], np.ndarray, list[bytes]] | None = None

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of `text`, without special tokens added."""
        return list(self._encoder.encode(text, add_special_tokens=False).ids)

    # Backend tokenizer objects are built lazily: each costs from tens of ms
    # (8k vocab) to about a second (128k+), and a deployment may use one backend.
    def xgrammar_info(self) -> Any:
        with self._lock:
            if self._xgr_info is None:
                from ._xgr import build_tokenizer_info

                self._xgr_info = build_tokenizer_info(self)
            return self._xgr_info

    def llguidance_tokenizer(self) -> Any:
        with self._lock:
            if self._llg_tokenizer is None:
                from ._llg import build_tokenizer

                self._llg_tokenizer = build_tokenizer(
                    self.tokenizer_json, self.vocab_size, self.eos_token_ids
                )
            return self._llg_tokenizer

    def worker_payload(self) -> dict[str, Any]:
        """What a compile worker process needs to rebuild both backends' tokenizers."""
        return {
            "tokenizer_json": self.tokenizer_json,
            "xgr_info_json": self.xgrammar_info().serialize_json(),
            "vocab_size": self.vocab_size,
            "eos_token_ids": list(self.eos_token_ids),
        }

    def token_bytes(self, token_id: int) -> bytes:
        return self._sorted_vocab()[2][token_id]

    def extensions(self, token_id: int) -> np.ndarray:
        """Ids of tokens whose bytes strictly extend those of `token_id`.

        Used to decide whether a forced string's last token could merge with
        what the model writes next (then it is held back).
        """
        keys, ids, table = self._sorted_vocab()
        prefix = table[token_id]
        if not prefix:
            return ids[:0]
        lo = bisect.bisect_right(keys, prefix)
        end = _prefix_end(prefix)
        hi = bisect.bisect_left(keys, end, lo) if end else len(keys)
        return ids[lo:hi]

    def _sorted_vocab(self) -> tuple[list[bytes], np.ndarray, list[bytes]]:
        if self._sorted is None:
            # xgrammar already knows how to turn byte-level / byte-fallback
            # vocabularies back into raw bytes; stop tokens have no text.
            table = list(self.xgrammar_info().decoded_vocab)
            for i in self.eos_token_ids:
                table[i] = b""
            order = sorted(range(len(table)), key=table.__getitem__)
            keys = [table[i] for i in order]
            built = (keys, np.asarray(order, dtype=np.int64), table)
            with self._lock:
                if self._sorted is None:
                    self._sorted = built
        return self._sorted


def _prefix_end(prefix: bytes) -> bytes:
    """Smallest byte string greater than every string starting with `prefix` (b"" if none)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b""
    p[-1] += 1
    return bytes(p)
