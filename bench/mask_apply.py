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

    python bench/mask_apply.py [--batch 64] [--vocab 8192,32000,128256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def best_ms(fn, iters: int, repeat: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", default="8192,32000,128256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    import torch

    from engine.kernels import cpu_ops
    from engine.step_masks import mask_applier
    from grammar import apply_token_bitmask_inplace

    torch.set_num_threads(1)
    if cpu_ops() is None:
        print("the CPU extension did not build: nothing to compare")
        return 1
    ours = mask_applier(torch.device("cpu"))
    rows = list(range(args.batch))
    print(f"batch {args.batch}, ms a call (best of {args.repeat} x {args.iters}), one thread")
    print(f"{'vocab':>7} {'mask':>7} {'xgrammar':>9} {'ours':>7} {'speed-up':>8}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        logits = torch.randn(args.batch, vocab)
        for kind in ("json", "string", "random"):
            mask = bitmask(kind, args.batch, vocab)
            a, b = logits.clone(), logits.clone()
            apply_token_bitmask_inplace(a, mask, rows)
            ours(b, mask, rows)
            assert torch.equal(a, b), (vocab, kind)
            theirs_ms = best_ms(lambda: apply_token_bitmask_inplace(a, mask, rows), args.iters, args.repeat)  # noqa: B023
            ours_ms = best_ms(lambda: ours(b, mask, rows), args.iters, args.repeat)  # noqa: B023
            print(f"{vocab:>7} {kind:>7} {theirs_ms:>9.3f} {ours_ms:>7.3f} {theirs_ms / ours_ms:>7.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
