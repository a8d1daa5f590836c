"""Host work per generated token: CPU time of the engine thread alone.

With overlap off, the thread that calls `LLM.generate` runs scheduling, step
inputs and postprocess, while the model runs on the device thread; its CPU time
(`time.thread_time()`) is the engine's host overhead, and it drifts less with a
busy machine than wall time does. `tiny-llama` keeps the forward pass nearly
free. Reported: microseconds of engine-thread CPU per generated token, best of
--repeat runs, unconstrained and with a regex constraint.

    python bench/host_overhead.py
    python bench/host_overhead.py --requests 16 --new-tokens 200 --repeat 7
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()

    from engine import LLM, SamplingParams
    from engine.presets import ensure_preset
    from grammar import GrammarSpec

    llm = LLM(ensure_preset("tiny-llama"), kv_cache_gib=0.25, overlap=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 8000, size=args.prompt_len).tolist() for _ in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
    result = {}
    for name, spec in (("free", None), ("regex", GrammarSpec.regex(REGEX))):
        params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=args.new_tokens,
                                ignore_eos=spec is None)
        best = float("inf")
        for _ in range(args.repeat):
            start = time.thread_time()
            outs = llm.generate(prompts, params, constraint=spec)
            tokens = sum(len(o.token_ids) for o in outs)
            best = min(best, (time.thread_time() - start) / tokens)
        result[f"{name}_us_per_token"] = round(1e6 * best, 1)
    llm.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
