"""A compile handed to another compiler (grammar/export.py): loaded, not compiled
again, and the matchers it makes mask exactly as the exporter's do."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
import threading

import pytest
import torch

from grammar import CompiledExport, GrammarCompiler, GrammarSpec, Matcher
from grammar.export import ExportSlot

from .conftest import MODEL_VOCAB, STOP_IDS

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
          "items": {"type": "string", "maxLength": 4}, "uniqueItems": True}}, "required": ["id", "tags"]}
# (spec, the backend asked for, text the grammar accepts)
CASES = [
    (GrammarSpec.json_schema(SCHEMA), "auto", '{"id":12,"tags":["ab","c"]}'),
    (GrammarSpec.json_schema(SCHEMA), "xgrammar", '{"id":7,"tags":[]}'),
    (GrammarSpec.ebnf('root ::= "yes" | "no" | [0-9]+'), "auto", "2024"),
    (GrammarSpec.regex("[a-z]{2,6}@example\\.(com|org)"), "auto", "mail@example.org"),
]


def _compiler(tokenizer, **options) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                           compile_timeout_s=10.0, **options)


@pytest.fixture(scope="module")
def exporter(tokenizer):
    with _compiler(tokenizer, export_compiled=True) as c:  # worker processes, as a server's
        yield c


def _masks(matcher: Matcher, tokens: list[int]) -> list[torch.Tensor]:
    """The matcher's mask before each token and after the last."""
    out = []
    for tok in [*tokens, None]:
        bitmask = torch.zeros(1, (MODEL_VOCAB + 31) // 32, dtype=torch.int32)
        matcher.fill_bitmask(bitmask, 0)
        out.append(bitmask)
        if tok is not None:
            assert matcher.accept_token(tok)
    return out


@pytest.mark.parametrize("spec, backend, text", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_a_loaded_compile_masks_as_the_exporters(exporter, tokenizer, spec, backend, text) -> None:
    sent = exporter.compile(spec, backend)
    export = sent.export
    assert isinstance(export, CompiledExport) and export.backend == sent.backend
    export = pickle.loads(pickle.dumps(export))  # as it crosses to an engine process
    assert exporter.compile(spec, backend).export is None  # a cache hit: the other side has it already
    with _compiler(tokenizer, isolation="thread") as receiver:
        got = receiver.compile_async(spec, sent.backend, given=export).result(timeout=30)
        assert receiver.counts.run == 0 and receiver.counts.loaded == 1
        assert got.backend == sent.backend and got.export is None
        # Everything the compile gives a matcher besides the grammar is there too.
        assert got.unenforced_keywords == sent.unenforced_keywords
        assert (got.validator is None) == (sent.validator is None)
        assert (got.watch_plan is None) == (sent.watch_plan is None)
        tokens = exporter.tokenizer_data.encode(text)
        fresh = exporter.compile(spec, backend)
        assert all(torch.equal(a, b) for a, b in zip(_masks(fresh, tokens), _masks(got, tokens), strict=True))
        assert got.validator is None or got.validator.validate_text(text).valid


def test_an_in_process_xgrammar_compile_is_exported_serialized(tokenizer) -> None:
    spec = GrammarSpec.ebnf('root ::= "on" | "off"')
    with _compiler(tokenizer, isolation="thread", export_compiled=True) as c:
        export = c.compile(spec, "xgrammar").export
    assert export is not None and "json" in export.payload and "compiled" not in export.payload
    pickle.dumps(export)


def test_requests_sharing_a_compile_send_its_export_once(exporter) -> None:
    spec = GrammarSpec.ebnf('root ::= "shared" [0-9]{1,3}')
    futures = [exporter.compile_async(spec, "xgrammar") for _ in range(3)]  # one compile, three waiters
    exports = [f.result(timeout=30).export for f in futures]
    assert sum(e is not None for e in exports) == 1


def test_an_export_that_fails_leaves_the_compile_alone(tokenizer, monkeypatch, caplog) -> None:
    from grammar import compiler as compiler_module

    def fail(payload):
        raise RuntimeError("cannot serialize")

    monkeypatch.setattr(compiler_module, "portable_payload", fail)
    spec = GrammarSpec.ebnf('root ::= "kept" [a-z]*')
    with _compiler(tokenizer, isolation="thread", export_compiled=True) as c, caplog.at_level(logging.WARNING):
        assert c.compile(spec, "xgrammar").export is None
        assert c.compile(spec, "xgrammar").accept_tokens(c.tokenizer_data.encode("kept")) > 0  # cached, not failed
    assert "could not export" in caplog.text


def test_a_compiler_without_export_gives_none(compiler) -> None:
    assert compiler.compile(GrammarSpec.regex("no-export-[0-9]"), "llguidance").export is None


def _given_elsewhere(exporter, spec: GrammarSpec, backend: str) -> CompiledExport:
    matcher = exporter.compile(spec, backend)
    assert matcher.export is not None
    return matcher.export


@pytest.mark.parametrize("change", ["fingerprint", "backend", "spec", "payload"])
def test_a_given_compile_that_does_not_fit_is_compiled_here(exporter, tokenizer, change, caplog) -> None:
    spec = GrammarSpec.ebnf(f'root ::= "{change}" [a-c]*')
    export = _given_elsewhere(exporter, spec, "xgrammar")
    if change == "fingerprint":
        export = dataclasses.replace(export, fingerprint="another tokenizer")
    elif change == "backend":
        export = dataclasses.replace(export, backend="llguidance")
    elif change == "spec":  # another grammar's compile, sent with this spec
        export = dataclasses.replace(export, spec=GrammarSpec.ebnf('root ::= "other"'))
    else:
        export = dataclasses.replace(export, payload={"json": "{not a grammar", "size": 1})
    with _compiler(tokenizer, isolation="thread") as receiver, caplog.at_level(logging.WARNING):
        got = receiver.compile_async(spec, "xgrammar", given=export).result(timeout=30)
        assert receiver.counts.run == 1 and receiver.counts.loaded == 0
    assert got.accept_tokens(receiver.tokenizer_data.encode(change + "abc")) > 0
    assert ("could not load" in caplog.text) == (change == "payload")


def test_an_export_is_taken_once_whatever_the_threads() -> None:
    # A compile's runner and a caller joining as it finished both make a matcher
    # from it; a read-then-clear could give both the export (loaded twice; a
    # window of a few bytecodes, which this rarely hits: it checks the contract).
    export = CompiledExport("f", "xgrammar", GrammarSpec.regex("a"), {})
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(50):
            slot = ExportSlot(export)
            start = threading.Barrier(4)
            got: list[CompiledExport | None] = []

            def take(slot: ExportSlot = slot, start: threading.Barrier = start,
                     got: list[CompiledExport | None] = got) -> None:
                start.wait()
                got.append(slot.take())

            threads = [threading.Thread(target=take) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sum(g is export for g in got) == 1 and got.count(None) == 3
    finally:
        sys.setswitchinterval(interval)
