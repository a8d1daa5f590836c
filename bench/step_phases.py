"""Where an engine's decode step goes, phase by phase, for benchmarks.

`StepPhases(llm)` times, while it is open (a context manager), what the
engine thread does each step (schedule; launch: build the inputs and submit
the device job, the build beside the mask's fill with overlap on; advance: wait for the previous step's tokens, then move its
requests on; fill: the grammar mask; report: detokenize and build outputs)
and how long the device thread waits for each grammar mask before sampling
(from the end of a constrained step's forward job to the start of its
sampling job, which the engine thread submits once the mask is filled).
With overlap on, that fill follows the previous step's tokens, so
"advance (work)" + "fill" is on the device's path; the engine thread's total
(every phase but the waits) must stay under the device's step time.

It wraps the pipeline's phase methods on the instance and, while open, a
class method (`SamplerOutput.host`) and the pipeline module's two device
jobs (`run_step`, `sample_step`, see `MaskGaps`): benchmarks only.

    with StepPhases(llm) as phases:
        llm.generate(...)
    print(phases.summary())
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any


class MaskGaps:
    """While open, the seconds (`seconds`) the device thread spends between a
    constrained step's forward job and its sampling job, which the engine
    thread submits once it has filled the step's grammar mask: grammar work
    the forward pass did not hide. Wraps the pipeline module's two device jobs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._undo: tuple[Any, Any] | None = None

    def __enter__(self) -> MaskGaps:
        import engine.pipeline as module

        self.seconds = 0.0

        run_step, sample_step = module.run_step, module.sample_step
        forwarded: dict[int, float] = {}  # id of the step's PendingMask -> end of its forward job

        @functools.wraps(run_step)
        def timed_run(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return run_step(inputs, *args, **kwargs)
            finally:
                if inputs.grammar is not None:
                    forwarded[id(inputs.grammar)] = time.perf_counter()

        @functools.wraps(sample_step)
        def timed_sample(forward: Any, grammar: Any, *args: Any, **kwargs: Any) -> Any:
            done = forwarded.pop(id(grammar), None)
            if done is not None:
                self.seconds += time.perf_counter() - done
            return sample_step(forward, grammar, *args, **kwargs)

        self._undo = (run_step, sample_step)
        module.run_step, module.sample_step = timed_run, timed_sample
        return self

    def __exit__(self, *exc: object) -> None:
        import engine.pipeline as module

        if self._undo is not None:
            module.run_step, module.sample_step = self._undo
            self._undo = None


class StepPhases:
    """Per-step means (milliseconds) of the engine's phases while open."""

    def __init__(self, llm: Any):
        self._llm = llm
        self._seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._steps0 = 0
        self.steps = 0
        self._undo: list[tuple[Any, str, Any, bool]] = []
        self._gaps = MaskGaps()

    # -- installing ----------------------------------------------------------
    def _wrap(self, owner: Any, name: str, key: str, on_class: bool = False, less: tuple[str, ...] = ()) -> None:
        """Time `owner.name` into `key`, less what phases `less` counted during it."""
        real = getattr(owner, name)
        seconds = self._seconds

        @functools.wraps(real)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, inner = time.perf_counter(), sum(seconds[k] for k in less)
            try:
                return real(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start - (sum(seconds[k] for k in less) - inner)

        self._undo.append((owner, name, real, on_class))
        setattr(owner, name, timed)

    def __enter__(self) -> StepPhases:
        from engine.sampler import SamplerOutput

        eng = self._llm.engine
        pipe = eng.pipeline
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(pipe, "prepare", "launch")
        self._wrap(pipe, "submit", "launch")
        self._wrap(pipe, "advance", "advance")
        self._wrap(eng.postprocessor, "step_done", "step_done")
        # The next step is scheduled and built inside the fill (beside the
        # library's work where it can be): counted there, not twice.
        self._wrap(pipe, "fill_grammar", "fill", less=("schedule", "launch"))
        self._wrap(pipe, "report", "report")
        self._wrap(SamplerOutput, "host", "tokens_wait", on_class=True)
        self._gaps.__enter__()
        self._steps0 = pipe.forward_passes
        return self

    def __exit__(self, *exc: object) -> None:
        self.steps = self._llm.engine.pipeline.forward_passes - self._steps0
        self._gaps.__exit__()
        self._seconds["mask_wait"] = self._gaps.seconds
        for owner, name, real, on_class in reversed(self._undo):
            if on_class:
                setattr(owner, name, real)
            else:
                delattr(owner, name)  # the instance's wrapper goes; the class's method shows again
        self._undo.clear()

    # -- reading -------------------------------------------------------------
    def per_step_ms(self) -> dict[str, float]:
        """Each phase's milliseconds a step (forward passes), after the block closed."""
        s, steps = self._seconds, max(self.steps, 1)
        # advance = waiting for the job + step_done; step_done reads the tokens (waiting for their copy).
        waiting = s["advance"] - s["step_done"] + s["tokens_wait"]
        phases = {
            "schedule": s["schedule"], "launch": s["launch"], "advance (waiting)": waiting,
            "advance (work)": s["advance"] - waiting, "fill": s["fill"], "report": s["report"],
            "device waits for the mask": s["mask_wait"],
        }
        phases["engine thread busy"] = sum(v for k, v in phases.items() if k in _ENGINE_WORK)
        return {k: 1e3 * v / steps for k, v in phases.items()}

    def summary(self) -> str:
        """One line: each phase's ms a step."""
        return ", ".join(f"{k} {v:.2f}" for k, v in self.per_step_ms().items()) + f" (ms a step, {self.steps} steps)"


_ENGINE_WORK = ("schedule", "launch", "advance (work)", "fill", "report")
