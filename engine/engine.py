"""The engine core: requests in, per-step output deltas out."""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .attention import make_attention
from .config import EngineConfig
from .context import GenerationStatus, TextContext
from .errors import InvalidRequest
from .executor import StepExecutor
from .kernels import cpu_ops
from .kv_cache import KVCacheManager, PageAllocator, page_tensor_shape, pages_for_budget
from .kv_cache.memory import empty_huge
from .models.config import CheckpointError, load_model_config
from .models.llama import LlamaFamilyModel
from .models.weights import WeightSource
from .output import OutputStream, RequestOutput
from .pipeline import StepHandle, TextGenerationPipeline
from .runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .speech import (
    CODES_PER_FRAME,
    DEFAULT_SPEECH_SAMPLING,
    AudioGenerator,
    SpeechCodec,
    SpeechLayout,
    TTSContext,
)
from .structured import StructuredOutput
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_SPEECH_CHARS = 2000


# Steps that may fail in a row (each is retried with fewer requests) before the
# engine declares itself broken: a fault no single request explains.
MAX_FAILED_STEPS = 8


class EngineBroken(RuntimeError):
    """Steps keep failing whatever runs in them; the engine cannot go on."""


class SpeechUnavailable(RuntimeError):
    """A speech request reached an engine without a speech model and codec."""


class EngineCore:
    """Loads a model and runs scheduled steps over a paged KV cache.

    Not thread-safe: one thread drives `step()`; the service wraps it.
    """

    def __init__(self, config: EngineConfig, wrap_model: Callable[[Any], Any] | None = None,
                 executor: StepExecutor | None = None):
        """`wrap_model` may wrap the loaded model (tests use it for scripted logits).

        `executor` shares another engine's device thread (e.g. a speech model
        served beside a text model): one thread runs all model work.
        """
        self.config = config
        self.model_config = load_model_config(config.model)
        self.tokenizer = Tokenizer(config.model)
        self._owns_executor = executor is None
        self.executor = executor or StepExecutor(config.torch_device)
        try:
            # Every tensor computation, loading included, happens on the device thread.
            self.executor.call(lambda: self._build(wrap_model))
        except BaseException:
            if self._owns_executor:
                self.executor.close()
            raise
        self._streams: dict[str, OutputStream] = {}
        self._inflight: StepHandle | None = None
        self._failed_steps = 0  # steps failed in a row

    def _build(self, wrap_model: Callable[[Any], Any] | None) -> None:
        config, mc = self.config, self.model_config
        device, dtype = config.torch_device, config.torch_dtype
        source = WeightSource(config.model)
        self.model = LlamaFamilyModel(mc, source, device, dtype, cpu_ops() if device.type == "cpu" else None,
                                      small_batch_gemm=config.cpu_small_batch_gemm)
        source.close()
        if wrap_model is not None:
            self.model = wrap_model(self.model)

        max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        num_pages = pages_for_budget(config.kv_cache_gib, mc.num_layers, config.page_size,
                                     mc.num_kv_heads, mc.head_dim, dtype)
        if num_pages < 2:
            raise ValueError(f"kv_cache_gib={config.kv_cache_gib} holds fewer than 2 pages")
        if num_pages * config.page_size < max_len:
            log.warning("KV cache holds %d tokens; capping the context length from %d",
                        num_pages * config.page_size, max_len)
            max_len = num_pages * config.page_size
        self.max_model_len = max_len
        shape = page_tensor_shape(num_pages, mc.num_layers, config.page_size, mc.num_kv_heads, mc.head_dim)
        if device.type == "cpu":
            # Every slot is written before it is read, but on CPU the memory is
            # touched now anyway: left to first use, the OS's page faults land
            # inside write_kv and cost more than the copy (200 ms of a 2.5 s
            # prefill of 16 x 128 tokens on the bench model). Zeroing up front
            # takes about 0.25 s per GiB, once.
            kv_blocks = empty_huge(shape, dtype).zero_()
        else:
            kv_blocks = torch.empty(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages, config.page_size, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(kv_blocks, self.allocator)
        self.attention = make_attention(kv_blocks, mc.num_heads, mc.head_dim, config.attention)
        runner = ModelRunner(self.model, self.kv_manager, self.attention)
        eos = mc.eos_token_ids or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.eos_token_ids = frozenset(eos)
        self.structured = StructuredOutput(self.tokenizer.hf, mc.vocab_size, sorted(self.eos_token_ids),
                                           config.grammar_backend, config.grammar_compile_timeout_s)
        self.pipeline = TextGenerationPipeline(runner, self.kv_manager, mc.vocab_size, max_len,
                                               self.executor, self.structured, overlap=config.overlap,
                                               max_slots=config.max_num_seqs + 1)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_seq_len=max_len, num_steps=config.num_steps,
                            speculative_constrained=config.speculative_constrained),
            self.kv_manager,
            release=self.pipeline.release,
        )
        self.audio: AudioGenerator | None = None
        self.speech_layout: SpeechLayout | None = None
        if config.speech_codec:
            layout = SpeechLayout.for_model(config.model)
            try:
                layout.check_vocab(mc.vocab_size)
            except ValueError as e:
                raise CheckpointError(f"{config.model} is not a speech model: {e}") from None
            self.speech_layout = layout
            self.audio = AudioGenerator(SpeechCodec(config.speech_codec, device))
        log.info("engine ready: %s, %s %s, %d KV pages of %d tokens, attention=%s, overlap=%s",
                 mc.architecture, device, dtype, num_pages, config.page_size, self.attention.name,
                 config.overlap)

    # -- requests -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def make_context(self, prompt: Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, matcher: Any = None) -> TextContext:
        """Validate a tokenized prompt and its parameters; build its context.

        `matcher` is a compiled grammar matcher (see `structured.compile_async`)
        when the output is constrained; compile it before calling this.
        """
        params = params or SamplingParams()
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise InvalidRequest("prompt", "the prompt is empty")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise InvalidRequest("prompt", f"token id {int(bad[0])} is outside the vocabulary "
                                           f"[0, {self.vocab_size})")
        if ids.size >= self.max_model_len:
            raise InvalidRequest("prompt", f"the prompt has {ids.size} tokens; the context holds "
                                           f"{self.max_model_len} including at least one new token")
        if params.max_new_tokens is not None:
            max_length = ids.size + params.max_new_tokens
            if max_length > self.max_model_len:
                raise InvalidRequest("max_new_tokens", f"prompt ({ids.size}) + max_new_tokens "
                                     f"({params.max_new_tokens}) exceeds the context length "
                                     f"{self.max_model_len}")
        else:
            max_length = self.max_model_len
        self._check_token_ids(params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        kwargs: dict[str, Any] = {"request_id": request_id} if request_id else {}
        return TextContext(tokens=ids, max_length=max_length, sampling_params=params,
                           eos_token_ids=self.eos_token_ids, seed=seed, matcher=matcher, **kwargs)

    def _check_token_ids(self, params: SamplingParams) -> None:
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise InvalidRequest("stop_token_ids", f"token id {tok} is outside the vocabulary")
        for tok in params.logit_bias:
            if tok >= self.vocab_size:
                raise InvalidRequest("logit_bias", f"token id {tok} is outside the vocabulary")

    @property
    def serves_speech(self) -> bool:
        return self.audio is not None

    def make_speech_context(self, text: str, params: SamplingParams | None = None,
                            request_id: str | None = None, chunk_frames: int = 4,
                            max_audio_seconds: float = 30.0,
                            audio_prompt_codes: Sequence[int] | None = None,
                            audio_prompt_transcription: str = "") -> TTSContext:
        """Validate a speech request and build its context (see engine.speech).

        Audio prompt codes (voice cloning) are SNAC codes, 7 per frame in the
        Orpheus order, each in [0, codebook_size). Default sampling follows
        Orpheus: temperature 0.6, top_p 0.95, repetition_penalty 1.1.
        """
        if self.audio is None or self.speech_layout is None:
            raise SpeechUnavailable("this server has no speech model")
        layout = self.speech_layout
        if not text.strip():
            raise InvalidRequest("input", "the text to speak is empty")
        if len(text) > MAX_SPEECH_CHARS:
            raise InvalidRequest("input", f"at most {MAX_SPEECH_CHARS} characters, got {len(text)}")
        if not 1 <= chunk_frames <= 64:
            raise InvalidRequest("chunk_frames", "must be in [1, 64]")
        if not 0 < max_audio_seconds <= 300:
            raise InvalidRequest("max_audio_seconds", "must be in (0, 300]")
        codes = None
        if audio_prompt_codes:
            codes = np.asarray(audio_prompt_codes, dtype=np.int64)
            if codes.size % CODES_PER_FRAME or (codes < 0).any() or (codes >= layout.codebook_size).any():
                raise InvalidRequest("audio_prompt_tokens", f"need whole frames of {CODES_PER_FRAME} codes in "
                                                            f"[0, {layout.codebook_size})")
        # Orpheus tokenizes the text with its special tokens (BOS after
        # start-of-human); tokenizers that add none are unaffected.
        text_tokens = self.tokenizer.encode(text)
        prompt = layout.prompt(text_tokens, codes,
                               self.tokenizer.encode(audio_prompt_transcription, add_special_tokens=False))
        frames = math.ceil(max_audio_seconds * self.audio.decoder_sample_rate / self.audio.samples_per_frame)
        base = params or DEFAULT_SPEECH_SAMPLING
        self._check_token_ids(base)
        wanted = frames * CODES_PER_FRAME if base.max_new_tokens is None else \
            base.max_new_tokens // CODES_PER_FRAME * CODES_PER_FRAME
        room = (self.max_model_len - len(prompt)) // CODES_PER_FRAME * CODES_PER_FRAME
        if room < CODES_PER_FRAME:
            # Name the voice prompt when the text alone would have fitted.
            alone = len(layout.prompt(text_tokens))
            field = "audio_prompt_tokens" if codes is not None and alone + CODES_PER_FRAME <= self.max_model_len \
                else "input"
            raise InvalidRequest(field, "the prompt is too long for the speech model's context")
        params = dataclasses.replace(base, max_new_tokens=max(CODES_PER_FRAME, min(wanted, room)),
                                     stop_token_ids=(*base.stop_token_ids, layout.end_of_speech),
                                     ignore_eos=True, logprobs=None, prompt_logprobs=None)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        kwargs: dict[str, Any] = {"request_id": request_id} if request_id else {}
        assert params.max_new_tokens is not None
        return TTSContext(tokens=np.asarray(prompt), max_length=len(prompt) + params.max_new_tokens,
                          sampling_params=params, eos_token_ids=self.eos_token_ids, seed=seed,
                          layout=layout, chunk_frames=chunk_frames, **kwargs)

    def add_request(self, ctx: TextContext) -> None:
        if ctx.request_id in self._streams:
            raise InvalidRequest("request_id", f"request {ctx.request_id} is already running")
        self._streams[ctx.request_id] = OutputStream(ctx, self.tokenizer)
        self.scheduler.add(ctx)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its pages are freed now, its final output comes next step."""
        ctx = self.scheduler.find(request_id)
        if ctx is None:
            return False
        ctx.finish(GenerationStatus.CANCELLED)
        self.scheduler.abort(ctx)
        return True

    def close(self) -> None:
        """Stop background helpers (the device thread, the grammar compiler's worker)."""
        if self._owns_executor:
            self.executor.close()
        self.structured.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.dropped) or self._inflight is not None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # -- stepping -------------------------------------------------------------
    def _decode_audio(self, touched: Sequence[TextContext]) -> dict[str, np.ndarray]:
        """New audio of the speech requests in `touched` (all of it for finished ones).

        Requests are decoded together; if that fails, one by one, and a request
        whose audio cannot be decoded ends with an error.
        """
        speech = [c for c in touched if isinstance(c, TTSContext) and c.status is not GenerationStatus.CANCELLED
                  and c.request_id in self._streams]
        if not speech or self.audio is None:
            return {}
        audio = self.audio
        try:
            return self.executor.call(lambda: audio.drain(speech))
        except Exception:  # noqa: BLE001 - find the request at fault
            out: dict[str, np.ndarray] = {}
            for ctx in speech:
                try:
                    out.update(self.executor.call(lambda c=ctx: audio.drain([c])))  # type: ignore[misc]
                except Exception:  # noqa: BLE001
                    log.exception("request %s: decoding its audio failed", ctx.request_id)
                    ctx.fail("internal error while decoding audio; see the server log")
            return out

    def _launch(self, sched: SchedulerOutput) -> StepHandle | None:
        try:
            return self.pipeline.launch(sched.contexts, sched.num_steps)
        except Exception as exc:  # noqa: BLE001 - see _step_failed
            self._step_failed(sched.contexts, exc)
            return None

    def _process(self, handle: StepHandle, next_step: StepHandle | None = None) -> bool:
        """Process a launched step; False if it failed (see _step_failed).

        `next_step` was launched on top of `handle` (overlap): when `handle`
        failed it is discarded too, its requests recomputed.
        """
        try:
            self.pipeline.process(handle)
        except Exception as exc:  # noqa: BLE001
            innocent: list[TextContext] = []
            if next_step is not None:
                self.pipeline.fill_grammar(next_step)  # its job may wait for the mask
                assert next_step.job is not None
                next_step.job.exception()  # wait for it; its result is dropped
                self._inflight = None
                innocent = next_step.contexts
            self._step_failed(handle.contexts, exc, innocent)
            return False
        self._failed_steps = 0
        return True

    def _step_failed(self, contexts: Sequence[TextContext], exc: BaseException,
                     innocent: Sequence[TextContext] = ()) -> None:
        """A step failed as a whole: find the request at fault without failing the rest.

        A step of one request fails that request. Otherwise every request in it
        becomes a *suspect*: all are recomputed from scratch (as after a
        preemption), and the scheduler runs each suspect alone until a step of
        its own succeeds; the one that breaks its step alone is the one that
        fails. Requests of a later step launched on top of the failed one are
        recomputed too. Steps that keep failing whatever runs in them mean the
        engine itself is broken: after MAX_FAILED_STEPS in a row it gives up.
        """
        self._failed_steps += 1
        culprit = contexts[0] if len(contexts) == 1 else None
        log.error("a step of %d request(s) failed (%s); %s", len(contexts), type(exc).__name__,
                  f"ending request {culprit.request_id}" if culprit is not None
                  else "running each of them alone to find the one at fault", exc_info=exc)
        if self._failed_steps > MAX_FAILED_STEPS:
            raise EngineBroken(f"{self._failed_steps} steps in a row failed") from exc
        for ctx in dict.fromkeys([*contexts, *innocent]):
            if ctx.is_done:
                continue  # ended meanwhile; removed at the end of this step
            if ctx is culprit:
                ctx.fail("internal error while running this request; see the server log")
                self.scheduler.abort(ctx)
            else:
                self.scheduler.requeue(ctx)
                ctx.suspect = ctx.suspect or any(ctx is c for c in contexts)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return what each request produced.

        With overlap on, this launches step N+1 and then processes step N while
        N+1 computes, so outputs trail the launches by one step.
        """
        sched = self.scheduler.schedule()
        handle = self._launch(sched) if sched is not None else None
        touched: list[TextContext] = []
        if not self.pipeline.overlap:
            if handle is not None:
                self.pipeline.fill_grammar(handle)
                if self._process(handle):
                    touched = handle.contexts
        else:
            previous, self._inflight = self._inflight, handle
            try:
                if previous is not None and self._process(previous, next_step=handle):
                    touched = previous.contexts
            finally:
                if handle is not None and self._inflight is handle:
                    # Matchers have now seen step N's tokens: release N+1's sampling.
                    self.pipeline.fill_grammar(handle)
        # Requests that ended outside a step (aborted, failed, or could never fit).
        touched = touched + self.scheduler.take_dropped()
        audio = self._decode_audio(touched)
        outputs = []
        for ctx in touched:
            stream = self._streams.get(ctx.request_id)
            if stream is None:
                continue
            delta = self._delta(stream)
            if ctx.request_id in audio:
                delta.audio = audio[ctx.request_id]
            if delta.finished:
                del self._streams[ctx.request_id]
            if delta.token_ids or delta.text or delta.finished or delta.prompt_logprobs \
                    or delta.audio is not None:
                outputs.append(delta)
        self.scheduler.remove_finished()
        return outputs

    def _delta(self, stream: OutputStream) -> RequestOutput:
        """The request's new output; a final error output if it cannot be built."""
        ctx = stream.ctx
        try:
            delta = stream.delta()
        except Exception:  # noqa: BLE001 - this request's fault; the others go on
            log.exception("request %s: decoding its output failed", ctx.request_id)
            ctx.fail("internal error while decoding the output; see the server log")
            ctx.drop_futures()
            self.scheduler.remove(ctx)
            return RequestOutput(ctx.request_id, finished=True, status=ctx.status, error=ctx.error,
                                 error_cause=ctx.error_cause, prompt_tokens=ctx.prompt_len)
        if ctx.error:
            delta.error = ctx.error
            delta.error_cause = ctx.error_cause
        return delta
