"""The vLLM protocol's checks and facts, without a server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine import EngineConfig, EngineCore
from engine.sampling_params import MAX_LOGIT_BIAS
from service.errors import ServiceError
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.ops.request_log import valid_request_id
from service.vllm_protocol import convert
from service.vllm_protocol.info import model_info


@pytest.fixture(scope="module")
def engine(preset) -> Iterator[EngineCore]:
    engine = EngineCore(EngineConfig(str(preset("tiny-llama")), kv_cache_gib=0.02))
    yield engine
    engine.close()


def test_the_checkpoints_sampling_defaults_are_reported_for_the_router(engine: EngineCore, monkeypatch) -> None:
    # The protocol's fields cannot be unset, so a router applies these itself (as for vLLM).
    monkeypatch.setattr(engine, "sampling_defaults", {"temperature": 0.6, "top_k": 20})
    info = model_info(engine, "m")
    assert json.loads(info.default_sampling_params_json) == {"temperature": 0.6, "top_k": 20}
    monkeypatch.setattr(engine, "sampling_defaults", {})
    assert model_info(engine, "m").default_sampling_params_json == ""


def _request(ids: list[int], **params: int) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(request_id="job", tokenized=vpb.TokenizedInput(input_ids=ids))
    req.sampling_params.max_tokens = 4
    for name, value in params.items():
        setattr(req.sampling_params, name, value)
    return req


def test_the_other_sequences_ids_are_none_a_client_could_send(engine: EngineCore) -> None:
    # Sequence 1 of "job" was "job/1", a client's own id: an Abort of "job"
    # stopped an unrelated "job/1", and an n=2 "x" was refused while one ran.
    prepared = convert.prepare_generate(_request([5, 6, 7], n=3), engine, "job")
    ids = [spec.request_id for spec in prepared.specs]
    assert ids[0] == "job" and len(set(ids)) == 3
    assert all(rid is not None and rid.startswith("job") and not valid_request_id(rid) for rid in ids[1:])


def test_a_bad_id_is_named_at_its_index_in_the_untruncated_prompt(engine: EngineCore) -> None:
    req = _request([5, 6, 7, engine.vocab_size + 9, 8], truncate_prompt_tokens=2)
    with pytest.raises(ServiceError) as info:
        convert.prepare_generate(req, engine, "job")
    assert info.value.violations[0][0] == "tokenized.input_ids[3]"


def test_logit_bias_is_copied_out_of_the_message_and_bounded() -> None:
    p = vpb.SamplingParams()
    p.logit_bias[3] = -2.5
    params = convert.sampling_params(p)
    p.logit_bias[3] = 9.0  # the request keeps what was sent, not a view of the message
    assert dict(params.logit_bias) == {3: -2.5}
    for token in range(MAX_LOGIT_BIAS + 1):
        p.logit_bias[token] = 1.0
    with pytest.raises(ServiceError) as info:
        convert.sampling_params(p)
    assert "logit_bias" in info.value.violations[0][0]


def test_a_text_prompt_far_past_the_context_is_refused_unless_truncated(engine: EngineCore) -> None:
    # Refused from a part of it (the whole was tokenized first); with
    # truncate_prompt_tokens its end is kept, so all of it is tokenized.
    req = vpb.GenerateRequest(request_id="job", text="a b c d " * 100_000)
    req.sampling_params.max_tokens = 4
    with pytest.raises(ServiceError) as info:
        convert.prepare_generate(req, engine, "job")
    assert info.value.violations[0][0] == "text" and "more than" in info.value.violations[0][1]
    req.sampling_params.truncate_prompt_tokens = 8
    prepared = convert.prepare_generate(req, engine, "job")
    assert len(prepared.specs[0].prompt) == 8


def test_seed_minus_one_is_no_seed_as_vllm_reads_it(engine: EngineCore) -> None:
    # -1 was taken modulo 2^63: one fixed seed, so every such request drew the same samples.
    unseeded = [convert.prepare_generate(_request([5, 6, 7], seed=-1), engine, "job").specs[0] for _ in range(2)]
    assert unseeded[0].params.seed is None and unseeded[0].seed != unseeded[1].seed
    assert convert.sampling_params(_request([5], seed=-2).sampling_params).seed == (1 << 63) - 2
    assert convert.sampling_params(_request([5], seed=7).sampling_params).seed == 7


def test_several_greedy_samples_are_refused_as_vllm_does(engine: EngineCore) -> None:
    req = _request([5, 6, 7], n=2)
    req.sampling_params.temperature = 0.0
    with pytest.raises(ServiceError) as info:
        convert.prepare_generate(req, engine, "job")
    assert info.value.violations[0][0] == "sampling_params.n"
    req.sampling_params.temperature = 0.7
    assert len(convert.prepare_generate(req, engine, "job").specs) == 2
    req.sampling_params.n = 1
    req.sampling_params.temperature = 0.0
    assert len(convert.prepare_generate(req, engine, "job").specs) == 1


def test_truncation_past_the_context_is_refused_as_vllm_does(engine: EngineCore) -> None:
    req = _request([5, 6, 7], truncate_prompt_tokens=engine.max_model_len + 1)
    with pytest.raises(ServiceError) as info:
        convert.prepare_generate(req, engine, "job")
    assert info.value.violations[0][0] == "sampling_params.truncate_prompt_tokens"
    for keep, kept in ((engine.max_model_len, 3), (-1, 3), (2, 2)):
        req.sampling_params.truncate_prompt_tokens = keep
        assert len(convert.prepare_generate(req, engine, "job").specs[0].prompt) == kept
    # -1 on a prompt past the context keeps its end, one token short of the
    # context: room for the answer's first token, where it ends ("length").
    long = _request([5] * (engine.max_model_len + 10), truncate_prompt_tokens=-1)
    spec = convert.prepare_generate(long, engine, "job").specs[0]
    assert len(spec.prompt) == engine.max_model_len - 1 and spec.params.max_new_tokens == 1


def test_schemas_are_read_as_vllm_reads_them() -> None:
    # SMG builds required tool calls as an array of objects that name their
    # properties and say nothing of others; read as JSON Schema reads it, a
    # weak model wrote keys of its own until max_tokens.
    for field, value in (("json_schema", '{"type": "object", "properties": {"a": {}}}'),
                         ("structural_tag", json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                                                        "triggers": ["<f>"]}))):
        p = vpb.SamplingParams()
        setattr(p, field, value)
        prepared = convert.constraint_spec(p)
        assert prepared is not None and prepared.spec.options.closed_objects
    p = vpb.SamplingParams(regex="a+")
    prepared = convert.constraint_spec(p)
    assert prepared is not None and not prepared.spec.options.closed_objects


def test_outputs_read_as_vllm_writes_them() -> None:
    from engine import GenerationStatus, RequestOutput
    from engine.context import TokenLogprobs

    # A context-length cut is "length", as a max_tokens one is.
    for status, reason in ((GenerationStatus.CONTEXT_LENGTH, "length"), (GenerationStatus.MAXIMUM_LENGTH, "length"),
                           (GenerationStatus.CANCELLED, "abort"), (GenerationStatus.END_OF_SEQUENCE, "stop")):
        assert convert.finish_reason(RequestOutput("r", finished=True, status=status)) == reason
    # logprobs=0: the sampled tokens' log-probabilities, no top entries.
    items = [TokenLogprobs(5, -0.1, [])]
    out = convert.output_logprobs(items, 0)
    assert out is not None and list(out.token_ids) == [5] and len(out.top_logprobs) == 0
    out = convert.output_logprobs([TokenLogprobs(5, -0.1, [(5, -0.1)])], 1)
    assert out is not None and list(out.top_logprobs[0].token_ids) == [5]


def test_n_up_to_its_maximum_is_served(engine: EngineCore) -> None:
    req = _request([5, 6, 7], n=convert.MAX_N)
    req.sampling_params.temperature = 1.0
    assert len(convert.prepare_generate(req, engine, "job").specs) == convert.MAX_N
    req.sampling_params.n = convert.MAX_N + 1
    with pytest.raises(ServiceError):
        convert.prepare_generate(req, engine, "job")
