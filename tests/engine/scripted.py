"""A scripted model: the real forward runs (KV cache written as usual), but the
logits follow a bigram table, so engine behaviour can be tested exactly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class ScriptedModel:
    """Wraps a loaded model. After token a the model strongly prefers `table[a]`;
    with no entry, or when that token is masked, lower token ids are preferred."""

    def __init__(self, real, table: Mapping[int, int]):
        self.real = real
        self.config = real.config
        self.device = real.device
        vocab = real.config.vocab_size
        self.next_of = torch.full((vocab,), -1, dtype=torch.long)
        for a, b in table.items():
            self.next_of[a] = b
        # A gentle slope so the fallback choice is deterministic: lowest id wins.
        self.base = -torch.arange(vocab, dtype=torch.float32) * 1e-3

    def forward(self, input_ids, positions, attention, meta):
        self.real.forward(input_ids, positions, attention, meta)
        return input_ids.to(torch.float32)[:, None]  # each row remembers its input token

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[:, 0].long()
        out = self.base.expand(ids.shape[0], -1).clone()
        nxt = self.next_of[ids]
        rows = torch.nonzero(nxt >= 0)[:, 0]
        out[rows, nxt[rows]] = 10.0
        return out


def chain(tokens: Sequence[int]) -> dict[int, int]:
    """Bigram table that makes the model emit tokens[1:] after tokens[0]."""
    if len(set(tokens)) != len(tokens):
        raise ValueError("a bigram script needs distinct tokens")
    return {a: b for a, b in zip(tokens, tokens[1:], strict=False)}


def scripted(table: Mapping[int, int]):
    return lambda real: ScriptedModel(real, table)


class PositionScriptedModel:
    """Wraps a loaded model; the token it wants depends on the position being
    sampled: `script[p]` lists the tokens it prefers at position p, best
    first (each next one is still preferred over every unlisted token). With no
    entry, or when every listed token is masked, lower ids are preferred."""

    def __init__(self, real, script: Mapping[int, Sequence[int]]):
        self.real = real
        self.config = real.config
        self.device = real.device
        self.script = {p: list(tokens) for p, tokens in script.items()}
        vocab = real.config.vocab_size
        self.base = -torch.arange(vocab, dtype=torch.float32) * 1e-3

    def forward(self, input_ids, positions, attention, meta):
        self.real.forward(input_ids, positions, attention, meta)
        return positions.to(torch.float32)[:, None]  # each row remembers its position

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.base.expand(hidden.shape[0], -1).clone()
        for row, position in enumerate(hidden[:, 0].long().tolist()):
            for rank, token in enumerate(self.script.get(position + 1, ())):
                out[row, token] = 10.0 - rank
        return out


def scripted_by_position(script: Mapping[int, Sequence[int]]):
    return lambda real: PositionScriptedModel(real, script)
