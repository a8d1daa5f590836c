"""The text generation pipeline the scheduler drives (MAX's TokenGenerator).

`next_token(batch, num_steps)` runs one scheduled step. It is two calls so an
overlap scheduler can put host work between them:

- `launch` builds the step's inputs, advances every sampling context with
  future-token placeholders (so the next step can be scheduled at once), and
  submits the device job: forward pass, grammar mask, sampling. A placeholder
  input is read on the device from the token buffer row of its request (the
  token sampled by the previous step), never through the host.
- `process` waits for the job, realizes the placeholders with the real tokens,
  checks token-level stops (EOS, stop token ids, lengths) and advances grammars.

Overlap off runs the same code with `process` right after `launch`, so
outputs are identical either way. Jobs run on the engine's device thread
(see executor.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from .context import FUTURE_TOKEN, GenerationStatus, TextContext, TokenLogprobs
from .executor import StepExecutor
from .kv_cache import KVCacheManager
from .runner import ForwardBatch, ModelRunner
from .sampler import SamplerOutput, SamplingBatch, build_sampling_batch, sample
from .structured import StructuredOutput

log = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A launched step: contexts in batch order, and the device job's future."""

    contexts: list[TextContext]
    epochs: list[int]  # ctx.num_preemptions at launch: a change means the row is stale
    sampled: list[int]  # rows of `contexts` that sample a token
    num_steps: int
    job: Future | None = None
    # Set once every constrained row's matcher has caught up (see fill_grammar).
    grammar_ready: threading.Event | None = None
    bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None
    prompt_targets: dict[int, tuple[int, int, int]] = field(default_factory=dict)


@dataclass
class StepResult:
    """What the device job hands back."""

    outputs: list[SamplerOutput]
    prompt_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


@dataclass
class TextGenerationOutput:
    """Token-level result of one step for one request."""

    request_id: str
    tokens: list[int]
    status: GenerationStatus


class TextGenerationPipeline:
    """Runs scheduled steps: forward, sample, update contexts."""

    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager, vocab_size: int,
                 max_seq_len: int, executor: StepExecutor, structured: StructuredOutput | None = None,
                 overlap: bool = False, max_slots: int = 64):
        self.runner = runner
        self.kv_manager = kv_manager
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.device = runner.device
        self.structured = structured
        self.executor = executor
        self.overlap = overlap
        self.forward_passes = 0
        # Last sampled token of every request slot, on the device.
        self.token_buffer = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self._free_slots = list(range(max_slots - 1, -1, -1))

    # -- TokenGenerator interface ------------------------------------------------
    def next_token(self, batch: Mapping[str, TextContext] | Sequence[TextContext],
                   num_steps: int = 1) -> dict[str, TextGenerationOutput]:
        handle = self.launch(batch, num_steps)
        self.fill_grammar(handle)
        return self.process(handle)

    def release(self, ctx: TextContext) -> None:
        self.kv_manager.release(ctx)
        if ctx.slot is not None:
            # Safe to reuse at once: steps run in order, so a later owner's
            # reads come after any in-flight write by this request.
            self._free_slots.append(ctx.slot)
            ctx.slot = None

    def _slot(self, ctx: TextContext) -> int:
        if ctx.slot is None:
            if not self._free_slots:
                grown = torch.zeros(2 * len(self.token_buffer), dtype=torch.int64, device=self.device)
                grown[: len(self.token_buffer)] = self.token_buffer
                self._free_slots = list(range(len(grown) - 1, len(self.token_buffer) - 1, -1))
                self.token_buffer = grown
            ctx.slot = self._free_slots.pop()
        return ctx.slot

    # -- launch ---------------------------------------------------------------------
    def launch(self, batch: Mapping[str, TextContext] | Sequence[TextContext],
               num_steps: int = 1) -> StepHandle:
        """Build inputs, advance contexts with placeholders, submit the device job."""
        contexts = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        sampled = [i for i, c in enumerate(contexts) if c.active_idx == c.end_idx]
        if num_steps > 1 and not all(multi_step_ok(c) for c in contexts):
            raise ValueError("multi-step decoding needs a decode-only batch without EOS blocks")
        handle = StepHandle(contexts, [c.num_preemptions for c in contexts], sampled, num_steps)

        host_ids = np.concatenate([c.next_tokens for c in contexts])
        future_rows = np.flatnonzero(host_ids == FUTURE_TOKEN)
        future_slots: list[int] = []
        for ctx in contexts:
            future_slots += [self._slot(ctx)] * int(np.count_nonzero(ctx.next_tokens == FUTURE_TOKEN))
        fwd = self.runner.prepare(contexts, num_steps, input_ids=np.where(host_ids < 0, 0, host_ids))
        for row, ctx in enumerate(contexts):
            n = ctx.sampling_params.prompt_logprobs
            if n is not None and ctx.start_idx < ctx.prompt_len:
                last = min(ctx.active_idx, ctx.prompt_len - 1)
                if last > ctx.start_idx:
                    handle.prompt_targets[row] = (fwd.spans[row].q_start, ctx.start_idx, last)

        sample_ctx = [contexts[i] for i in sampled]
        sbatch = build_sampling_batch(sample_ctx, self.vocab_size, self.device) if sampled else None
        sample_rows = torch.tensor([fwd.spans[i].q_end - 1 for i in sampled], device=self.device)
        sample_slots = torch.tensor([self._slot(contexts[i]) for i in sampled], dtype=torch.int64,
                                    device=self.device)
        # Penalties count the previous token too, which may still be on the device.
        penalty_fix = None
        if sbatch is not None and sbatch.output_counts is not None:
            rows = [k for k, c in enumerate(sample_ctx) if c.next_tokens[0] == FUTURE_TOKEN
                    and c.sampling_params.uses_penalties]
            if rows:
                penalty_fix = (torch.tensor(rows, device=self.device),
                               torch.tensor([sample_ctx[k].slot for k in rows], device=self.device))
        if any(c.matcher is not None for c in sample_ctx):
            handle.grammar_ready = threading.Event()

        targets = {row: torch.from_numpy(ctx.tokens[s + 1:last + 1].copy())
                   for row, (_, s, last) in handle.prompt_targets.items() for ctx in [contexts[row]]}

        # Host bookkeeping now, so the next step can be scheduled before this one ends.
        for row, ctx in enumerate(contexts):
            if row in sampled:
                for _ in range(num_steps):
                    ctx.update_with_future_token()
            else:
                ctx.mark_chunk_done()

        future_idx = torch.from_numpy(future_rows).to(self.device)
        future_src = torch.tensor(future_slots, dtype=torch.int64, device=self.device)

        def job() -> StepResult:
            if len(future_rows):
                fwd.input_ids[future_idx] = self.token_buffer[future_src]
            hidden = self.runner.forward(fwd)
            self.forward_passes += 1
            prompt_lp = {row: self._prompt_logprobs(hidden, q_start, targets[row],
                                                    contexts[row].sampling_params.prompt_logprobs or 0)
                         for row, (q_start, _, _) in handle.prompt_targets.items()}
            outputs: list[SamplerOutput] = []
            if sbatch is None:
                return StepResult(outputs, prompt_lp)
            if penalty_fix is not None:
                _count_tokens(sbatch, self.token_buffer[penalty_fix[1]], penalty_fix[0])
            out = self._sample(hidden.index_select(0, sample_rows), sbatch, handle, 0)
            outputs.append(out)
            step_fwd: ForwardBatch = fwd
            for step in range(1, num_steps):
                step_fwd = self.runner.decode_step_after(step_fwd, out.tokens)
                hidden = self.runner.forward(step_fwd)
                self.forward_passes += 1
                _count_tokens(sbatch, out.tokens)
                out = self._sample(hidden, sbatch, handle, step)
                outputs.append(out)
            self.token_buffer.index_copy_(0, sample_slots, out.tokens)
            for o in outputs:  # start the copies to the host; process() reads them
                o.to_host_async()
            return StepResult(outputs, prompt_lp)

        handle.job = self.executor.submit(job)
        return handle

    def _sample(self, hidden: torch.Tensor, sbatch: SamplingBatch, handle: StepHandle,
                step: int) -> SamplerOutput:
        logits = self.runner.model.logits(hidden)
        mask = None
        ready = handle.grammar_ready
        if ready is not None:
            def mask(lg: torch.Tensor) -> None:
                # The host fills the bitmask once the previous step's tokens are in.
                ready.wait()
                if handle.bitmask is not None:
                    assert self.structured is not None
                    self.structured.apply(lg, handle.bitmask, handle.bitmask_rows or [])
        return sample(logits, sbatch, mask, position_offset=step)

    def _prompt_logprobs(self, hidden: torch.Tensor, q_start: int, targets: torch.Tensor, n: int):
        logits = self.runner.model.logits(hidden[q_start:q_start + len(targets)])
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets.to(self.device)[:, None])[:, 0]
        top = logprobs.topk(n, dim=-1) if n > 0 else None
        return chosen, top.indices if top else None, top.values if top else None

    # -- grammar ----------------------------------------------------------------------
    def fill_grammar(self, handle: StepHandle) -> None:
        """Fill the step's bitmask rows from the matchers and release its sampling.

        Call when every matcher has consumed the tokens before its sample
        position: right after `launch` with overlap off, after processing the
        previous step with overlap on.
        """
        if handle.grammar_ready is None:
            return
        try:
            contexts = [handle.contexts[i] for i in handle.sampled]
            live = [c if c.matcher is not None and not c.is_done else None for c in contexts]
            if self.structured is not None and any(c is not None for c in live):
                handle.bitmask, handle.bitmask_rows = self.structured.fill(live)
        finally:
            handle.grammar_ready.set()

    # -- process ---------------------------------------------------------------------
    def process(self, handle: StepHandle) -> dict[str, TextGenerationOutput]:
        """Wait for the step and advance every context with its real tokens.

        Raises if the step itself failed (every request in it is affected); a
        failure while advancing one request ends that request only.
        """
        assert handle.job is not None
        result: StepResult = handle.job.result()
        host = [o.host() for o in result.outputs]
        sampled_row = {ctx_row: k for k, ctx_row in enumerate(handle.sampled)}
        results: dict[str, TextGenerationOutput] = {}
        for row, ctx in enumerate(handle.contexts):
            if ctx.is_done or ctx.num_preemptions != handle.epochs[row]:
                continue  # finished, aborted or preempted while this step ran
            new: list[int] = []
            try:
                self._store_prompt_logprobs(ctx, result.prompt_logprobs.get(row),
                                            handle.prompt_targets.get(row))
                k = sampled_row.get(row)
                if k is not None:
                    new = self._advance(ctx, host, k)
                    ctx.suspect = False  # it sampled in a step that worked
                self.kv_manager.commit(ctx)
            except Exception:  # noqa: BLE001 - this request's fault; the others go on
                log.exception("request %s failed while its step was processed", ctx.request_id)
                ctx.fail("internal error while processing this request; see the server log")
                ctx.drop_futures()
            results[ctx.request_id] = TextGenerationOutput(ctx.request_id, new, ctx.status)
        return results

    def _advance(self, ctx: TextContext, host: list, k: int) -> list[int]:
        """Realize ctx's sampled tokens (row k of each step), check stops, advance its grammar."""
        new: list[int] = []
        params = ctx.sampling_params
        for tokens, lp, top_ids, top_lp in host:
            tok = int(tokens[k])
            index = ctx.realize_future_token(tok)
            new.append(tok)
            if params.logprobs is not None and lp is not None:
                n = params.logprobs
                top = list(zip(top_ids[k, :n].tolist(), top_lp[k, :n].tolist(), strict=True)) \
                    if top_ids is not None and top_lp is not None else []
                ctx.logprobs.append(TokenLogprobs(tok, float(lp[k]), top))
            self.check_stop(ctx, tok, index)
            if ctx.is_done:
                break
        if ctx.matcher is not None and self.structured is not None and not ctx.is_done:
            self.structured.advance(ctx, self.check_stop)
        if ctx.is_done:
            ctx.drop_futures()
        return new

    def check_stop(self, ctx: TextContext, token: int, index: int) -> None:
        """Token-level stop conditions for the token now known at `index`."""
        params = ctx.sampling_params
        generated = index + 1 - ctx.prompt_len
        constrained = ctx.matcher is not None
        if generated >= params.min_new_tokens or constrained:
            if token in params.stop_token_ids and not (constrained and token in ctx.eos_token_ids):
                ctx.finish(GenerationStatus.STOP_TOKEN)
                return
            # A constrained output ends with EOS only when its matcher accepts
            # the stop token (structured.advance): never on the sampler's word.
            if not params.ignore_eos and token in ctx.eos_token_ids and not constrained:
                ctx.finish(GenerationStatus.END_OF_SEQUENCE)
                return
        # Length limits apply once everything before the limit is known.
        if ctx.pending_futures == 0 and ctx.end_idx >= min(ctx.max_length, self.max_seq_len):
            limited_by_request = params.max_new_tokens is not None and \
                ctx.num_generated >= params.max_new_tokens
            ctx.finish(GenerationStatus.MAXIMUM_LENGTH if limited_by_request
                       else GenerationStatus.CONTEXT_LENGTH)

    def _store_prompt_logprobs(self, ctx: TextContext, item, target) -> None:
        if ctx.sampling_params.prompt_logprobs is not None and not ctx.prompt_logprobs:
            ctx.prompt_logprobs.append(None)  # the first prompt token has no prediction
        if item is None or target is None:
            return
        chosen, top_ids, top_lp = item
        first = target[1] + 1
        chosen_h = chosen.cpu().tolist()
        ids_h = top_ids.cpu().tolist() if top_ids is not None else None
        lp_h = top_lp.cpu().tolist() if top_lp is not None else None
        for j, value in enumerate(chosen_h):
            top = list(zip(ids_h[j], lp_h[j], strict=True)) if ids_h is not None and lp_h is not None else []
            ctx.prompt_logprobs.append(TokenLogprobs(int(ctx.tokens[first + j]), value, top))


def multi_step_ok(ctx: TextContext) -> bool:
    """Whether `ctx` can take several decode steps without the host in between."""
    return (ctx.active_length == 1 and ctx.active_idx == ctx.end_idx and ctx.matcher is None
            and ctx.allowed_token_range() is None
            and ctx.num_generated >= ctx.sampling_params.min_new_tokens)


def _count_tokens(sbatch: SamplingBatch, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Add `tokens` (one per row, or per `rows`) to the penalty state."""
    if sbatch.output_counts is None or sbatch.seen is None:
        return
    if rows is None:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
    sbatch.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=sbatch.output_counts.dtype),
                                    accumulate=True)
    sbatch.seen[rows, tokens] = True
