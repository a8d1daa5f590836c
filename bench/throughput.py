"""Offline generation throughput: stencild vs transformers on the `bench` preset.

The bench preset is the reference model of this project's benchmarks (Llama architecture,
hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, vocab 8192, tied
embeddings, fp32, random weights), written by `engine.presets`. Each system and
batch size runs in its own subprocess so peak RSS is measured per system.

Throughput = generated tokens / wall time of the whole request batch (prefill
included), best of --repeat runs after a warm-up.

    python bench/throughput.py                      # batch 1 and 16, both systems
    python bench/throughput.py --batches 16 --systems stencild
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 8000, size=length).tolist() for _ in range(batch)]


def run_stencild(path: str, batch: int, args: argparse.Namespace) -> list[float]:
    from engine import LLM, SamplingParams

    llm = LLM(path, kv_cache_gib=args.kv_cache_gib, max_num_seqs=max(batch, 16),
              max_num_batched_tokens=args.max_num_batched_tokens, num_steps=args.num_steps)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts(batch, args.prompt_len, seed=99), SamplingParams(temperature=0.0, max_new_tokens=4))
    times = []
    for r in range(args.repeat):
        batch_prompts = prompts(batch, args.prompt_len, seed=r)
        start = time.perf_counter()
        out = llm.generate(batch_prompts, params)
        times.append(time.perf_counter() - start)
        assert all(len(o.token_ids) == args.new_tokens for o in out)
        # Fresh prompts every repeat, and no help from the prefix cache.
        llm.engine.allocator.clear_cache()
    return times


def run_transformers(path: str, batch: int, args: argparse.Namespace) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=4)
    with torch.inference_mode():
        warm = torch.tensor(prompts(batch, args.prompt_len, seed=99))
        model.generate(warm, attention_mask=torch.ones_like(warm), **{**gen, "max_new_tokens": 4,
                                                                      "min_new_tokens": 4})
        times = []
        for r in range(args.repeat):
            ids = torch.tensor(prompts(batch, args.prompt_len, seed=r))
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            times.append(time.perf_counter() - start)
            assert out.shape[1] == args.prompt_len + args.new_tokens
    return times


def worker(args: argparse.Namespace) -> None:
    run = run_stencild if args.worker == "stencild" else run_transformers
    times = run(args.model, args.batch, args)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "rss_mb": rss_mb}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--systems", nargs="+", default=["stencild", "transformers"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-steps", type=int, default=1)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bench preset)")
    p.add_argument("--worker", choices=["stencild", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.model is None:
        from engine.presets import ensure_preset

        args.model = str(ensure_preset("bench"))
    print(f"model {args.model}; {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, "
          f"ignore EOS; torch threads {os.cpu_count()} cpus")
    print("| system | batch | output tok/s | wall s | peak RSS MB |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        for system in args.systems:
            cmd = [sys.executable, __file__, "--worker", system, "--batch", str(batch), "--model", args.model,
                   "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                   "--repeat", str(args.repeat), "--kv-cache-gib", str(args.kv_cache_gib),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--num-steps", str(args.num_steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                print(f"| {system} | {batch} | failed: {res.stderr.strip().splitlines()[-1]} | | |")
                continue
            data = json.loads(res.stdout.strip().splitlines()[-1])
            best = min(data["times"])
            print(f"| {system} | {batch} | {batch * args.new_tokens / best:.1f} | {best:.2f} | "
                  f"{data['rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
