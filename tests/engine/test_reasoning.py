"""Reasoning models (engine/reasoning.py): the thought is sampled freely, the
constraint starts after `</think>`, the output reports the thought and the
answer apart, and overlap on or off changes no token.

Models are scripted by position (scripted.py) over the tiny-reasoning preset,
whose tokenizer has `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as
single tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.presets import END_THINK_ID, IM_END_ID, THINK_ID, ensure_preset
from engine.reasoning import ReasoningOptions, ReasoningParser
from engine.tokenizer import Tokenizer
from grammar import GrammarSpec

from ..conftest import assert_no_page_leak
from .scripted import scripted_by_position

IN_THOUGHT = [9, 5, THINK_ID]  # the chat template opened the thought
CLOSED = [9, THINK_ID, 5, END_THINK_ID]  # enable_thinking false: the thought is given closed
BARE = [9, 5]  # no marker at all
YES_NO = GrammarSpec.choice(["yes", "no"])
INTS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
CONFIGS = [
    {"overlap": False},
    {"overlap": True},
    {"overlap": True, "speculative_constrained": True},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ensure_preset("tiny-reasoning")))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def script(prompt: list[int], *parts: list[int] | list[list[int]]) -> dict[int, list[int]]:
    """A position script: the model writes the tokens of `parts` in order
    after the prompt; a list of lists at one position gives choices, best first."""
    out: dict[int, list[int]] = {}
    pos = len(prompt)
    for part in parts:
        for item in part:
            out[pos] = list(item) if isinstance(item, list) else [item]
            pos += 1
    return out


def engine(table, parser: str = "qwen3", **config) -> LLM:
    return LLM(ensure_preset("tiny-reasoning"), wrap_model=scripted_by_position(table), reasoning_parser=parser,
               kv_cache_gib=0.02, **config)


def run(make_llm, parser: str, table, prompt, spec=None, config=None, reasoning=None, **params):
    """One request on a fresh scripted engine (closed after it: each engine
    has its own grammar worker processes)."""
    llm = engine(table, parser, **(config or {}))
    try:
        sampling = SamplingParams(temperature=0, **{"max_new_tokens": 24, **params})
        out = llm.generate([prompt], sampling, constraint=spec, reasoning=reasoning)[0]
        assert_no_page_leak(llm)
        return out
    finally:
        llm.close()


def summary(out):
    return (out.token_ids, out.text, out.reasoning, out.finish_reason, out.forced_tokens, out.thought,
            out.reasoning_tokens)


def test_reasoning_tokens_count_only_the_thought_inside_the_output_sent() -> None:
    import numpy as np

    parser = ReasoningParser("deepseek_r1", start_id=THINK_ID, end_id=END_THINK_ID, opens_implicitly=True)
    gate = parser.gate([1, 2])  # thinking from the first output token
    tokens = np.array([1, 2, 7, 8, 9, END_THINK_ID, 5, 6])
    gate.observe(tokens, len(tokens))
    assert gate.thought_end == 5 and gate.reasoning_tokens(8) == 3  # the marker is not counted
    # A stop string that cut the output inside the thought, its end marker
    # already read (the step after it ran): only what was sent counts.
    assert gate.reasoning_tokens(4) == 2


def test_parsers_resolve_their_markers(tok):
    parser = ReasoningParser.load("qwen3", tok.hf.get_vocab())
    assert (parser.start_id, parser.end_id) == (THINK_ID, END_THINK_ID)
    assert parser.prompt_thinking(IN_THOUGHT) is True
    assert parser.prompt_thinking(CLOSED) is False
    assert parser.prompt_thinking(BARE) is None
    with pytest.raises(ValueError, match="not a single token"):
        ReasoningParser.load("deepseek_r1", Tokenizer(str(ensure_preset("tiny-llama"))).hf.get_vocab())
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser.load("nope", tok.hf.get_vocab())


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_thought_that_closes_then_a_constrained_answer(make_llm, tok, parser, config):
    # The thought's words are nothing the grammar allows: it is sampled freely.
    table = script(IN_THOUGHT, ids(tok, "Let me see"), [END_THINK_ID], ids(tok, "no"))
    out = run(make_llm, parser, table, IN_THOUGHT, YES_NO, config)
    assert out.reasoning == "Let me see" and out.text == "no"
    assert out.finish_reason == "eos" and out.thought == "closed"
    assert out.reasoning_tokens == len(ids(tok, "Let me see"))
    assert out.token_ids[:len(ids(tok, "Let me see")) + 1] == ids(tok, "Let me see") + [END_THINK_ID]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_thought_that_never_closes_has_no_answer(make_llm, tok, config):
    words = ids(tok, " and so on and so forth")
    table = {len(IN_THOUGHT) + i: [words[i % len(words)]] for i in range(40)}
    out = run(make_llm, "deepseek_r1", table, IN_THOUGHT, YES_NO, config, max_new_tokens=12)
    assert out.finish_reason == "length" and out.thought == "unfinished"
    assert out.text == "" and out.reasoning == tok.decode(out.token_ids)
    assert out.reasoning_tokens == 12 and out.forced_tokens == 0


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_thinking_budget_forces_the_end_then_the_answer(make_llm, tok, config, backend, logprobs):
    words = ids(tok, " and so on and so forth")
    table = {len(IN_THOUGHT) + i: [words[i % len(words)]] for i in range(40)}
    out = run(make_llm, "qwen3", table, IN_THOUGHT, YES_NO, {**config, "grammar_backend": backend},
              ReasoningOptions(max_thinking_tokens=3), logprobs=logprobs)
    assert out.token_ids[:4] == words[:3] + [END_THINK_ID]
    assert out.reasoning == tok.decode(words[:3]) and out.text in ("yes", "no")
    assert out.thought == "forced" and out.reasoning_tokens == 3 and out.finish_reason == "eos"
    assert out.forced_tokens >= 1  # the end marker (and whatever the grammar forced)
    if logprobs is not None:  # one per token: the forced ones were sampled under a mask of only them
        assert [lp.token_id for lp in out.logprobs] == out.token_ids


@pytest.mark.parametrize("config", CONFIGS)
def test_a_budget_of_zero_and_an_unconstrained_request(make_llm, tok, config):
    table = script(IN_THOUGHT, ids(tok, "Let me see"))
    llm = engine(table, "deepseek_r1", **config)
    try:
        out = llm.generate([IN_THOUGHT], SamplingParams(temperature=0, max_new_tokens=3),
                           reasoning=ReasoningOptions(max_thinking_tokens=0))[0]
        # The budget's mask needed no grammar compiler (no worker processes).
        assert llm.engine.structured._compiler is None
    finally:
        llm.close()
    assert out.token_ids[0] == END_THINK_ID and out.reasoning == "" and out.thought == "forced"
    assert out.reasoning_tokens == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_qwen3_first_token_opens_a_thought_or_starts_the_answer(make_llm, tok, config):
    # The model opens a thought itself (Qwen3's older templates).
    table = script(BARE, [THINK_ID], ids(tok, "hm"), [END_THINK_ID], ids(tok, "yes"))
    out = run(make_llm, "qwen3", table, BARE, YES_NO, config)
    assert (out.reasoning, out.text, out.thought) == ("hm", "yes", "closed")
    assert out.token_ids[0] == THINK_ID and out.reasoning_tokens == len(ids(tok, "hm"))
    # The model does not: no thought; the first token is the grammar's (plus `<think>`).
    table = script(BARE, ids(tok, "Let me see"))
    out = run(make_llm, "qwen3", table, BARE, YES_NO, config)
    assert out.reasoning == "" and out.text in ("yes", "no") and out.thought == "none"
    assert out.finish_reason == "eos"
    # deepseek_r1 reads the same output as a thought from its first token.
    out = run(make_llm, "deepseek_r1", table, BARE, YES_NO, config, max_new_tokens=3)
    assert out.reasoning == tok.decode(ids(tok, "Let me see")[:3]) and out.text == ""
    assert out.thought == "unfinished"


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_prompt_that_closes_the_thought_leaves_all_to_the_answer(make_llm, tok, parser):
    table = script(CLOSED, ids(tok, "Let me see"))
    out = run(make_llm, parser, table, CLOSED, YES_NO)
    assert out.reasoning == "" and out.text in ("yes", "no") and out.thought == "none"
    assert out.reasoning_tokens == 0


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_start_marker_the_model_writes_is_in_neither_part(make_llm, tok, parser):
    table = script(IN_THOUGHT, [THINK_ID], ids(tok, "hm"), [END_THINK_ID], ids(tok, " ok"))
    out = run(make_llm, parser, table, IN_THOUGHT, max_new_tokens=5)
    assert (out.reasoning, out.text) == ("hm", " ok")
    assert tok.decode(out.token_ids) == "<think>hm</think> ok"


@pytest.mark.parametrize("config", CONFIGS)
def test_eos_inside_the_thought_ends_the_output_without_an_answer(make_llm, tok, config):
    table = script(IN_THOUGHT, ids(tok, "Let"), [IM_END_ID])
    out = run(make_llm, "qwen3", table, IN_THOUGHT, YES_NO, config)
    assert out.finish_reason == "eos" and out.thought == "unfinished"
    assert (out.reasoning, out.text) == ("Let", "")


@pytest.mark.parametrize("config", CONFIGS)
def test_min_new_tokens_keeps_a_thought_from_stopping(make_llm, tok, config):
    [a] = ids(tok, "a")
    table = script(IN_THOUGHT, [[IM_END_ID, a]], [END_THINK_ID], ids(tok, "no"))
    out = run(make_llm, "qwen3", table, IN_THOUGHT, YES_NO, config, min_new_tokens=2)
    assert (out.reasoning, out.text, out.finish_reason) == ("a", "no", "eos")


@pytest.mark.parametrize("config", CONFIGS)
def test_a_json_answer_after_a_thought_is_resampled(make_llm, tok, config):
    # The answer [1,1,2] breaks uniqueItems; its second item is resampled.
    answer = ids(tok, "[1,1,2]")
    [three] = ids(tok, "3")
    thought = ids(tok, "hm")
    table = script(IN_THOUGHT, thought, [END_THINK_ID], [[t] for t in answer])
    table[len(IN_THOUGHT) + len(thought) + 1 + 3].append(three)
    out = run(make_llm, "qwen3", table, IN_THOUGHT, GrammarSpec.json_schema(json.dumps(INTS)), config)
    assert (out.reasoning, out.text, out.schema_retries) == ("hm", "[1,3,2]", 1)
    assert out.finish_reason == "eos"


def test_constraint_from_the_first_token(make_llm, tok):
    # grammar_from_first_token: no gate; the grammar applies to the thought's
    # place too, and the output is all text.
    table = script(IN_THOUGHT, ids(tok, "Let me see"), [END_THINK_ID], ids(tok, "no"))
    out = run(make_llm, "qwen3", table, IN_THOUGHT, YES_NO, reasoning=ReasoningOptions(after_thought=False))
    assert out.reasoning == "" and out.text in ("yes", "no") and out.thought is None


def test_overlap_and_graphs_change_no_token(make_llm, tok):
    words = ids(tok, " and so on and so forth")
    table = {len(IN_THOUGHT) + i: [words[i % len(words)]] for i in range(40)}
    closing = script(IN_THOUGHT, ids(tok, "Let me see"), [END_THINK_ID], ids(tok, "no"))
    schema = GrammarSpec.json_schema(json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                                 "required": ["a"]}))
    from engine.presets import TOOL_CALL_ID
    from grammar.tool_calls import Tool, call_constraint

    tag = GrammarSpec.structural_tag({"structures": [
        {"begin": "<tool_call>\n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                "required": ["n"]}, "end": "\n</tool_call>"}],
        "triggers": ["<tool_call>"]})
    calling = script(IN_THOUGHT, ids(tok, "hm"), [END_THINK_ID], ids(tok, "Sure."), [TOOL_CALL_ID])
    requests = [
        (table, ReasoningOptions(max_thinking_tokens=4), schema),
        (closing, None, YES_NO),
        (table, ReasoningOptions(max_thinking_tokens=2), None),
        (closing, None, schema),
        (calling, None, tag),
        (closing, None, call_constraint([Tool("f", {"type": "object", "properties": {"a": {"enum": [1, 2]}},
                                                    "required": ["a"]})], "required")),
        (closing, None, None),  # no grammar, no budget: multi-step decode runs it; the split holds
    ]
    results = []
    configs: list[dict[str, Any]] = [*CONFIGS, {"overlap": False, "cuda_graphs": "emulate"},
                                     {"overlap": True, "cuda_graphs": "emulate"}, {"overlap": False, "num_steps": 4}]
    for config in configs:
        row: dict[int, tuple] = {}
        for table_i in {id(t): t for t, _, _ in requests}.values():  # one engine per script
            llm = engine(table_i, "qwen3", **config)
            try:
                for n, (t, options, spec) in enumerate(requests):
                    if t is table_i:
                        out = llm.generate([IN_THOUGHT], SamplingParams(temperature=0, max_new_tokens=24),
                                           constraint=spec, reasoning=options)[0]
                        row[n] = summary(out)
                assert_no_page_leak(llm)
            finally:
                llm.close()
        results.append([row[n] for n in range(len(requests))])
    assert all(r == results[0] for r in results[1:])


def test_a_mixed_batch_is_the_same_as_each_alone(make_llm, tok):
    """Gated rows in one batch with free and constrained rows: the same
    tokens as run alone (overlap on, speculative thoughts)."""
    words = ids(tok, " and so on and so forth")
    table = {len(IN_THOUGHT) + i: [words[i % len(words)]] for i in range(60)}
    llm = make_llm("tiny-reasoning", wrap_model=scripted_by_position(table), reasoning_parser="qwen3",
                   kv_cache_gib=0.02)
    prompts = [IN_THOUGHT, CLOSED, BARE, IN_THOUGHT]
    specs = [YES_NO, YES_NO, None, None]
    options = [ReasoningOptions(max_thinking_tokens=2), None, None, ReasoningOptions(max_thinking_tokens=5)]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    together = [summary(o) for o in llm.generate(prompts, params, constraint=specs, reasoning=options)]
    alone = [summary(llm.generate([p], params, constraint=s, reasoning=o)[0])
             for p, s, o in zip(prompts, specs, options, strict=True)]
    assert together == alone


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("prompt", [IN_THOUGHT, CLOSED], ids=["after-a-thought", "no-thought"])
def test_a_structural_tag_in_free_text(make_llm, tok, config, prompt):
    """Free text, then a tag the model opens itself: the rest of its begin and
    the schema's key are forced, the contents follow the schema, then free
    text again until the model stops."""
    from engine.presets import TOOL_CALL_ID

    tag = GrammarSpec.structural_tag({"structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER, "end": "}\n</tool_call>"}],
        "triggers": ["<tool_call>"]})
    thought = ids(tok, "hm") + [END_THINK_ID] if prompt is IN_THOUGHT else []
    table = script(prompt, thought, ids(tok, "Sure."), [TOOL_CALL_ID])
    out = run(make_llm, "qwen3", table, prompt, tag, config, max_new_tokens=60)
    assert out.reasoning == ("hm" if thought else "")
    assert out.text.startswith('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city":')
    assert out.text.endswith("}\n</tool_call>") and out.finish_reason == "eos"
    call = json.loads(out.text[len("Sure.<tool_call>\n"):-len("\n</tool_call>")])
    assert set(call["arguments"]) == {"city"} and len(call["arguments"]["city"]) <= 6
    assert out.forced_tokens > 5


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_tool_calls_required_and_named_after_a_thought(make_llm, tok, config, choice):
    from grammar.tool_calls import CallReader, Tool, call_constraint

    tools = [Tool("get_weather", WEATHER), Tool("get_time", TIME)]
    table = script(IN_THOUGHT, ids(tok, "Let me see"), [END_THINK_ID], ids(tok, "I think it is sunny"))
    out = run(make_llm, "qwen3", table, IN_THOUGHT, call_constraint(tools, choice), config, max_new_tokens=80)
    assert out.reasoning == "Let me see" and out.thought == "closed"
    # The model wanted prose after its thought: the calls came instead.
    assert out.text.startswith("<tool_call>\n") and out.finish_reason == "eos"
    calls = CallReader(tools).parse(out.text)
    assert calls and all(c.validation.valid for c in calls)
    if choice == "get_time":
        assert [c.name for c in calls] == ["get_time"]
        assert out.text.startswith('<tool_call>\n{"name": "get_time", "arguments":')
