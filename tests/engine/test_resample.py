"""JSON outputs (resampling on, the default): a value that breaks a keyword
the grammar does not enforce (a duplicate item under `uniqueItems`, a value
`not` rejects, ...) is rolled back and resampled."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.presets import ensure_preset
from engine.resample import Resampler
from engine.tokenizer import Tokenizer
from grammar import GrammarSpec

from .scripted import scripted_by_position

PROMPT = [9, 5]  # outputs start at position 2
INTS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ensure_preset("tiny-llama")))


def _script(tok: Tokenizer, text: str, alternatives: dict[int, list[str]] | None = None) -> dict[int, list[int]]:
    """A position script that writes `text` token by token; `alternatives`
    (output token index -> texts) adds more choices there, in order."""
    ids = tok.encode(text, add_special_tokens=False)
    script = {len(PROMPT) + i: [t] for i, t in enumerate(ids)}
    for i, texts in (alternatives or {}).items():
        for alt in texts:
            [alt_id] = tok.encode(alt, add_special_tokens=False)
            script[len(PROMPT) + i].append(alt_id)
    return script


def _generate(llm, schema: dict, resample: bool = True, max_new_tokens: int = 40):
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    return llm.generate([PROMPT], params, constraint=GrammarSpec.json_schema(json.dumps(schema)),
                        resample=resample)[0]


@pytest.mark.parametrize("config", [
    {"grammar_backend": "llguidance"},
    {"grammar_backend": "xgrammar"},
    {"grammar_backend": "llguidance", "overlap": False},
    {"grammar_backend": "xgrammar", "speculative_constrained": True},
    # Small pages: the rollback reaches into a page already in the prefix cache.
    {"grammar_backend": "llguidance", "page_size": 4},
])
def test_duplicate_item_is_resampled(make_llm, tok, config):
    # The model wants [1,1,2]; at the second item its second choice is 3.
    script = _script(tok, "[1,1,2]", {3: ["3"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), **config)
    out = _generate(llm, INTS)
    assert out.text == "[1,3,2]" and out.finish_reason == "eos"
    assert out.schema_retries == 1
    assert out.token_ids == llm.tokenizer.encode("[1,3,2]", add_special_tokens=False) + [out.token_ids[-1]]


def test_without_resampling_the_duplicate_stays(make_llm, tok):
    script = _script(tok, "[1,1,2]", {3: ["3"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    out = _generate(llm, INTS, resample=False)
    assert out.text == "[1,1,2]" and out.schema_retries == 0


def test_retries_per_value_are_bounded(make_llm, tok):
    # At the fifth item the model tries 1, 2, 3 and 4: three retries, then the
    # duplicate 4 stays (validation reports it).
    script = _script(tok, "[1,2,3,4,1]", {9: ["2", "3", "4", "5"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    out = _generate(llm, INTS)
    assert out.text == "[1,2,3,4,4]" and out.schema_retries == 3 and out.finish_reason == "eos"


def test_a_forced_duplicate_is_not_retried(make_llm, tok):
    # Items can only be 1: the grammar forces the second one; no choice to mask.
    schema = {"type": "array", "items": {"const": 1}, "uniqueItems": True}
    script = _script(tok, "[1,1]")
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    out = _generate(llm, schema)
    assert out.text == "[1,1]" and out.schema_retries == 0


def test_object_items_nested_in_an_object(make_llm, tok):
    schema = {"type": "object", "properties": {"xs": {
        "type": "array", "uniqueItems": True,
        "items": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                  "additionalProperties": False}}},
        "required": ["xs"], "additionalProperties": False}
    text = '{"xs":[{"a":1},{"a":1}]}'
    ids = tok.encode(text, add_special_tokens=False)
    one = [i for i, t in enumerate(ids) if tok.decode([t]) == "1"]
    script = _script(tok, text, {one[1]: ["3"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    out = _generate(llm, schema, max_new_tokens=60)
    assert json.loads(out.text) == {"xs": [{"a": 1}, {"a": 3}]} and out.schema_retries == 1


def test_the_stream_never_carries_what_a_rollback_takes_back(make_llm, tok):
    script = _script(tok, "[1,1,2]", {3: ["3"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    engine = llm.engine
    matcher = engine.structured.compile(GrammarSpec.json_schema(json.dumps(INTS)))
    ctx = engine.make_context(PROMPT, SamplingParams(temperature=0, max_new_tokens=20), matcher=matcher)
    engine.add_request(ctx)
    sent, token_ids, finished = [], [], False
    while not finished:
        for delta in engine.step():
            sent.append(delta.text)
            token_ids += delta.token_ids
            finished = finished or delta.finished
    while engine.has_work():
        engine.step()
    text = "".join(sent)
    assert text == "[1,3,2]" and ctx.schema_retries == 1
    assert tok.decode(token_ids) == text
    # An item goes out once the `,` or `]` after it shows it complete (and unique).
    assert [s for s in sent if s] == ["[", "1,", "3,", "2]"]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_rollback_into_a_token_already_sent_sends_no_token_twice(make_llm, overlap):
    # The model (lowest id first) writes `["` `a` `","` `a`: the duplicate's
    # rollback takes back the `","` token, which also closed the first item,
    # so that item is open again and the watch's stable point falls below
    # what was sent. Text was guarded, token ids and log-probabilities were
    # not: the stream sent `["` `a` again and the ids spelled `["a["a","b"...`.
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 3, "maxItems": 3,
              "uniqueItems": True}
    llm = make_llm("tiny-reasoning", wrap_model=scripted_by_position({}), overlap=overlap)
    params = SamplingParams(temperature=0, max_new_tokens=40, logprobs=0)
    out = llm.generate([[9] * 5], params, constraint=GrammarSpec.json_schema(json.dumps(schema)))[0]
    assert out.text == '["a","b","c"]' and out.schema_retries >= 1
    assert llm.tokenizer.decode(out.token_ids) == out.text
    assert len(out.logprobs) == len(out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_value_that_not_rejects_is_resampled(make_llm, tok, backend):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}},
              "required": ["n"], "additionalProperties": False}
    text = '{"n":1}'
    ids = tok.encode(text, add_special_tokens=False)
    [one] = [i for i, t in enumerate(ids) if tok.decode([t]) == "1"]
    script = _script(tok, text, {one: ["2"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), grammar_backend=backend)
    out = _generate(llm, schema)
    assert json.loads(out.text) == {"n": 2} and out.schema_retries == 1 and out.finish_reason == "eos"
    out = _generate(llm, schema, resample=False)
    assert json.loads(out.text) == {"n": 1} and out.schema_retries == 0


def test_a_top_level_scalar_is_resampled_at_its_stop_token(make_llm, tok):
    # The model wants 7 and then to stop; `not: {const: 7}` is seen only when
    # the stop token arrives (7 could have become 70).
    schema = {"type": "integer", "not": {"const": 7}}
    script = _script(tok, "7", {0: ["8"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    out = _generate(llm, schema)
    assert out.text == "8" and out.schema_retries == 1 and out.finish_reason == "eos"


def test_a_checked_value_streams_only_once_it_passes(make_llm, tok):
    # `free` is not checked and streams as it comes; `n` is held back until
    # its value completes and passes `not` (the first try, 1, never goes out).
    schema = {"type": "object", "properties": {
        "free": {"type": "string", "maxLength": 3},
        "n": {"type": "integer", "not": {"const": 1}}},
        "required": ["free", "n"], "additionalProperties": False}
    text = '{"free":"ab","n":1}'
    ids = tok.encode(text, add_special_tokens=False)
    [one] = [i for i, t in enumerate(ids) if tok.decode([t]) == "1"]
    script = _script(tok, text, {one: ["2"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), grammar_backend="llguidance")
    engine = llm.engine
    matcher = engine.structured.compile(GrammarSpec.json_schema(json.dumps(schema)))
    assert "not" in matcher.unenforced_keywords
    ctx = engine.make_context(PROMPT, SamplingParams(temperature=0, max_new_tokens=40), matcher=matcher)
    engine.add_request(ctx)
    sent, finished = [], False
    while not finished:
        for delta in engine.step():
            sent.append(delta.text)
            finished = finished or delta.finished
    while engine.has_work():
        engine.step()
    assert "".join(sent) == '{"free":"ab","n":2}' and ctx.schema_retries == 1
    # Everything before `n`'s value went out before the value completed.
    pieces = [s for s in sent if s]
    assert "".join(pieces[:-1]) == '{"free":"ab","n":' and pieces[-1] == "2}"


def test_a_missing_dependent_property_is_added_by_taking_back_the_brace(make_llm, tok):
    # The model closes {"a":1} although `a` requires `b`: only the `}` is
    # taken back and banned there, and the model goes on with its next choice.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "dependentRequired": {"a": ["b"]}, "additionalProperties": False}
    text = '{"a":1,"b":2}'
    ids = tok.encode(text, add_special_tokens=False)
    [comma] = [i for i, t in enumerate(ids) if tok.decode([t]).startswith(",")]
    script = _script(tok, text)
    [brace] = tok.encode("}", add_special_tokens=False)
    script[len(PROMPT) + comma].insert(0, brace)  # it would rather stop there
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), grammar_backend="llguidance")
    out = _generate(llm, schema)
    assert json.loads(out.text) == {"a": 1, "b": 2} and out.schema_retries == 1 and out.finish_reason == "eos"
    out = _generate(llm, schema, resample=False)
    assert out.text == '{"a":1}'


def test_a_failing_value_check_fails_only_its_request(make_llm, tok):
    # A fault inside one request's value checks (injected) ends that request
    # with an error; the request beside it runs to the end, and no KV page
    # leaks (the make_llm fixture checks).
    script = _script(tok, "[1,2,3]")
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script))
    engine = llm.engine
    spec = GrammarSpec.json_schema(json.dumps(INTS))
    params = SamplingParams(temperature=0, max_new_tokens=20)
    broken = engine.make_context(PROMPT, params, request_id="broken", matcher=engine.structured.compile(spec))
    healthy = engine.make_context(PROMPT, params, request_id="healthy", matcher=engine.structured.compile(spec))
    assert broken.resampler is not None

    def fault(_: bytes) -> None:
        raise RuntimeError("injected value-check fault")

    broken.resampler.watch.feed = fault  # type: ignore[method-assign]
    engine.add_request(broken)
    engine.add_request(healthy)
    final = {}
    while engine.has_work():
        for delta in engine.step():
            if delta.finished:
                final[delta.request_id] = delta
    assert final["broken"].error is not None and "internal error" in final["broken"].error
    assert final["healthy"].error is None and healthy.schema_retries == 0
    assert tok.decode(healthy.tokens[len(PROMPT):healthy.end_idx].tolist(), skip_special_tokens=True) == "[1,2,3]"


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_value_with_a_forced_start_gets_every_retry(make_llm, tok, backend):
    # An object item starts with forced tokens (`{"a":`). After a rollback they
    # are forced again, so the next ban lands on the value's first sampled
    # token; before, it landed on the start (sampled under a one-token mask
    # then), the mask could not apply it, and the retry replayed the same item.
    text = '[{"a":1},{"a":2},{"a":1}]'
    ids = tok.encode(text, add_special_tokens=False)
    third = [i for i, t in enumerate(ids) if tok.decode([t]) in ("1", "2")][2]
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(_script(tok, text, {third: ["2", "3"]})),
                   grammar_backend=backend)
    schema = {"type": "array", "uniqueItems": True,
              "items": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                        "additionalProperties": False}}
    out = _generate(llm, schema)
    assert json.loads(out.text) == [{"a": 1}, {"a": 2}, {"a": 3}] and out.schema_retries == 2


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_preemption_keeps_the_forced_token_in_flight(make_llm, tok, backend, logprobs):
    # Preempted while the token the grammar forces is in flight: that position
    # is sampled again under the one-token mask (before, under the grammar's
    # whole row, where this model prefers `{` to the forced `{"`).
    text = '{"xs":[{"a":1},{"a":2}]}'
    ids = tok.encode(text, add_special_tokens=False)
    second = [i for i, t in enumerate(ids) if tok.decode([t]) == '{"'][2]
    script = _script(tok, text)
    [brace] = tok.encode("{", add_special_tokens=False)
    script[len(PROMPT) + second].insert(0, brace)
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}}}, "required": ["xs"], "additionalProperties": False}
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), grammar_backend=backend,
                   speculative_constrained=True)
    eng = llm.engine

    def run(preempt: bool) -> list[int]:
        matcher = eng.structured.compile(GrammarSpec.json_schema(json.dumps(schema)))
        ctx = eng.make_context(PROMPT, SamplingParams(temperature=0, max_new_tokens=40, logprobs=logprobs),
                               matcher=matcher, resample=False)
        eng.add_request(ctx)
        preempted = False
        while eng.has_work():
            if preempt and not preempted and ctx.grammar.forced_next is not None and ctx.pending_futures \
                    and ctx in eng.scheduler.running and ctx.num_final_tokens == len(PROMPT) + second:
                eng.scheduler._preempt(ctx)  # what schedule() does when pages run out
                preempted = True
            eng.step()
        assert preempted or not preempt
        return ctx.tokens[len(PROMPT):ctx.end_idx].tolist()

    plain = run(preempt=False)
    assert tok.decode(plain).startswith(text)
    assert run(preempt=True) == plain


@pytest.mark.parametrize(("text", "wanted", "whitespace"), [
    ('["ab","ab"]', '["ab","cd"]', "compact"),  # the ban went on the opening quote
    ('["ab", "ab"]', '["ab", "cd"]', "flexible"),  # ... on the space before it
    ('["a","a"]', '["a","b"]', "compact"),  # `","` ends one item and opens the next
])
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_the_ban_falls_on_what_the_value_says_not_its_layout(make_llm, tok, text, wanted, whitespace, backend):
    from grammar import GrammarOptions

    # The duplicate's content token gets the model's second choice, the wanted item.
    ids = tok.encode(text, add_special_tokens=False)
    last = max(i for i, t in enumerate(ids) if tok.decode([t]) == json.loads(text)[-1])
    script = _script(tok, text, {last: [json.loads(wanted)[-1]]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), grammar_backend=backend)
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=40),
                       constraint=GrammarSpec.json_schema(json.dumps(schema), GrammarOptions(whitespace=whitespace)))[0]
    assert out.text == wanted and out.schema_retries == 1 and out.finish_reason == "eos"


def test_a_value_mended_at_its_closing_bracket_has_the_same_retries_as_any(make_llm, tok):
    # dependentRequired asks for more: the closing brace is taken back, the
    # model adds a property and closes again, further on each time. The tries
    # were counted where the brace stood, so one value took every retry.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "dependentRequired": {"a": ["b"]}}
    head, more = tok.encode('{"a":1', add_special_tokens=False), tok.encode(',"c":1', add_special_tokens=False)
    [close] = tok.encode("}", add_special_tokens=False)
    ids = head + more * 8 + [close]
    script = {len(PROMPT) + i: [t] for i, t in enumerate(ids)}
    for k in range(9):  # wherever a property ends, the model would rather close
        script[len(PROMPT) + len(head) + k * len(more)] = [close, more[0]] if k < 8 else [close]
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), grammar_backend="llguidance")
    out = _generate(llm, schema, max_new_tokens=80)
    assert out.schema_retries == 3 and out.finish_reason == "eos"
    assert out.text == '{"a":1' + ',"c":1' * 3 + "}"


@pytest.mark.parametrize("config", [
    {"grammar_backend": "llguidance"},
    {"grammar_backend": "xgrammar"},
    {"grammar_backend": "llguidance", "overlap": False, "num_steps": 3},
])
@pytest.mark.parametrize("keep", [True, False])
def test_a_stop_token_closing_a_value_has_the_value_checked_first(make_llm, tok, config, keep):
    # A stop token id the grammar allows ("]") ended the request before the
    # value it closed was checked: [1,1] stayed, where EOS or the same text
    # as a stop string had it resampled.
    [bracket] = tok.encode("]", add_special_tokens=False)
    script = _script(tok, "[1,1]", {3: ["3"]})
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(script), **config)
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(bracket,),
                            include_stop_str_in_output=keep)
    out = llm.generate([PROMPT], params, constraint=GrammarSpec.json_schema(json.dumps(INTS)), resample=True)[0]
    assert out.schema_retries == 1 and out.stop_reason == bracket
    assert out.text == ("[1,3]" if keep else "[1,3")
    # A stop token inside a value still open ends the request as before: nothing to check yet.
    [comma] = tok.encode(",", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(comma,))
    llm2 = make_llm("tiny-llama", wrap_model=scripted_by_position(_script(tok, "[1,1]", {3: ["3"]})), **config)
    out = llm2.generate([PROMPT], params, constraint=GrammarSpec.json_schema(json.dumps(INTS)), resample=True)[0]
    assert out.text == "[1" and out.schema_retries == 0 and out.stop_reason == comma


def test_a_stop_token_ending_the_whole_output_has_it_checked_as_eos_does(make_llm, tok):
    # The object's closing brace is a stop token: the whole output is checked
    # (check_end) before the request ends, as at EOS.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}},
              "required": ["n"], "additionalProperties": False}
    [brace] = tok.encode("}", add_special_tokens=False)
    llm = make_llm("tiny-llama", wrap_model=scripted_by_position(_script(tok, '{"n":1}')))
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(brace,),
                            include_stop_str_in_output=True)
    out = llm.generate([PROMPT], params, constraint=GrammarSpec.json_schema(json.dumps(schema)), resample=True)[0]
    assert out.schema_retries == 1 and out.stop_reason == brace
    value = json.loads(out.text)
    assert isinstance(value["n"], int) and value["n"] != 1


def test_a_ban_that_would_leave_the_grammar_nothing_is_not_applied() -> None:
    # Banned tokens leave a value's next sample, unless they are all the
    # grammar allows: an empty row is a dead end that fails the request.
    resampler = Resampler(watch=None, token_bytes=lambda token: b"")  # type: ignore[arg-type]
    resampler._bans[(2, (7,))] = {5}  # at position 3, after token 7 at the value's start (2)
    ctx = SimpleNamespace(tokens=np.array([1, 2, 7]), num_final_tokens=3)

    def row(*allowed: int) -> torch.Tensor:
        r = torch.zeros(1, dtype=torch.int32)
        for token in allowed:
            r |= 1 << token
        return r

    both = row(5, 6)
    resampler.mask(ctx, both[0:1])  # type: ignore[arg-type]
    assert int(both[0]) == 1 << 6
    only = row(5)
    resampler.mask(ctx, only[0:1])  # type: ignore[arg-type]
    assert int(only[0]) == 1 << 5
    elsewhere = row(5, 6)
    resampler.mask(SimpleNamespace(tokens=np.array([1, 2, 8]), num_final_tokens=3), elsewhere[0:1])  # type: ignore[arg-type]
    assert int(elsewhere[0]) == (1 << 5) | (1 << 6)
