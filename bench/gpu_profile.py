"""Where a decode step's GPU time goes: kernels per step and their time, by name.

On a CUDA machine, for a checkpoint (default: bench/gpu.py's 1.1B shape,
written if missing), runs eager decode steps of a batch under
`torch.profiler` and prints every kernel with its calls per step, its GPU
time per step and its share, the kernel count per step and the sum of their
times. A graph replay runs the same kernels back to back; so this says which
ones to fuse or speed up when a graph's time is far from the bandwidth bound.

    python bench/gpu_profile.py [--model 1.1b|8b|DIR] [--batch 1] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.1b", help="a bench/gpu.py shape (1.1b, 8b) or a checkpoint directory")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        print("bench/gpu_profile.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from bench.gpu import SHAPES, default_out_dir, make_prompts, write_checkpoint
    from engine import LLM, SamplingParams

    model_dir = Path(args.model) if args.model not in SHAPES else write_checkpoint(SHAPES[args.model],
                                                                                  default_out_dir())
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", cuda_graphs="off", overlap=False,
              max_num_seqs=max(args.batch, 1), kv_cache_gib=2.0)
    prompts = make_prompts(args.batch, args.prompt_len, 0)
    params = SamplingParams(temperature=0.0, max_new_tokens=4 + args.steps, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: kernels compiled and tuned
    params = SamplingParams(temperature=0.0, max_new_tokens=1 + args.steps, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)  # a prefill, then `steps` decode steps
    llm.close()
    # Kernels of the prefill step are counted too; with a short prompt they are
    # one step's worth against `steps` decode steps.
    calls: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type.name != "CUDA" or event.device_time_total <= 0:
            continue
        calls[event.key] += event.count
        micros[event.key] += event.device_time_total
    steps = args.steps + 1
    total = sum(micros.values())
    print(f"{model_dir.name}, batch {args.batch}: {sum(calls.values()) / steps:.0f} kernels and "
          f"{total / steps / 1000:.3f} ms of GPU time per step (mean over {steps} steps, the prefill included)")
    print(f"{'kernel':<90} {'calls/step':>10} {'us/step':>9} {'share':>6}")
    for name in sorted(micros, key=micros.get, reverse=True)[:args.top]:  # type: ignore[arg-type]
        print(f"{name[:90]:<90} {calls[name] / steps:>10.1f} {micros[name] / steps:>9.1f} "
              f"{100 * micros[name] / total:>5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
