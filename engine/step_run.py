"""Phase 2 of a step, on the device thread: `run_step(inputs, ...)` -> `StepResult`.

Forward pass, prompt log-probabilities, grammar mask, sampling; for a
multi-step decode, the next forward passes fed with the tokens just sampled,
without the host in between. Everything it needs comes in as arguments; it
never reads or writes a request's context (see step_inputs.py for the phases).

A step with a grammar mask is two device jobs: `run_step` queues the forward
pass and returns (`Forwarded`); `sample_step`, submitted by the engine thread
once it has filled the mask, masks and samples. So the device thread never
waits for the engine thread: a step launched before the previous one's
tokens are processed queues its forward pass at once, and other work sent to
the device thread (a speech chunk's decode) never queues behind a wait.
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
from .sampler import SamplerOutput, count_tokens, sample
from .staging import HostCopy, upload
from .step_inputs import PromptLogprobTarget, SampleInputs, StepInputs
from .step_masks import ApplyMask, PendingMask


class StepModel(Protocol):
    """What a step needs of a model (the Llama-family decoder, or a test's wrapper)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                meta: object) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


# A step's mask bound to its bitmask: masks the logits [S, V] in place.
MaskLogits = Callable[[torch.Tensor], None]
# (chosen token's log-probability [N], top ids [N, n] | None, top log-probabilities | None)
PromptLogprobs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class StepResult:
    """What the device hands back: sampled tokens per decode step, prompt log-probabilities."""

    outputs: list[SamplerOutput]
    prompt_logprobs: dict[int, HostCopy]  # per row: PromptLogprobs on their way to the host
    forward_passes: int


@dataclass(frozen=True)
class Forwarded:
    """A step whose forward pass is queued and whose sampling waits for its
    grammar mask: `sample(mask)` finishes it on the device thread (`sample_step`)."""

    sample: Callable[[MaskLogits | None], StepResult]


@dataclass
class LaunchedStep:
    """A step on its way: its requests (and their epochs at launch), its inputs
    (None if building them failed), its forward job's future (None while the
    step is built but not yet queued: `TextGenerationPipeline.submit`) and, for
    a step with a grammar mask, its sampling job's (set once the mask is filled)."""

    contexts: tuple[TextContext, ...]
    epochs: tuple[int, ...]
    inputs: StepInputs | None
    job: Future[StepResult | Forwarded] | None
    sampling: Future[StepResult] | None = None

    @property
    def awaits_mask(self) -> bool:
        """Whether the step's sampling still waits for its grammar mask to be filled."""
        return self.inputs is not None and self.inputs.grammar is not None and self.sampling is None

    def live(self, row: int) -> bool:
        """Whether row's work still counts (not ended, not reset since launch)."""
        ctx = self.contexts[row]
        return not ctx.is_done and ctx.sched.epoch == self.epochs[row]

    def result(self) -> StepResult:
        """Wait for the step's device work; its result (re-raises its failure)."""
        job = self.sampling if self.sampling is not None else self.job
        if job is None:
            raise RuntimeError("the step was built but never queued")
        head = job.result()
        if isinstance(head, Forwarded):
            raise RuntimeError("the step's sampling was never queued: its grammar mask was not filled")
        return head


def run_step(inputs: StepInputs, model: StepModel, attention: AttentionBackend, token_buffer: torch.Tensor,
             graphs: DecodeGraphs | None = None) -> StepResult | Forwarded:
    """Run one step's forward pass, and its sampling unless a grammar mask must
    come first: then the step is `Forwarded`, and `sample_step` finishes it. The
    sampled tokens also go to `token_buffer` for the next step's placeholders.

    The step's host inputs are uploaded here, on this thread's stream, and
    nowhere else (staging.py). A graph step copies its token ids, positions
    and attention metadata straight into the graph's static buffers instead.
    """
    device = token_buffer.device
    future_rows = upload(inputs.future_rows, device)
    future_buffer_rows = upload(inputs.future_buffer_rows, device)
    s = upload(inputs.sample, device)
    rest: Callable[[MaskLogits | None], StepResult]
    if inputs.graph:
        assert graphs is not None and isinstance(inputs.attention, PagedMetadata)
        bucket = graphs.refresh(inputs.attention, inputs.input_ids, inputs.positions)
        if future_rows.numel():
            graphs.input_ids[future_rows] = token_buffer[future_buffer_rows]
        graphs.run(bucket)
        if s is None:  # every row is inside a forced run (scheduler.py): nothing samples yet
            return StepResult([], {}, 1)
        _count_pending(s, token_buffer)
        # Gathered now, before a later replay can rewrite the graph's logits.
        logits = graphs.logits.index_select(0, s.hidden_rows)
        rest = partial(_sample_once, s, logits, token_buffer)
    else:
        input_ids = upload(inputs.input_ids, device)
        if future_rows.numel():
            input_ids[future_rows] = token_buffer[future_buffer_rows]
        positions = upload(inputs.positions, device)
        hidden = model.forward(input_ids, positions, attention, upload(inputs.attention, device))
        targets = upload(inputs.prompt_logprobs, device)
        prompt_lp = {row: HostCopy(_prompt_logprobs(model, hidden, target)) for row, target in targets.items()}
        if s is None:
            return StepResult([], prompt_lp, 1)
        _count_pending(s, token_buffer)
        logits = model.logits(hidden.index_select(0, s.hidden_rows))
        rest = partial(_sample_and_decode, inputs, s, logits, positions, prompt_lp, model, attention, token_buffer)
    return rest(None) if inputs.grammar is None else Forwarded(rest)


def sample_step(forward: Future[StepResult | Forwarded], grammar: PendingMask, apply_mask: ApplyMask) -> StepResult:
    """The second device job of a step with a grammar mask, queued once the
    engine thread has filled the mask: mask the logits, sample, finish the step.
    `forward` is the step's first job (`run_step`), done by now: jobs run in order."""
    head = forward.result()  # re-raises the forward pass's failure
    if isinstance(head, StepResult):
        return head
    return head.sample(partial(grammar.apply, apply_mask=apply_mask))


def _count_pending(s: SampleInputs, token_buffer: torch.Tensor) -> None:
    if s.pending_counts is not None:
        rows, buffer_rows = s.pending_counts
        count_tokens(s.batch, token_buffer[buffer_rows], rows)


def _sample_once(s: SampleInputs, logits: torch.Tensor, token_buffer: torch.Tensor,
                 mask: MaskLogits | None) -> StepResult:
    return _finish(s, [sample(logits, s.batch, mask)], {}, token_buffer, 1)


def _sample_and_decode(inputs: StepInputs, s: SampleInputs, logits: torch.Tensor, positions: torch.Tensor,
                       prompt_lp: dict[int, HostCopy], model: StepModel, attention: AttentionBackend,
                       token_buffer: torch.Tensor, mask: MaskLogits | None) -> StepResult:
    """Sample the step's first tokens; for a multi-step decode, run its next
    forward passes fed with the tokens just sampled, without the host in between."""
    device = token_buffer.device
    out = sample(logits, s.batch, mask, step=0)
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
        out = sample(model.logits(hidden), s.batch, None, step=step)
        outputs.append(out)
    return _finish(s, outputs, prompt_lp, token_buffer, inputs.num_steps)


def _finish(s: SampleInputs, outputs: list[SamplerOutput], prompt_lp: dict[int, HostCopy],
            token_buffer: torch.Tensor, num_steps: int) -> StepResult:
    """Write the last sampled tokens to the token buffer and start the copies to the host."""
    token_buffer.index_copy_(0, s.buffer_rows, outputs[-1].tokens)
    for o in outputs:  # postprocess reads them
        o.to_host_async()
    return StepResult(outputs, prompt_lp, num_steps)


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
