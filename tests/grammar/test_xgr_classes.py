"""xgrammar's character classes admit only Unicode scalar values (grammar/xgr_classes.py):
the UTF-16 surrogates, whose three-byte encodings are not UTF-8, are out of every
class, JSON strings included; a regex's `.` leaves out the newline, as in Rust."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from grammar import GrammarError, GrammarSpec
from grammar._xgr import build_grammar
from grammar.xgr_classes import scalar_classes

SURROGATE = b"\xed\xb6\x8a"  # U+DD8A, what a random model sampled inside a JSON string
EURO = "\u20ac".encode()


@pytest.fixture(scope="module")
def byte_compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<s>"], xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _accepts(compiler: xgr.GrammarCompiler, grammar: xgr.Grammar, data: bytes) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return all(matcher.accept_token(b) for b in data) and matcher.accept_token(256)


@pytest.mark.parametrize(("spec", "template"), [
    (GrammarSpec.json_schema(json.dumps({"type": "string"})), b'"%s"'),
    (GrammarSpec.json_schema(json.dumps({"type": "string", "maxLength": 5})), b'"%s"'),
    (GrammarSpec.regex("[^a]"), b"%s"),
    (GrammarSpec.regex("x."), b"x%s"),
    (GrammarSpec.regex(r"[\u0080-\uFFFF]"), b"%s"),
    (GrammarSpec.ebnf("root ::= [^a]"), b"%s"),
])
def test_surrogates_are_out_of_every_class(byte_compiler, spec: GrammarSpec, template: bytes) -> None:
    grammar = build_grammar(spec)
    assert _accepts(byte_compiler, grammar, template % EURO)
    assert not _accepts(byte_compiler, grammar, template % SURROGATE)
    # Before the rewrite xgrammar took them (the reason for it).
    raw = xgr.Grammar.from_regex("[^a]")
    assert _accepts(byte_compiler, raw, SURROGATE)


def test_a_regex_dot_is_not_a_newline(byte_compiler) -> None:
    grammar = build_grammar(GrammarSpec.regex("a.b"))
    assert _accepts(byte_compiler, grammar, b"a-b")
    assert not _accepts(byte_compiler, grammar, b"a\nb")
    assert _accepts(byte_compiler, build_grammar(GrammarSpec.regex(r"a[.]b")), b"a.b")


def test_the_rewrite_keeps_literals_and_other_classes() -> None:
    text = 'root ::= ("[" [a-z] "]" [+\\-] [^\\0-\\x1f\\"\\\\\\r\\n])'
    assert scalar_classes(text) == 'root ::= ("[" [a-z] "]" [+\\-] [^\\0-\\x1f\\"\\\\\\r\\n\\ud800-\\udfff])'
    with pytest.raises(GrammarError, match="surrogates"):
        scalar_classes("root ::= [\\ud800-\\udfff]")


@pytest.mark.parametrize(("spec", "text", "wrong"), [
    (GrammarSpec.json_schema(json.dumps({"const": "ü1"})), '"ü1"', '"\u0fc1"'),
    (GrammarSpec.json_schema(json.dumps({"enum": ["réaction", "none"]})), '"réaction"', '"r\u0e9action"'),
    (GrammarSpec.json_schema(json.dumps({"type": "object", "properties": {"année": {"type": "integer"}},
                                         "required": ["année"]})), '{"année":2024}', '{"ann\u0e9ee":2024}'),
    (GrammarSpec.ebnf('root ::= "cafée" [\u00e0-\u00ff] "1"'), "caféeà1", "caf\u0e9eà1"),
    (GrammarSpec.regex("réa"), "réa", "r\u0e9a"),
    (GrammarSpec.regex(r"\\xab"), "\\xab", "\u00ab"),  # an escaped backslash before an x stays one
])
def test_characters_printed_as_hex_escapes_read_back_whole(byte_compiler, spec: GrammarSpec, text: str,
                                                           wrong: str) -> None:
    # xgrammar prints U+0080-U+00FF as \xHH and read back every hex digit
    # after it: "é" + "a" became U+0E9A, so "réaction" was refused and the
    # wrong character allowed.
    grammar = build_grammar(spec)
    assert _accepts(byte_compiler, grammar, text.encode())
    assert not _accepts(byte_compiler, grammar, wrong.encode())
