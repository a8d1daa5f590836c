"""The schema store (grammar/schema_store.py): documents a `$ref` names by URI,
read from a local directory, inlined by the normalizer and read by the
validators; anything outside it stays unresolved and fails closed."""

from __future__ import annotations

import json
import pickle

import pytest

from grammar import GrammarCompiler, GrammarError, GrammarSpec
from grammar.schema_normalize import Unresolved, normalize_schema
from grammar.schema_store import SchemaStore
from grammar.validation import SchemaValidator

from .conftest import MODEL_VOCAB, STOP_IDS

BASE = "https://schemas.example.com/"


@pytest.fixture
def store(tmp_path):
    docs = tmp_path / "docs"
    (docs / "shared").mkdir(parents=True)
    (docs / "address.json").write_text(json.dumps({
        "$defs": {"street": {"type": "string", "maxLength": 20}},
        "type": "object",
        "properties": {"street": {"$ref": "#/$defs/street"}, "zip": {"$ref": "shared/zip"}},
        "required": ["street", "zip"], "additionalProperties": False}))
    # No `.json` in the reference: the store tries the name as written, then with `.json`.
    (docs / "shared" / "zip.json").write_text(json.dumps({
        "$anchor": "zip", "type": "string", "pattern": "^[0-9]{5}$"}))
    (tmp_path / "secret.json").write_text('{"type": "null"}')
    return SchemaStore({BASE: docs})


def test_documents_by_prefix_and_relative_path(store):
    assert store.get(BASE + "address.json")["required"] == ["street", "zip"]
    assert store.get(BASE + "shared/zip#zip")["type"] == "string"  # fragment ignored, .json added
    assert store.get(BASE + "missing.json") is None
    assert store.get("https://elsewhere.example.com/address.json") is None
    assert store.get(BASE + "../secret.json") is None  # never outside its directory
    with pytest.raises(ValueError, match="not in the schema store"):
        store.retrieve(BASE + "missing.json")
    assert pickle.loads(pickle.dumps(store)) == store  # travels to compile workers


def test_odd_uris_are_misses_and_misses_are_not_remembered(store, tmp_path):
    assert store.get(BASE + "x" * 300) is None  # a name too long for the filesystem
    assert store.get(BASE + "a\x00b.json") is None  # a NUL byte
    assert store.get(BASE + "later.json") is None
    (tmp_path / "docs" / "later.json").write_text('{"type": "boolean"}')
    assert store.get(BASE + "later.json") == {"type": "boolean"}  # found once it exists
    # One cache entry per file, however the URI spells it.
    for spelling in ("address.json", "address", "./address.json", "shared/../address.json"):
        assert store.get(BASE + spelling)["required"] == ["street", "zip"]
    assert len(store._documents) == 2


def test_parse_mappings(tmp_path):
    parsed = SchemaStore.parse([f"{BASE}={tmp_path}"])
    assert parsed is not None and parsed.roots == {BASE: tmp_path.resolve()}
    assert SchemaStore.parse([]) is None
    with pytest.raises(ValueError, match="URI_PREFIX=DIRECTORY"):
        SchemaStore.parse(["no-equals-sign"])
    with pytest.raises(ValueError, match="does not exist"):
        SchemaStore.parse([f"{BASE}={tmp_path / 'nope'}"])


def test_normalizer_inlines_documents_from_the_store(store):
    schema = {"type": "object", "properties": {"home": {"$ref": BASE + "address.json"},
                                               "code": {"$ref": BASE + "shared/zip.json#zip"}}}
    out = normalize_schema(schema, store)
    home = out["properties"]["home"]
    # Pointers and relative references resolve inside the retrieved document.
    assert home["properties"]["street"] == {"type": "string", "maxLength": 20}
    assert home["properties"]["zip"] == {"type": "string", "pattern": "^[0-9]{5}$"}
    assert out["properties"]["code"] == {"type": "string", "pattern": "^[0-9]{5}$"}
    with pytest.raises(Unresolved):  # not in the store: left as written
        normalize_schema({"$ref": BASE + "missing.json"}, store)
    with pytest.raises(Unresolved):  # no store: nothing outside the schema resolves
        normalize_schema(schema)


def test_relative_refs_resolve_against_the_nearest_id():
    schema = {"$id": "http://example.com/a/root.json",
              "$defs": {"inner": {"$id": "../b/inner.json", "$defs": {"x": {"type": "integer"}},
                                  "$ref": "#/$defs/x"}},
              "properties": {"n": {"$ref": "../b/inner.json"}, "m": {"$ref": "http://example.com/b/inner.json"}}}
    out = normalize_schema(schema)
    assert out["properties"] == {"n": {"type": "integer"}, "m": {"type": "integer"}}


def test_validator_reads_the_store(store):
    schema = {"$ref": BASE + "address.json"}
    validator = SchemaValidator(schema, store)
    assert validator.validate({"street": "Main", "zip": "12345"}).valid
    bad = validator.validate({"street": "Main", "zip": "1234"})
    assert not bad.valid and bad.instance_path == "/zip" and bad.keyword == "pattern"
    with pytest.raises(ValueError):  # without the store the document cannot be read
        SchemaValidator(schema)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_compiled_grammar_enforces_a_stored_document(tokenizer, store, isolation):
    spec = GrammarSpec("json_schema", json.dumps({"$ref": BASE + "address.json"}))
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation=isolation, schema_store=store) as compiler:
        matcher = compiler.compile(spec)
        assert matcher.validator is not None
        good = tokenizer.encode('{"street":"Main","zip":"12345"}', add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in good) and matcher.can_terminate()
        matcher.reset()
        bad = tokenizer.encode('{"street":"Main","zip":"x', add_special_tokens=False)
        assert not all(matcher.accept_token(t) for t in bad)
    # The same schema without the store fails closed: it is refused, never
    # compiled as "any value".
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation=isolation) as compiler, pytest.raises(GrammarError):
        compiler.compile(spec)


def test_a_tags_verdict_reads_the_store(tokenizer, store):
    # The verdict builds the tag's grammar as the compile did: without the
    # store its remote $ref was unreadable and the verdict NOT_CHECKED.
    tag = {"structures": [{"begin": "<a>", "schema": {"$ref": BASE + "address.json"}, "end": "</a>"}],
           "triggers": ["<a>"]}
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread",
                         schema_store=store) as compiler:
        matcher = compiler.compile(GrammarSpec.structural_tag(tag))
        assert matcher.validator is not None
        assert matcher.validator.validate_text('<a>{"street": "Main", "zip": "12345"}</a>').valid
        bad = matcher.validator.validate_text('<a>{"street": "Main", "zip": "1234"}</a>')
        assert bad.checked and not bad.valid
