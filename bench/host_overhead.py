"""Host work per decode step: CPU time of the engine thread alone.

With overlap off, the thread that calls `LLM.generate` runs scheduling, step
inputs and postprocess, while the model runs on the device thread; its CPU time
(`time.thread_time()`) is the engine's host overhead, and it drifts less with a
busy machine than wall time does. `tiny-llama` keeps the forward pass nearly
free. Reported, best of --repeat runs: milliseconds of engine-thread CPU per
step at each batch size (greedy, seeded sampling, the same with repetition and
frequency penalties, the same with a logit_bias of BIASED token ids on every
row, and a regex constraint), and
microseconds per generated token at batch 16 (the figure kept since issue 5).

The CUDA path's goal (issue 25): at most 1 ms per decode step at batch 1 and
3 ms at batch 64, so that with overlap the GPU waits on the host for less than
10 % of a step.

    python bench/host_overhead.py
    python bench/host_overhead.py --batches 1,16,64 --new-tokens 200 --repeat 7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

# The repository first on sys.path, so the script runs from a checkout without
# an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REGEX = r"([a-f]{2,6}-[0-9]{2} ){1,60}"
BIASED = 4096  # token ids each row of the "bias" kind biases (a client banning a word list)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()

    from engine import LLM, SamplingParams
    from engine.presets import ensure_preset
    from grammar import GrammarSpec

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(ensure_preset("tiny-llama"), kv_cache_gib=0.25, overlap=False, max_num_seqs=max(batches))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 8000, size=args.prompt_len).tolist() for _ in range(max(batches))]
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
    kinds = (("greedy", None, 0.0), ("sampled", None, 0.8), ("penalties", None, 0.8), ("bias", None, 0.8),
             ("regex", GrammarSpec.regex(REGEX), 0.8))
    bias = {int(t): -5.0 for t in rng.choice(8000, size=BIASED, replace=False)}
    result: dict[str, float] = {}
    for batch in batches:
        for name, spec, temperature in kinds:
            penalised = name == "penalties"
            params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=args.new_tokens,
                                    ignore_eos=spec is None, repetition_penalty=1.1 if penalised else 1.0,
                                    frequency_penalty=0.2 if penalised else 0.0,
                                    logit_bias=bias if name == "bias" else {})
            best_step = best_token = float("inf")
            for _ in range(args.repeat):
                passes = llm.engine.pipeline.forward_passes
                start = time.thread_time()
                outs = llm.generate(prompts[:batch], params, constraint=spec)
                spent = time.thread_time() - start
                best_step = min(best_step, spent / (llm.engine.pipeline.forward_passes - passes))
                best_token = min(best_token, spent / sum(len(o.token_ids) for o in outs))
            result[f"b{batch}_{name}_ms_per_step"] = round(1e3 * best_step, 3)
            if batch == 16 and name in ("sampled", "regex"):
                result[f"{'free' if name == 'sampled' else name}_us_per_token"] = round(1e6 * best_token, 1)
    llm.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
