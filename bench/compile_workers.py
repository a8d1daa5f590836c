"""How fast a grammar compile worker comes up, forked from the zygote or
started as a fresh interpreter, and what it costs in memory.

For each way (the zygote; then `fork_worker` disabled, as where no zygote
runs), in one process, on the demo tokenizer (8k vocabulary):

- start: a new `GrammarCompiler`'s first compile (a small regex), which waits
  for its worker to come up: what every engine and server start pays, and a
  request whose constraint is the first;
- replace: after a compile is killed at its timeout (a schema that takes
  xgrammar minutes, `--timeout` seconds allowed), how long the next compile
  takes: the replacement worker's start-up, which the tenant of the killed
  compile waits through;
- PSS: the worker's proportional set size (shared pages split between the
  processes that map them), from /proc.

Medians of `--repeat` trials, after one trial that starts the zygote.

    python bench/compile_workers.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grammar import GrammarCompiler, GrammarError, GrammarSpec, _pool, _zygote  # noqa: E402


def _pss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss line")


def _nested_any_of(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": schema}}, {"type": "array", "items": schema},
                            {"type": "string"}]}
    return schema


def _trial(tokenizer, timeout_s: float) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    with GrammarCompiler(tokenizer, compile_workers=1, compile_timeout_s=timeout_s) as c:
        c.compile(GrammarSpec.regex("a+"), backend="xgrammar")
        first = time.perf_counter() - start
        (worker,) = c.worker_pids()
        pss = _pss_mib(worker)
        try:
            c.compile(GrammarSpec.json_schema(_nested_any_of(7)), backend="xgrammar")
            raise RuntimeError("the slow schema compiled in time: raise its depth")
        except GrammarError:
            pass
        killed = time.perf_counter()
        while True:  # busy until the replacement is up
            try:
                c.compile(GrammarSpec.regex("b+"), backend="xgrammar")
                break
            except GrammarError:
                pass
        return first, time.perf_counter() - killed, pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1.0, help="compile timeout (s) of the killed compile")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "engine/presets/tokenizer"))
    fork = _pool.fork_worker
    print(f"{'worker':<12} {'start s':>8} {'replace s':>10} {'PSS MiB':>8}")
    for way in ("zygote", "interpreter"):
        _pool.fork_worker = fork if way == "zygote" else (lambda *a: None)  # type: ignore[assignment]
        _trial(tokenizer, args.timeout)
        trials = [_trial(tokenizer, args.timeout) for _ in range(args.repeat)]
        first, replace, pss = (statistics.median(t[i] for t in trials) for i in range(3))
        print(f"{way:<12} {first:>8.3f} {replace:>10.3f} {pss:>8.0f}")
    _pool.fork_worker = fork
    zygote = _zygote.zygote_pid()
    if zygote is not None:
        print(f"the zygote itself: PSS {_pss_mib(zygote):.0f} MiB, once per process")


if __name__ == "__main__":
    main()
