"""A prompt that ends inside a UTF-8 character: the response carries none of
the prompt's text, over gRPC (stencil.v1 and the vLLM protocol) and offline,
with the demo model.

The prompt is "A user record: caf" followed by the single byte token of 0xC3
(the first byte of "é"). Before the fix the first chunk began with the
prompt's tail (": caf\ufffd"), and a JSON answer no longer parsed.
"""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.presets import ensure_preset
from engine.tokenizer import Tokenizer
from grammar import GrammarSpec
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc
from tests.engine.test_detokenize import expected_text, tokenizer

from .helpers import TIMEOUT, ServerHandle, engine_factory, generate, greedy

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
Finish = pb.GenerateComplete.FinishReason


@pytest.fixture(scope="module")
def demo(make_module_server) -> ServerHandle:  # type: ignore[no-untyped-def]
    return make_module_server(engine_factory("demo"), model_name="demo")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tok, byte_ids = tokenizer("byte-level")
    ids = tok.backend.encode("A user record: caf", add_special_tokens=False).ids + [byte_ids[0xC3]]
    assert ids[-1] == 132, "the demo tokenizer's byte token of 0xC3"
    return ids


def _request(prompt: list[int], max_new_tokens: int = 12, **fields) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    req = greedy(max_new_tokens=max_new_tokens, **fields)
    req.token_ids.ids.extend(prompt)
    return req


def _rule(prompt: list[int], generated: list[int], skip: bool = True) -> str:
    tok, _ = tokenizer("byte-level")
    return expected_text(tok, prompt, generated, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_free_text_carries_no_prompt_text(demo: ServerHandle, prompt: list[int], skip: bool) -> None:
    req = _request(prompt)
    req.response.skip_special_tokens = skip
    text, ids, done, _ = generate(demo.stub, req)
    assert ids and text == _rule(prompt, ids, skip)
    assert not text.startswith(": caf") and "caf" not in text[:8]


def test_json_answer_parses(demo: ServerHandle, prompt: list[int]) -> None:
    req = _request(prompt, max_new_tokens=48)
    req.constraint.json_schema = json.dumps(SCHEMA)
    text, ids, done, _ = generate(demo.stub, req)
    assert text == _rule(prompt, ids)
    assert text.startswith('{"a":'), text
    try:
        whole = json.loads(text)
    except ValueError:  # the length limit cut it short
        assert done.finish_reason != Finish.EOS
        assert done.schema_validation.result == pb.SchemaValidation.NOT_CHECKED
    else:
        assert whole.keys() == {"a"}
        assert done.schema_validation.result == pb.SchemaValidation.VALID


def test_a_stop_string_never_matches_the_prompts_text(demo: ServerHandle, prompt: list[int]) -> None:
    req = _request(prompt)
    req.stopping.stop.append(": caf")
    req.stopping.ignore_eos = True
    text, ids, done, _ = generate(demo.stub, req)
    assert done.finish_reason == Finish.LENGTH and len(ids) == 12
    assert text == _rule(prompt, ids)


def test_vllm_protocol_n_sequences_and_stop_strings(demo: ServerHandle, prompt: list[int]) -> None:
    """The router reads token ids; the engine matches stop strings on the text."""
    req = vpb.GenerateRequest(request_id="boundary", tokenized=vpb.TokenizedInput(input_ids=prompt))
    p = req.sampling_params
    p.max_tokens, p.temperature, p.seed, p.n, p.ignore_eos = 8, 1.0, 5, 2, True
    p.stop.append(": caf")
    done = [m.complete for m in vpb_grpc.VllmEngineStub(demo.channel).Generate(req, timeout=TIMEOUT)]
    assert len(done) == 2
    for out in done:
        assert out.finish_reason == "length" and len(out.output_ids) == 8


def test_offline_generate(prompt: list[int]) -> None:
    llm = LLM(ensure_preset("demo"), kv_cache_gib=0.05)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=12)
        free, constrained = llm.generate([prompt, prompt], params,
                                         constraint=[None, GrammarSpec.json_schema(json.dumps(SCHEMA))])
        assert free.text == _rule(prompt, free.token_ids)
        assert constrained.text == _rule(prompt, constrained.token_ids)
        assert constrained.text.startswith('{"a":'), constrained.text
        tok = Tokenizer(ensure_preset("demo"))
        assert not free.text.startswith(tok.decode(prompt[-3:])[:4])
    finally:
        llm.close()
