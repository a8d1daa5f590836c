"""Batched sampling on the device.

Order per row (vLLM's, V1): logit_bias -> penalties -> min_new_tokens EOS mask ->
grammar mask (by the caller) -> greedy argmax, or temperature -> min-p -> top-k
(tokens tied with the k-th kept) -> top-p -> a draw by inverse CDF.
Log-probabilities are of the raw model output.

Hard masks hold whatever the model outputs: the model's logits are made finite
first (NaN and -inf become a very low finite value, +inf a very high one), so
the -inf of a mask (grammar, speech token range, EOS block) is always below
every allowed token, and no row can choose a token its masks rule out, even
when the model gave every allowed token -inf or NaN (it then falls back to the
first allowed one).

Randomness is per request, not per batch: a row's draw is one uniform number
hashed from (request seed, token position) on the host when the step's inputs
are built, so a seeded request draws the same tokens whatever else shares its
batch, and after a preemption. On the device a draw is then one batched
softmax, cumulative sum and search (and a check that the token found is one
the row allows): no random generator per row per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .context import TextContext
from .staging import HostCopy, Staging

# What non-finite model logits become (see the module docstring). Finite with
# room to spare: a repetition penalty (at most 10) or a temperature down to
# 1e-5 still leaves them finite. A tiny repetition penalty (any > 0 is vLLM's
# range) divides a logit past them: penalised logits are clamped back.
_LOW_LOGIT = -1e30
_HIGH_LOGIT = 1e30


@dataclass
class Penalties:
    """A step's repetition, frequency and presence penalties.

    The tokens each penalised row has seen come as flat (row, token) pairs,
    weighted 1 for a generated token and 0 for a prompt token (which only the
    repetition penalty reads); the device turns them into `[B, V]` counts and
    masks when the step first needs them (`state`). So the host's work and the
    copy to the device grow with the tokens, not with the vocabulary (a dense
    `[64, 128k]` array a step is tens of megabytes).
    """

    frequency: torch.Tensor  # [B] float
    presence: torch.Tensor  # [B] float
    repetition: torch.Tensor  # [B] float
    rows: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64, each < vocab_size
    generated: torch.Tensor  # [N] float32: 1.0 for a generated token, 0.0 for a prompt token
    vocab_size: int
    # On the device, made by `state` once a step: [B, V] float counts of
    # generated tokens, and [B, V] bool, token in prompt or output.
    counts: torch.Tensor | None = field(default=None, init=False)
    seen: torch.Tensor | None = field(default=None, init=False)

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense counts and seen-mask, built on the pairs' device the first
        time a step asks (no host read: scatters only)."""
        if self.counts is None or self.seen is None:
            shape = (self.frequency.shape[0], self.vocab_size)
            device = self.tokens.device
            self.counts = torch.zeros(shape, dtype=torch.float32, device=device).index_put_(
                (self.rows, self.tokens), self.generated, accumulate=True)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=device).index_put_(
                (self.rows, self.tokens), torch.ones_like(self.tokens, dtype=torch.bool))
        return self.counts, self.seen


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one step: host tensors until the device
    thread uploads them (staging.py)."""

    size: int
    all_greedy: bool
    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float, > 1 where disabled
    min_p: torch.Tensor | None  # [B] float
    # [num_steps, B] float32 host-hashed uniforms in [0, 1), one per row and
    # decode step (None when every row is greedy).
    uniform: torch.Tensor | None
    # Penalties (None when no row uses them).
    penalties: Penalties | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, cols, values
    eos_block: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, cols masked to -inf
    # Rows restricted to [lo, hi) plus one extra token (speech codebooks): rows, lo, hi, extra (-1: none).
    token_ranges: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: int | None = None  # top-N wanted by some row (None: no logprobs)


def uniforms(seeds: Sequence[int], positions: Sequence[int], num_steps: int = 1) -> np.ndarray:
    """[num_steps, B] uniform numbers in [0, 1): row b of step s from (seeds[b],
    positions[b] + s), splitmix64-hashed: 24 bits each, exact in float32."""
    with np.errstate(over="ignore"):
        seed = np.asarray(seeds, dtype=np.uint64)[None, :]
        pos = np.asarray(positions, dtype=np.uint64)[None, :] + np.arange(num_steps, dtype=np.uint64)[:, None]
        x = seed * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0xBF58476D1CE4E5B9) \
            + np.uint64(0x94D049BB133111EB)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(40)).astype(np.float64) * 2.0 ** -24).astype(np.float32)


def build_sampling_batch(contexts: Sequence[TextContext], vocab_size: int, staging: Staging,
                         num_steps: int = 1) -> SamplingBatch:
    """Collect the sampling options of `contexts` (one row each) into host
    tensors (`num_steps` decode steps of draws)."""
    params = [c.sampling_params for c in contexts]
    b = len(contexts)
    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)
    batch = SamplingBatch(
        size=b,
        all_greedy=all_greedy,
        greedy=staging.tensor(greedy, torch.bool),
        temperature=staging.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                                   torch.float32),
        top_k=None,
        top_p=None,
        min_p=None,
        uniform=None if all_greedy else staging.tensor(
            uniforms([c.seed for c in contexts], [c.end_idx for c in contexts], num_steps)),
    )
    if not batch.all_greedy:
        if any(p.top_k > 0 for p in params):
            batch.top_k = staging.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                                         torch.int64)
        if any(p.top_p < 1.0 for p in params):
            batch.top_p = staging.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            batch.min_p = staging.tensor([p.min_p for p in params], torch.float32)
    if any(p.uses_penalties for p in params):
        _add_penalties(batch, contexts, vocab_size, staging)
    biased = [(r, p.logit_bias_arrays) for r, p in enumerate(params) if p.logit_bias]
    if biased:
        # Arrays each request built once (a bias of the whole vocabulary was a
        # Python loop of 10 ms a step, slowing every row of the batch).
        cols = np.concatenate([c for _, (c, _) in biased])
        vals = np.concatenate([v for _, (_, v) in biased])
        bias_rows = np.repeat(np.array([r for r, _ in biased], dtype=np.int64), [len(c) for _, (c, _) in biased])
        if int(cols.max()) >= vocab_size:  # admission checks the ids; a narrower head than the vocabulary's
            keep = cols < vocab_size
            bias_rows, cols, vals = bias_rows[keep], cols[keep], vals[keep]
        batch.bias = (staging.tensor(bias_rows), staging.tensor(cols), staging.tensor(vals))
    rows, cols_eos = [], []
    for r, c in enumerate(contexts):
        # A constrained request ends when its grammar says the output is
        # complete; min_new_tokens must not block the only allowed token.
        # (One whose thought is open gets its EOS block in the grammar mask,
        # filled when the gate's state for the sampled token is known.)
        if c.num_generated < c.sampling_params.min_new_tokens and c.matcher is None:
            # EOS too under ignore_eos, as vLLM's min-tokens block (which
            # decides only whether EOS stops, not whether it may come first).
            for tok in set(c.sampling_params.stop_token_ids) | c.eos_token_ids:
                if tok < vocab_size:
                    rows.append(r)
                    cols_eos.append(tok)
    if rows:
        batch.eos_block = (staging.tensor(rows, torch.int64), staging.tensor(cols_eos, torch.int64))
    range_rows: list[list[int]] = []
    for r, c in enumerate(contexts):
        rule = c.allowed_token_range()
        if rule is not None:
            lo, hi, extra = rule
            range_rows.append([r, lo, hi, -1 if extra is None else extra])
    if range_rows:
        table = np.asarray(range_rows, dtype=np.int64).T
        batch.token_ranges = (staging.tensor(table[0]), staging.tensor(table[1]), staging.tensor(table[2]),
                              staging.tensor(table[3]))
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    batch.num_logprobs = max(wanted) if wanted else None
    return batch


def _add_penalties(batch: SamplingBatch, contexts: Sequence[TextContext], vocab: int,
                   staging: Staging) -> None:
    params = [c.sampling_params for c in contexts]
    rows = [r for r, p in enumerate(params) if p.uses_penalties]
    # Every known token of the penalised rows (prompt, then output), with its row.
    lengths = np.array([contexts[r].end_idx for r in rows], dtype=np.int64)
    tokens = np.concatenate([contexts[r].tokens[:contexts[r].end_idx] for r in rows]).astype(np.int64)
    row_of = np.repeat(np.array(rows, dtype=np.int64), lengths)
    position = np.arange(len(tokens), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    generated = position >= np.repeat(np.array([contexts[r].prompt_len for r in rows], dtype=np.int64), lengths)
    keep = (tokens >= 0) & (tokens < vocab)  # placeholders of tokens still on the device are negative
    batch.penalties = Penalties(
        frequency=staging.tensor([p.frequency_penalty for p in params], torch.float32),
        presence=staging.tensor([p.presence_penalty for p in params], torch.float32),
        repetition=staging.tensor([p.repetition_penalty for p in params], torch.float32),
        rows=staging.tensor(row_of[keep]), tokens=staging.tensor(tokens[keep]),
        generated=staging.tensor(generated[keep].astype(np.float32)), vocab_size=vocab)


def apply_penalties_and_bias(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: logit_bias, then repetition, frequency and presence penalties
    (vLLM's order: a bias is penalised with its logit), then the EOS block."""
    if batch.bias is not None:
        rows, cols, vals = batch.bias
        logits.index_put_((rows, cols), vals, accumulate=True)
    if batch.penalties is not None:
        pen = batch.penalties
        counts, seen = pen.state()
        rep = pen.repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep).clamp_(_LOW_LOGIT, _HIGH_LOGIT)
        logits.copy_(torch.where(seen, penalised, logits))
        logits -= pen.frequency[:, None] * counts
        logits -= pen.presence[:, None] * (counts > 0).float()
    if batch.eos_block is not None:
        rows, cols = batch.eos_block
        logits[rows, cols] = float("-inf")
    if batch.token_ranges is not None:
        rows, lo, hi, extra = batch.token_ranges
        ids = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        outside = ((ids < lo[:, None]) | (ids >= hi[:, None])) & (ids != extra[:, None])
        logits[rows] = logits[rows].masked_fill(outside, float("-inf"))


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p as -inf masks (vLLM V1's
    order: min-p on the whole distribution, the others on what it leaves).
    Returns new logits."""
    out = logits / batch.temperature[:, None]
    if batch.min_p is not None:
        probs = out.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        out = out.masked_fill(probs < threshold, float("-inf"))
    if batch.top_k is not None or batch.top_p is not None:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if batch.top_k is not None:
            # Below the k-th value: a token tied with it stays, as in vLLM.
            kth = sorted_logits.gather(1, (batch.top_k[:, None] - 1).clamp(0, out.shape[-1] - 1))
            remove |= sorted_logits < kth
        if batch.top_p is not None:
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= mass_before >= batch.top_p[:, None]
        remove[:, 0] = False  # the most likely token always survives
        out = out.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return out


def draw(filtered: torch.Tensor, uniform: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """One token per row of `filtered` logits (-inf: excluded), at the inverse
    CDF of the row's uniform number in [0, 1); `fallback` ([B], a token each
    row allows) where the search lands on an excluded token.

    The search finds the first bucket above the target, and an excluded
    token's bucket is empty while the cumulative sum never decreases, which
    holds for a sum taken in order (the CPU's). On CUDA a one-row cumulative
    sum is a device-wide scan whose partial sums are added in another order,
    so it may step up by a rounding unit at an excluded token: once in about
    a million draws the target would land there. The check costs a gather."""
    cdf = _cdf(filtered)
    target = (uniform[:, None] * cdf[:, -1:]).to(cdf.dtype)
    drawn = torch.searchsorted(cdf, target, right=True).clamp_(max=filtered.shape[-1] - 1)
    allowed = filtered.gather(1, drawn)[:, 0] > float("-inf")
    return torch.where(allowed, drawn[:, 0], fallback)


def _cdf(filtered: torch.Tensor) -> torch.Tensor:
    return filtered.softmax(dim=-1).cumsum(dim=-1)


@dataclass
class SamplerOutput:
    """Device tensors from one sampling step."""

    tokens: torch.Tensor  # [B] int64
    logprob: torch.Tensor | None = None  # [B] log p(sampled token) under the raw model
    top_ids: torch.Tensor | None = None  # [B, N]
    top_logprobs: torch.Tensor | None = None  # [B, N]
    _copy: HostCopy | None = None

    def to_host_async(self) -> None:
        """Start copying to host memory (on the device thread, behind the sampling)."""
        self._copy = HostCopy([self.tokens, self.logprob, self.top_ids, self.top_logprobs])

    def host(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(tokens, logprob, top_ids, top_logprobs) as numpy arrays; waits for the copy."""
        if self._copy is None:
            self.to_host_async()
        assert self._copy is not None
        tokens, lp, ids, tlp = self._copy.arrays()
        assert tokens is not None
        return tokens, lp, ids, tlp


def sample(logits: torch.Tensor, batch: SamplingBatch, grammar_mask=None, step: int = 0) -> SamplerOutput:
    """Choose one token per row of float32 `logits` [B, V] (modified in place).

    `grammar_mask(logits)` masks disallowed tokens in place, if given.
    `step` is the decode step of a multi-step decode (its row of draws).
    """
    raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
    torch.nan_to_num_(logits, nan=_LOW_LOGIT, posinf=_HIGH_LOGIT, neginf=_LOW_LOGIT)
    apply_penalties_and_bias(logits, batch)
    if grammar_mask is not None:
        grammar_mask(logits)
    best = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = best
    else:
        assert batch.uniform is not None
        # The filters never exclude a row's most likely token: it is the draw's fallback.
        drawn = draw(filter_logits(logits, batch), batch.uniform[step], best)
        tokens = torch.where(batch.greedy, best, drawn)
    out = SamplerOutput(tokens=tokens)
    if raw_logprobs is not None:
        assert batch.num_logprobs is not None
        out.logprob = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        if batch.num_logprobs > 0:
            top = raw_logprobs.topk(batch.num_logprobs, dim=-1)
            out.top_ids, out.top_logprobs = top.indices, top.values
    return out


def count_tokens(batch: SamplingBatch, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Add `tokens` (one per row, or per `rows`) to the penalty state."""
    if batch.penalties is None:
        return
    counts, seen = batch.penalties.state()
    if rows is None:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    seen[rows, tokens] = True
