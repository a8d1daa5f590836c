"""Every spec kind on every backend: token-by-token acceptance, rejection, EOS, masks."""

from __future__ import annotations

import json

import pytest
import torch

from grammar import GrammarOptions, GrammarSpec, _xgr

from .conftest import BACKENDS, MODEL_VOCAB, SPECIAL_NON_STOP, STOP_IDS, allowed, feed

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

CASES = {
    "json_schema": (
        GrammarSpec.json_schema(PERSON),
        ['{"name":"Bob","age":12}', '{"name":"Ann \\"A\\"","age":-3}'],
        [
            '{"name":12,"age":1}',
            '{"name":"Bob","age":"x"}',
            '{"name": "Bob","age":1}',
            '{"name":"Bob"}',
        ],
        ['{"name":"Bob"', '{"name":"Bob","age":1'],
    ),
    "json_object": (
        GrammarSpec.json_object(),
        ['{"a":[1,{"b":null}],"c":"d"}', "{}"],
        ["[1]", '"x"', '{"a": 1}'],
        ['{"a":1', "{"],
    ),
    "regex": (
        GrammarSpec.regex(r"\d{3}-\d{4}"),
        ["555-1234"],
        ["5551234", "555-12345", "abc"],
        ["555-", "555-123"],
    ),
    "choice": (
        GrammarSpec.choice(["yes", "no", "maybe so"]),
        ["yes", "no", "maybe so"],
        ["yess", "nope", "maybe not"],
        ["ye", "maybe"],
    ),
    "ebnf": (
        GrammarSpec.ebnf('root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
        ["(1,22,333)", "(7)"],
        ["(1,,2)", "(a)", "(1))"],
        ["(1,", "(12"],
    ),
    "lark": (
        GrammarSpec.lark('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'),
        ["(1,22,333)", "(7)"],
        ["(1,,2)", "(a)", "(1))"],
        ["(1,", "(12"],
    ),
    # vLLM's structural tag: free text, and calls whose contents follow a schema.
    "structural_tag": (
        GrammarSpec.structural_tag({"structures": [{"begin": "<fn=add>", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "end": "</fn>"}],
            "triggers": ["<fn="]}),
        ['Sure. <fn=add>{"a":1}</fn> and <fn=add>{"a": 22}</fn>!', "no call at all"],
        ['<fn=add>{"a":"x"}</fn>', '<fn=sub>{"a":1}</fn>', '<fn=add>{"b":1}</fn>'],
        ['<fn=add>{"a":1', "x <fn=add>"],
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(CASES))
def test_kind_on_backend(compiler, backend, kind):
    spec, valid, invalid, incomplete = CASES[kind]
    matcher = compiler.compile(spec, backend=backend)
    assert matcher.backend == backend
    tok = compiler.tokenizer_data
    bitmask = compiler.allocate_bitmask(1)
    for text in valid:
        matcher.reset()
        assert feed(matcher, tok.encode(text), bitmask), text
        assert matcher.can_terminate() and not matcher.is_terminated()
        assert matcher.accept_token(torch.tensor(STOP_IDS[1]))  # sampler output as-is
        assert matcher.is_terminated()
        assert not matcher.accept_token(tok.encode("x")[0])  # nothing after the stop token
        matcher.fill_bitmask(bitmask, 0)
        assert allowed(bitmask) == set(STOP_IDS)
    for text in invalid:
        matcher.reset()
        assert not feed(matcher, tok.encode(text), bitmask), text
        assert matcher.error() is None  # a rejected token is not an error
    for text in incomplete:
        matcher.reset()
        assert feed(matcher, tok.encode(text), bitmask), text
        assert not matcher.can_terminate()
        assert not any(matcher.accept_token(s) for s in STOP_IDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_token_leaves_matcher_unchanged(compiler, backend):
    matcher = compiler.compile(GrammarSpec.json_schema(PERSON), backend=backend)
    tok = compiler.tokenizer_data
    bitmask = compiler.allocate_bitmask(2)
    prefix = tok.encode('{"name":"Bob"')
    assert matcher.accept_tokens(prefix) == len(prefix)
    before = matcher.num_accepted
    matcher.fill_bitmask(bitmask, 0)
    # `}` (age is required), `{`, a stop token, a special token, padding ids, junk ids
    for bad in [*tok.encode("}"), *tok.encode("{"), STOP_IDS[0], 2, 8191 + 50, MODEL_VOCAB + 5, -1]:
        assert not matcher.accept_token(bad), bad
    matcher.fill_bitmask(bitmask, 1)
    assert matcher.num_accepted == before
    assert allowed(bitmask, 0) == allowed(bitmask, 1)
    assert matcher.error() is None
    assert feed(matcher, tok.encode(',"age":3}'), bitmask) and matcher.can_terminate()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_never_allows_specials_or_padding(compiler, backend):
    matcher = compiler.compile(GrammarSpec.json_schema(PERSON), backend=backend)
    tok = compiler.tokenizer_data
    bitmask = compiler.allocate_bitmask(3)
    assert tuple(bitmask.shape) == (3, (MODEL_VOCAB + 31) // 32)
    assert tok.tokenizer_size == 8192 < compiler.vocab_size == MODEL_VOCAB
    matcher.accept_tokens(tok.encode('{"name":"'))  # inside a string: almost anything goes
    matcher.fill_bitmask(bitmask, 2)
    ids = allowed(bitmask, 2)
    assert len(ids) > 7000
    assert not ids & set(SPECIAL_NON_STOP)  # <|im_start|> is not string text
    assert not ids & set(STOP_IDS)  # cannot stop inside a string
    assert max(ids) < tok.tokenizer_size  # padded ids never allowed


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_and_reset(compiler, backend):
    matcher = compiler.compile(GrammarSpec.json_schema(PERSON), backend=backend)
    tok = compiler.tokenizer_data
    bitmask = compiler.allocate_bitmask(1)
    tokens = tok.encode('{"name":"Bob","age":12}')
    assert feed(matcher, tokens, bitmask)
    assert matcher.accept_token(STOP_IDS[0]) and matcher.is_terminated()
    matcher.rollback(1)  # un-stop
    assert not matcher.is_terminated() and matcher.can_terminate()
    matcher.rollback(3)
    assert not matcher.can_terminate()
    assert matcher.num_accepted == len(tokens) - 3
    assert feed(matcher, tokens[-3:], bitmask)
    assert matcher.accept_token(STOP_IDS[1])
    with pytest.raises(ValueError):
        matcher.rollback(len(tokens) + 5)
    matcher.reset()
    assert matcher.num_accepted == 0 and not matcher.is_terminated()
    assert feed(matcher, tokens, bitmask) and matcher.can_terminate()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matchers_are_independent(compiler, backend):
    spec = GrammarSpec.choice(["alpha", "beta"])
    a, b = compiler.compile(spec, backend=backend), compiler.compile(spec, backend=backend)
    tok = compiler.tokenizer_data
    assert a.accept_tokens(tok.encode("alpha")) == len(tok.encode("alpha"))
    assert b.num_accepted == 0 and not b.can_terminate()
    assert b.accept_tokens(tok.encode("beta")) == len(tok.encode("beta"))


# ---- forced (jump-ahead) tokens ---------------------------------------------

KEYED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}


def _check_forced(matcher, tok) -> list[int]:
    forced = matcher.forced_tokens()
    before = matcher.num_accepted
    assert matcher.forced_tokens() == forced  # a pure query
    assert matcher.num_accepted == before
    text = tok._encoder.decode(forced) if forced else ""
    assert tok.encode(text) == forced, "forced tokens must be the canonical tokenization"
    assert all(t not in STOP_IDS for t in forced)
    assert matcher.accept_tokens(forced) == len(forced)
    return forced


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tokens_for_key_heavy_schema(compiler, backend):
    matcher = compiler.compile(GrammarSpec.json_schema(KEYED), backend=backend)
    tok = compiler.tokenizer_data
    forced = _check_forced(matcher, tok)
    # `{"name":` is forced; the opening quote of the value is held back because
    # it could merge with what the model writes next (e.g. into `""` or `","`).
    assert tok._encoder.decode(forced) == '{"name":'
    assert forced == tok.encode('{"name":"')[: len(forced)]
    # The model writes the value; the next key and its punctuation are forced.
    assert matcher.accept_tokens(tok.encode('"Bob"')) == len(tok.encode('"Bob"'))
    forced = _check_forced(matcher, tok)
    assert tok._encoder.decode(forced) == ',"age":'
    assert matcher.accept_tokens(tok.encode("41")) == 1
    # After a number the model may still add digits, so nothing is forced.
    assert matcher.forced_tokens() == []
    assert matcher.accept_tokens(tok.encode(',"address":{"city":"Oslo","zip":"0150"}}')) > 0
    assert matcher.can_terminate()
    assert matcher.forced_tokens() == []  # stop tokens are never forced


def test_forced_tokens_agree_across_backends(compiler):
    tok = compiler.tokenizer_data
    for spec in [
        GrammarSpec.json_schema(KEYED),
        GrammarSpec.choice(["application/json", "application/xml"]),
        GrammarSpec.regex(r"item-[0-9]+"),
        GrammarSpec.choice(["hello world"]),
    ]:
        results = [_check_forced(compiler.compile(spec, backend=b), tok) for b in BACKENDS]
        assert results[0] == results[1], spec
        assert results[0], spec


def test_forced_tokens_whole_remaining_output(compiler):
    # When nothing can follow, the last token is not held back.
    tok = compiler.tokenizer_data
    for backend in BACKENDS:
        matcher = compiler.compile(GrammarSpec.choice(["hello world"]), backend=backend)
        assert matcher.forced_tokens() == tok.encode("hello world")


def _sentencepiece_tokenizer(root, legacy: bool):
    """A Llama-2-style (`legacy`: a prepended U+2581) or Mistral-style
    (Metaspace, prepended to the first piece) tokenizer with byte fallback."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for ch in "\u2581abcdefghijklmnopqrstuvwxyz0123456789:{}\",":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                         decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>") \
        .save_pretrained(root)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root)


@pytest.mark.parametrize("legacy", [True, False], ids=["llama2-legacy", "metaspace-first"])
def test_sentencepiece_tokenizers_get_forced_tokens_on_both_backends(tmp_path, legacy):
    # xgrammar tokenized a forced string as a text of its own, which these
    # tokenizers start with a space token the grammar refuses: nothing was
    # ever forced with Llama-2- or Mistral-style tokenizers.
    from grammar import GrammarCompiler

    hf = _sentencepiece_tokenizer(tmp_path / "tok", legacy)
    with GrammarCompiler(hf, eos_token_ids=[2], compile_timeout_s=10.0) as comp:
        tok = comp.tokenizer_data
        assert tok.encode_after('{"name":') == [hf.convert_tokens_to_ids(c) for c in '{"name":']
        assert tok.encode_after(" ab") == [hf.convert_tokens_to_ids(c) for c in "\u2581ab"]
        forced = {}
        for backend in BACKENDS:
            matcher = comp.compile(GrammarSpec.json_schema(KEYED), backend=backend)
            first = matcher.forced_tokens()
            value = 'bob"' if tok._encoder.decode(first).endswith(':"') else '"bob"'
            written = [hf.convert_tokens_to_ids(c) for c in value]
            assert matcher.accept_tokens(first) == len(first)
            assert matcher.accept_tokens(written) == len(written)
            forced[backend] = (tok._encoder.decode(first), tok._encoder.decode(matcher.forced_tokens()))
        assert forced["xgrammar"] == forced["llguidance"]
        assert forced["xgrammar"][0].startswith('{"name":') and forced["xgrammar"][1] == ',"age":'


# ---- whitespace styles ------------------------------------------------------

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
    },
}
VALUE = {"id": 7, "tags": ["a", "b"], "meta": {"ok": True}}


def _inside_string(prefix: str) -> bool:
    inside = escaped = False
    for ch in prefix:
        if escaped:
            escaped = False
        elif ch == "\\" and inside:
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _whitespace_only(tok) -> list[int]:
    vocab = _xgr.vocab_index(tok)
    return [
        i
        for i in range(tok.tokenizer_size)
        if vocab.token_bytes(i) and not vocab.token_bytes(i).strip(b" \t\r\n")
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_default_allows_no_whitespace(compiler, backend):
    tok = compiler.tokenizer_data
    spec = GrammarSpec.json_schema(NESTED)
    matcher = compiler.compile(spec, backend=backend)
    bitmask = compiler.allocate_bitmask(1)
    blanks = set(_whitespace_only(tok))
    text = json.dumps(VALUE, separators=(",", ":"))
    tokens = tok.encode(text)
    for i, token in enumerate(tokens):
        matcher.fill_bitmask(bitmask, 0)
        if not _inside_string(tok._encoder.decode(tokens[:i])):
            assert not allowed(bitmask) & blanks, "a whitespace run must be impossible"
        assert matcher.accept_token(token)
    assert matcher.can_terminate()
    matcher.reset()
    assert not feed(matcher, tok.encode(json.dumps(VALUE)), bitmask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flexible_whitespace_is_bounded(compiler, backend):
    tok = compiler.tokenizer_data
    spec = GrammarSpec.json_schema(NESTED, GrammarOptions("flexible", max_whitespace=4))
    matcher = compiler.compile(spec, backend=backend)
    bitmask = compiler.allocate_bitmask(1)
    for text in [json.dumps(VALUE), '{ "id" : 7 ,\n "tags" : [ "a" ] }', '{"id":1}']:
        matcher.reset()
        assert feed(matcher, tok.encode(text), bitmask), text
        assert matcher.can_terminate()
    for text in ['{"id":     7}', "{" + " " * 40]:
        matcher.reset()
        assert not feed(matcher, tok.encode(text), bitmask), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_pretty_accepts_indented_json(compiler, backend):
    tok = compiler.tokenizer_data
    spec = GrammarSpec.json_schema(NESTED, GrammarOptions("pretty", indent=2))
    matcher = compiler.compile(spec, backend=backend)
    bitmask = compiler.allocate_bitmask(1)
    assert feed(matcher, tok.encode(json.dumps(VALUE, indent=2)), bitmask)
    assert matcher.can_terminate()
    matcher.reset()
    assert not feed(matcher, tok.encode('{"id":' + " " * 80), bitmask)


def test_xgrammar_bounded_strings_exclude_control_characters(compiler) -> None:
    """xgrammar writes length-bounded strings with a character class that lets
    raw control characters in; the compiler narrows it to valid JSON."""
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 12}},
                         "required": ["s"]})
    matcher = compiler.compile(GrammarSpec.json_schema(schema), backend="xgrammar")
    data = compiler.tokenizer_data
    for tok in data.encode('{"s":"ab'):
        assert matcher.accept_token(tok)
    bitmask = compiler.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    control = {t for t in range(len(data.encoded_vocab)) if any(b < 0x20 for b in _xgr.token_bytes(data, t))}
    assert control and not allowed(bitmask) & control


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [GrammarSpec.choice(["\u65e5\u672c", "\u65e5\u66dc"]),
                                  GrammarSpec.ebnf('root ::= "x" ("\u00e9" | "\u00e8")')], ids=["cjk", "accents"])
def test_a_forced_run_ending_inside_a_character_forces_what_is_whole(compiler, tokenizer, backend, spec):
    # xgrammar's forced string stopped inside a character ("日本" | "日曜"
    # share its first bytes) and its binding raised on decoding it.
    matcher = compiler.compile(spec, backend=backend)
    forced = matcher.forced_tokens()
    assert matcher.accept_tokens(forced) == len(forced)
    assert "\ufffd" not in tokenizer.decode(forced) or backend == "llguidance"  # llguidance forces bytes


def test_llguidance_reads_non_special_added_tokens_as_text(tokenizer):
    # Qwen's <tool_call> and </tool_call> are added tokens marked not special:
    # llguidance allowed (and forced) them, then refused to consume them.
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from grammar import GrammarCompiler

    from .conftest import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tool_call, end = (tok.get_vocab()[t] for t in ("<tool_call>", "</tool_call>"))
    with GrammarCompiler(tok, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread") as c:
        for spec in (GrammarSpec.regex(r"<tool_call>\n[a-z]+\n</tool_call>"),
                     GrammarSpec.lark('start: "<tool_call>" /[a-z]+/ "</tool_call>"')):
            matcher = c.compile(spec, backend="llguidance")
            bitmask = c.allocate_bitmask(1)
            matcher.fill_bitmask(bitmask, 0)
            # What the mask allows, the matcher takes (it may take more: the
            # mask keeps to canonical tokenizations, which spell the tag out).
            assert tool_call not in allowed(bitmask) or matcher.accept_token(tool_call)
        matcher = c.compile(GrammarSpec.regex(r"ab</tool_call>"), backend="llguidance")
        assert matcher.accept_tokens(tok.encode("a", add_special_tokens=False)) == 1
        forced = matcher.forced_tokens()
        assert forced and matcher.accept_tokens(forced) == len(forced)
        assert matcher.accept_token(end) or matcher.can_terminate()


@pytest.mark.parametrize("source", ['start: "a" <|im_end|>', 'start: "a" (<|end_of_text|> | "c")',
                                    'start: "a" <[3]>'])
def test_a_grammar_naming_a_stop_token_is_refused(compiler, source):
    # llguidance's mask allowed (and forced) the stop token the grammar names,
    # and consuming it was the end, refused before the grammar was complete:
    # every such request failed as a server fault.
    from grammar import GrammarError

    with pytest.raises(GrammarError, match="is a stop token"):
        compiler.compile(GrammarSpec.lark(source), backend="llguidance")
    compiler.compile(GrammarSpec.lark('start: "a" "<|im_end|>x"'), backend="llguidance")  # as text, in quotes


def test_a_token_reference_past_the_tokenizer_is_refused(compiler):
    # The model's padding ids (8192..8319 here) have no text.
    from grammar import GrammarError

    for source in ('start: "a" <[8300]>', 'start: "a" <[8190-8200]>'):
        with pytest.raises(GrammarError, match="past the tokenizer"):
            compiler.compile(GrammarSpec.lark(source), backend="llguidance")
    compiler.compile(GrammarSpec.lark('start: "a" <[8191]>'), backend="llguidance")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", [" ", "\t", "  "])
def test_a_regex_of_whitespace_alone_matches_it(compiler, backend, pattern):
    # It was refused as an empty source (INVALID_ARGUMENT for a valid regex).
    matcher = compiler.compile(GrammarSpec.regex(pattern), backend=backend)
    tok = compiler.tokenizer_data
    assert matcher.accept_tokens(tok.encode(pattern)) == len(tok.encode(pattern)) and matcher.can_terminate()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_only_the_config_calls_special_is_text_to_the_grammar(tmp_path, backend):
    # tokenizer_config.json listed `<tool_call>` as special, tokenizer.json
    # not: every response printed it as text, but the grammar gave it no text
    # (xgrammar never allowed it where `<tool_call>` was due).
    from transformers import AutoTokenizer

    from grammar import GrammarCompiler
    from grammar.vocab import token_bytes

    from .conftest import TOKENIZER_DIR

    hf = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    hf.add_tokens(["<tool_call>"])
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "additional_special_tokens": ["<tool_call>"]}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    tag = hf.convert_tokens_to_ids("<tool_call>")
    assert tag in hf.all_special_ids and hf.backend_tokenizer.decode([tag], skip_special_tokens=True) == "<tool_call>"
    with GrammarCompiler(hf, eos_token_ids=list(STOP_IDS), compile_timeout_s=10.0) as comp:
        assert token_bytes(comp.tokenizer_data)(tag) == b"<tool_call>"
        matcher = comp.compile(GrammarSpec.regex("<tool_call>[a-z]*"), backend=backend)
        assert matcher.accept_token(tag) and matcher.accept_tokens(comp.tokenizer_data.encode("ab")) == 1
