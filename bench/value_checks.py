"""Cost of the value checks behind resampling (grammar/value_watch.py), per token.

Resampling is on by default: a JSON request whose grammar leaves a keyword
unenforced has its output read by a `ValueWatch` on the engine thread, after
the grammar advances. This measures, per output token, what the watch costs
next to the grammar's own per-token work (accept the token, fill the next
mask), for schemas whose unenforced keywords sit on many values, on one
value, and on the whole output. Each output is a valid instance (no
rollbacks), tokenized with the demo tokenizer and fed token by token.

    .venv/bin/python bench/value_checks.py [--repeats N]

prints the markdown rows of BENCHMARKS.md's "Value checks" table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

TOKENIZER_DIR = ROOT / "engine/presets/tokenizer"


def cases() -> list[tuple[str, dict[str, Any], Any]]:
    item = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
            "required": ["id", "name"], "additionalProperties": False}
    unique = {"type": "array", "items": item, "uniqueItems": True}
    guarded = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "not": {"const": 0}},
        "email": {"type": "string"}, "phone": {"type": "string"}},
        "required": ["name", "age"], "dependentRequired": {"email": ["phone"]},
        "additionalProperties": False}
    wide = {"type": "object", "properties": {
        f"f{i}": {"type": "integer", "not": {"const": -1}} for i in range(200)},
        "required": [f"f{i}" for i in range(200)], "additionalProperties": False}
    root = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(50)},
            "required": [f"k{i}" for i in range(50)], "additionalProperties": False,
            "if": {"properties": {"k0": {"const": "x"}}}, "then": {"required": ["k1"]}}
    return [
        ("uniqueItems: 40 objects", unique, [{"id": i, "name": f"item {i}"} for i in range(40)]),
        ("`not` + dependentRequired, 4 props", guarded,
         {"name": "Ann", "age": 31, "email": "a@b.c", "phone": "555"}),
        ("`not` on each of 200 props", wide, {f"f{i}": i for i in range(200)}),
        ("if/then on the root, 50 props", root, {f"k{i}": f"value {i}" for i in range(50)}),
    ]


def measure(compiler: Any, schema: dict[str, Any], instance: Any, repeats: int) -> dict[str, float]:
    from grammar import GrammarSpec
    from grammar.value_watch import ValueWatch
    from grammar.vocab import token_bytes

    tok = compiler.tokenizer_data
    read = token_bytes(tok)
    matcher = compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert matcher.unenforced_keywords, "the case must leave a keyword to the value checks"
    tokens = tok.encode(json.dumps(instance, separators=(",", ":")))
    bitmask = compiler.allocate_bitmask(1)
    grammar_s: list[float] = []
    watch_s: list[float] = []
    for _ in range(repeats):
        matcher.reset()
        watch = ValueWatch(matcher.watch_plan, matcher.unenforced_keywords, matcher.validator)
        for t in tokens:
            start = time.perf_counter()
            assert matcher.accept_token(t)
            matcher.fill_bitmask(bitmask, 0)
            mid = time.perf_counter()
            assert watch.feed(read(t)) is None
            end = time.perf_counter()
            grammar_s.append(mid - start)
            watch_s.append(end - mid)
        assert watch.finish() is None
    q = statistics.quantiles(watch_s, n=100)
    return {"tokens": len(tokens), "grammar_p50_us": statistics.median(grammar_s) * 1e6,
            "watch_p50_us": statistics.median(watch_s) * 1e6, "watch_p99_us": q[98] * 1e6,
            "watch_total_ms": sum(watch_s) / repeats * 1e3,
            "grammar_total_ms": sum(grammar_s) / repeats * 1e3}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from grammar import GrammarCompiler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    print("| schema | tokens | grammar µs/token p50 | checks µs/token p50 | checks µs/token p99 "
          "| checks per output (ms) | grammar per output (ms) |")
    print("|---|---|---|---|---|---|---|")
    with GrammarCompiler(tokenizer, vocab_size=8320, eos_token_ids=(1, 3)) as compiler:
        for name, schema, instance in cases():
            m = measure(compiler, schema, instance, args.repeats)
            print(f"| {name} | {m['tokens']} | {m['grammar_p50_us']:.1f} | {m['watch_p50_us']:.1f} "
                  f"| {m['watch_p99_us']:.1f} | {m['watch_total_ms']:.2f} | {m['grammar_total_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
