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
target: no slower per request than without a schema).

    python bench/schema_emulated.py
    python bench/schema_emulated.py --batch 16 --device-ms 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device-ms", type=float, default=3.0)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--preset", default="tiny-llama")
    args = p.parse_args()

    from bench.gpu import BENCH_SCHEMA
    from engine import LLM, SamplingParams
    from engine.models.llama import LlamaFamilyModel
    from engine.presets import ensure_preset
    from grammar import GrammarSpec

    delay = args.device_ms / 1000
    forward = LlamaFamilyModel.forward

    def emulated(self, *a, **k):  # type: ignore[no-untyped-def]
        out = forward(self, *a, **k)
        time.sleep(delay)  # the device's share of the step: no CPU, no GIL
        return out

    LlamaFamilyModel.forward = emulated  # type: ignore[method-assign]
    llm = LLM(ensure_preset(args.preset), kv_cache_gib=0.25, max_num_seqs=args.batch, cuda_graphs="emulate")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 8000, size=32).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    schema = GrammarSpec.json_schema(json.dumps(BENCH_SCHEMA))
    llm.generate(prompts[:4], params, constraint=schema)  # warm-up, the schema compiled
    best: dict[str, float] = {}
    try:
        for _ in range(args.repeat):
            for name, constraint in (("none", None), ("schema", schema)):
                passes = llm.engine.pipeline.forward_passes
                start = time.perf_counter()
                llm.generate(prompts, params, constraint=constraint)
                per_step = (time.perf_counter() - start) / (llm.engine.pipeline.forward_passes - passes)
                best[name] = min(best.get(name, float("inf")), 1e3 * per_step)
    finally:
        llm.close()
    print(f"batch {args.batch}, device {args.device_ms} ms a step: {best['none']:.2f} ms a step without a "
          f"constraint, {best['schema']:.2f} ms with the JSON schema ({best['schema'] / best['none']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
