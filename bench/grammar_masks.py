"""Grammar micro-benchmarks: mask time per token and compile time, per backend.

    .venv/bin/python bench/grammar_masks.py [--tokenizers demo,bpe32k] [--iters N] [--e2e | --e2e-only]

- mask time: one matcher walks a compact JSON instance of each schema token by
  token; every step's `fill_bitmask` is timed (p50 / p99 / mean, µs), and a
  16-row `fill_bitmasks` batch step is timed too (µs per row);
- compile time: cold compiles (distinct cache keys) through `GrammarCompiler`
  with process isolation (what the server pays: worker compile + transfer +
  rebuild), and the same in-process (`isolation="thread"`), whose difference is
  the cost of isolation.

Tokenizers: the committed 8k demo tokenizer, and a 32k byte-level BPE trained
here on the standard library's .py sources plus the demo tokenizer's corpus,
cached under ~/.cache/stencild/tokenizers (never committed).

`--e2e` adds end-to-end engine numbers (`--e2e-only`: just those): the offline
`LLM` on the `bench` preset, a batch of 16 prompts, greedy, unconstrained vs
constrained by a key-heavy JSON schema (`E2E_SCHEMA`): output tok/s, the share
of forced tokens, and output tokens per forward pass. See `end_to_end`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEMO_TOKENIZER = ROOT / "engine/presets/tokenizer"
CACHE = Path.home() / ".cache/stencild/tokenizers"
BACKENDS = ("xgrammar", "llguidance")

SCHEMAS: dict[str, tuple[dict[str, Any] | None, Any]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["name", "age", "email"],
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^ord-[0-9]{6}$"},
                "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["id", "status", "items", "note"],
        },
        {
            "id": "ord-004217",
            "status": "shipped",
            "items": [
                {"sku": "A-100", "qty": 2, "price": 9.5},
                {"sku": "B-7", "qty": 1, "price": 120.0},
            ],
            "note": None,
        },
    ),
    "json_object": (
        None,
        {"query": "grammar masks", "filters": {"year": [2023, 2024], "open": True}, "k": 10},
    ),
}


# ---- tokenizers --------------------------------------------------------------


def _stdlib_sources(limit_bytes: int) -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    used = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        used += len(text)
        if used > limit_bytes:
            return
        yield text


def bpe32k(corpus_mb: int) -> Path:
    """Train (once) and cache a 32k byte-level BPE; returns its directory."""
    target = CACHE / f"bpe32k-stdlib{corpus_mb}mb-v1"
    if (target / "tokenizer.json").exists():
        return target
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from engine.presets import train_tokenizer as demo

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=32768,
        min_frequency=2,
        special_tokens=demo.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def corpus() -> Iterator[str]:
        yield from _stdlib_sources(corpus_mb << 20)
        yield from demo.corpus()

    start = time.perf_counter()
    tok.train_from_iterator(corpus(), trainer=trainer)
    print(f"trained 32k BPE in {time.perf_counter() - start:.1f} s -> {target}", file=sys.stderr)
    tmp = target.with_name(target.name + ".tmp")
    demo.save_tokenizer(tok, tmp)
    tmp.rename(target)
    return target


def load_tokenizer(name: str, corpus_mb: int) -> Any:
    from transformers import AutoTokenizer

    path = DEMO_TOKENIZER if name == "demo" else bpe32k(corpus_mb)
    return AutoTokenizer.from_pretrained(str(path))


# ---- measurements ------------------------------------------------------------


def _spec(name: str, salt: int = 0) -> Any:
    from grammar import GrammarSpec

    schema, _ = SCHEMAS[name]
    if schema is None:
        if not salt:
            return GrammarSpec.json_object()
        schema = {"type": "object"}  # what json_object compiles to
    if salt:
        schema = {**schema, "title": f"bench-{salt}"}  # new cache key, same grammar
    return GrammarSpec.json_schema(schema)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def mask_times(compiler: Any, name: str, backend: str, iters: int) -> dict[str, float]:
    matcher = compiler.compile(_spec(name), backend=backend)
    tokens = compiler.tokenizer_data.encode(json.dumps(SCHEMAS[name][1], separators=(",", ":")))
    bitmask = compiler.allocate_bitmask(16)
    single: list[float] = []
    forced: list[float] = []
    for _ in range(iters):
        matcher.reset()
        for tok in tokens:
            t0 = time.perf_counter_ns()
            matcher.fill_bitmask(bitmask, 0)
            t1 = time.perf_counter_ns()
            matcher.forced_tokens()
            t2 = time.perf_counter_ns()
            single.append((t1 - t0) / 1e3)
            forced.append((t2 - t1) / 1e3)
            if not matcher.accept_token(tok):
                raise RuntimeError(f"{backend} rejected the {name} instance")
    # A batch of 16 requests at the same positions, one native call per step.
    batch = [compiler.compile(_spec(name), backend=backend) for _ in range(16)]
    per_row: list[float] = []
    for tok in tokens:
        t0 = time.perf_counter_ns()
        compiler.fill_bitmasks(batch, bitmask)
        per_row.append((time.perf_counter_ns() - t0) / 1e3 / len(batch))
        for m in batch:
            m.accept_token(tok)
    return {
        "tokens": len(tokens),
        "p50": _pct(single, 0.5),
        "p99": _pct(single, 0.99),
        "mean": statistics.fmean(single),
        "forced_p50": _pct(forced, 0.5),
        "batch16_row": statistics.fmean(per_row),
    }


def compile_times(compiler: Any, name: str, backend: str, reps: int, salt0: int) -> float:
    """Median cold compile time (ms) over `reps` distinct cache keys."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        compiler.compile(_spec(name, salt0 + i + 1), backend=backend)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# Key-heavy, every value bounded: enums, bounded integers, short strings. A
# compact object is ~45 tokens of the demo tokenizer, most of them forced.
E2E_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ticket_id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "status": {"enum": ["open", "in_progress", "blocked", "closed"]},
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "team": {"enum": ["infra", "frontend", "backend", "data"]},
        "assignee": {"type": "string", "minLength": 1, "maxLength": 8},
        "estimate_hours": {"type": "integer", "minimum": 0, "maximum": 99},
        "billable": {"type": "boolean"},
    },
    "required": ["ticket_id", "status", "priority", "team", "assignee", "estimate_hours", "billable"],
    "additionalProperties": False,
}


def _e2e_run(llm: Any, prompts: list[str], params: Any, spec: Any) -> dict[str, float]:
    passes = llm.engine.pipeline.forward_passes
    start = time.perf_counter()
    outs = llm.generate(prompts, params, constraint=spec)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    complete = sum(o.finish_reason == "eos" for o in outs) if spec is not None else len(outs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "forced": sum(o.forced_tokens for o in outs) / max(tokens, 1),
        "per_pass": tokens / max(llm.engine.pipeline.forward_passes - passes, 1),
        "complete": complete,
        "errors": sum(o.finish_reason == "error" for o in outs),
    }


def end_to_end(args: argparse.Namespace) -> str:
    """Engine tok/s at batch `--e2e-batch`, unconstrained vs JSON-schema constrained.

    Each case runs once to warm up (kernels, grammar compile, lexer caches),
    then `--e2e-reps` times; the best run is reported. Unconstrained requests
    ignore EOS so each produces exactly `--e2e-tokens`; constrained ones end
    when the object is complete (EOS) or at `--e2e-tokens` (LENGTH).
    """
    import os

    import torch

    from engine import LLM, SamplingParams
    from engine.presets import ensure_preset
    from grammar import GrammarSpec

    torch.set_num_threads(os.cpu_count() or 1)  # undo the micro-benchmarks' single thread
    llm = LLM(ensure_preset(args.e2e_preset), max_num_seqs=max(args.e2e_batch, 16),
              grammar_backend=args.e2e_backend, overlap=not args.e2e_no_overlap)
    try:
        prompts = [f"Ticket {i}: the build is failing on branch release-{i}." for i in range(args.e2e_batch)]
        free = SamplingParams(temperature=0.0, max_new_tokens=args.e2e_tokens, ignore_eos=True)
        shaped = SamplingParams(temperature=0.0, max_new_tokens=args.e2e_tokens)
        spec = GrammarSpec.json_schema(E2E_SCHEMA)
        rows = []
        for label, params, constraint in (("unconstrained", free, None),
                                          ("json schema", shaped, spec)):
            _e2e_run(llm, prompts, params, constraint)
            best = max((_e2e_run(llm, prompts, params, constraint) for _ in range(args.e2e_reps)),
                       key=lambda r: r["tok_s"])
            rows.append(
                f"| {label} | {best['tokens']} | {best['seconds']:.2f} | {best['tok_s']:.0f} | "
                f"{100 * best['forced']:.0f}% | {best['per_pass']:.2f} | "
                f"{best['complete']}/{len(prompts)} | {best['errors']} |"
            )
    finally:
        llm.close()
    head = (f"{args.e2e_preset} preset, batch {args.e2e_batch}, greedy, max_new_tokens "
            f"{args.e2e_tokens}, grammar backend {args.e2e_backend}, overlap "
            f"{'off' if args.e2e_no_overlap else 'on'}, best of {args.e2e_reps}\n\n")
    table = ("| case | output tokens | s | tok/s | forced | tokens / forward pass | complete | errors |\n"
             "|---|---|---|---|---|---|---|---|\n")
    return head + table + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", default="demo,bpe32k")
    parser.add_argument("--iters", type=int, default=20, help="walks per schema for mask times")
    parser.add_argument("--compile-reps", type=int, default=3)
    parser.add_argument(
        "--corpus-mb",
        type=int,
        default=64,
        help="MB of stdlib .py sources for the 32k BPE (64: all of them)",
    )
    parser.add_argument("--e2e", action="store_true", help="also run the end-to-end benchmark")
    parser.add_argument("--e2e-only", action="store_true", help="run only the end-to-end benchmark")
    parser.add_argument("--e2e-preset", default="bench")
    parser.add_argument("--e2e-batch", type=int, default=16)
    parser.add_argument("--e2e-tokens", type=int, default=64, help="max_new_tokens")
    parser.add_argument("--e2e-reps", type=int, default=2)
    parser.add_argument("--e2e-backend", default="auto", choices=["auto", *BACKENDS])
    parser.add_argument("--e2e-no-overlap", action="store_true")
    args = parser.parse_args(argv)
    if args.e2e_only:
        print(end_to_end(args))
        return 0

    import torch

    from grammar import GrammarCompiler

    torch.set_num_threads(1)
    mask_rows, compile_rows = [], []
    for tok_name in args.tokenizers.split(","):
        tokenizer = load_tokenizer(tok_name, args.corpus_mb)
        label = f"{tok_name} ({len(tokenizer)})"
        with (
            GrammarCompiler(tokenizer) as proc,
            GrammarCompiler(tokenizer, isolation="thread") as thr,
        ):
            proc.compile(_spec("person"), backend="xgrammar")  # worker warm-up
            for name in SCHEMAS:
                for backend in BACKENDS:
                    r = mask_times(proc, name, backend, args.iters)
                    mask_rows.append(
                        f"| {label} | {name} | {backend} | {r['tokens']} | {r['p50']:.1f} | "
                        f"{r['p99']:.1f} | {r['mean']:.1f} | {r['batch16_row']:.1f} | "
                        f"{r['forced_p50']:.1f} |"
                    )
                    p = compile_times(proc, name, backend, args.compile_reps, 1000)
                    t = compile_times(thr, name, backend, args.compile_reps, 2000)
                    compile_rows.append(f"| {label} | {name} | {backend} | {p:.1f} | {t:.1f} |")
    print("### Mask time per token (µs, one CPU thread)\n")
    print(
        "| tokenizer | schema | backend | tokens | p50 | p99 | mean | batch-16 per row | forced_tokens p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(mask_rows))
    print("\n### Cold compile time (ms, median)\n")
    print("| tokenizer | schema | backend | isolated (worker process) | in-process |")
    print("|---|---|---|---|---|")
    print("\n".join(compile_rows))
    if args.e2e:
        print("\n### End to end\n")
        print(end_to_end(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
