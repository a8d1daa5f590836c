"""The text generation pipeline (MAX's TokenGenerator): one step, in three phases.

`next_token(batch, num_steps)` runs a step to its end: inputs (step_inputs.py,
engine thread), run (step_run.py, device thread), postprocess (postprocess.py,
engine thread). `release(context)` frees what the pipeline holds for a
request. An overlap scheduler uses the phases separately: `launch` builds the
inputs and submits the device job (the forward pass, and the sampling unless
a grammar mask must come first), `fill_grammar` fills the step's grammar mask
once the matchers are up to date and submits its sampling job, and `finish`
waits for the step and postprocesses. `finish` is `advance` (wait, then move
each request on by its tokens: stop rules, grammar) and `report` (detokenize,
build outputs); the engine (engine.py) orders the phases of consecutive steps
so that the host work of one step hides behind the forward pass of the next.
With overlap off the same code runs in order, so outputs are identical either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial

from .attention import AttentionBackend
from .context import TextContext
from .executor import StepExecutor
from .graphs import DecodeGraphs
from .kv_cache import KVCacheManager
from .output import RequestOutput
from .postprocess import Postprocessor
from .staging import Staging
from .step_inputs import advance_with_placeholders, build_step_inputs
from .step_masks import StepMasks
from .step_run import Forwarded, LaunchedStep, StepModel, StepResult, run_step, sample_step
from .token_buffer import TokenBuffer

Batch = Mapping[str, TextContext] | Sequence[TextContext]


class TextGenerationPipeline:
    """Runs scheduled steps of a Llama-family model over the paged KV cache."""

    def __init__(self, model: StepModel, attention: AttentionBackend, kv: KVCacheManager, buffer: TokenBuffer,
                 executor: StepExecutor, masks: StepMasks, postprocessor: Postprocessor,
                 vocab_size: int, overlap: bool = False, graphs: DecodeGraphs | None = None):
        self.model = model
        self.attention = attention
        # Decode steps replay these graphs when set (graphs.py).
        self.graphs = graphs
        self.staging = Staging(buffer.tokens.device)
        self.kv = kv
        self.buffer = buffer
        self.executor = executor
        self.masks = masks
        self.postprocessor = postprocessor
        self.vocab_size = vocab_size
        self.overlap = overlap
        self.forward_passes = 0

    # -- TokenGenerator ---------------------------------------------------------------
    def next_token(self, batch: Batch, num_steps: int = 1) -> dict[str, RequestOutput]:
        """Run one step over `batch` (contexts with next_tokens set); each request's output."""
        step = self.launch(batch, num_steps)
        self.fill_grammar(step)
        return {out.request_id: out for out in self.finish(step)}

    def release(self, ctx: TextContext) -> None:
        """Free what the pipeline holds for `ctx`: its KV pages and token-buffer row."""
        self.kv.release(ctx)
        self.buffer.free(ctx)

    # -- the phases ---------------------------------------------------------------------
    def launch(self, batch: Batch, num_steps: int = 1) -> LaunchedStep:
        """Build the step's inputs, advance its contexts with placeholders, submit the run.

        A failure building the inputs is the step's failure, handled by `finish`.
        """
        return self.submit(self.prepare(batch, num_steps))

    def prepare(self, batch: Batch, num_steps: int = 1) -> LaunchedStep:
        """`launch`'s host half: build the step's inputs and advance its contexts
        with placeholders; nothing reaches the device thread until `submit`."""
        contexts = tuple(batch.values()) if isinstance(batch, Mapping) else tuple(batch)
        epochs = tuple(c.sched.epoch for c in contexts)
        try:
            inputs = build_step_inputs(contexts, num_steps, self.kv, self.buffer, self.attention, self.vocab_size,
                                       self.staging, self.graphs)
            advance_with_placeholders(contexts, inputs)
        except Exception as exc:  # noqa: BLE001 - see Postprocessor.step_failed
            failed: Future[StepResult | Forwarded] = Future()
            failed.set_exception(exc)
            return LaunchedStep(contexts, epochs, None, failed)
        return LaunchedStep(contexts, epochs, inputs, None)

    def submit(self, step: LaunchedStep) -> LaunchedStep:
        """Queue a prepared step's run on the device thread (once: a no-op after)."""
        if step.job is None:
            assert step.inputs is not None
            step.job = self.executor.submit(partial(run_step, step.inputs, self.model, self.attention,
                                                    self.buffer.tokens, self.graphs))
        return step

    def fill_grammar(self, step: LaunchedStep, meanwhile: Callable[[], object] | None = None) -> None:
        """Fill the step's grammar mask and submit its sampling (a no-op for a
        step without one, or filled already); `meanwhile` runs on this thread
        once, beside the fill where it can (`StepMasks.fill`), else after it.

        Call when every matcher has consumed the tokens before its sample
        position: right after `launch` when no step is in flight before it,
        after finishing the previous step otherwise.
        """
        inputs = step.inputs
        if not step.awaits_mask:
            if meanwhile is not None:
                meanwhile()
            return
        assert inputs is not None and inputs.grammar is not None
        assert step.job is not None, "a step's sampling is queued after its forward pass"
        live = [step.contexts[row] if step.live(row) else None for row in inputs.sampled]
        try:
            self.masks.fill(inputs.grammar, live, meanwhile)
        finally:  # the mask is set even if the fill failed (StepMasks.fill): never leave the step hanging
            step.sampling = self.executor.submit(partial(sample_step, step.job, inputs.grammar, self.masks.apply))

    def finish(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for the step's run and postprocess it."""
        return self.report(self.advance(step))

    def advance(self, step: LaunchedStep) -> list[TextContext]:
        """Wait for the step's run and move its requests on by what it sampled,
        giving back the pages and token-buffer rows of those that finished (so
        a step scheduled before their outputs are built can use them); the
        requests to `report` on."""
        try:
            result = step.result()
        except Exception as exc:  # noqa: BLE001 - the step failed as a whole
            self.postprocessor.step_failed(step, exc)
            return []
        self.forward_passes += result.forward_passes
        touched = self.postprocessor.step_done(step, result)
        self.postprocessor.release_finished(touched)
        return touched

    def report(self, touched: Sequence[TextContext]) -> list[RequestOutput]:
        """The outputs of requests a step moved on (detokenized; stop strings end them here)."""
        return self.postprocessor.outputs(touched)
