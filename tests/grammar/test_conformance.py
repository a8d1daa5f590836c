"""JSON-Schema-Test-Suite (draft 2020-12) through every backend and `auto`.

The runner lives in bench/grammar_conformance.py (which also prints the table
for BENCHMARKS.md); this test asserts that `auto` accepts at least as many valid
instances as the better single backend, plus sanity floors.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from grammar import GrammarCompiler

from .conftest import MODEL_VOCAB, REPO, STOP_IDS

SUITE = REPO / "tests/data/json-schema-test-suite"


def _runner():
    spec = importlib.util.spec_from_file_location(
        "grammar_conformance", REPO / "bench/grammar_conformance.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tokenizer):
    if not SUITE.is_dir():
        pytest.skip(f"JSON-Schema-Test-Suite not found at {SUITE}")
    runner = _runner()
    with GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=5.0,
        schema_store=runner.suite_store(SUITE),
    ) as compiler:
        return runner.evaluate(compiler, runner.load_suite(SUITE))


def test_suite_covers_every_keyword(report):
    assert len(report.per_keyword) >= 40
    total = report.total("auto")
    assert total.groups >= 350 and total.valid >= 700 and total.invalid >= 500


def test_auto_is_at_least_as_good_as_either_backend(report):
    # Schema by schema: no backend that enforces as much as auto's choice
    # accepts more valid instances. (In total xgrammar may accept more: an
    # untyped node's `format` or `properties` it leaves open to every value.)
    # Known exceptions: an integer const/enum whose instance the suite spells
    # as a float (0.0, 1.0, -2, 2**53 as 9007199254740992.0): only xgrammar
    # takes that spelling, and at a tie auto prefers llguidance; a model
    # writes the integer. And a `format` the suite takes as an annotation
    # (any string is valid) where xgrammar's check is looser than
    # llguidance's: its date-time takes February 31st.
    known = {
        "format: date-time format",
        "const: const with 0 does not match other zero-like types",
        "const: const with 1 does not match true",
        "const: const with -2.0 matches integer and float types",
        "const: float and integers are equal up to 64-bit representation limits",
        "enum: enum with 0 does not match false",
        "enum: enum with 1 does not match true",
    }
    assert set(report.auto_behind) <= known
    auto = report.total("auto")
    # The target is 95%; 96.7% measured with the suite's remote
    # documents in the schema store. Grammar alone rejects 65.0% of the
    # invalid instances (the value checks the rest: see the last test).
    assert auto.valid_accepted / auto.valid >= 0.95
    assert auto.invalid_rejected / auto.invalid >= 0.63
    # The suite's valid instances behind a `$ref` to another document: the
    # store serves them (the two left need the metaschema, $dynamicRef throughout).
    assert auto.valid_remote == 23 and auto.valid_remote_accepted >= 21


def test_strict_backend_never_accepts_what_it_cannot_enforce(report):
    # A grammar that reports every keyword of its schema as enforced rejects
    # every invalid instance token by token: the keyword tables are honest.
    for backend in ("xgrammar", "llguidance", "auto"):
        for keyword, tallies in report.per_keyword.items():
            assert tallies[backend].invalid_missed_when_enforced == 0, (backend, keyword)


def test_every_invalid_instance_is_rejected_or_flagged(report):
    # What the grammar lets through, the output validator reports as INVALID.
    for backend in ("xgrammar", "llguidance", "auto"):
        t = report.total(backend)
        assert t.invalid_rejected + t.invalid_caught_by_validator == t.invalid, backend


def test_remote_references_resolve_from_the_store(report):
    # Every refRemote schema's documents are in the store: inlined, they are
    # enforced like bundled ones (nothing fetched).
    t = report.per_keyword["refRemote"]["auto"]
    assert t.compiled == t.groups and t.valid_accepted == t.valid
    assert t.invalid_rejected == t.invalid


def test_core_keywords_fully_supported_by_auto(report):
    for keyword in ("properties", "required", "items", "prefixItems", "boolean_schema", "anyOf"):
        t = report.per_keyword[keyword]["auto"]
        assert t.valid_accepted == t.valid, keyword


def test_default_requests_reject_every_invalid_instance_and_no_valid_one(report):
    # A default request is `auto` plus the value checks that drive resampling
    # (grammar/value_watch.py): every invalid instance the grammar lets
    # through breaks a checked value (the target for auto is 90%),
    # and no valid instance is refused that the grammar accepts.
    auto, default = report.total("auto"), report.total("default")
    assert default.invalid_rejected == default.invalid
    assert default.valid_accepted == auto.valid_accepted
    assert default.strict_refused <= 10
