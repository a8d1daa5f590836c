"""The grammar mask applied to CPU logits: the CPU extension's kernel against
xgrammar's CPU kernel (what the grammar package calls, and what the engine
used before), per step.

A step masks its constrained rows' logits in place before sampling, on the
device thread, in the step's critical path. Bitmasks are made in the shapes
JSON-schema masks have, word by word (32 tokens a word): "json", a structural
position (nearly every word 0, a few mixed); "string", inside a string value
(nearly every word -1, a few mixed); "random", every word mixed (a worst case
for the word-by-word kernel). Prints milliseconds a call, best of `--repeat`
rounds of `--iters` calls, one thread (as the device thread's call runs).
With `--device cuda`: the grammar package's tensor ops against our Triton
kernel, timed with CUDA events (bench/gpu.py reports it too).

    python bench/mask_apply.py [--batch 64] [--vocab 8192,32000,128256] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


KINDS = ("json", "string", "random")


def bitmask(kind: str, batch: int, vocab: int, seed: int = 0):  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    mixed = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
    if kind == "random":
        return mixed
    base = torch.zeros if kind == "json" else torch.ones
    out = -base(batch, words, dtype=torch.int32) if kind == "string" else base(batch, words, dtype=torch.int32)
    few = torch.rand(batch, words, generator=gen) < 0.02
    out[few] = mixed[few]
    return out


def best_ms(fn, iters: int, repeat: int, device):  # type: ignore[no-untyped-def]
    """Milliseconds a call of `fn`, the best of `repeat` rounds of `iters` calls
    (on CUDA timed with events: the kernels' time, launches queued back to back)."""
    import torch

    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter() - t) / iters)
    return best * 1e3


def compare(device, batch: int, vocab: int, kinds=KINDS, iters: int = 20, repeat: int = 5) -> list[dict]:  # type: ignore[no-untyped-def]
    """Per kind of mask, the milliseconds a call of the path the engine took
    before ("before": xgrammar's CPU kernel on a CPU, the grammar package's
    tensor ops on CUDA) and of the one it takes now (`mask_applier`), after
    checking the two agree. Bitmask and rows are on the device already: the
    copies the engine makes first are the same for both."""
    import torch

    from engine import step_masks
    from grammar import apply_token_bitmask_inplace

    before = apply_token_bitmask_inplace if device.type == "cpu" else step_masks._apply_anywhere
    now = step_masks.mask_applier(device, triton=device.type == "cuda")
    rows = torch.arange(batch, device=device)
    logits = torch.randn(batch, vocab, device=device)
    out = []
    for kind in kinds:
        mask = bitmask(kind, batch, vocab).to(device)
        a, b = logits.clone(), logits.clone()
        before(a, mask, rows)
        now(b, mask, rows)
        assert torch.equal(a, b), (vocab, kind)
        out.append({"vocab": vocab, "mask": kind,
                    "before_ms": best_ms(lambda: before(a, mask, rows), iters, repeat, device),  # noqa: B023
                    "now_ms": best_ms(lambda: now(b, mask, rows), iters, repeat, device)})  # noqa: B023
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", default="8192,32000,128256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the tensor ops against the Triton kernel")
    args = p.parse_args()

    import torch

    from engine.kernels import cpu_ops

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
        if cpu_ops() is None:
            print("the CPU extension did not build: nothing to compare")
            return 1
    names = ("xgrammar", "ours") if device.type == "cpu" else ("tensor ops", "triton")
    print(f"batch {args.batch} on {device}, ms a call (best of {args.repeat} x {args.iters})"
          + (", one thread" if device.type == "cpu" else ""))
    print(f"{'vocab':>7} {'mask':>7} {names[0]:>10} {names[1]:>7} {'speed-up':>8}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for row in compare(device, args.batch, vocab, iters=args.iters, repeat=args.repeat):
            print(f"{vocab:>7} {row['mask']:>7} {row['before_ms']:>10.3f} {row['now_ms']:>7.3f} "
                  f"{row['before_ms'] / row['now_ms']:>7.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
