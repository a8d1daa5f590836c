"""Phase 2 of a step, on the device thread: `run_step(inputs, ...)` -> `StepResult`.

Forward pass, prompt log-probabilities, grammar mask, sampling; for a
multi-step decode, the next forward passes fed with the tokens just sampled,
without the host in between. Everything it needs comes in as arguments; it
never reads or writes a request's context (see step_inputs.py for the phases).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from .attention import AttentionBackend, PagedMetadata, SeqSpan
from .context import TextContext
from .graphs import DecodeGraphs
from .memory import PROMPT_LOGPROB_ROWS
from .sampler import SamplerOutput, SamplingBatch, count_tokens, sample
from .staging import HostCopy, upload
from .step_inputs import PromptLogprobTarget, SampleInputs, StepInputs
from .step_masks import PendingMask


class StepModel(Protocol):
    """What a step needs of a model (the Llama-family decoder, or a test's wrapper)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                meta: object) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


# Masks the disallowed tokens of some rows of the logits in place: (logits, bitmask, rows as
# a list, or a host tensor on CUDA; see step_masks.PendingMask).
ApplyMask = Callable[[torch.Tensor, torch.Tensor, list[int] | torch.Tensor], None]
# (chosen token's log-probability [N], top ids [N, n] | None, top log-probabilities | None)
PromptLogprobs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class StepResult:
    """What the device hands back: sampled tokens per decode step, prompt log-probabilities."""

    outputs: list[SamplerOutput]
    prompt_logprobs: dict[int, HostCopy]  # per row: PromptLogprobs on their way to the host
    forward_passes: int


@dataclass(frozen=True)
class LaunchedStep:
    """A step on its way: its requests (and their epochs at launch), its inputs
    (None if building them failed) and the device job's future."""

    contexts: tuple[TextContext, ...]
    epochs: tuple[int, ...]
    inputs: StepInputs | None
    job: Future[StepResult]

    def live(self, row: int) -> bool:
        """Whether row's work still counts (not ended, not reset since launch)."""
        ctx = self.contexts[row]
        return not ctx.is_done and ctx.sched.epoch == self.epochs[row]


def run_step(inputs: StepInputs, model: StepModel, attention: AttentionBackend, token_buffer: torch.Tensor,
             apply_mask: ApplyMask, graphs: DecodeGraphs | None = None) -> StepResult:
    """Run one step; the sampled tokens also go to `token_buffer` for the next step's placeholders.

    The step's host inputs are uploaded here, on this thread's stream, and
    nowhere else (staging.py). A graph step copies its token ids, positions
    and attention metadata straight into the graph's static buffers instead.
    """
    device = token_buffer.device
    future_rows = upload(inputs.future_rows, device)
    future_buffer_rows = upload(inputs.future_buffer_rows, device)
    s = upload(inputs.sample, device)
    if inputs.graph:
        assert graphs is not None and isinstance(inputs.attention, PagedMetadata)
        bucket = graphs.refresh(inputs.attention, inputs.input_ids, inputs.positions)
        if future_rows.numel():
            graphs.input_ids[future_rows] = token_buffer[future_buffer_rows]
        graphs.run(bucket)
        if s is None:  # every row is inside a forced run (scheduler.py): nothing samples yet
            return StepResult([], {}, 1)
        if s.pending_counts is not None:
            rows, buffer_rows = s.pending_counts
            count_tokens(s.batch, token_buffer[buffer_rows], rows)
        logits = graphs.logits.index_select(0, s.hidden_rows)
        out = sample(logits, s.batch, _mask(inputs.grammar, apply_mask))
        return _finish(s, [out], {}, token_buffer, 1)
    input_ids = upload(inputs.input_ids, device)
    if future_rows.numel():
        input_ids[future_rows] = token_buffer[future_buffer_rows]
    positions = upload(inputs.positions, device)
    hidden = model.forward(input_ids, positions, attention, upload(inputs.attention, device))
    targets = upload(inputs.prompt_logprobs, device)
    prompt_lp = {row: HostCopy(_prompt_logprobs(model, hidden, target)) for row, target in targets.items()}
    if s is None:
        return StepResult([], prompt_lp, 1)
    if s.pending_counts is not None:
        rows, buffer_rows = s.pending_counts
        count_tokens(s.batch, token_buffer[buffer_rows], rows)
    out = _sample(model, hidden.index_select(0, s.hidden_rows), s.batch, inputs.grammar, apply_mask, 0)
    outputs = [out]
    spans, kv = inputs.spans, inputs.kv
    for step in range(1, inputs.num_steps):
        # The next decode step of a decode-only batch: one token per sequence.
        spans = [SeqSpan(sp.index, sp.index, sp.index + 1, sp.ctx_len) for sp in spans]
        kv = kv.after_decode_step()
        # Each sequence one position further, computed where the positions are
        # (a host array copied in here would be a synchronous copy on CUDA).
        positions = positions + 1
        hidden = model.forward(out.tokens, positions, attention, upload(attention.plan(spans, inputs.table, kv), device))
        count_tokens(s.batch, out.tokens)
        out = _sample(model, hidden, s.batch, None, apply_mask, step)
        outputs.append(out)
    return _finish(s, outputs, prompt_lp, token_buffer, inputs.num_steps)


def _finish(s: SampleInputs, outputs: list[SamplerOutput], prompt_lp: dict[int, HostCopy],
            token_buffer: torch.Tensor, num_steps: int) -> StepResult:
    """Write the last sampled tokens to the token buffer and start the copies to the host."""
    token_buffer.index_copy_(0, s.buffer_rows, outputs[-1].tokens)
    for o in outputs:  # postprocess reads them
        o.to_host_async()
    return StepResult(outputs, prompt_lp, num_steps)


def _mask(grammar: PendingMask | None, apply_mask: ApplyMask) -> Callable[[torch.Tensor], None] | None:
    # The engine thread fills the mask once the matchers are up to date: it waits.
    return None if grammar is None else partial(grammar.apply, apply_mask=apply_mask)


def _sample(model: StepModel, hidden: torch.Tensor, batch: SamplingBatch, grammar: PendingMask | None,
            apply_mask: ApplyMask, step: int) -> SamplerOutput:
    return sample(model.logits(hidden), batch, _mask(grammar, apply_mask), step=step)


def _prompt_logprobs(model: StepModel, hidden: torch.Tensor, target: PromptLogprobTarget) -> PromptLogprobs:
    chosen, ids, values = [], [], []
    for start in range(0, len(target.tokens), PROMPT_LOGPROB_ROWS):
        tokens = target.tokens[start:start + PROMPT_LOGPROB_ROWS]
        rows = target.q_start + start
        logprobs = model.logits(hidden[rows:rows + len(tokens)]).log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, tokens[:, None])[:, 0])
        if target.top_n > 0:
            top = logprobs.topk(target.top_n, dim=-1)
            ids.append(top.indices)
            values.append(top.values)
    return torch.cat(chosen), torch.cat(ids) if ids else None, torch.cat(values) if values else None
