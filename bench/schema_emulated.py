"""What a JSON schema costs per decode step when the device, not the host, sets the pace.

With overlap on, a constrained step's sampling waits for its grammar mask,
which the engine thread fills once the matchers have seen the previous step's
tokens; everything the host does before that fill is on the device's path. On
a CPU the model's own compute hides this, so here each forward pass (the real
model, tiny-llama by default) is followed by `--device-ms` of sleep on the
device thread (no CPU, no GIL), as a GPU's share of a step would be. Decode
graphs are emulated (`cuda_graphs="emulate"`), so the scheduler shapes
constrained batches as it does on a GPU.

Reports, best of --repeat, wall milliseconds per step at batch B without a
constraint and with bench/gpu.py's JSON schema, and their ratio (the GPU
target: no slower per request than without a schema), and the CPU time per
step of the engine thread (the caller's, offline) and the device thread, and
the best run's steps phase by phase (bench/step_phases.py).
`--forward zeros` skips the model's compute too (the forward pass returns
zeros, as bench/serve_emulated.py's does): then every figure is host work
alone, as with a GPU fast enough that the host sets the pace.
`--device-model deadline` stops the sleeping: a forward pass only sets when
the device would be done, and reading the step's tokens waits for that, so the
device thread's own CPU work overlaps the device's time as on a GPU
(bench/device_emulation.py).

    python bench/schema_emulated.py
    python bench/schema_emulated.py --batch 16 --device-ms 3
    python bench/schema_emulated.py --forward zeros --device-ms 1
    python bench/schema_emulated.py --forward zeros --device-ms 2.5 --device-model deadline
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.device_emulation import FORWARDS, MODELS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device-ms", type=float, default=3.0)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--preset", default="tiny-llama")
    p.add_argument("--forward", choices=FORWARDS, default="real",
                   help="the model's forward pass, or zeros (host work alone)")
    p.add_argument("--mask-threads", type=int, default=None,
                   help="grammar mask fill threads (default: the engine's choice for this host)")
    p.add_argument("--device-model", choices=MODELS, default="sleep",
                   help="sleep: each forward pass sleeps on the device thread; deadline: it only sets "
                        "when its result is ready, and reading the step's tokens waits for that")
    args = p.parse_args()

    from bench.device_emulation import install
    from bench.gpu import BENCH_SCHEMA
    from bench.step_phases import StepPhases
    from engine import LLM, SamplingParams
    from engine.presets import ensure_preset
    from grammar import GrammarSpec
    from service.ops.metrics import thread_cpu_seconds

    install(args.device_ms, args.device_model, args.forward)
    llm = LLM(ensure_preset(args.preset), kv_cache_gib=0.25, max_num_seqs=args.batch, cuda_graphs="emulate",
              grammar_mask_threads=args.mask_threads)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 8000, size=32).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    schema = GrammarSpec.json_schema(json.dumps(BENCH_SCHEMA))
    llm.generate(prompts[:4], params, constraint=schema)  # warm-up, the schema compiled
    device = llm.engine.executor.thread

    def cpu() -> tuple[float, float]:
        return time.thread_time(), (thread_cpu_seconds(device) or 0.0) if device is not None else 0.0

    # Per figure: ms a step, engine / device CPU ms a step, steps, the run's phases (StepPhases).
    best: dict[str, tuple[float, float, float, int, StepPhases]] = {}
    try:
        for _ in range(args.repeat):
            for name, constraint in (("none", None), ("schema", schema)):
                (engine0, device0), start = cpu(), time.perf_counter()
                with StepPhases(llm) as timer:
                    llm.generate(prompts, params, constraint=constraint)
                wall, (engine1, device1) = time.perf_counter() - start, cpu()
                steps = timer.steps
                figures = (1e3 * wall / steps, 1e3 * (engine1 - engine0) / steps, 1e3 * (device1 - device0) / steps,
                           steps, timer)
                if name not in best or figures[0] < best[name][0]:
                    best[name] = figures
    finally:
        llm.close()
    none, with_schema = best["none"], best["schema"]
    print(f"batch {args.batch}, device {args.device_ms} ms a step ({args.device_model}), forward {args.forward}, "
          f"{llm.engine.structured.mask_threads} mask thread(s):")
    for name, (ms, engine_cpu, device_cpu, steps, timer) in best.items():
        print(f"  {name:6}: {ms:.2f} ms a step over {steps} steps; CPU ms a step: engine {engine_cpu:.2f}, "
              f"device {device_cpu:.2f}; mask fill {timer.per_step_ms()['fill']:.2f} ms a step")
    print(f"  schema / none: {with_schema[0] / none[0]:.2f}x a step, "
          f"{with_schema[0] * with_schema[3] / (none[0] * none[3]):.2f}x a request")
    for name, (*_, timer) in best.items():
        print(f"  {name} phases: {timer.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
