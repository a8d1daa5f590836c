"""JSON-Schema-Test-Suite (draft 2020-12) conformance of the grammar backends.

For every schema group in the suite and every backend (xgrammar, llguidance,
auto): compile the schema; feed each `valid: true` instance - serialized with
`json.dumps(x, separators=(",", ":"), ensure_ascii=False)`, compact UTF-8 as a
model writes JSON, tokenized with the demo tokenizer - token
by token (each token must be inside the filled bitmask and accepted, and a stop
token must be allowed at the end); count the `valid: false` instances that are
rejected somewhere (or cannot terminate). A schema that fails to compile (or
times out) accepts none of its valid instances and rejects all invalid ones.
The `auto` column is the grammar alone. The `default` column is what a
request with default settings gets: backend auto plus the value checks that
drive resampling (grammar/value_watch.py, `Constraint.resample`, on unless
turned off): an instance the grammar accepts is also read by a `ValueWatch`,
and counts as rejected when a completed value (or the whole output, at its
stop token) breaks a keyword the grammar left unenforced - the value a
request would roll back and resample. `strict refuses` counts the schemas
strict mode refuses up front (a keyword no value check can see).
`$ref`s to other documents resolve from a schema store of the suite's
`_remotes` directory (`--no-store`: unresolved).

    .venv/bin/python bench/grammar_conformance.py [--suite DIR] [--timeout S] [--json OUT]

prints a markdown table per keyword (the suite's file name). tests/grammar/
test_conformance.py runs the same `evaluate` function.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SUITE = ROOT / "tests/data/json-schema-test-suite"
TOKENIZER_DIR = ROOT / "engine/presets/tokenizer"
BACKENDS = ("xgrammar", "llguidance", "auto", "default")
MODEL_VOCAB = 8320  # a padded model vocabulary, as tiny-qwen2 has
STOP_IDS = (1, 3)
# Run as a script, this directory comes first on sys.path and its grammar.py
# would shadow the grammar package.
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))


@dataclass
class Tally:
    """Instances tried and what the grammar did with them, for one keyword and backend."""

    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    # Invalid instances the grammar accepted but the output validator flags
    # (what a request reports as INVALID, and strict mode ends SCHEMA_VIOLATION).
    invalid_caught_by_validator: int = 0
    # Invalid instances the grammar accepted although it reported every keyword
    # of the schema as enforced (must be 0: see grammar/schema_keywords.py).
    invalid_missed_when_enforced: int = 0
    groups: int = 0
    compiled: int = 0
    # `default` only: schemas strict mode refuses (a keyword it cannot check on its own value).
    strict_refused: int = 0
    # Valid instances of schemas with a `$ref` to another document (see
    # `needs_remote`), which the schema store serves.
    valid_remote: int = 0
    valid_remote_accepted: int = 0

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Report:
    """Every keyword's tallies per backend, and the groups where auto chose badly."""

    per_keyword: dict[str, dict[str, Tally]] = field(default_factory=dict)
    seconds: float = 0.0
    # Schema groups where a backend leaving no more keywords unenforced than
    # auto's choice accepted more valid instances than auto: a bad choice.
    # (One enforcing less may accept more, by letting everything through.)
    auto_behind: list[str] = field(default_factory=list)

    def total(self, backend: str) -> Tally:
        out = Tally()
        for tallies in self.per_keyword.values():
            out.add(tallies[backend])
        return out


def load_suite(suite_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """keyword (file stem) -> schema groups, for the suite's top-level files."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(suite_dir.glob("*.json"))}


def _allowed(bitmask: Any, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def run_instance(matcher: Any, tokens: list[int], bitmask: Any, stop_id: int) -> bool:
    """True when every token is in the mask and accepted, and the output may end."""
    matcher.reset()
    for tok in tokens:
        matcher.fill_bitmask(bitmask, 0)
        if not _allowed(bitmask, tok) or not matcher.accept_token(tok):
            return False
    matcher.fill_bitmask(bitmask, 0)
    return _allowed(bitmask, stop_id) and matcher.can_terminate()


def needs_remote(schema: Any) -> bool:
    """Whether a schema refers to a document outside itself: a `$ref` or
    `$dynamicRef` whose absolute URI (resolved against the `$id`s on its way)
    is no `$id` of the schema. The suite expects those at localhost:1234 (and
    the metaschemas at json-schema.org); stencild never fetches anything, and
    reads them from its schema store (`suite_store`)."""
    from urllib.parse import urldefrag, urljoin

    ids: set[str] = set()
    refs: list[str] = []

    def walk(node: Any, base: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                base = urljoin(base, node["$id"])
                ids.add(urldefrag(base)[0])
            for key in ("$ref", "$dynamicRef"):
                if isinstance(node.get(key), str):
                    refs.append(urldefrag(urljoin(base, node[key]))[0])
            for value in node.values():
                walk(value, base)
        elif isinstance(node, list):
            for value in node:
                walk(value, base)

    walk(schema, "")
    return any(r.startswith(("http://", "https://", "urn:")) and r not in ids for r in refs)


def watch_rejects(matcher: Any, tokens: list[int], token_bytes: Any) -> bool:
    """Whether the value checks of a resampling request reject this output."""
    from grammar.value_watch import ValueWatch

    if matcher.watch_plan is None or not matcher.unenforced_keywords:
        return False
    watch = ValueWatch(matcher.watch_plan, matcher.unenforced_keywords, matcher.validator)
    for tok in tokens:
        if watch.feed(token_bytes(tok)) is not None:
            return True
    return watch.finish() is not None


def evaluate(
    compiler: Any,
    suite: dict[str, list[dict[str, Any]]],
    backends: Iterable[str] = BACKENDS,
) -> Report:
    from grammar import GrammarError, GrammarSpec
    from grammar.vocab import token_bytes

    tok = compiler.tokenizer_data
    read = token_bytes(tok)
    stop_id = tok.eos_token_ids[0]
    bitmask = compiler.allocate_bitmask(1)
    report = Report()
    start = time.perf_counter()
    for keyword, groups in suite.items():
        tallies = {b: Tally() for b in backends}
        report.per_keyword[keyword] = tallies
        for group in groups:
            spec = GrammarSpec("json_schema", json.dumps(group["schema"]))
            remote = needs_remote(group["schema"])
            cases = [
                (t["valid"], tok.encode(json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)))
                for t in group["tests"]
            ]
            accepted: dict[str, int] = {}
            unenforced: dict[str, float] = {}
            for backend in backends:
                tally = tallies[backend]
                tally.groups += 1
                checked = backend == "default"
                try:
                    matcher = compiler.compile(spec, backend="auto" if checked else backend)
                    tally.compiled += 1
                except GrammarError:
                    matcher = None
                accepted[backend] = 0
                unenforced[backend] = len(matcher.unenforced_keywords) if matcher is not None else float("inf")
                if checked and matcher is not None:
                    tally.strict_refused += set(matcher.unenforced_keywords) != set(matcher.resampled_keywords)
                validator = getattr(matcher, "validator", None)
                for (valid, tokens), test in zip(cases, group["tests"], strict=True):
                    ok = matcher is not None and run_instance(matcher, tokens, bitmask, stop_id)
                    if ok and checked:
                        ok = not watch_rejects(matcher, tokens, read)
                    if valid:
                        tally.valid += 1
                        tally.valid_accepted += ok
                        accepted[backend] += ok
                        tally.valid_remote += remote
                        tally.valid_remote_accepted += ok and remote
                    else:
                        tally.invalid += 1
                        tally.invalid_rejected += not ok
                        if ok and validator is not None:
                            tally.invalid_caught_by_validator += not validator.validate(
                                test["data"]).valid
                        if ok and matcher is not None and not matcher.unenforced_keywords:
                            tally.invalid_missed_when_enforced += 1
            if "auto" in accepted and any(
                    accepted.get(b, 0) > accepted["auto"] and unenforced[b] <= unenforced["auto"]
                    for b in ("xgrammar", "llguidance")):
                report.auto_behind.append(f"{keyword}: {group.get('description', '')}")
    report.seconds = time.perf_counter() - start
    return report


def markdown(report: Report, backends: Iterable[str] = BACKENDS) -> str:
    backends = list(backends)
    head = "| keyword | " + " | ".join(f"{b} valid ✓ | {b} invalid ✗" for b in backends) + " |"
    sep = "|---|" + "---|---|" * len(backends)
    lines = [head, sep]

    def row(name: str, tallies: dict[str, Tally]) -> str:
        cells = []
        for b in backends:
            t = tallies[b]
            cells.append(f"{t.valid_accepted}/{t.valid}")
            cells.append(f"{t.invalid_rejected}/{t.invalid}")
        return f"| {name} | " + " | ".join(cells) + " |"

    for keyword, tallies in report.per_keyword.items():
        lines.append(row(keyword, tallies))
    totals = {b: report.total(b) for b in backends}
    lines.append(row("**total**", totals))
    pct = []
    for b in backends:
        t = totals[b]
        pct.append(f"{100 * t.valid_accepted / max(t.valid, 1):.1f}%")
        pct.append(f"{100 * t.invalid_rejected / max(t.invalid, 1):.1f}%")
    lines.append("| **rate** | " + " | ".join(pct) + " |")
    remote = []
    for b in backends:
        t = totals[b]
        remote += [f"{t.valid_remote_accepted}/{t.valid_remote}", ""]
    lines.append("| of which behind a `$ref` to another document (schema store) | "
                 + " | ".join(remote) + " |")
    flagged = []
    for b in backends:
        t = totals[b]
        caught = t.invalid_rejected + t.invalid_caught_by_validator
        flagged += ["", f"{caught}/{t.invalid} ({100 * caught / max(t.invalid, 1):.1f}%)"]
    lines.append("| **invalid rejected or flagged INVALID by the output validator** | "
                 + " | ".join(flagged) + " |")
    compiled = " | ".join(f"{totals[b].compiled}/{totals[b].groups} | " for b in backends)
    lines.append(f"| schemas compiled | {compiled}|")
    if "default" in totals:
        cells = " | ".join(f"{totals[b].strict_refused} | " if b == "default" else " | " for b in backends)
        lines.append(f"| schemas strict refuses | {cells}|")
    return "\n".join(lines)


def suite_store(suite_dir: Path) -> Any:
    """The schema store that serves the suite's remote documents, which it
    expects at http://localhost:1234/ (None when the suite has none)."""
    from grammar.schema_store import SchemaStore

    remotes = suite_dir / "_remotes"
    return SchemaStore({"http://localhost:1234/": remotes}) if remotes.is_dir() else None


def make_compiler(timeout_s: float, store: Any = None) -> Any:
    from transformers import AutoTokenizer

    from grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    return GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=timeout_s,
        schema_store=store,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, default=DEFAULT_SUITE)
    parser.add_argument("--timeout", type=float, default=5.0, help="per-schema compile timeout (s)")
    parser.add_argument("--json", type=Path, help="also write the raw tallies here")
    parser.add_argument("--no-store", action="store_true",
                        help="no schema store: a `$ref` to another document stays unresolved")
    args = parser.parse_args(argv)
    if not args.suite.is_dir():
        print(f"suite not found at {args.suite}", file=sys.stderr)
        return 2
    suite = load_suite(args.suite)
    store = None if args.no_store else suite_store(args.suite)
    with make_compiler(args.timeout, store) as compiler:
        report = evaluate(compiler, suite)
    print(markdown(report))
    print(f"\n{sum(len(g) for g in suite.values())} schema groups, {report.seconds:.1f} s")
    if args.json:
        raw = {k: {b: vars(t) for b, t in v.items()} for k, v in report.per_keyword.items()}
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
