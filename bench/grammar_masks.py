"""Grammar micro-benchmarks: mask time per token and compile time, per backend.

    .venv/bin/python bench/grammar_masks.py [--tokenizers demo,bpe32k] [--iters N] [--skip-compile]
    .venv/bin/python bench/grammar_masks.py --steps [--steps-batch 64] [--e2e-tokens 48]
    .venv/bin/python bench/grammar_masks.py [--e2e | --e2e-only]

- mask time: one matcher walks a compact JSON instance of each schema token by
  token; at every position its mask is filled three ways, timed in a rotating
  order: the raw library's own call on its native matcher (xgrammar
  `GrammarMatcher.fill_next_token_bitmask`, llguidance
  `llguidance.torch.fill_next_token_bitmask`) into a preallocated bitmask, our
  `Matcher.fill_bitmask`, and the engine's per-step `StepMasks.fill` for
  a one-row step (p50 / p99, µs; ratio = engine / raw). A 16-row batch step is
  timed too (µs per row), the library's batch call vs `fill_bitmasks`;
- compile time: cold compiles (distinct cache keys) through `GrammarCompiler`
  with process isolation (what the server pays: worker compile + transfer +
  rebuild), and the same in-process (`isolation="thread"`), whose difference is
  the cost of isolation.
- `--steps`: per-step grammar work for a batch of constrained rows (64 by
  default) against the device jobs of the same steps, overlap on: how much of
  it the forward pass does not hide (see `step_costs`).

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

from bench.step_phases import MaskGaps  # noqa: E402 - after the path

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


class _Row:
    """The fields of a TextContext that `StepMasks.fill` reads."""

    constrained = True

    def __init__(self, matcher: Any) -> None:
        from engine.context import GrammarState
        from engine.sampling_params import SamplingParams

        self.matcher = matcher
        self.grammar = GrammarState(grammar_idx=0)
        # No min_new_tokens: no stop token is held back.
        self.sampling_params = SamplingParams()
        self.num_final_tokens = self.prompt_len = 0
        self.eos_token_ids: frozenset[int] = frozenset()


def _raw_fill(backend: str, native: Any, bitmask: Any) -> None:
    """The library's own single-row fill, as its documentation shows it."""
    if backend == "xgrammar":
        native.fill_next_token_bitmask(bitmask, 0)
    else:
        import llguidance.torch as llt

        llt.fill_next_token_bitmask(native, bitmask, 0)


def _raw_batch_fill(backend: str, natives: list[Any], bitmask: Any, pool: Any) -> None:
    """The library's own batch fill (rows 0..n-1), as its documentation shows it."""
    if backend == "xgrammar":
        pool.batch_fill_next_token_bitmask(natives, bitmask)
    else:
        import llguidance.torch as llt

        llt.fill_next_token_bitmask_par(pool, [(m, i) for i, m in enumerate(natives)], bitmask)


def _raw_pool(backend: str) -> Any:
    if backend == "xgrammar":
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher(max_threads=1)
    import llguidance

    return llguidance.LLExecutor(num_threads=1)


# The ways one row's mask is filled, timed in turn at every position.
WAYS = ("raw", "matcher", "engine")


def mask_times(masks: Any, name: str, backend: str, iters: int) -> dict[str, Any]:
    """Per-token mask time of the raw library vs our two entry points, same matcher, same tokens.

    At each position of the instance the one matcher's mask is filled three
    ways, in an order that rotates with the position (so none always runs on
    warm caches): `raw`, the library's own call on its native matcher into a
    preallocated bitmask; `matcher`, `Matcher.fill_bitmask`; `engine`,
    `StepMasks.fill` for a one-row step (what the engine runs per step,
    PendingMask release included; the PendingMask is built outside the timing,
    as the engine builds it with the step's inputs).
    """
    from engine.step_masks import PendingMask

    compiler = masks._structured.compiler
    matcher = compiler.compile(_spec(name), backend=backend)
    tokens = compiler.tokenizer_data.encode(json.dumps(SCHEMAS[name][1], separators=(",", ":")))
    bitmask = compiler.allocate_bitmask(16)
    rows = [_Row(matcher)]
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    forced: list[float] = []
    masks.fill(PendingMask(), rows)  # allocates the engine's bitmask once
    # Every way writes the same memory (the engine's one-row view): a way that
    # wrote a buffer the others do not touch would pay cache misses they skip.
    row_mask = masks._view(1)
    position = 0
    for _ in range(iters):
        matcher.reset()
        native = matcher.native  # llguidance's reset makes a new native matcher
        for tok in tokens:
            pending = PendingMask()
            for k in range(len(WAYS)):
                way = WAYS[(position + k) % len(WAYS)]
                t0 = time.perf_counter_ns()
                if way == "raw":
                    _raw_fill(backend, native, row_mask)
                elif way == "matcher":
                    matcher.fill_bitmask(row_mask, 0)
                else:
                    masks.fill(pending, rows)
                times[way].append((time.perf_counter_ns() - t0) / 1e3)
            position += 1
            t1 = time.perf_counter_ns()
            matcher.forced_tokens()
            forced.append((time.perf_counter_ns() - t1) / 1e3)
            if not matcher.accept_token(tok):
                raise RuntimeError(f"{backend} rejected the {name} instance")
    # A batch of 16 requests at the same positions: the library's batch call
    # vs ours (one native call per backend), alternating which goes first.
    batch = [compiler.compile(_spec(name), backend=backend) for _ in range(16)]
    pool = _raw_pool(backend)
    raw16: list[float] = []
    ours16: list[float] = []
    for i, tok in enumerate(tokens):
        natives = [m.native for m in batch]
        for k in range(2):
            t0 = time.perf_counter_ns()
            if (i + k) % 2:
                _raw_batch_fill(backend, natives, bitmask, pool)
                raw16.append((time.perf_counter_ns() - t0) / 1e3 / len(batch))
            else:
                compiler.fill_bitmasks(batch, bitmask)
                ours16.append((time.perf_counter_ns() - t0) / 1e3 / len(batch))
        for m in batch:
            m.accept_token(tok)
    out: dict[str, Any] = {"tokens": len(tokens), "forced_p50": _pct(forced, 0.5),
                           "batch16_raw": statistics.fmean(raw16),
                           "batch16_ours": statistics.fmean(ours16)}
    for way, samples in times.items():
        out[way] = {"p50": _pct(samples, 0.5), "p99": _pct(samples, 0.99),
                    "mean": statistics.fmean(samples)}
    return out


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


class _StepClock:
    """Per-step timers hooked around the engine's step phases (this process only).

    `run`: the device thread's jobs per step (forward pass and sampling, two
    jobs for a constrained step); `wait`: the device thread's wait between a
    constrained step's two jobs for its grammar mask, i.e. grammar work the
    forward pass did not hide (step_phases.MaskGaps); `fill` and `advance`:
    grammar work on the engine thread (mask fill; feeding tokens to matchers
    and appending forced ones). `calls["run"]` counts the steps.
    """

    def __init__(self) -> None:
        self.totals = {"run": 0.0, "wait": 0.0, "fill": 0.0, "advance": 0.0}
        self.calls = dict.fromkeys(self.totals, 0)
        self._undo: list[tuple[Any, str, Any]] = []
        self._gaps = MaskGaps()

    def _wrap(self, owner: Any, name: str, key: str, *, static: bool = False, counts: bool = True) -> None:
        original = owner.__dict__[name]
        func = original.__func__ if static else original
        totals, calls = self.totals, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - t0
                calls[key] += counts

        setattr(owner, name, staticmethod(timed) if static else timed)
        self._undo.append((owner, name, original))

    def __enter__(self) -> _StepClock:
        import engine.pipeline as pipeline
        from engine.step_masks import StepMasks

        self._wrap(pipeline, "run_step", "run")  # a module: same __dict__ / setattr
        self._wrap(pipeline, "sample_step", "run", counts=False)  # a constrained step's second job
        self._wrap(StepMasks, "fill", "fill")
        self._wrap(StepMasks, "advance", "advance", static=True)
        self._gaps.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._gaps.__exit__()
        self.totals["wait"] = self._gaps.seconds
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def step_costs(args: argparse.Namespace) -> str:
    """Per-step grammar work at batch `--steps-batch` vs the forward pass, overlap on.

    The offline engine on the `--e2e-preset` model runs a batch of requests
    constrained by an array of `E2E_SCHEMA` records (long enough that every
    request runs to `--e2e-tokens`), once to warm up and then measured, and
    the same batch unconstrained. Per step: the device jobs' time, how long
    the device thread waited for the grammar mask between a step's forward
    pass and its sampling (exposed grammar work), and the engine thread's
    grammar work (mask fill, advance), which overlap scheduling runs while
    the device computes.
    """
    import os

    import torch

    from engine import LLM, SamplingParams
    from engine.presets import ensure_preset
    from grammar import GrammarSpec

    torch.set_num_threads(os.cpu_count() or 1)
    batch = args.steps_batch
    llm = LLM(ensure_preset(args.e2e_preset), max_num_seqs=batch, grammar_backend=args.e2e_backend,
              overlap=True)
    rows = []
    try:
        prompts = [f"Ticket {i}: the build is failing on branch release-{i}." for i in range(batch)]
        params = SamplingParams(temperature=0.8, seed=7, max_new_tokens=args.e2e_tokens,
                                ignore_eos=True)
        spec = GrammarSpec.json_schema({"type": "array", "items": E2E_SCHEMA, "minItems": 50})
        for label, constraint in (("unconstrained", None), ("json schema", spec)):
            llm.generate(prompts, params, constraint=constraint)  # warm-up
            with _StepClock() as clock:
                start = time.perf_counter()
                outs = llm.generate(prompts, params, constraint=constraint)
                wall = time.perf_counter() - start
            t = clock.totals
            n = max(clock.calls["run"], 1)  # one device job per step
            tokens = sum(len(o.token_ids) for o in outs)
            rows.append(
                f"| {label} | {batch} | {tokens} | {tokens / wall:.0f} | {1e3 * wall / n:.2f} "
                f"| {1e3 * t['run'] / n:.2f} | {1e3 * t['fill'] / n:.3f} "
                f"| {1e3 * t['advance'] / n:.3f} | {1e3 * t['wait'] / n:.3f} |"
            )
    finally:
        llm.close()
    head = (f"{args.e2e_preset} preset, batch {batch}, temperature 0.8 (seeded), "
            f"{args.e2e_tokens} new tokens per request, overlap on, grammar backend "
            f"{args.e2e_backend}, {os.cpu_count()} CPU threads; per step, ms\n\n")
    table = ("| case | batch | output tokens | tok/s | wall per step | device jobs "
             "| mask fill (engine thread) | advance (engine thread) | device blocked on mask |\n"
             "|---|---|---|---|---|---|---|---|---|\n")
    return head + table + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", default="demo,bpe32k")
    parser.add_argument("--iters", type=int, default=20, help="walks per schema for mask times")
    parser.add_argument("--compile-reps", type=int, default=3)
    parser.add_argument("--skip-compile", action="store_true", help="mask times only")
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
    parser.add_argument("--steps", action="store_true",
                        help="run only the per-step grammar cost at --steps-batch (overlap on)")
    parser.add_argument("--steps-batch", type=int, default=64)
    args = parser.parse_args(argv)
    if args.e2e_only:
        print(end_to_end(args))
        return 0
    if args.steps:
        print(step_costs(args))
        return 0

    import torch

    from engine.staging import Staging
    from engine.step_masks import StepMasks
    from engine.structured import StructuredOutput
    from grammar import GrammarCompiler, TokenizerData

    torch.set_num_threads(1)
    mask_rows, compile_rows = [], []
    for tok_name in args.tokenizers.split(","):
        tokenizer = load_tokenizer(tok_name, args.corpus_mb)
        label = f"{tok_name} ({len(tokenizer)})"
        eos = TokenizerData(tokenizer).eos_token_ids
        structured = StructuredOutput(tokenizer, len(tokenizer), eos)
        proc = structured.compiler  # process isolation, as the server compiles
        try:
            with GrammarCompiler(tokenizer, isolation="thread") as thr:
                proc.compile(_spec("person"), backend="xgrammar")  # worker warm-up
                for name in SCHEMAS:
                    for backend in BACKENDS:
                        masks = StepMasks(structured, len(tokenizer), Staging(torch.device("cpu")))
                        r = mask_times(masks, name, backend, args.iters)
                        raw, ours, eng = r["raw"], r["matcher"], r["engine"]
                        mask_rows.append(
                            f"| {label} | {name} | {backend} | {r['tokens']} "
                            f"| {raw['p50']:.1f} | {raw['p99']:.1f} "
                            f"| {ours['p50']:.1f} | {ours['p99']:.1f} "
                            f"| {eng['p50']:.1f} | {eng['p99']:.1f} "
                            f"| {eng['p50'] / raw['p50']:.2f} | {eng['p99'] / raw['p99']:.2f} "
                            f"| {r['batch16_raw']:.1f} | {r['batch16_ours']:.1f} "
                            f"| {r['forced_p50']:.1f} |"
                        )
                        if args.skip_compile:
                            continue
                        p = compile_times(proc, name, backend, args.compile_reps, 1000)
                        t = compile_times(thr, name, backend, args.compile_reps, 2000)
                        compile_rows.append(f"| {label} | {name} | {backend} | {p:.1f} | {t:.1f} |")
        finally:
            structured.close()
    print("### Mask time per token (µs, one CPU thread)\n")
    print("raw: the library's own fill on its matcher; matcher: `Matcher.fill_bitmask`; "
          "engine: `StepMasks.fill` of a one-row step; ratio: engine / raw.\n")
    print("| tokenizer | schema | backend | tokens | raw p50 | raw p99 | matcher p50 | matcher p99 "
          "| engine p50 | engine p99 | ratio p50 | ratio p99 | batch-16 per row raw | "
          "batch-16 per row ours | forced_tokens p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(mask_rows))
    if compile_rows:
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
