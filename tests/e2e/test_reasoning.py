"""Reasoning models and tool calls over gRPC, both protocols: stencil.v1's
reasoning options, chunks and complete fields, structural tags and tools; the
vLLM protocol's GetServerInfo and grammar_from_first_token.

One server runs the tiny-reasoning preset with `--reasoning-parser qwen3` and
a model scripted by position (tests/engine/scripted.py); each scenario uses a
prompt of its own length, so its tokens fall in a region of the script of its
own."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from engine import EngineConfig, EngineCore
from engine.presets import END_THINK_ID, IM_END_ID, THINK_ID, TOOL_CALL_ID, ensure_preset
from engine.tokenizer import Tokenizer
from service.errors import bad_request_violations
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc

from ..engine.scripted import scripted_by_position
from .helpers import TIMEOUT, generate

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
# Prompt lengths: each scenario's script region.
CLOSES, LOOPS, STOPS, CALLS = 3, 40, 140, 180


def _tok() -> Tokenizer:
    return Tokenizer(ensure_preset("tiny-reasoning"))


def _prompt(length: int, thinking: bool = True) -> list[int]:
    """A prompt of `length` tokens that leaves the model in a thought (or closes it)."""
    return [9] * (length - 1) + [THINK_ID] if thinking else [9] * (length - 3) + [THINK_ID, 9, END_THINK_ID]


def _script() -> dict[int, list[int]]:
    tok = _tok()
    table: dict[int, list[int]] = {}

    def write(start: int, tokens: list[int]) -> None:
        for i, t in enumerate(tokens):
            table[start + i] = [t]

    write(CLOSES, tok.encode("Let me see", add_special_tokens=False) + [END_THINK_ID])
    words = tok.encode(" and so on", add_special_tokens=False)
    write(LOOPS, [words[i % len(words)] for i in range(90)])  # a thought that never closes
    write(STOPS, tok.encode("Hmm", add_special_tokens=False) + [IM_END_ID])  # EOS inside the thought
    write(CALLS, [TOOL_CALL_ID])  # no thought (closed in the prompt): a call at once
    return table


@pytest.fixture(scope="module")
def reasoner(make_module_server):  # type: ignore[no-untyped-def]
    path = ensure_preset("tiny-reasoning")
    config = EngineConfig(model=str(path), kv_cache_gib=0.05, reasoning_parser="qwen3")
    return make_module_server(lambda: EngineCore(config, wrap_model=scripted_by_position(_script())),
                              model_name="tiny-reasoning")


def _request(prompt: list[int], max_new_tokens: int = 60, **fields) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), **fields)
    req.sampling.temperature = 0.0
    req.stopping.max_new_tokens = max_new_tokens
    return req


def _reasoning(chunks: list[pb.GenerateChunk]) -> str:
    return "".join(c.reasoning for c in chunks)


def test_a_json_answer_after_the_thought(reasoner) -> None:  # type: ignore[no-untyped-def]
    req = _request(_prompt(CLOSES))
    req.constraint.json_schema = json.dumps(ANSWER)
    text, ids, done, chunks = generate(reasoner.stub, req)
    assert _reasoning(chunks) == "Let me see"
    jsonschema.validate(json.loads(text), ANSWER)
    assert done.finish_reason == pb.GenerateComplete.EOS
    assert done.thought == pb.GenerateComplete.THOUGHT_CLOSED
    n = len(_tok().encode("Let me see", add_special_tokens=False))
    assert done.usage.reasoning_tokens == n and ids[n] == END_THINK_ID
    assert done.schema_validation.result == pb.SchemaValidation.VALID


def test_a_thought_that_never_closes_and_its_budget(reasoner) -> None:  # type: ignore[no-untyped-def]
    req = _request(_prompt(LOOPS), max_new_tokens=12)
    req.constraint.choice.choices.extend(["yes", "no"])
    text, _, done, chunks = generate(reasoner.stub, req)
    assert text == "" and _reasoning(chunks).startswith(" and so on")
    assert done.finish_reason == pb.GenerateComplete.LENGTH
    assert done.thought == pb.GenerateComplete.THOUGHT_UNFINISHED and done.usage.reasoning_tokens == 12
    assert done.schema_validation.result == pb.SchemaValidation.NOT_CHECKED
    # With a budget the end of the thought is forced, then the answer.
    req.reasoning.max_thinking_tokens = 4
    text, ids, done, chunks = generate(reasoner.stub, req)
    assert text in ("yes", "no") and ids[4] == END_THINK_ID and done.usage.reasoning_tokens == 4
    assert done.thought == pb.GenerateComplete.THOUGHT_FORCED and done.finish_reason == pb.GenerateComplete.EOS
    assert done.schema_validation.result == pb.SchemaValidation.VALID
    # From the first token: no thought, the grammar decides at once.
    req.reasoning.Clear()
    req.reasoning.constraint_start = pb.ReasoningOptions.CONSTRAINT_START_FIRST_TOKEN
    text, _, done, chunks = generate(reasoner.stub, req)
    assert text in ("yes", "no") and _reasoning(chunks) == ""
    assert done.thought == pb.GenerateComplete.THOUGHT_UNSPECIFIED


def test_eos_inside_the_thought_is_no_answer(reasoner) -> None:  # type: ignore[no-untyped-def]
    req = _request(_prompt(STOPS))
    req.constraint.json_schema = json.dumps(ANSWER)
    req.constraint.strict = True
    text, _, done, chunks = generate(reasoner.stub, req)
    assert (text, _reasoning(chunks)) == ("", "Hmm")
    assert done.thought == pb.GenerateComplete.THOUGHT_UNFINISHED
    assert done.schema_validation.result == pb.SchemaValidation.INVALID
    assert "inside the model's thought" in done.schema_validation.message
    assert done.finish_reason == pb.GenerateComplete.SCHEMA_VIOLATION  # strict


def _weather_tools(req: pb.GenerateRequest) -> None:
    req.tools.add(name="get_weather", description="Weather in a city", parameters=json.dumps(WEATHER))
    req.tools.add(name="get_time", parameters=json.dumps(TIME))


def test_a_structural_tag_in_free_text(reasoner) -> None:  # type: ignore[no-untyped-def]
    tag = {"type": "structural_tag", "structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER, "end": "}\n</tool_call>"}],
        "triggers": ["<tool_call>"]}
    req = _request(_prompt(CALLS, thinking=False), max_new_tokens=80)
    req.constraint.structural_tag = json.dumps(tag)
    text, _, done, chunks = generate(reasoner.stub, req)
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert text.endswith("}\n</tool_call>") and done.finish_reason == pb.GenerateComplete.EOS
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    jsonschema.validate(call["arguments"], WEATHER)
    # llguidance: the city's maxLength would make xgrammar's masks slow.
    assert done.thought == pb.GenerateComplete.THOUGHT_NONE and done.grammar_backend == "llguidance"
    assert done.schema_validation.result == pb.SchemaValidation.VALID
    assert done.usage.forced_tokens > 10  # the begin and the key were forced inside the tag


@pytest.mark.parametrize("choice", ["auto", "required", "get_time"])
def test_tool_calls_are_enforced_and_parsed(reasoner, choice) -> None:  # type: ignore[no-untyped-def]
    # Auto: the model opens a call itself (its script); required and named
    # calls are forced from the first token of the answer, after the thought.
    prompt = _prompt(CALLS, thinking=False) if choice == "auto" else _prompt(CLOSES)
    req = _request(prompt, max_new_tokens=80)
    _weather_tools(req)
    if choice == "required":
        req.tool_choice.mode = pb.ToolChoice.MODE_REQUIRED
    elif choice == "get_time":
        req.tool_choice.function_name = "get_time"
    text, _, done, chunks = generate(reasoner.stub, req)
    assert done.finish_reason == pb.GenerateComplete.EOS, text
    assert len(done.tool_calls) >= 1
    call = done.tool_calls[0]
    assert call.name == "get_time" if choice == "get_time" else call.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.arguments), TIME if call.name == "get_time" else WEATHER)
    assert call.validation.result == pb.SchemaValidation.VALID
    assert done.schema_validation.result == pb.SchemaValidation.VALID
    if choice != "auto":
        assert _reasoning(chunks) == "Let me see" and text.startswith("<tool_call>")
    if choice == "get_time":
        assert len(done.tool_calls) == 1


def test_tools_in_a_chat_prompt_and_no_calls(reasoner) -> None:  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest()
    req.chat.messages.add(role="user", content="Weather in Oslo?")
    req.chat.template_kwargs = json.dumps({"enable_thinking": False})
    _weather_tools(req)
    req.tool_choice.mode = pb.ToolChoice.MODE_NONE
    req.stopping.max_new_tokens = 4
    req.sampling.temperature = 0.0
    _, _, done, _ = generate(reasoner.stub, req)
    assert not done.tool_calls and not done.HasField("schema_validation")
    assert done.thought == pb.GenerateComplete.THOUGHT_NONE  # enable_thinking false closed the thought
    assert done.usage.prompt_tokens > 100  # the tools were rendered into the prompt


BAD = {
    "reasoning.max_thinking_tokens": {"reasoning": {"max_thinking_tokens": 3,
                                                    "constraint_start": "CONSTRAINT_START_FIRST_TOKEN"}},
    "tools[0].parameters": {"tools": [{"name": "f", "parameters": "{"}]},
    "tools[0].name": {"tools": [{"name": "bad name"}]},
    "constraint": {"tools": [{"name": "f"}], "constraint": {"regex": "a"}},
    "tool_choice.function_name": {"tools": [{"name": "f"}], "tool_choice": {"function_name": "g"}},
    "tool_choice": {"tool_choice": {"mode": "MODE_REQUIRED"}},
    "constraint.structural_tag": {"constraint": {"structural_tag": '{"structures": []}'}},
    "chat.template_kwargs": {"chat": {"messages": [{"role": "user", "content": "hi"}],
                                      "template_kwargs": '{"tools": []}'}},
}


_DEEP_SCHEMA = '{"type":"object","properties":{"a":' * 495 + "{}" + "}}" * 495
# Each was answered INTERNAL (RecursionError) or named the wrong field.
MORE_BAD = [
    ("tools[0].parameters", {"tools": [{"name": "rename_file", "parameters": "[1, 2]"}]}),
    ("tools|tools[0].parameters", {"tools": [{"name": "f", "parameters": _DEEP_SCHEMA}]}),  # where it overflows
    ("chat.template_kwargs", {"chat": {"messages": [{"role": "user", "content": "hi"}],
                                       "template_kwargs": '{"a":' * 500 + "1" + "}" * 500}}),
]


@pytest.mark.parametrize("field, fields", [*BAD.items(), *MORE_BAD])
def test_bad_reasoning_and_tool_fields_are_named(reasoner, field, fields) -> None:  # type: ignore[no-untyped-def]
    from google.protobuf import json_format

    req = _request(_prompt(CLOSES))
    json_format.ParseDict(fields, req)
    if req.HasField("chat"):
        req.ClearField("token_ids")
    with pytest.raises(grpc.RpcError) as err:
        generate(reasoner.stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(named, _)] = bad_request_violations(err.value.trailing_metadata())
    assert named in field.split("|")


@pytest.mark.parametrize("name", ["messages", "documents", "add_generation_prompt"])
def test_template_kwargs_may_not_set_what_the_renderer_sets(reasoner, name) -> None:  # type: ignore[no-untyped-def]
    # The template's renderer passes these itself: a client's value was a
    # TypeError inside transformers, answered INTERNAL.
    req = _request(_prompt(CLOSES))
    req.ClearField("token_ids")
    req.chat.messages.add(role="user", content="hi")
    req.chat.template_kwargs = json.dumps({name: []})
    tokenize = pb.TokenizeRequest(chat=req.chat)
    for call in (lambda: generate(reasoner.stub, req), lambda: reasoner.stub.Tokenize(tokenize, timeout=TIMEOUT)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in bad_request_violations(err.value.trailing_metadata())] == ["chat.template_kwargs"]


def test_reasoning_options_need_a_parser(server) -> None:  # type: ignore[no-untyped-def]
    req = _request([5, 6, 7])
    req.reasoning.constraint_start = pb.ReasoningOptions.CONSTRAINT_START_AFTER_THOUGHT
    with pytest.raises(grpc.RpcError) as err:
        generate(server.stub, req)
    assert [f for f, _ in bad_request_violations(err.value.trailing_metadata())] == ["reasoning.constraint_start"]
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.reasoning_parser == ""


def test_the_vllm_protocol_reports_and_honours_the_gate(reasoner, server) -> None:  # type: ignore[no-untyped-def]
    stub = vpb_grpc.VllmEngineStub(reasoner.channel)
    info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert (info.engine_reasoning_parser, info.constrained_decoding_start) == ("qwen3", "after_reasoning")
    plain = vpb_grpc.VllmEngineStub(server.channel).GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert (plain.engine_reasoning_parser, plain.constrained_decoding_start) == ("", "first_token")
    assert reasoner.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT).reasoning_parser == "qwen3"
    tok = _tok()

    def run(first_token: bool, **constraint) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
        req = vpb.GenerateRequest(request_id=f"v-{first_token}-{len(constraint)}",
                                  tokenized=vpb.TokenizedInput(input_ids=_prompt(CLOSES)))
        req.sampling_params.max_tokens = 40
        req.sampling_params.temperature = 0.0
        req.sampling_params.grammar_from_first_token = first_token
        for name, value in constraint.items():
            if name == "choice":
                req.sampling_params.choice.choices.extend(value)
            else:
                setattr(req.sampling_params, name, value)
        done = list(stub.Generate(req, timeout=TIMEOUT))[0].complete
        return list(done.output_ids), done.finish_reason

    # Unset: the constraint waits for the thought, which the model writes freely.
    ids, reason = run(False, choice=["yes", "no"])
    thought = tok.encode("Let me see", add_special_tokens=False)
    n = len(thought) + 1
    assert ids[:n] == thought + [END_THINK_ID] and reason == "stop"
    assert tok.decode(ids[n:], skip_special_tokens=True) in ("yes", "no")
    # Set: the gateway's grammar covers the thought; it starts at the first token.
    ids, reason = run(True, choice=["yes", "no"])
    assert tok.decode(ids, skip_special_tokens=True) in ("yes", "no") and END_THINK_ID not in ids
    # A structural tag in SMG's (xgrammar's) spelling.
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "separator": "\n",
                                                "at_least_one": True, "stop_after_first": True, "tags": [
        {"type": "tag", "begin": "<tool_call>\n", "content": {"type": "json_schema", "json_schema": TIME},
         "end": "\n</tool_call>"}]}}
    ids, reason = run(False, structural_tag=json.dumps(tag))
    answer = tok.decode(ids[n:], skip_special_tokens=True)
    assert ids[:n] == thought + [END_THINK_ID] and reason == "stop"
    assert answer.startswith("<tool_call>\n") and answer.endswith("\n</tool_call>")
    jsonschema.validate(json.loads(answer[len("<tool_call>\n"):-len("\n</tool_call>")]), TIME)
