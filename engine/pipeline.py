"""The text generation pipeline the scheduler drives (MAX's TokenGenerator).

`next_token(batch, num_steps)` runs one scheduled step and updates the
contexts. It is two calls so an overlap scheduler can put work between them:
`launch` starts the forward pass(es) and sampling and returns device tensors;
`process` reads them on the host, updates contexts and checks token-level stop
conditions (EOS, stop token ids, max_new_tokens, context length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .context import GenerationStatus, TextContext, TokenLogprobs
from .kv_cache import KVCacheManager
from .runner import ModelRunner
from .sampler import SamplerOutput, SamplingBatch, build_sampling_batch, sample
from .structured import StructuredOutput


@dataclass
class StepHandle:
    """A launched step: contexts in batch order plus device results."""

    contexts: list[TextContext]
    sampled: list[int]  # rows of `contexts` that sample a token
    num_steps: int
    outputs: list[SamplerOutput] = field(default_factory=list)
    prompt_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]] = \
        field(default_factory=dict)


@dataclass
class TextGenerationOutput:
    """Token-level result of one step for one request."""

    request_id: str
    tokens: list[int]
    status: GenerationStatus


class TextGenerationPipeline:
    """Runs scheduled steps: forward, sample, update contexts."""

    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager, vocab_size: int,
                 max_seq_len: int, structured: StructuredOutput | None = None):
        self.runner = runner
        self.kv_manager = kv_manager
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.device = runner.device
        self.structured = structured
        self.forward_passes = 0

    # -- TokenGenerator interface ------------------------------------------------
    def next_token(self, batch: Mapping[str, TextContext] | Sequence[TextContext],
                   num_steps: int = 1) -> dict[str, TextGenerationOutput]:
        return self.process(self.launch(batch, num_steps))

    def release(self, ctx: TextContext) -> None:
        self.kv_manager.release(ctx)

    # -- the two halves of a step ------------------------------------------------
    def launch(self, batch: Mapping[str, TextContext] | Sequence[TextContext],
               num_steps: int = 1) -> StepHandle:
        contexts = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        sampled = [i for i, c in enumerate(contexts) if c.active_idx == c.end_idx]
        if num_steps > 1 and not all(multi_step_ok(c) for c in contexts):
            raise ValueError("multi-step decoding needs a decode-only batch without EOS blocks")
        handle = StepHandle(contexts, sampled, num_steps)
        fwd = self.runner.prepare(contexts, num_steps)
        hidden = self.runner.forward(fwd)
        self.forward_passes += 1
        self._collect_prompt_logprobs(handle, fwd.spans, hidden)
        if not sampled:
            return handle
        rows = torch.tensor([fwd.spans[i].q_end - 1 for i in sampled], device=self.device)
        sample_ctx = [contexts[i] for i in sampled]
        sbatch = build_sampling_batch(sample_ctx, self.vocab_size, self.device)
        out = self._sample(hidden.index_select(0, rows), sbatch, sample_ctx, 0)
        handle.outputs.append(out)
        for step in range(1, num_steps):
            fwd = self.runner.decode_step_after(fwd, out.tokens)
            hidden = self.runner.forward(fwd)
            self.forward_passes += 1
            _count_new_tokens(sbatch, out.tokens)
            out = self._sample(hidden, sbatch, sample_ctx, step)
            handle.outputs.append(out)
        return handle

    def _sample(self, hidden: torch.Tensor, sbatch: SamplingBatch, contexts: list[TextContext],
                step: int) -> SamplerOutput:
        with torch.inference_mode():
            logits = self.runner.model.logits(hidden)
            mask = None
            structured = self.structured
            if structured is not None and any(c.matcher is not None for c in contexts):
                def mask(lg: torch.Tensor) -> None:
                    structured.mask(lg, contexts)
            return sample(logits, sbatch, mask, position_offset=step)

    def process(self, handle: StepHandle) -> dict[str, TextGenerationOutput]:
        """Read the step's tokens on the host and advance every context."""
        results: dict[str, TextGenerationOutput] = {}
        host = [_to_host(o) for o in handle.outputs]
        sampled_row = {ctx_row: k for k, ctx_row in enumerate(handle.sampled)}
        for row, ctx in enumerate(handle.contexts):
            self._store_prompt_logprobs(handle, row, ctx)
            k = sampled_row.get(row)
            new: list[int] = []
            if k is None:
                ctx.mark_chunk_done()
            else:
                for step in range(handle.num_steps):
                    if ctx.is_done:
                        break
                    tokens, lp, top_ids, top_lp = host[step]
                    tok = int(tokens[k])
                    # In a multi-step decode the previous token was computed on the
                    # device; update() moves start_idx past it, as it should.
                    ctx.update(tok)
                    new.append(tok)
                    if ctx.sampling_params.logprobs is not None and lp is not None:
                        n = ctx.sampling_params.logprobs
                        top = list(zip(top_ids[k, :n].tolist(), top_lp[k, :n].tolist(), strict=True)) \
                            if top_ids is not None else []
                        ctx.logprobs.append(TokenLogprobs(tok, float(lp[k]), top))
                    self.check_stop(ctx, tok)
                    if ctx.matcher is not None and self.structured is not None \
                            and ctx.status is not GenerationStatus.ERROR:
                        self.structured.advance(ctx, tok, self.check_stop)
            self.kv_manager.commit(ctx)
            results[ctx.request_id] = TextGenerationOutput(ctx.request_id, new, ctx.status)
        return results

    def check_stop(self, ctx: TextContext, token: int) -> None:
        """Token-level stop conditions after `token` was appended."""
        params = ctx.sampling_params
        if ctx.num_generated >= params.min_new_tokens:
            if token in params.stop_token_ids:
                ctx.finish(GenerationStatus.STOP_TOKEN)
                return
            if not params.ignore_eos and token in ctx.eos_token_ids:
                ctx.finish(GenerationStatus.END_OF_SEQUENCE)
                return
        if ctx.end_idx >= ctx.max_length:
            limited_by_request = params.max_new_tokens is not None and \
                ctx.num_generated >= params.max_new_tokens
            ctx.finish(GenerationStatus.MAXIMUM_LENGTH if limited_by_request
                       else GenerationStatus.CONTEXT_LENGTH)
        elif ctx.end_idx >= self.max_seq_len:
            ctx.finish(GenerationStatus.CONTEXT_LENGTH)

    # -- prompt log-probabilities ---------------------------------------------------
    def _collect_prompt_logprobs(self, handle: StepHandle, spans, hidden: torch.Tensor) -> None:
        for row, ctx in enumerate(handle.contexts):
            n = ctx.sampling_params.prompt_logprobs
            if n is None or ctx.start_idx >= ctx.prompt_len:
                continue
            span = spans[row]
            # Positions p in the chunk predict token p + 1, while that is a prompt token.
            last = min(ctx.active_idx, ctx.prompt_len - 1)
            count = last - ctx.start_idx
            if count <= 0:
                continue
            with torch.inference_mode():
                logits = self.runner.model.logits(hidden[span.q_start:span.q_start + count])
                logprobs = logits.log_softmax(dim=-1)
            targets = torch.from_numpy(ctx.tokens[ctx.start_idx + 1:last + 1].copy()).to(self.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0]
            top = logprobs.topk(n, dim=-1) if n > 0 else None
            handle.prompt_logprobs[row] = (chosen, top.indices if top else None,
                                           top.values if top else None, ctx.start_idx + 1)

    def _store_prompt_logprobs(self, handle: StepHandle, row: int, ctx: TextContext) -> None:
        if ctx.sampling_params.prompt_logprobs is not None and not ctx.prompt_logprobs:
            ctx.prompt_logprobs.append(None)  # the first prompt token has no prediction
        item = handle.prompt_logprobs.get(row)
        if item is None:
            return
        chosen, top_ids, top_lp, first = item
        chosen_h = chosen.cpu().tolist()
        ids_h = top_ids.cpu().tolist() if top_ids is not None else None
        lp_h = top_lp.cpu().tolist() if top_lp is not None else None
        for j, value in enumerate(chosen_h):
            tok = int(ctx.tokens[first + j])
            top = list(zip(ids_h[j], lp_h[j], strict=True)) if ids_h is not None and lp_h is not None else []
            ctx.prompt_logprobs.append(TokenLogprobs(tok, value, top))


def multi_step_ok(ctx: TextContext) -> bool:
    """Whether `ctx` can take several decode steps without the host in between."""
    return (ctx.active_length == 1 and ctx.active_idx == ctx.end_idx and ctx.matcher is None
            and ctx.num_generated >= ctx.sampling_params.min_new_tokens)


def _count_new_tokens(sbatch: SamplingBatch, tokens: torch.Tensor) -> None:
    """Keep penalty state current between the steps of a multi-step decode."""
    if sbatch.output_counts is not None and sbatch.seen is not None:
        idx = tokens[:, None]
        sbatch.output_counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=sbatch.output_counts.dtype))
        sbatch.seen.scatter_(1, idx, True)


def _to_host(out: SamplerOutput):
    tokens = out.tokens.cpu().numpy()
    lp = out.logprob.cpu().numpy() if out.logprob is not None else None
    ids = out.top_ids.cpu().numpy() if out.top_ids is not None else None
    tlp = out.top_logprobs.cpu().numpy() if out.top_logprobs is not None else None
    return tokens, lp, ids, tlp

