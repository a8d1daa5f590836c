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

    if not torch.cuda.is_available():
        print("bench/gpu_profile.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from bench.gpu import SHAPES, default_out_dir, write_checkpoint

    model_dir = Path(args.model) if args.model not in SHAPES else write_checkpoint(SHAPES[args.model],
                                                                                  default_out_dir())
    for line in kernel_table(model_dir, args.batch, args.prompt_len, args.steps, args.top):
        print(line)
    return 0


def kernel_table(model_dir: Path, batch: int, prompt_len: int, steps: int, top: int,
                 device: str = "cuda") -> list[str]:
    """Eager decode steps of `batch` rows under torch.profiler: a line of totals,
    then the `top` kernels by GPU time per step (on a CPU, for tests: ops by
    CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu import make_prompts
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, dtype="bfloat16", cuda_graphs="off", overlap=False,
              max_num_seqs=max(batch, 1), kv_cache_gib=2.0 if device == "cuda" else 0.05)
    prompts = make_prompts(batch, prompt_len, 0)
    params = SamplingParams(temperature=0.0, max_new_tokens=4 + steps, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: kernels compiled and tuned
    params = SamplingParams(temperature=0.0, max_new_tokens=1 + steps, ignore_eos=True)
    kind = "CUDA" if device == "cuda" else "CPU"
    with profile(activities=[getattr(ProfilerActivity, kind)]) as prof:
        llm.generate(prompts, params)  # a prefill, then `steps` decode steps
    llm.close()
    # Kernels of the prefill step are counted too; with a short prompt they are
    # one step's worth against `steps` decode steps.
    calls: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = event.device_time_total if kind == "CUDA" else event.self_cpu_time_total
        if event.device_type.name != kind or us <= 0:
            continue
        calls[event.key] += event.count
        micros[event.key] += us
    runs = steps + 1
    total = sum(micros.values())
    lines = [f"{model_dir.name}, batch {batch}: {sum(calls.values()) / runs:.0f} kernels and "
             f"{total / runs / 1000:.3f} ms of {'GPU' if kind == 'CUDA' else 'CPU'} time per step "
             f"(mean over {runs} steps, the prefill included)",
             f"{'kernel':<90} {'calls/step':>10} {'us/step':>9} {'share':>6}"]
    for name in sorted(micros, key=micros.__getitem__, reverse=True)[:top]:
        lines.append(f"{name[:90]:<90} {calls[name] / runs:>10.1f} {micros[name] / runs:>9.1f} "
                     f"{100 * micros[name] / total:>5.1f}%")
    return lines


if __name__ == "__main__":
    sys.exit(main())
