"""Resampling inside structural tags and tool calls: the JSON content of a
tag whose schema leaves keywords unenforced (xgrammar ignores `uniqueItems`
and `not`) is watched like a JSON answer; a value that breaks one is rolled
back and resampled, the free text around the tags is never checked, and the
stream holds back only the open checked value inside a tag.

Models are scripted by position (scripted.py) over the tiny-reasoning
preset, whose tokenizer has `<tool_call>` and `</tool_call>` as single tokens."""

from __future__ import annotations

import json

import pytest

from engine import SamplingParams
from engine.presets import END_THINK_ID, THINK_ID, ensure_preset
from engine.tokenizer import Tokenizer
from grammar import GrammarSpec
from grammar.tool_calls import CallReader, Tool, call_constraint

from .scripted import scripted_by_position
from .test_reasoning import CONFIGS

BARE = [9, 5]
IN_THOUGHT = [9, 5, THINK_ID]
UNIQUE = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                  "uniqueItems": True}},
          "required": ["xs"], "additionalProperties": False}
TOOLS = [Tool("f", UNIQUE)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ensure_preset("tiny-reasoning")))


def _call(args: str) -> str:
    return f'<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'


def _script(tok: Tokenizer, prompt: list[int], text: str, alternatives: dict[int, list[str]] | None = None,
            thought: list[int] | None = None) -> dict[int, list[int]]:
    """A position script that writes `thought`, then `text` token by token;
    `alternatives` (index of a token of `text` -> texts) adds more choices there, in order."""
    ids = list(thought or []) + tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[len(thought or []):]) == text
    script = {len(prompt) + i: [t] for i, t in enumerate(ids)}
    for i, texts in (alternatives or {}).items():
        for alt in texts:
            [alt_id] = tok.encode(alt, add_special_tokens=False)
            script[len(prompt) + len(thought or []) + i].append(alt_id)
    return script


def _nth(tok: Tokenizer, text: str, piece: str, n: int = -1) -> int:
    """Index of the n-th token of `text` that decodes to `piece`."""
    ids = tok.encode(text, add_special_tokens=False)
    return [i for i, t in enumerate(ids) if tok.decode([t]) == piece][n]


def _llm(make_llm, script, prompt, **config):
    parser = {"reasoning_parser": "qwen3"} if prompt is IN_THOUGHT else {}
    return make_llm("tiny-reasoning", wrap_model=scripted_by_position(script), kv_cache_gib=0.02,
                    **parser, **config)


def _generate(llm, prompt, spec: GrammarSpec | None, resample: bool = True, max_new_tokens: int = 80):
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    return llm.generate([prompt], params, constraint=spec, resample=resample)[0]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("prompt", [BARE, IN_THOUGHT], ids=["no-thought", "after-a-thought"])
def test_a_duplicate_in_a_tool_call_is_resampled(make_llm, tok, config, prompt):
    # The free text holds what would break the schema if it were checked; the
    # call's second item is a duplicate, and the model's second choice is 2.
    text = "Sure [1, 1]." + _call('{"xs": [1, 1]}') + " Done."
    thought = tok.encode("hm", add_special_tokens=False) + [END_THINK_ID] if prompt is IN_THOUGHT else None
    script = _script(tok, prompt, text, {_nth(tok, text, " 1"): [" 2"]}, thought)
    llm = _llm(make_llm, script, prompt, **config)
    out = _generate(llm, prompt, call_constraint(TOOLS, "auto"))
    assert out.text == "Sure [1, 1]." + _call('{"xs": [1, 2]}') + " Done."
    assert out.schema_retries == 1 and out.finish_reason == "eos"
    assert out.reasoning == ("hm" if thought else "")
    [call] = CallReader(TOOLS).parse(out.text)
    assert call.validation.valid and json.loads(call.arguments) == {"xs": [1, 2]}
    # Without resampling the duplicate stays, and the call's verdict says so.
    out = _generate(llm, prompt, call_constraint(TOOLS, "auto"), resample=False)
    assert out.text == text and out.schema_retries == 0
    [call] = CallReader(TOOLS).parse(out.text)
    assert not call.validation.valid and call.validation.keyword == "uniqueItems"


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_a_value_that_not_rejects_inside_a_structural_tag_is_resampled(make_llm, tok, config):
    # vLLM's spelling; the tag's content is a bare integer, checked when the
    # tag's end starts (1 could have become 10). The free text's 1 is not checked.
    tag = GrammarSpec.structural_tag({"structures": [
        {"begin": "<n>", "schema": {"type": "integer", "not": {"const": 1}}, "end": "</n>"}],
        "triggers": ["<n>"]})
    text = "1 is <n>1</n> ok"
    script = _script(tok, BARE, text, {_nth(tok, text, "1"): ["2"]})
    llm = _llm(make_llm, script, BARE, **config)
    out = _generate(llm, BARE, tag)
    assert out.text == "1 is <n>2</n> ok" and out.schema_retries == 1 and out.finish_reason == "eos"


def test_required_calls_each_get_their_own_retries(make_llm, tok):
    # Calls only ("required"), one after another. In the first, the fifth
    # item is tried as 1, 2, 3 and 4: three retries, then the duplicate 4
    # stays (its call's verdict reports it). The second call is still
    # checked: its duplicate 7 is resampled to 8.
    first, second = _call('{"xs": [1, 2, 3, 4, 1]}'), _call('{"xs": [7, 7]}')
    text = first + "\n" + second
    n = len(tok.encode(first + "\n", add_special_tokens=False))
    script = _script(tok, BARE, text, {_nth(tok, first, " 1"): [" 2", " 3", " 4", " 5"],
                                       n + _nth(tok, second, " 7"): [" 8"]})
    llm = _llm(make_llm, script, BARE)
    out = _generate(llm, BARE, call_constraint(TOOLS, "required"), max_new_tokens=120)
    assert out.text == _call('{"xs": [1, 2, 3, 4, 4]}') + "\n" + _call('{"xs": [7, 8]}')
    assert out.schema_retries == 4 and out.finish_reason == "eos"
    calls = CallReader(TOOLS).parse(out.text)
    assert [c.validation.valid for c in calls] == [False, True]


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_the_stream_holds_back_only_the_open_checked_value(make_llm, tok, config):
    text = "Sure." + _call('{"xs": [1, 1]}') + " Done."
    final = "Sure." + _call('{"xs": [1, 2]}') + " Done."
    script = _script(tok, BARE, text, {_nth(tok, text, " 1"): [" 2"]})
    llm = _llm(make_llm, script, BARE, **config)
    engine = llm.engine
    matcher = engine.structured.compile(call_constraint(TOOLS, "auto"))
    assert matcher.tag_plan is not None
    matcher.prepare_checks()
    ctx = engine.make_context(BARE, SamplingParams(temperature=0, max_new_tokens=80), matcher=matcher)
    engine.add_request(ctx)
    sent: list[str] = []
    finished = False
    while not finished:
        for delta in engine.step():
            sent.append(delta.text)
            finished = finished or delta.finished
    while engine.has_work():
        engine.step()
    assert "".join(sent) == final and ctx.schema_retries == 1
    # Nothing a rollback took back went out; the free text and the call up to
    # its open item went out before the item completed (and passed).
    sofar = ["".join(sent[:i + 1]) for i in range(len(sent))]
    assert all(final.startswith(s) for s in sofar)
    first_with_item = next(i for i, s in enumerate(sofar) if "[1, 2" in s)
    assert sofar[first_with_item - 1] == 'Sure.<tool_call>\n{"name": "f", "arguments": {"xs": [1,'
