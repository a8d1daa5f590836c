"""The engine core: requests in, per-step output deltas out."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .attention import DenseDecodeAttention, HeadShape, choose_attention, make_attention
from .config import EngineConfig
from .context import GenerationStatus, TextContext
from .cpu_features import mask_threads_for, usable_cores
from .errors import InvalidRequest
from .executor import StepExecutor
from .graphs import DecodeGraphs, dense_graph_batch, graphs_mode
from .kernels import model_ops, triton_gemv, triton_ops
from .kv_cache import KVCacheManager, PageAllocator, page_tensor_shape, pages_for_budget
from .memory import empty_huge, kv_budget_gib
from .models.config import TEXT_CONFIGS, CheckpointError, load_model_config
from .models.llama import LlamaFamilyModel
from .models.moe import group_on_device
from .models.weights import WeightSource
from .output import RequestOutput
from .pipeline import TextGenerationPipeline
from .postprocess import Postprocessor
from .reasoning import ReasoningOptions, ReasoningParser
from .request_factory import RequestFactory
from .sampling_params import SamplingParams, model_defaults
from .scheduler import Scheduler, SchedulerConfig
from .speech import (
    AudioGenerator,
    SpeechCodec,
    SpeechLayout,
    SpeechModel,
    TTSContext,
)
from .staging import Staging
from .step_masks import StepMasks
from .step_run import LaunchedStep
from .structured import StructuredOutput
from .token_buffer import TokenBuffer
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from grammar import Matcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What one `EngineCore.step()` did, for the service's metrics: its wall
    time, the requests and tokens it scheduled, and how long filling its
    grammar bitmask took (None: no constrained row)."""

    seconds: float = 0.0
    batch_size: int = 0
    num_tokens: int = 0
    mask_seconds: float | None = None


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queues, KV cache and prefix-cache counters at one moment
    (read from any thread; each number is exact, together they may be a step
    apart)."""

    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    num_preemptions: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV pages referenced by requests (cached free pages count as free)."""
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


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
        if self.model_config.architecture in TEXT_CONFIGS:
            log.info("%s: serving its text model (text in, text out); its vision tower is not loaded",
                     self.model_config.architecture)
        self.tokenizer = Tokenizer(config.model)
        self.sampling_defaults, self.default_max_new_tokens = model_defaults(
            config.generation_config, self.model_config.sampling_defaults)
        if self.sampling_defaults or self.default_max_new_tokens:
            log.info("defaults from the checkpoint's generation_config.json: %s, max_new_tokens %s (a request's "
                     "own values win; --generation-config vllm ignores them)", self.sampling_defaults,
                     self.default_max_new_tokens)
        self._owns_executor = executor is None
        self.executor = executor or StepExecutor(config.torch_device)
        try:
            # Every tensor computation, loading included, happens on the device thread.
            self.executor.call(lambda: self._build(wrap_model))
        except BaseException:
            if self._owns_executor:
                self.executor.close()
            raise
        # Steps launched and not yet finished, oldest first (overlap; at most two between calls).
        self._in_flight: deque[LaunchedStep] = deque()
        self.last_step = StepStats()

    def _build(self, wrap_model: Callable[[Any], Any] | None) -> None:
        config, mc = self.config, self.model_config
        device, dtype = config.torch_device, config.torch_dtype
        source = WeightSource(config.model)
        self.attention_choice = choose_attention(
            device, dtype, config.attention,
            shape=HeadShape(mc.num_heads, mc.num_kv_heads, mc.head_dim, config.page_size))
        # The model's pointwise kernels follow the attention's probe: Triton's where it runs.
        ops, self.ops_choice = model_ops(device, dtype, triton=self.attention_choice.name == "triton")
        model = LlamaFamilyModel(mc, source, device, dtype, ops, small_batch_gemm=config.cpu_small_batch_gemm,
                                 max_positions=config.max_model_len)
        self.model = model
        source.close()
        # Batch-1 matrix-vector products: cuBLAS, or our Triton kernel per weight
        # shape where timing it here finds it faster (with the Triton pointwise kernels).
        self.gemv_choice = ""
        if device.type == "cuda":
            self.gemv_choice = triton_gemv.install(self.model.linears(), device, dtype) if ops is triton_ops \
                else "batch-1 GEMV: cuBLAS (no Triton kernels here)"
        # Experts grouped on the device where the Triton kernels run: no host
        # read a layer, so decode graphs can capture the model.
        self.experts_choice = ""
        if model.sparse_mlps():
            self.experts_choice = group_on_device(model.sparse_mlps(), device, dtype) if ops is triton_ops \
                else "experts: grouped on the host (no Triton kernels here); decode graphs off"
        if wrap_model is not None:
            self.model = wrap_model(self.model)

        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            # As vLLM: past the positions the model was trained for its output
            # is not to be trusted, and a silent cut hid what was asked for.
            raise ValueError(f"max_model_len={config.max_model_len} is longer than the model's context "
                             f"(max_position_embeddings={mc.max_position_embeddings})")
        max_len = config.max_model_len or mc.max_position_embeddings
        kv_gib = config.kv_cache_gib if config.gpu_memory_utilization is None else \
            kv_budget_gib(device, config.gpu_memory_utilization, config.max_num_batched_tokens,
                          config.max_num_seqs, mc.hidden_size, mc.intermediate_size, mc.vocab_size)
        num_pages = pages_for_budget(kv_gib, mc.num_layers, config.page_size,
                                     mc.num_kv_heads, mc.head_dim, dtype)
        if num_pages < 2:
            raise ValueError(f"kv_cache_gib={config.kv_cache_gib} holds fewer than 2 pages")
        if num_pages * config.page_size < max_len:
            held = num_pages * config.page_size
            if config.max_model_len is not None:
                # As vLLM: a context asked for and not there is refused at start-up,
                # not found out by the first request that needs it.
                budget = "kv_cache_gib" if config.gpu_memory_utilization is None else "gpu_memory_utilization"
                raise ValueError(f"max_model_len={config.max_model_len} is longer than the KV cache holds "
                                 f"({held} tokens); raise {budget} or lower max_model_len")
            log.warning("KV cache holds %d tokens; capping the context length from %d", held, max_len)
            max_len = held
        self.max_model_len = max_len
        model.keep_positions(max_len)
        graph_mode = graphs_mode(config.cuda_graphs, device, model.capturable)
        if not model.capturable and config.cuda_graphs != "off":
            log.info("decode graphs: off (the model's experts are grouped on the host each layer)")
        graph_batch = config.max_num_seqs
        if graph_mode is not None and not self.attention_choice.graph_capturable:
            graph_batch = dense_graph_batch(config.max_num_seqs, max_len)
            if graph_batch < config.max_num_seqs:
                log.info("decode graphs over dense attention up to batch %d only: it reads the whole %d-token "
                         "width every step (larger batches decode eagerly)", graph_batch, max_len)
            if graph_batch < 1:
                graph_mode = None
        # Decode graphs pad their batches with rows that write to a page no
        # request is ever given: one more page than the allocator hands out.
        shape = page_tensor_shape(num_pages + (graph_mode is not None), mc.num_layers, config.page_size,
                                  mc.num_kv_heads, mc.head_dim)
        # Zeroed on every device, so that the tests on CPU see what a GPU holds:
        # a kernel may read slots no request has written (the dense decode
        # fallback gathers whole pages), which must be finite. On CPU it also
        # moves the OS's page faults out of the first steps (200 ms of a 2.5 s
        # prefill of 16 x 128 tokens on the bench model; zeroing costs about
        # 0.25 s per GiB, once); on a GPU it is milliseconds.
        if device.type == "cpu":
            kv_blocks = empty_huge(shape, dtype).zero_()
        else:
            kv_blocks = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages, config.page_size, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(kv_blocks, self.allocator)
        softcap = mc.attn_logit_softcapping or 0.0
        self.attention = make_attention(self.attention_choice, kv_blocks, mc.num_heads, mc.head_dim, max_len,
                                        mc.sliding_windows, mc.attention_multiplier, softcap)
        self.graphs: DecodeGraphs | None = None
        if graph_mode is not None:
            graph_attention = self.attention if self.attention_choice.graph_capturable else \
                DenseDecodeAttention(mc.num_heads, mc.head_dim, Staging(device), mc.sliding_windows,
                                     mc.attention_multiplier, softcap)
            self.graphs = DecodeGraphs(self.model, graph_attention, kv_blocks, dummy_page=num_pages,
                                       max_batch=graph_batch, max_pages=-(-max_len // config.page_size),
                                       vocab_size=mc.vocab_size, capture=graph_mode == "capture")
        # The checkpoint's EOS ids and the tokenizer's, as vLLM stops on both (a
        # chat fine-tune may name its end-of-turn token only in the tokenizer).
        tokenizer_eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(mc.eos_token_ids) | ({tokenizer_eos} if tokenizer_eos is not None else set())
        # The reasoning parser's markers, resolved once (ValueError: not single tokens).
        self.reasoning: ReasoningParser | None = None
        if config.reasoning_parser is not None:
            try:
                self.reasoning = ReasoningParser.load(config.reasoning_parser, self.tokenizer.hf.get_vocab())
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        # The grammar compile service (any thread) and the per-step mask path
        # (engine and device threads) are separate owners.
        cores = usable_cores()
        mask_threads = config.grammar_mask_threads or mask_threads_for(cores, device.type)
        self.structured = StructuredOutput.for_engine(config, self.tokenizer.hf, mc.vocab_size,
                                                      self.eos_token_ids, mask_threads)
        # Where the pointwise kernels are Triton's, so is the mask's (after a probe of its own).
        self.masks = StepMasks(self.structured, mc.vocab_size, Staging(device), triton=ops is triton_ops)
        self.speech: SpeechModel | None = None
        if config.speech_codec:
            try:
                layout = SpeechLayout.for_model(config.model)
                layout.check_vocab(mc.vocab_size)
            except ValueError as e:
                raise CheckpointError(f"{config.model} is not a speech model: {e}") from None
            codec = SpeechCodec(config.speech_codec, device)
            if codec.codebook_size < layout.codebook_size:
                raise CheckpointError(f"codec {config.speech_codec} has {codec.codebook_size} codes a codebook; "
                                      f"the model writes {layout.codebook_size}")
            self.speech = SpeechModel(layout, AudioGenerator(codec))
        # What the event loop may call (checks, contexts): fixed facts only.
        self.requests = RequestFactory(self.tokenizer, mc.vocab_size, max_len, self.eos_token_ids, self.reasoning,
                                       config.max_thinking_tokens, self.speech)
        # One token-buffer row per request that can run at once.
        token_buffer = TokenBuffer(config.max_num_seqs, device)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_seq_len=max_len, num_steps=config.num_steps,
                            speculative_constrained=graph_mode is not None
                            if config.speculative_constrained is None else config.speculative_constrained,
                            decode_shaped=graph_mode is not None),
            self.kv_manager, token_buffer)
        self.postprocessor = Postprocessor(self.scheduler, self.kv_manager, self.tokenizer, self.executor, max_len,
                                           self.speech.audio if self.speech is not None else None)
        self.pipeline = TextGenerationPipeline(self.model, self.attention, self.kv_manager, token_buffer,
                                               self.executor, self.masks, self.postprocessor,
                                               mc.vocab_size, overlap=config.overlap, graphs=self.graphs)
        log.info("attention: %s (%s)", self.attention_choice.name, self.attention_choice.reason)
        log.info("pointwise kernels: %s", self.ops_choice)
        if self.gemv_choice:
            log.info("%s", self.gemv_choice)
        if self.experts_choice:
            log.info("%s", self.experts_choice)
        log.info("grammar masks: %d fill thread(s)%s", mask_threads,
                 "" if config.grammar_mask_threads else f" (chosen for {cores} usable cores, {device.type})")
        if self.graphs is not None:
            stats = self.graphs.capture_all()
            log.info("decode graphs (%s): %d buckets up to batch %d, %.2f s, %.1f MiB of device memory",
                     "captured" if graph_mode == "capture" else "emulated without capture", len(stats.buckets),
                     stats.buckets[-1], stats.seconds, stats.bytes / (1 << 20))
        log.info("engine ready: %s, %s %s, %d KV pages of %d tokens, attention=%s, decode graphs=%s, overlap=%s, "
                 "constrained requests scheduled %s", mc.architecture, device, dtype, num_pages, config.page_size,
                 self.attention.name, graph_mode or "off", config.overlap,
                 "ahead of their last token" if self.scheduler.config.speculative_constrained
                 else "once their last token is known")

    # -- requests -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # What any thread may call lives in `self.requests` (request_factory.py);
    # these two are shortcuts to it for offline callers (LLM, tests).
    def make_context(self, prompt: Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, matcher: Matcher | None = None,
                     resample: bool = True, reasoning: ReasoningOptions | None = None) -> TextContext:
        return self.requests.make_context(prompt, params, request_id, matcher, resample, reasoning)

    @property
    def serves_speech(self) -> bool:
        return self.speech is not None

    @property
    def audio(self) -> AudioGenerator | None:
        return self.speech.audio if self.speech is not None else None

    @property
    def speech_layout(self) -> SpeechLayout | None:
        return self.speech.layout if self.speech is not None else None

    def make_speech_context(self, text: str, params: SamplingParams | None = None,
                            request_id: str | None = None, **options: Any) -> TTSContext:
        return self.requests.make_speech_context(text, params, request_id, **options)

    def add_request(self, ctx: TextContext) -> None:
        if self.postprocessor.tracks(ctx.request_id):
            raise InvalidRequest("request_id", f"request {ctx.request_id} is already running")
        self.postprocessor.track(ctx)
        ctx.output.times.arrival = time.monotonic()
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
        self.masks.close()
        self.structured.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.dropped) or bool(self._in_flight)

    def load(self) -> EngineLoad:
        """Running and waiting requests and KV pages in use, without taking the
        engine thread (metrics read this at scrape time)."""
        sched = self.scheduler
        return EngineLoad(len(sched.running), len(sched.waiting), self.allocator.num_used,
                          self.allocator.num_pages, sched.prefix_cache_queries, sched.prefix_cache_hits,
                          sched.num_preemptions)

    # -- stepping -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return what each request produced.

        With overlap on, outputs trail the launches: see `_overlap_step`.
        """
        start = time.perf_counter()
        self.masks.last_mask_seconds = None
        if self.pipeline.overlap:
            outputs, num_contexts, num_tokens = self._overlap_step()
        else:
            sched = self.scheduler.schedule()
            contexts = sched.contexts if sched is not None else []
            num_contexts, num_tokens = len(contexts), sum(c.active_length for c in contexts)
            outputs = list(self.pipeline.next_token(contexts, sched.num_steps).values()) if sched else []
        # Requests that ended outside a step (aborted, failed alone, or could never fit).
        outputs += self.postprocessor.outputs(self.scheduler.take_dropped())
        self.last_step = StepStats(time.perf_counter() - start, num_contexts, num_tokens,
                                   self.masks.last_mask_seconds)
        # What the step did to the prefix cache, to its listeners (a router's index).
        self.allocator.flush_events()
        return outputs

    def _overlap_step(self) -> tuple[list[RequestOutput], int, int]:
        """One call of the overlap loop: finish step N, launch step N+2, report N.

        Between calls steps N and N+1 are in flight, N+1's mask filled once N
        was finished (its sampling queued behind its forward pass). A call:

        1. waits for N and moves its requests on (tokens, stop rules, grammar,
           forced tokens; finished requests give back their pages);
        2. fills N+1's grammar mask (N+1's sampling waits for it), and while
           the library fills it (off this thread where it releases the GIL)
           schedules N+2 and builds its inputs; queues N+1's sampling, then
           N+2's forward pass right behind it (its placeholders are N+1's
           tokens, read on the device);
        3. detokenizes N's tokens and builds its outputs, while N+1 and N+2 run.

        From N's tokens to N+1's sampling and N+2's forward pass is the path
        the device waits on, so only what must be is on it: the grammar's
        advance, its fill, and the schedule and build beside the fill, not
        after it. Reporting last keeps detokenizing off it. The scheduler sees
        N's stop rules but not its stop strings: a request a stop string ends
        may take one more step (and its pages), whose work is thrown away.
        `last_step`'s mask time is N+1's fill, its batch N+2's. Returns
        (outputs, contexts launched, their tokens).
        """
        pipeline, in_flight = self.pipeline, self._in_flight
        touched: list[TextContext] = []
        launched: list[tuple[int, int]] = []  # (contexts, tokens) of the step built, if any

        def build_next() -> None:
            sched = self.scheduler.schedule()
            if sched is not None:
                tokens = sum(c.active_length for c in sched.contexts)  # before the build moves the indices
                # Kept before it is queued: whatever fails from here, a step
                # whose placeholders its requests hold is queued and finished.
                in_flight.append(pipeline.prepare(sched.contexts, sched.num_steps))
                launched.append((len(sched.contexts), tokens))

        if len(in_flight) == 2:
            try:
                touched = pipeline.advance(in_flight.popleft())
            except BaseException:
                pipeline.fill_grammar(in_flight[0])  # N+1 must still sample
                raise
            try:
                pipeline.fill_grammar(in_flight[0], meanwhile=build_next)  # matchers have now seen N's tokens
            finally:
                for step in in_flight:
                    pipeline.submit(step)
        else:
            try:
                build_next()
            finally:
                for step in in_flight:
                    pipeline.submit(step)
            if in_flight:  # a step just built with nothing before it: its matchers are up to date
                pipeline.fill_grammar(in_flight[0])  # (filled already otherwise)
            if not launched and in_flight:  # nothing new to run: drain
                touched = pipeline.advance(in_flight.popleft())
        contexts, tokens = launched[0] if launched else (0, 0)
        return pipeline.report(touched), contexts, tokens

    def flush_prefix_cache(self) -> int:
        """Empty the prefix cache (pages running requests hold stay theirs,
        unshared: see `PageAllocator.clear_cache`); returns how many pages it
        held. Its listeners hear of it at once."""
        dropped = self.allocator.clear_cache()
        self.allocator.flush_events()
        return dropped
