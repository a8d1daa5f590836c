"""Proto -> engine validation and engine -> proto conversion, without a server."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from engine import EngineConfig, EngineCore, GenerationStatus, RequestOutput, SamplingParams
from engine.context import TokenLogprobs
from engine.sampling_params import MAX_LOGIT_BIAS
from service.api import convert
from service.errors import Reason, ServiceError
from service.gen.stencil.v1 import generate_pb2 as pb

Finish = pb.GenerateComplete.FinishReason


@pytest.fixture(scope="module")
def engine(preset) -> Iterator[EngineCore]:
    engine = EngineCore(EngineConfig(str(preset("tiny-llama")), kv_cache_gib=0.02))
    yield engine
    engine.close()


def test_unset_fields_keep_engine_defaults() -> None:
    params = convert.sampling_params(pb.GenerateRequest(text="x"))
    assert params == SamplingParams()


def test_explicit_values_including_zero_are_used() -> None:
    req = pb.GenerateRequest(text="x")
    req.sampling.temperature = 0.0
    req.sampling.top_k = 5
    req.sampling.seed = 7
    req.sampling.logit_bias[3] = -2.0
    req.stopping.max_new_tokens = 9
    req.stopping.ignore_eos = True
    req.stopping.stop.extend(["a", "bc"])
    req.response.logprobs = 0
    params = convert.sampling_params(req)
    assert params.temperature == 0.0 and params.greedy
    assert (params.top_k, params.seed, params.max_new_tokens) == (5, 7, 9)
    assert dict(params.logit_bias) == {3: -2.0}
    assert params.ignore_eos and params.stop == ("a", "bc")
    assert params.logprobs == 0


@pytest.mark.parametrize("path, value", [
    ("sampling.temperature", float("nan")),
    ("sampling.top_p", float("nan")),
    ("sampling.frequency_penalty", 3.0),
    ("sampling.presence_penalty", -3.0),
])
def test_bad_values_name_the_field(path: str, value: float) -> None:
    req = pb.GenerateRequest(text="x")
    msg, name = path.split(".")
    setattr(getattr(req, msg), name, value)
    with pytest.raises(ServiceError) as info:
        convert.sampling_params(req)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == path


def test_a_logit_bias_longer_than_any_vocabulary_is_refused_by_its_length() -> None:
    # Each entry was checked on the event loop: 1.4M (a 16 MB message) took ~4 s.
    req = pb.GenerateRequest(text="x")
    for token in range(MAX_LOGIT_BIAS + 1):
        req.sampling.logit_bias[token] = 1.0
    with pytest.raises(ServiceError) as info:
        convert.sampling_params(req)
    assert info.value.violations[0][0] == "sampling.logit_bias"
    assert str(MAX_LOGIT_BIAS) in info.value.violations[0][1]
    del req.sampling.logit_bias[0]
    assert len(convert.sampling_params(req).logit_bias) == MAX_LOGIT_BIAS  # one a token is fine


def prepare(req: pb.GenerateRequest, engine: EngineCore) -> convert.PreparedRequest:
    return convert.prepare_generate(req, engine, convert.check_request_id(req.request_id))


def test_prepare_generate_checks_the_request(engine: EngineCore) -> None:
    req = pb.GenerateRequest(text="hello there", request_id="r1")
    req.stopping.max_new_tokens = 4
    req.response.return_token_ids = False
    prepared = prepare(req, engine)
    assert prepared.request_id == "r1"
    assert prepared.spec.prompt.tolist() == engine.tokenizer.encode("hello there")
    assert prepared.options == convert.OutputOptions(return_token_ids=False)
    assert prepare(pb.GenerateRequest(text="x"), engine).request_id  # one is made up when unset


def test_constrained_request_is_validated_before_compiling(engine: EngineCore) -> None:
    req = pb.GenerateRequest(text="hello", request_id="c1")
    req.constraint.regex = "[a-z]+"
    prepared = prepare(req, engine)
    assert prepared.constraint is not None and prepared.constraint.field == "constraint.regex"
    matcher = engine.structured.compile(prepared.constraint.spec)  # compiled later, off the event loop
    ctx = engine.requests.context(prepared.spec, matcher)  # the context is built once, with its matcher
    assert ctx.matcher is matcher and ctx.request_id == "c1"
    assert ctx.prompt_tokens.tolist() == prepared.spec.prompt.tolist()
    assert ctx.seed == prepared.spec.seed, "the seed is drawn once, when the request is checked"
    # A bad prompt fails before any compile is started.
    bad = pb.GenerateRequest(text="hello")
    bad.constraint.json_schema = '{"type": "nonsense"}'
    bad.stopping.max_new_tokens = 100_000
    with pytest.raises(ServiceError) as info:
        prepare(bad, engine)
    assert info.value.violations[0][0] == "stopping.max_new_tokens"


def test_chat_without_template_is_failed_precondition(engine: EngineCore, monkeypatch) -> None:
    monkeypatch.setattr(type(engine.tokenizer), "has_chat_template", property(lambda self: False))
    req = pb.GenerateRequest()
    req.chat.messages.add(role="user", content="hi")
    with pytest.raises(ServiceError) as info:
        prepare(req, engine)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_chunks_merge_steps_and_honour_options() -> None:
    outs = [RequestOutput("r", token_ids=[5], text="a",
                          logprobs=[TokenLogprobs(5, -0.1, [(5, -0.1), (6, -2.0)])],
                          prompt_logprobs=[None, TokenLogprobs(9, -1.5, [])]),
            RequestOutput("r", token_ids=[6], text="b", logprobs=[TokenLogprobs(6, -0.2, [])])]
    msg = convert.chunk_response("r", outs, convert.OutputOptions(logprobs=True, prompt_logprobs=True))
    assert msg is not None and msg.request_id == "r"
    assert msg.chunk.text == "ab" and list(msg.chunk.token_ids) == [5, 6]
    assert [lp.token_id for lp in msg.chunk.logprobs] == [5, 6]
    assert [t.token_id for t in msg.chunk.logprobs[0].top] == [5, 6]
    assert [lp.token_id for lp in msg.chunk.prompt_logprobs] == [9]
    bare = convert.chunk_response("r", outs, convert.OutputOptions(return_token_ids=False))
    assert bare is not None
    assert list(bare.chunk.token_ids) == [] and len(bare.chunk.logprobs) == 0
    assert convert.chunk_response("r", [RequestOutput("r")], convert.OutputOptions()) is None
    # A token whose text is not complete yet (half a character): with token
    # ids off there is nothing to send, with them its id goes.
    partial = [RequestOutput("r", token_ids=[7], text="")]
    assert convert.chunk_response("r", partial, convert.OutputOptions(return_token_ids=False)) is None
    sent = convert.chunk_response("r", partial, convert.OutputOptions())
    assert sent is not None and list(sent.chunk.token_ids) == [7]


@pytest.mark.parametrize("status, reason, stop", [
    (GenerationStatus.END_OF_SEQUENCE, Finish.EOS, None),
    (GenerationStatus.STOP_STRING, Finish.STOP_STRING, "###"),
    (GenerationStatus.STOP_TOKEN, Finish.STOP_TOKEN, 42),
    (GenerationStatus.MAXIMUM_LENGTH, Finish.LENGTH, None),
    (GenerationStatus.CONTEXT_LENGTH, Finish.CONTEXT_LENGTH, None),
    (GenerationStatus.CANCELLED, Finish.CANCELLED, None),
])
def test_complete_message(status: GenerationStatus, reason: int, stop: str | int | None) -> None:
    final = RequestOutput("r", finished=True, status=status, stop_reason=stop, prompt_tokens=7,
                          completion_tokens=3, cached_prompt_tokens=4, forced_tokens=2)
    done = convert.complete_response("r", final).complete
    assert done.finish_reason == reason
    usage = done.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (7, 3, 4)
    assert usage.forced_tokens == 2
    which = done.WhichOneof("matched_stop")
    assert which == {str: "stop_string", int: "stop_token_id", type(None): None}[type(stop)]
    if which:
        assert getattr(done, which) == stop


def test_every_final_status_has_a_finish_reason() -> None:
    final = {s for s in GenerationStatus if s.is_done} - {GenerationStatus.ERROR}
    for status in final:
        reason = convert.finish_reason(RequestOutput("r", finished=True, status=status))
        assert reason != Finish.FINISH_REASON_UNSPECIFIED, status


def test_tokenize_offsets_in_code_points_or_utf8_bytes(engine: EngineCore) -> None:
    text = "naïve 本 🙂 x"
    req = pb.TokenizeRequest(text=text, return_offsets=True, add_special_tokens=False)
    points = convert.tokenize(req, engine.tokenizer).offsets
    req.offsets_in_utf8_bytes = True
    utf8 = convert.tokenize(req, engine.tokenizer).offsets
    assert len(points) == len(utf8) > 0
    raw = text.encode()
    for p, b in zip(points, utf8, strict=True):
        assert text[p.start:p.end].encode() == raw[b.start:b.end]
    assert utf8[-1].end == len(raw) and points[-1].end == len(text)
    with pytest.raises(ServiceError) as info:
        convert.tokenize(pb.TokenizeRequest(text=text, offsets_in_utf8_bytes=True), engine.tokenizer)
    assert info.value.violations[0][0] == "offsets_in_utf8_bytes"


def test_tokenize_offsets_built_in_slices_and_sized_before_they_are(engine: EngineCore,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A million offsets built in one go held the GIL for seconds, taking the
    # event loop with it, and an answer over the message limit was refused
    # only once built.
    import random

    rng = random.Random(7)
    pieces = ["héllo", " wörld", "\U0001F600", "\n", "abc", "  ", "日本語", "x" * 40, "12345"]
    monkeypatch.setattr(convert, "_MESSAGE_SLICE", 3)
    for i in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        req = pb.TokenizeRequest(text=text, return_offsets=True, offsets_in_utf8_bytes=i % 2 == 1)
        whole = engine.tokenizer.hf(text, add_special_tokens=True, return_offsets_mapping=True)
        answer = convert.tokenize(req, engine.tokenizer, max_bytes=1 << 20)
        expected = np.asarray(whole["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        if req.offsets_in_utf8_bytes:
            expected = convert.utf8_offsets(text)[expected]
        assert [[o.start, o.end] for o in answer.offsets] == expected.tolist()
        assert list(answer.token_ids) == list(whole["input_ids"])
        plain = convert.tokenize(pb.TokenizeRequest(text=text), engine.tokenizer)
        assert list(plain.token_ids) == list(whole["input_ids"]) and not plain.offsets
        size = answer.ByteSize()
        assert size - 12 <= convert._tokenize_answer_bytes(list(whole["input_ids"]), expected) <= size
        if size > 16:
            with pytest.raises(ServiceError) as info:
                convert.tokenize(req, engine.tokenizer, max_bytes=size - 16)
            assert info.value.reason == Reason.RESPONSE_TOO_LARGE and info.value.violations[0][0] == "text"


def test_unset_sampling_values_take_the_models_defaults() -> None:
    req = pb.GenerateRequest(text="x")
    req.sampling.top_k = 5
    params = convert.sampling_params(req, {"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (params.temperature, params.top_p, params.top_k) == (pytest.approx(0.6), pytest.approx(0.9), 5)
    assert convert.sampling_params(pb.GenerateRequest(text="x")).temperature == 1.0


def test_an_unset_max_new_tokens_takes_the_models_default_within_the_room_left(engine: EngineCore,
                                                                              monkeypatch) -> None:
    monkeypatch.setattr(engine, "default_max_new_tokens", 7)
    assert prepare(pb.GenerateRequest(text="x"), engine).spec.params.max_new_tokens == 7
    req = pb.GenerateRequest(text="x")
    req.stopping.max_new_tokens = 50
    assert prepare(req, engine).spec.params.max_new_tokens == 50  # the request's own wins
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * (engine.max_model_len - 3)))
    spec = prepare(long, engine).spec  # less room than the default: the context's limit, not the request's
    assert spec.params.max_new_tokens is None and spec.max_length == engine.max_model_len
    wants_more = pb.GenerateRequest(text="x")
    wants_more.stopping.min_new_tokens = 8
    with pytest.raises(ServiceError) as info:  # as vLLM: refused, the field and the default named
        prepare(wants_more, engine)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == "stopping.min_new_tokens"
    assert "generation_config.json" in info.value.violations[0][1]


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content + 1 }}{% endfor %}",  # TypeError
                                      "{{ 1 // (messages|length - 1) }}",  # ZeroDivisionError
                                      "{{ messages[5].content }}{{ {}['x'] + 1 }}"])  # the like of Python's
def test_a_chat_template_failing_on_the_messages_is_invalid_argument(tmp_path, template: str) -> None:  # type: ignore[no-untyped-def]
    # Python errors raised by the template's own code escaped as INTERNAL
    # (only jinja's TemplateError was a client error; vLLM answers 400).
    import json
    import shutil

    from engine.presets import ensure_preset
    from engine.tokenizer import Tokenizer

    source = ensure_preset("tiny-qwen3")
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="a")])
    with pytest.raises(ServiceError) as info:
        convert.chat_prompt(chat, Tokenizer(tmp_path))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == "chat.messages"


@pytest.mark.parametrize("form", ["text", "chat"])
def test_a_prompt_far_past_the_context_is_refused_before_it_is_all_tokenized(engine: EngineCore, form: str) -> None:
    long = "a b c d " * 100_000
    req = pb.GenerateRequest(text=long) if form == "text" else pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=long)]))
    with pytest.raises(ServiceError) as info:
        convert.prepare_generate(req, engine, "job")
    field, says = info.value.violations[0]
    assert field == ("text" if form == "text" else "chat.messages") and "more than" in says


def test_template_variables_past_their_size_are_refused_unread(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # 600k variables (11 MB) were parsed, walked and handed to the template:
    # ~1 s with the GIL held. Now their text's length decides, before parsing.
    import json

    from engine.presets import ensure_preset
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(ensure_preset("tiny-qwen3"))
    loads: list[str] = []

    def recorded(text, *args, **kwargs):  # type: ignore[no-untyped-def]
        loads.append(text)
        return json.JSONDecoder().decode(text)

    monkeypatch.setattr(convert.json, "loads", recorded)
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="a")])
    chat.template_kwargs = json.dumps({f"k{i}": i for i in range(100_000)})
    assert len(chat.template_kwargs) > convert.MAX_TEMPLATE_KWARGS_CHARS
    with pytest.raises(ServiceError) as info:
        convert.chat_prompt(chat, tokenizer)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0][0] == "chat.template_kwargs"
    assert chat.template_kwargs not in loads
    chat.template_kwargs = json.dumps({"enable_thinking": False, "note": "x" * 1000})
    assert convert.chat_prompt(chat, tokenizer)
    assert chat.template_kwargs in loads


def test_a_reasoning_only_chunk_is_sent_without_token_ids() -> None:
    # With token ids off, a chunk of thought alone is still news.
    outputs = [RequestOutput("r", token_ids=[5], text="", reasoning="hmm")]
    msg = convert.chunk_response("r", outputs, convert.OutputOptions(return_token_ids=False))
    assert msg is not None and msg.chunk.reasoning == "hmm" and not msg.chunk.token_ids
    assert convert.chunk_response("r", [RequestOutput("r", token_ids=[5])],
                                  convert.OutputOptions(return_token_ids=False)) is None


def test_limits_admit_their_own_value() -> None:
    from service.ops.request_log import MAX_REQUEST_ID_LENGTH

    assert convert.check_request_id("a" * MAX_REQUEST_ID_LENGTH) == "a" * MAX_REQUEST_ID_LENGTH
    with pytest.raises(ServiceError):
        convert.check_request_id("a" * (MAX_REQUEST_ID_LENGTH + 1))

    def nested(levels: int) -> list:
        value: list = []
        for _ in range(levels - 1):
            value = [value]
        return value

    limit = convert.MAX_TEMPLATE_KWARGS_DEPTH
    assert not convert._deeper_than(nested(limit), limit) and convert._deeper_than(nested(limit + 1), limit)


def test_utf8_offsets_at_each_encoded_width_boundary() -> None:
    for char, width in (("\x7f", 1), ("\x80", 2), ("\u07ff", 2), ("\u0800", 3), ("\uffff", 3),
                        ("\U00010000", 4)):
        assert convert.utf8_offsets(char + "a").tolist() == [0, width, width + 1], hex(ord(char))
        assert len((char + "a").encode()) == width + 1
