"""Shared fixtures: the demo tokenizer and one compiler (its worker starts once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grammar import GrammarCompiler, Matcher

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "engine/presets/tokenizer"
MODEL_VOCAB = 8320  # larger than the tokenizer's 8192, as padded checkpoints are
STOP_IDS = (1, 3)  # <|end_of_text|>, <|im_end|>
SPECIAL_NON_STOP = (0, 2, 4)
BACKENDS = ("xgrammar", "llguidance")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="session")
def compiler(tokenizer):
    with GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=10.0
    ) as c:
        yield c


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


def is_allowed(bitmask: torch.Tensor, token: int, row: int = 0) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def feed(
    matcher: Matcher, tokens: list[int], bitmask: torch.Tensor, *, check_eos: bool = True
) -> bool:
    """Feed tokens one by one, checking mask/accept agreement; True if all were accepted.

    With check_eos, also asserts at every step that the stop tokens are allowed
    exactly when the matcher says the output can end.
    """
    for tok in tokens:
        matcher.fill_bitmask(bitmask, 0)
        if check_eos:
            can_end = matcher.can_terminate()
            assert all(is_allowed(bitmask, s) == can_end for s in STOP_IDS)
        in_mask = is_allowed(bitmask, tok)
        accepted = matcher.accept_token(tok)
        assert in_mask == accepted, f"mask and accept_token disagree on token {tok}"
        if not accepted:
            return False
    matcher.fill_bitmask(bitmask, 0)
    if check_eos:
        assert all(is_allowed(bitmask, s) == matcher.can_terminate() for s in STOP_IDS)
    return True
