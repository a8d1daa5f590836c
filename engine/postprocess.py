"""Phase 3 of a step, on the engine thread: a step's results become outputs.

For every request of the step whose work still counts: realize its future
tokens, record log-probabilities, apply the token-level stop rules
(stopping.py), read them into its reasoning gate (reasoning.py: where a
thought ends, a spent thinking budget), advance its grammar and append forced
tokens (step_masks.py),
publish its finished KV pages, detokenize and match stop strings (output.py),
decode its audio (speech). Then build each request's output and free what the
finished requests hold. This is the one place a running request is finished;
the others are an abort and an admission that can never fit.

A step that fails as a whole is handled here too (`step_failed`): the engine
cannot tell which request broke it, so every request of that step becomes a
*suspect*: all are recomputed from scratch (as after a preemption) and the
scheduler runs each suspect alone until a step of its own succeeds; the one
that breaks its step alone is failed. Steps that keep failing whatever runs in
them mean the engine itself is broken (`EngineBroken`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from .context import Failure, GenerationStatus, TextContext, TokenLogprobs, Verdict
from .executor import StepExecutor
from .kv_cache import KVCacheManager
from .output import OutputStream, RequestOutput
from .scheduler import Scheduler
from .speech import AudioGenerator, TTSContext
from .staging import HostCopy
from .step_masks import StepMasks
from .step_run import LaunchedStep, StepResult
from .stopping import token_verdict
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Steps that may fail in a row (each is retried with fewer requests) before the
# engine declares itself broken: a fault no single request explains.
MAX_FAILED_STEPS = 8


class EngineBroken(RuntimeError):
    """Steps keep failing whatever runs in them; the engine cannot go on."""


class Postprocessor:
    """Turns steps into outputs; owns each request's output stream."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, tokenizer: Tokenizer,
                 executor: StepExecutor, max_seq_len: int, audio: AudioGenerator | None = None):
        self.scheduler = scheduler
        self.kv = kv
        self.tokenizer = tokenizer
        self.executor = executor
        self.max_seq_len = max_seq_len
        self.audio = audio
        self._streams: dict[str, OutputStream] = {}
        self.failed_steps = 0  # in a row

    # -- requests -----------------------------------------------------------
    def track(self, ctx: TextContext) -> None:
        """Start the output stream of a request entering the engine."""
        self._streams[ctx.request_id] = OutputStream(ctx, self.tokenizer)

    def tracks(self, request_id: str) -> bool:
        return request_id in self._streams

    # -- steps -----------------------------------------------------------------
    def step_done(self, step: LaunchedStep, result: StepResult) -> list[TextContext]:
        """Advance every live request of a completed step; the requests to build
        outputs for (`outputs`)."""
        assert step.inputs is not None
        self.failed_steps = 0
        host = [o.host() for o in result.outputs]
        sample_index = {row: k for k, row in enumerate(step.inputs.sampled)}
        mask_failures = step.inputs.grammar.failed if step.inputs.grammar is not None else {}
        touched = []
        for row, ctx in enumerate(step.contexts):
            if not step.live(row):
                continue  # finished, aborted or reset while this step ran
            touched.append(ctx)
            k = sample_index.get(row)
            try:
                if k in mask_failures:
                    ctx.fail(mask_failures[k])
                    ctx.drop_futures()
                    continue
                target = step.inputs.prompt_logprobs.get(row)
                self._store_prompt_logprobs(ctx, result.prompt_logprobs.get(row),
                                            None if target is None else target.first)
                if k is not None:
                    self._advance(ctx, host, k)
                    ctx.sched.suspect = False  # it sampled in a step that worked
                span = step.inputs.spans[row]  # its keys and values are written now
                self.kv.commit(ctx, span.cache_len + span.q_len
                               + (step.inputs.num_steps - 1 if k is not None else 0))
            except Exception:  # noqa: BLE001 - this request's fault; the others go on
                log.exception("request %s failed while its step was processed", ctx.request_id)
                ctx.fail(Failure("internal error while processing this request; see the server log"))
                ctx.drop_futures()
        return touched

    def step_failed(self, step: LaunchedStep, exc: BaseException) -> None:
        """A step failed as a whole: find the request at fault without failing the
        rest (a request it ends is reported through the scheduler's dropped list)."""
        live = [ctx for row, ctx in enumerate(step.contexts) if step.live(row)]
        if not live:
            return  # its work had been thrown away already
        self.failed_steps += 1
        culprit = step.contexts[0] if len(step.contexts) == 1 else None
        log.error("a step of %d request(s) failed (%s); %s", len(step.contexts), type(exc).__name__,
                  f"ending request {culprit.request_id}" if culprit is not None
                  else "running each of them alone to find the one at fault", exc_info=exc)
        if self.failed_steps > MAX_FAILED_STEPS:
            raise EngineBroken(f"{self.failed_steps} steps in a row failed") from exc
        for ctx in live:
            if ctx is culprit:
                ctx.fail(Failure("internal error while running this request; see the server log"))
                self.scheduler.abort(ctx)
            else:
                self.scheduler.requeue(ctx)
                ctx.sched.suspect = True

    # -- one request ---------------------------------------------------------------
    def _advance(self, ctx: TextContext, host: list, k: int) -> None:
        """Realize ctx's sampled tokens (row k of each decode step), apply the stop
        rules, advance its grammar."""
        params = ctx.sampling_params
        # A stop token (stop_token_ids) the grammar allowed may close a value
        # that breaks the schema: checked as EOS is before the request ends
        # (it ended first, and the value stayed unchecked).
        held: GenerationStatus | None = None
        for tokens, lp, top_ids, top_lp in host:
            tok = int(tokens[k])
            index = ctx.realize_future_token(tok)
            if params.logprobs is not None and lp is not None:
                n = params.logprobs
                top = list(zip(top_ids[k, :n].tolist(), top_lp[k, :n].tolist(), strict=True)) \
                    if top_ids is not None and top_lp is not None else []
                ctx.output.logprobs.append(TokenLogprobs(tok, float(lp[k]), top))
            status = token_verdict(ctx, tok, index, self.max_seq_len)
            if status is not None:
                if status is GenerationStatus.STOP_TOKEN and ctx.constrained and ctx.grammar.resampler is not None:
                    held = status
                else:
                    ctx.finish(status)
                break
        if ctx.grammar.gate is not None:
            self._advance_gate(ctx)
        if ctx.constrained and not ctx.is_done:
            verdict = self._advance_grammar(ctx, append_forced=held is None)
            if verdict is GenerationStatus.END_OF_SEQUENCE and ctx.grammar.resampler is not None \
                    and self._resample(ctx, at_end=True):
                verdict = None  # the output broke its schema: rolled back instead
            if verdict is not None:
                ctx.end(verdict)
        if ctx.grammar.resampler is not None and ctx.constrained and not ctx.is_done:
            # A stop token that completes the whole output is checked as EOS is.
            matcher = ctx.matcher
            whole = held is not None and matcher is not None and matcher.can_terminate()
            if not self._resample(ctx, at_end=whole) and held is not None:
                ctx.finish(held)
        elif held is not None:
            ctx.finish(held)
        if ctx.is_done:
            ctx.drop_futures()

    def _advance_grammar(self, ctx: TextContext, append_forced: bool = True) -> Verdict | None:
        """Feed ctx's matcher its new tokens and append what the grammar forces
        (StepMasks.advance; not with `append_forced` False); how that ends ctx,
        if it does: the grammar's verdict, or a length limit the forced tokens
        reached."""
        verdict, forced = StepMasks.advance(ctx, append_forced)
        if verdict is None and forced:
            last = ctx.end_idx - 1
            verdict = token_verdict(ctx, int(ctx.tokens[last]), last, self.max_seq_len)
        return verdict

    def _advance_gate(self, ctx: TextContext) -> None:
        """Read ctx's known tokens into its reasoning gate. When the answer
        starts, the matcher's input starts there; a thought whose budget is
        spent, with nothing in flight, gets its end marker appended now (with
        a step in flight, or log-probabilities asked for, its mask forces it:
        step_masks.py)."""
        gate = ctx.grammar.gate
        assert gate is not None
        opened = gate.observe(ctx.tokens, ctx.num_final_tokens)
        if not opened and not ctx.is_done and ctx.pending_futures == 0 and gate.budget_spent(ctx.end_idx) \
                and ctx.sampling_params.logprobs is None and ctx.end_idx < min(ctx.max_length, self.max_seq_len):
            ctx.jump_ahead(gate.parser.end_id)
            opened = gate.observe(ctx.tokens, ctx.end_idx)
            status = token_verdict(ctx, gate.parser.end_id, ctx.end_idx - 1, self.max_seq_len)
            if status is not None:
                ctx.finish(status)
        if opened:
            assert gate.answer_start is not None
            ctx.grammar.grammar_idx = gate.answer_start
            ctx.grammar.forced_next = None  # the forced end marker, now read

    def _resample(self, ctx: TextContext, at_end: bool = False) -> bool:
        """Roll ctx back to the start of a value that broke its schema, if one
        just completed (`at_end`: the grammar accepted a stop token) and
        retries remain (see resample.py). Whether it rolled back."""
        assert ctx.grammar.resampler is not None
        stream = self._streams.get(ctx.request_id)
        floor = stream.sent_tokens if stream is not None else 0
        to = ctx.grammar.resampler.check_end(ctx, floor) if at_end else ctx.grammar.resampler.check(ctx, floor)
        if to is None:
            return False
        log.debug("request %s: a value breaks %s; resampling from token %d (retry %d)",
                  ctx.request_id, to.keyword or "the schema", to.position - ctx.prompt_len,
                  ctx.grammar.resampler.retries)
        matcher = ctx.matcher
        assert matcher is not None
        matcher.rollback(ctx.grammar.grammar_idx - to.position)
        ctx.rollback(ctx.end_idx - to.position)
        ctx.grammar.forced_next = None
        # A step launched with the old tokens (speculative constrained decoding)
        # computed work that is gone: its results for ctx are discarded.
        ctx.sched.epoch += 1
        self.kv.truncate(ctx)
        if stream is not None:
            stream.rolled_back()
        # What the grammar forces from there is forced again, as the first
        # time: the value's first choice, where its ban goes, is a sampled token.
        verdict = self._advance_grammar(ctx)
        if verdict is not None:
            ctx.end(verdict)
        return True

    @staticmethod
    def _store_prompt_logprobs(ctx: TextContext, item: HostCopy | None, first: int | None) -> None:
        if ctx.sampling_params.prompt_logprobs is not None and not ctx.output.prompt_logprobs:
            ctx.output.prompt_logprobs.append(None)  # the first prompt token has no prediction
        if item is None or first is None:
            return
        chosen, top_ids, top_lp = item.arrays()
        assert chosen is not None
        ids_h = top_ids.tolist() if top_ids is not None else None
        lp_h = top_lp.tolist() if top_lp is not None else None
        stored = ctx.output.prompt_logprobs  # entry i: prompt position i's
        for j, value in enumerate(chosen.tolist()):
            if first + j < len(stored):
                continue  # computed again after a preemption: kept as first stored
            top = list(zip(ids_h[j], lp_h[j], strict=True)) if ids_h is not None and lp_h is not None else []
            stored.append(TokenLogprobs(int(ctx.tokens[first + j]), value, top))

    def release_finished(self, touched: Sequence[TextContext]) -> None:
        """Give back the pages and token-buffer rows of the requests in `touched`
        that have finished, before their outputs are built (`outputs`): so that
        a step scheduled in between can use them. The pipeline's `advance`
        calls it on what `step_done` moved on; `outputs` releases only what it
        ends itself."""
        for ctx in touched:
            if ctx.is_done:
                ctx.drop_futures()
                self.scheduler.remove(ctx)

    # -- outputs ------------------------------------------------------------------
    def outputs(self, touched: Sequence[TextContext]) -> list[RequestOutput]:
        """Detokenize (ending requests on a stop string), decode audio, build each
        request's output; then free what the requests it ended hold (those that
        had ended before were released by `release_finished`)."""
        # Scanning the scheduler's queues again for every finished request
        # would cost O(waiting) each under a deep queue.
        running = [ctx for ctx in touched if not ctx.is_done]
        for ctx in touched:
            stream = self._streams.get(ctx.request_id)
            if stream is None or ctx.status is GenerationStatus.CANCELLED:
                continue
            try:
                match = stream.decode()
            except Exception:  # noqa: BLE001 - this request's fault; the others go on
                log.exception("request %s: decoding its output failed", ctx.request_id)
                ctx.fail(Failure("internal error while decoding the output; see the server log"))
                continue
            if match is not None:
                # Tokens decoded after the one completing the stop are dropped.
                ctx.rollback(ctx.num_generated - match.keep_tokens)
                ctx.end_at_stop_string()
        audio = self._decode_audio(touched)
        outputs = []
        now = time.monotonic()
        for ctx in touched:
            stream = self._streams.get(ctx.request_id)
            if stream is None:
                continue
            delta = stream.delta()
            if ctx.request_id in audio:
                delta.audio = audio[ctx.request_id]
            times = ctx.output.times
            if delta.token_ids and times.first_token is None:
                times.first_token = now
            if delta.finished:
                times.finished = now
            if delta.finished:
                del self._streams[ctx.request_id]
            if delta.token_ids or delta.text or delta.finished or delta.prompt_logprobs \
                    or delta.audio is not None:
                outputs.append(delta)
        self.release_finished(running)  # those a stop string (or a failed decode) ended
        return outputs

    def _decode_audio(self, touched: Sequence[TextContext]) -> dict[str, np.ndarray]:
        """New audio of the speech requests in `touched` (all of it for finished ones).

        Requests are decoded together; if that fails, one by one, and a request
        whose audio cannot be decoded fails.
        """
        speech = [c for c in touched if isinstance(c, TTSContext) and c.status is not GenerationStatus.CANCELLED
                  and c.status is not GenerationStatus.ERROR and c.request_id in self._streams]
        audio = self.audio
        if audio is None:
            return {}
        # Most steps complete no chunk, and a call on the device thread queues
        # behind the next step's launch: only a ready chunk is worth the trip.
        speech = audio.ready(speech)
        if not speech:
            return {}
        try:
            return self.executor.call(lambda: audio.drain(speech))
        except Exception:  # noqa: BLE001 - find the request at fault
            out: dict[str, np.ndarray] = {}
            for ctx in speech:
                try:
                    out.update(self.executor.call(lambda c=ctx: audio.drain([c])))  # type: ignore[misc]
                except Exception:  # noqa: BLE001
                    log.exception("request %s: decoding its audio failed", ctx.request_id)
                    ctx.fail(Failure("internal error while decoding audio; see the server log"))
            return out
