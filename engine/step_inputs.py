"""Phase 1 of a step, on the engine thread: a scheduled batch -> `StepInputs`.

A step has three phases with one owner each:

1. inputs (this module, engine thread): the scheduled contexts become a
   `StepInputs` (token ids and positions, `KVCacheInputs` and the attention
   backend's metadata, the sampling batch, the rows that sample) and are
   advanced on the host at once: a sampling context gets a placeholder for
   the token the device will sample, so the next step can be scheduled before
   this one ends;
2. run (step_run.py, device thread): `run_step(inputs, ...)` -> `StepResult`;
3. postprocess (postprocess.py, engine thread): the step's results become
   outputs; the only place a running request is finished.

A placeholder input (`FUTURE_TOKEN`) is read on the device from the request's
row of the token buffer, where the previous step wrote it: never via the host.

Phase 1 touches no device: every tensor of a `StepInputs` is a host tensor
(page-locked on CUDA, see staging.py), which the device thread uploads on its
own stream when the step runs (`run_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionBackend, SeqSpan
from .attention.base import concat_ranges
from .context import FUTURE_TOKEN, TextContext
from .graphs import DecodeGraphs
from .kv_cache import KVCacheInputs, KVCacheManager
from .sampler import SamplingBatch, build_sampling_batch
from .staging import Staging
from .step_masks import PendingMask
from .token_buffer import TokenBuffer


@dataclass(frozen=True)
class PromptLogprobTarget:
    """Prompt tokens whose log-probabilities a step computes for one request."""

    q_start: int  # the step's row of the first query predicting them
    first: int  # position of the first predicted prompt token
    tokens: torch.Tensor  # the predicted prompt tokens (host)
    top_n: int


@dataclass(frozen=True)
class SampleInputs:
    """What sampling needs: which rows sample, with what options, where their tokens go."""

    batch: SamplingBatch
    hidden_rows: torch.Tensor  # [S] the step's row of each sampling request's last query
    buffer_rows: torch.Tensor  # [S] the token-buffer row its token goes to
    # Penalties count every generated token, the last one included, which may
    # still be on the device: (rows of the sampling batch, token-buffer rows).
    pending_counts: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class StepInputs:
    """Everything the device needs to run one step; no context is touched there."""

    input_ids: torch.Tensor  # [T] placeholders are 0 here...
    future_rows: torch.Tensor  # [F] ...until these rows are read from the token buffer
    future_buffer_rows: torch.Tensor  # [F] at these rows
    positions: torch.Tensor  # [T]
    spans: list[SeqSpan]
    table: np.ndarray  # the lookup table on the host (multi-step decode plans from it)
    kv: KVCacheInputs
    attention: object  # the attention backend's metadata for `spans`
    num_steps: int
    sampled: tuple[int, ...]  # rows of the batch that sample a token
    sample: SampleInputs | None
    prompt_logprobs: dict[int, PromptLogprobTarget]
    grammar: PendingMask | None  # filled on the engine thread, applied just before sampling
    # The step replays a decode graph (graphs.py): `attention` is then its
    # PagedMetadata, which the graph's static buffers are refreshed from.
    graph: bool = False


def build_step_inputs(contexts: Sequence[TextContext], num_steps: int, kv: KVCacheManager,
                      buffer: TokenBuffer, attention: AttentionBackend, vocab_size: int,
                      staging: Staging, graphs: DecodeGraphs | None = None) -> StepInputs:
    """The inputs of one step over `contexts` (their next_tokens, set by the
    scheduler), as host tensors. With `graphs`, a decode-only step is planned
    for a graph replay instead of the eager backend."""
    # One pass over the contexts for their indices; the rest is whole-batch
    # numpy (at batch 64 this function runs every step on the engine thread).
    n = len(contexts)
    starts = np.fromiter((c.start_idx for c in contexts), np.int64, n)
    actives = np.fromiter((c.active_idx for c in contexts), np.int64, n)
    ends = np.fromiter((c.end_idx for c in contexts), np.int64, n)
    q_lens = actives - starts
    if n and q_lens.min() == q_lens.max() == 1:  # decode: one token each
        host_ids = np.fromiter((c.tokens[c.start_idx] for c in contexts), np.int64, n)
        positions = starts
    else:
        host_ids = np.concatenate([c.next_tokens for c in contexts])
        positions = concat_ranges(starts, q_lens)
    future_rows = np.flatnonzero(host_ids == FUTURE_TOKEN)
    # Each placeholder is read from its request's token-buffer row.
    owners = np.repeat(np.arange(n), q_lens)[future_rows]
    future_buffer_rows = [buffer.row(contexts[i]) for i in owners.tolist()]
    q_ends = np.cumsum(q_lens)
    spans = [SeqSpan(i, q_end - q_len, q_end, start) for i, (q_end, q_len, start)
             in enumerate(zip(q_ends.tolist(), q_lens.tolist(), starts.tolist(), strict=True))]
    table = kv.lookup_table(contexts)
    kv_inputs = kv.inputs(table, starts.astype(np.int32), q_lens.astype(np.int32), num_steps, staging)
    sampled = np.flatnonzero(actives == ends).tolist()
    sample = _sample_inputs([contexts[i] for i in sampled], [spans[i] for i in sampled], buffer, vocab_size,
                            staging, num_steps) if sampled else None
    grammar = PendingMask() if any(contexts[i].needs_mask for i in sampled) else None
    prompt_logprobs = _prompt_targets(contexts, spans, staging)
    graph_meta = graphs.plan(spans, table, kv_inputs, staging) \
        if graphs is not None and num_steps == 1 and not prompt_logprobs else None
    return StepInputs(
        input_ids=staging.tensor(np.where(host_ids < 0, 0, host_ids)),
        future_rows=staging.tensor(future_rows),
        future_buffer_rows=staging.tensor(future_buffer_rows, torch.int64),
        positions=staging.tensor(positions),
        spans=spans, table=table, kv=kv_inputs,
        attention=graph_meta if graph_meta is not None else attention.plan(spans, table, kv_inputs),
        num_steps=num_steps, sampled=tuple(sampled), sample=sample,
        prompt_logprobs=prompt_logprobs, grammar=grammar, graph=graph_meta is not None)


def _sample_inputs(contexts: list[TextContext], spans: list[SeqSpan], buffer: TokenBuffer, vocab_size: int,
                   staging: Staging, num_steps: int) -> SampleInputs:
    batch = build_sampling_batch(contexts, vocab_size, staging, num_steps)
    pending = None
    if batch.penalties is not None:
        rows = [k for k, c in enumerate(contexts)
                if c.next_tokens[0] == FUTURE_TOKEN and c.sampling_params.uses_penalties]
        if rows:
            pending = (staging.tensor(rows, torch.int64),
                       staging.tensor([buffer.row(contexts[k]) for k in rows], torch.int64))
    return SampleInputs(
        batch=batch,
        hidden_rows=staging.tensor([s.q_end - 1 for s in spans], torch.int64),
        buffer_rows=staging.tensor([buffer.row(c) for c in contexts], torch.int64),
        pending_counts=pending)


def _prompt_targets(contexts: Sequence[TextContext], spans: list[SeqSpan],
                    staging: Staging) -> dict[int, PromptLogprobTarget]:
    """Prompt positions whose predictions this step computes, per row asking for them."""
    targets = {}
    for row, ctx in enumerate(contexts):
        n = ctx.sampling_params.prompt_logprobs
        if n is None or ctx.start_idx >= ctx.prompt_len:
            continue
        # Not the positions stored already (a prompt computed again after a preemption).
        first = max(ctx.start_idx + 1, len(ctx.output.prompt_logprobs))
        last = min(ctx.active_idx, ctx.prompt_len - 1)
        if last >= first:
            targets[row] = PromptLogprobTarget(spans[row].q_start + first - ctx.start_idx - 1, first,
                                               staging.tensor(ctx.tokens[first:last + 1]), n)
    return targets


def advance_with_placeholders(contexts: Sequence[TextContext], inputs: StepInputs) -> None:
    """Advance each context past its next_tokens now, before the step runs.

    A context that samples gets a placeholder per decode step for the token the
    device will sample; the others (a prompt chunk that is not the last) move
    on to their next chunk.
    """
    sampled = set(inputs.sampled)
    for row, ctx in enumerate(contexts):
        if row in sampled:
            for _ in range(inputs.num_steps):
                ctx.update_with_future_token()
        else:
            ctx.mark_chunk_done()
