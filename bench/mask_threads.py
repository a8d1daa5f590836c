"""A step's batch mask fill against its thread count (`--grammar-mask-threads`).

64 requests of bench/gpu.py's JSON schema walk a document that fits it, each
a few tokens behind the last (so the rows are in different states, as a real
batch's are); at every position the whole batch's bitmask is filled at once,
as the engine does each step (`BitmaskFiller.fill`, through the compiler the
engine would build with that many threads: llguidance keeps a template copy
per thread). Prints the mean and p90 milliseconds of a 64-row fill per thread
count, and the speed-up over one thread. Cores matter: run it where the
server will run.

    python bench/mask_threads.py [--threads 1,2,4,8] [--backend llguidance] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fill_times(tokenizer, backend: str, threads: int, batch: int, ids: list[int], lag: int) -> list[float]:  # type: ignore[no-untyped-def]
    from bench.gpu import BENCH_SCHEMA
    from grammar import BitmaskFiller, GrammarCompiler, GrammarSpec, allocate_bitmask

    spec = GrammarSpec.json_schema(json.dumps(BENCH_SCHEMA))
    with GrammarCompiler(tokenizer, backend=backend, vocab_size=len(tokenizer), isolation="thread",
                         mask_threads=threads) as compiler:
        matchers = [compiler.compile(spec) for _ in range(batch)]
        bitmask = allocate_bitmask(batch, compiler.vocab_size)
        filler = BitmaskFiller(compiler.tokenizer_data, threads)
        times = []
        for step in range(len(ids) + lag * batch):
            start = time.perf_counter()
            filler.fill(matchers, bitmask)
            times.append(time.perf_counter() - start)
            for row, matcher in enumerate(matchers):
                position = step - row * lag  # row r starts r * lag steps late
                if 0 <= position < len(ids):
                    assert matcher.accept_token(ids[position])
        return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--backend", default="llguidance", choices=("llguidance", "xgrammar"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lag", type=int, default=3, help="tokens each row trails the one before")
    p.add_argument("--preset", default="tiny-llama")
    args = p.parse_args()

    from engine.cpu_features import mask_threads_for, usable_cores
    from engine.presets import ensure_preset
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(str(ensure_preset(args.preset)))
    item = {"id": 7, "name": "Ada Lovelace", "role": "admin", "active": True, "tags": ["math", "engines"]}
    ids = tok.hf.encode(json.dumps([item] * 8, separators=(",", ":")), add_special_tokens=False)
    cores = usable_cores()
    print(f"{args.batch} rows, {args.backend}, {len(ids)}-token document, {cores} usable cores "
          f"(the engine's default here: {mask_threads_for(cores, 'cuda')} thread(s) beside a GPU, "
          f"{mask_threads_for(cores, 'cpu')} for a model on the CPU)")
    base = None
    for threads in (int(t) for t in args.threads.split(",")):
        times = np.array(fill_times(tok.hf, args.backend, threads, args.batch, ids, args.lag)) * 1e3
        mean = float(times.mean())
        base = base or mean
        print(f"  {threads} thread(s): {mean:.3f} ms a fill (p90 {np.percentile(times, 90):.3f}), "
              f"{base / mean:.2f}x one thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
