"""Structured output through gRPC: every completed output follows its constraint,
bad or slow constraints fail only their own call, cut outputs say LENGTH."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from engine import EngineConfig, EngineCore
from engine.presets import ensure_preset
from engine.tokenizer import Tokenizer
from service.cli import main
from service.errors import bad_request_violations
from service.gen.stencil.v1 import generate_pb2 as pb

from ..engine.scripted import scripted_by_position
from .helpers import TIMEOUT, ServerHandle, engine_factory, generate, greedy

Finish = pb.GenerateComplete.FinishReason
C = pb.Constraint
V = pb.SchemaValidation

# Bounded strings, enums, bounded integers and arrays, no extra keys: a random
# model cannot wander off, so every output completes within max_new_tokens.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ord-[0-9]{4}$"},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "customer": {
            "type": "object",
            "properties": {"first_name": {"type": "string", "maxLength": 8},
                           "country_code": {"enum": ["DE", "FR", "US"]}},
            "required": ["first_name", "country_code"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 6},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "gift_wrap": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items", "gift_wrap"],
    "additionalProperties": False,
}
# (temperature, seed): greedy, and sampling with several seeds.
SAMPLING = [(0.0, None), (0.8, 1), (0.8, 2), (0.8, 3)]

# xgrammar cases run with overlap on and off: with overlap, forced tokens are
# appended behind an in-flight step whose mask is narrowed to the first of them
# (xgrammar would otherwise also allow other tokenizations of the forced text).
PERSON_PATTERNED = {
    **PERSON,
    "properties": {**PERSON["properties"],
                   "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,11}$"}},
}


def nested_any_of(depth: int, salt: str = "") -> dict[str, Any]:
    """Nested anyOf of objects and arrays: xgrammar's compile time explodes with
    depth (depth 7 takes ~30 s; see tests/grammar/test_compiler.py)."""
    schema: dict[str, Any] = {"type": "string"}
    for i in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {f"k{i}_{j}{salt}": schema},
                             "required": [f"k{i}_{j}{salt}"]} for j in range(2)]
                  + [{"type": "array", "items": schema}]}
    return schema


def constrained(prompt: str, temperature: float = 0.0, seed: int | None = None,
                max_new_tokens: int = 200, **constraint: Any) -> pb.GenerateRequest:
    req = greedy(prompt, max_new_tokens=max_new_tokens)
    req.sampling.temperature = temperature
    if seed is not None:
        req.sampling.seed = seed
    choices = constraint.pop("choice", None)
    req.constraint.CopyFrom(pb.Constraint(**constraint))
    if choices is not None:
        req.constraint.choice.SetInParent()  # set even when empty
        req.constraint.choice.choices.extend(choices)
    return req


def run_all(stub: Any, reqs: list[pb.GenerateRequest]) -> list[tuple[str, pb.GenerateComplete]]:
    """Run the requests at once (so they share engine steps); (text, complete) each."""
    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(lambda r: generate(stub, r), reqs))
    return [(text, done) for text, _, done, _ in results]


def _generate_once_compiler_is_up(stub: Any, req: pb.GenerateRequest) -> Any:
    """`generate`, retried while the server answers RESOURCE_EXHAUSTED: after a
    compile timeout killed the only worker, compiles that come before its
    replacement is up find the compiler busy (and say so, retryable)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return generate(stub, req)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value


@pytest.fixture(scope="module")
def no_overlap_server(make_module_server) -> ServerHandle:  # type: ignore[no-untyped-def]
    return make_module_server(engine_factory(overlap=False), warmup_grammar=True)


@pytest.fixture(params=["overlap", "no-overlap"])
def xgrammar_server(request: pytest.FixtureRequest) -> ServerHandle:
    """Both schedulings, for cases xgrammar serves."""
    if request.param == "overlap":
        return request.getfixturevalue("grammar_server")
    return request.getfixturevalue("no_overlap_server")


def check_json(stub: Any, name: str, schema: dict[str, Any], whitespace: int,
               backend: int = C.BACKEND_UNSPECIFIED,
               sampling: list[tuple[float, int | None]] = SAMPLING) -> None:
    reqs = [constrained(f"Describe {name} {i}", t, seed, json_schema=json.dumps(schema),
                        whitespace=whitespace, backend=backend) for i, (t, seed) in enumerate(sampling)]
    for text, done in run_all(stub, reqs):
        assert done.finish_reason == Finish.EOS, (text, done)
        jsonschema.validate(json.loads(text), schema)
        assert done.schema_validation.result == V.VALID, done
        assert list(done.unenforced_keywords) == []
        assert 0 < done.usage.forced_tokens <= done.usage.completion_tokens
        if whitespace == C.WHITESPACE_UNSPECIFIED:  # compact: exactly json.dumps' separators
            assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
        if whitespace == C.WHITESPACE_PRETTY:
            assert text == json.dumps(json.loads(text), indent=2, ensure_ascii=False)


@pytest.mark.parametrize("name, schema, whitespace", [
    ("person", PERSON, C.WHITESPACE_UNSPECIFIED),
    ("order", ORDER, C.WHITESPACE_UNSPECIFIED),
    ("order-flexible", ORDER, C.WHITESPACE_FLEXIBLE),
])
def test_json_schema_outputs_parse_and_validate(grammar_server: ServerHandle, name: str,
                                                schema: dict[str, Any], whitespace: int) -> None:
    # backend auto: llguidance for these (the more conformant JSON backend).
    check_json(grammar_server.stub, name, schema, whitespace)


def test_xgrammar_json_outputs_parse_and_validate(xgrammar_server: ServerHandle) -> None:
    # Pretty JSON goes to xgrammar under auto (it alone enforces indentation).
    check_json(xgrammar_server.stub, "person-pretty", PERSON_PATTERNED, C.WHITESPACE_PRETTY)
    check_json(xgrammar_server.stub, "person-xgrammar", PERSON_PATTERNED, C.WHITESPACE_UNSPECIFIED,
               C.BACKEND_XGRAMMAR)


def test_xgrammar_free_strings_are_valid_json(no_overlap_server: ServerHandle) -> None:
    # xgrammar's bounded-string rule used to admit raw control characters (about
    # one output in ten, measured offline); grammar/_xgr.py narrows it.
    check_json(no_overlap_server.stub, "person-free", PERSON, C.WHITESPACE_UNSPECIFIED,
               C.BACKEND_XGRAMMAR, [(0.8, seed) for seed in range(24)])


def test_ebnf_output_matches(xgrammar_server: ServerHandle) -> None:
    reqs = [constrained(f"ebnf {i}", t, seed, ebnf='root ::= "color=" ("red" | "green") ";"')
            for i, (t, seed) in enumerate(SAMPLING)]
    for text, done in run_all(xgrammar_server.stub, reqs):
        assert done.finish_reason == Finish.EOS, (text, done)
        assert text in ("color=red;", "color=green;")


def test_key_heavy_schema_forces_tokens(grammar_server: ServerHandle) -> None:
    text, _, done, _ = generate(grammar_server.stub, constrained("order", json_schema=json.dumps(ORDER)))
    jsonschema.validate(json.loads(text), ORDER)
    # Every key, quote, colon and comma of the object's skeleton is forced.
    assert done.usage.forced_tokens >= 10, done.usage
    assert done.usage.forced_tokens * 4 >= done.usage.completion_tokens, done.usage


def test_json_object_regex_choice_and_grammars_match(grammar_server: ServerHandle) -> None:
    regex = r"[a-z]{3,8}-[0-9]{2,4}"
    choices = ["yes", "no", "it depends"]
    reqs, checks = [], []
    def token(text: str) -> int:
        (tok,) = grammar_server.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False)).token_ids
        return tok

    quote, brace = token('"'), token("}")
    for i, (t, seed) in enumerate(SAMPLING):
        # Free keys never end under a random model: favouring '"' closes each
        # string at once, then '}' the object (logit_bias composes with the mask).
        req = constrained(f"json {i}", t, seed, json_object=True)
        req.sampling.logit_bias[quote] = 30.0
        req.sampling.logit_bias[brace] = 20.0
        reqs.append(req)
        checks.append(lambda s: isinstance(json.loads(s), dict))
        reqs.append(constrained(f"id {i}", t, seed, regex=regex))
        checks.append(lambda s: re.fullmatch(regex, s) is not None)
        reqs.append(constrained(f"answer {i}", t, seed, choice=choices))
        checks.append(lambda s: s in choices)
    reqs.append(constrained("lark", 0.8, 6, lark='start: "n=" /[0-9]{1,3}/'))
    checks.append(lambda s: re.fullmatch(r"n=[0-9]{1,3}", s) is not None)
    for (text, done), check in zip(run_all(grammar_server.stub, reqs), checks, strict=True):
        assert done.finish_reason == Finish.EOS, (text, done)
        assert check(text), text


def test_per_request_backend(grammar_server: ServerHandle) -> None:
    # The completion reports which library compiled the constraint; auto picks
    # llguidance for JSON schemas and xgrammar for EBNF.
    for backend, expected in ((C.BACKEND_LLGUIDANCE, "llguidance"), (C.BACKEND_XGRAMMAR, "xgrammar"),
                              (C.BACKEND_AUTO, "llguidance")):
        text, _, done, _ = generate(grammar_server.stub,
                                    constrained("p", json_schema=json.dumps(PERSON), backend=backend))
        assert done.finish_reason == Finish.EOS
        jsonschema.validate(json.loads(text), PERSON)
        assert done.grammar_backend == expected
    _, _, done, _ = generate(grammar_server.stub, constrained("e", ebnf='root ::= "a" | "b"'))
    assert done.grammar_backend == "xgrammar"
    _, _, done, _ = generate(grammar_server.stub, greedy("free", max_new_tokens=2))
    assert done.grammar_backend == ""


def test_cut_by_max_new_tokens_finishes_with_length(grammar_server: ServerHandle) -> None:
    text, _, done, _ = generate(grammar_server.stub,
                                constrained("cut", max_new_tokens=3, json_schema=json.dumps(ORDER)))
    assert done.finish_reason == Finish.LENGTH
    assert done.usage.completion_tokens == 3
    assert done.schema_validation.result == V.NOT_CHECKED
    with pytest.raises(ValueError):
        json.loads(text)


def test_a_value_the_length_limits_last_token_completes_is_validated(grammar_server: ServerHandle) -> None:
    schema = json.dumps({"enum": ["stencil"]})
    text, ids, done, _ = generate(grammar_server.stub, constrained("whole", json_schema=schema))
    assert done.finish_reason == Finish.EOS and text == '"stencil"'
    value_tokens = done.usage.completion_tokens - 1  # less the EOS
    # The last token the limit allows closes the value: the output is whole.
    _, _, done, _ = generate(grammar_server.stub,
                             constrained("whole", max_new_tokens=value_tokens, json_schema=schema))
    assert done.finish_reason == Finish.LENGTH
    assert done.schema_validation.result == V.VALID, done.schema_validation


def test_output_ended_by_a_stop_string_is_validated_when_whole(grammar_server: ServerHandle) -> None:
    schema = json.dumps({"enum": ["stencil"]})
    # The stop string cuts the value short: not JSON, so not checked.
    req = constrained("s", json_schema=schema)
    req.stopping.stop.append("il")
    text, _, done, _ = generate(grammar_server.stub, req)
    assert done.finish_reason == Finish.STOP_STRING and text == '"stenc'
    assert done.schema_validation.result == V.NOT_CHECKED
    # It ends right at the value's end (kept in the output): validated.
    req.stopping.stop[:] = ['il"']
    req.stopping.include_stop_str_in_output = True
    text, _, done, _ = generate(grammar_server.stub, req)
    assert done.finish_reason == Finish.STOP_STRING and text == '"stencil"'
    assert done.schema_validation.result == V.VALID


# Three items from three values, all different: a random model repeats one
# often, and neither library enforces uniqueItems token by token.
UNIQUE = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3,
          "uniqueItems": True}


def test_outputs_are_validated_against_the_whole_schema(grammar_server: ServerHandle) -> None:
    # Resampling off: what the model writes stays, and validation reports it.
    reqs = [constrained(f"u {seed}", 1.0, seed, json_schema=json.dumps(UNIQUE), resample=False)
            for seed in range(8)]
    results = set()
    for text, done in run_all(grammar_server.stub, reqs):
        assert done.finish_reason == Finish.EOS, (text, done)
        assert list(done.unenforced_keywords) == ["uniqueItems"]
        value = json.loads(text)
        expected = V.VALID if len(set(value)) == 3 else V.INVALID
        assert done.schema_validation.result == expected, (text, done)
        if expected == V.INVALID:
            assert done.schema_validation.keyword == "uniqueItems"
            assert done.schema_validation.instance_path == ""
            assert done.schema_validation.message
        results.add(expected)
    assert V.INVALID in results  # the random model does repeat itself


def test_default_requests_resample_what_the_grammar_cannot_enforce(grammar_server: ServerHandle) -> None:
    # The same requests with resample left unset: every duplicate is rolled
    # back and resampled, so every output is valid and the retries say so.
    reqs = [constrained(f"u {seed}", 1.0, seed, json_schema=json.dumps(UNIQUE)) for seed in range(8)]
    retries = 0
    for text, done in run_all(grammar_server.stub, reqs):
        assert done.finish_reason == Finish.EOS, (text, done)
        assert done.schema_validation.result == V.VALID, (text, done)
        assert len(set(json.loads(text))) == 3
        retries += done.usage.schema_retries
    assert retries > 0
    # resample applies to JSON only, and strict cannot turn it off.
    err = _error(grammar_server.stub.Generate(constrained("r", regex="a+", resample=True), timeout=TIMEOUT))
    assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.resample"
    err = _error(grammar_server.stub.Generate(
        constrained("s", json_schema=json.dumps(UNIQUE), strict=True, resample=False), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.resample"


def test_strict_refuses_what_the_grammar_cannot_enforce(grammar_server: ServerHandle) -> None:
    stub = grammar_server.stub
    # `not` inside an anyOf branch: which branch applies depends on the value,
    # so no check sees the value `not` constrains on its own.
    schema = {"anyOf": [{"type": "object", "not": {"required": ["a"]}}, {"type": "string"}]}
    req = constrained("s", json_schema=json.dumps(schema), strict=True)
    err = _error(stub.Generate(req, timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not" in err.details() and "strict" in err.details()
    assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.json_schema"
    err = _error(stub.Generate(constrained("r", regex="a+", strict=True), timeout=TIMEOUT))
    assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.strict"
    # A schema the grammar enforces whole runs as usual.
    text, _, done, _ = generate(stub, constrained("p", json_schema=json.dumps(PERSON), strict=True))
    assert done.finish_reason == Finish.EOS and done.schema_validation.result == V.VALID


def _scripted_strict(make_server, text: str, alternatives: dict[int, str], schema: dict,  # type: ignore[no-untyped-def]
                     **server_config):
    """A server whose model writes `text` (with `alternatives`: output token
    index -> its next choice there) and a strict request for `schema`."""
    path = ensure_preset("tiny-llama")
    tok = Tokenizer(str(path))
    ids = tok.encode(text, add_special_tokens=False)
    script = {2 + i: [t] for i, t in enumerate(ids)}  # the prompt is 2 tokens
    for i, alt in alternatives.items():
        script[2 + i] += tok.encode(alt, add_special_tokens=False)
    server = make_server(lambda: EngineCore(EngineConfig(model=str(path), kv_cache_gib=0.05),
                                            wrap_model=scripted_by_position(script)), **server_config)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[9, 5]))
    req.sampling.temperature = 0
    req.stopping.max_new_tokens = 20
    req.constraint.CopyFrom(pb.Constraint(json_schema=json.dumps(schema), strict=True))
    return server, req


def test_strict_resamples_a_duplicate_item(make_server) -> None:  # type: ignore[no-untyped-def]
    """A scripted model that wants [1,1,2]: the second 1 is rolled back and
    resampled (its second choice, 3); the stream never carried the duplicate."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    server, req = _scripted_strict(make_server, "[1,1,2]", {3: "3"}, schema)
    text, _, done, chunks = generate(server.stub, req)
    assert text == "[1,3,2]" and done.finish_reason == Finish.EOS
    assert done.usage.schema_retries == 1
    assert done.schema_validation.result == V.VALID
    assert list(done.unenforced_keywords) == ["uniqueItems"]  # not token by token: by resampling
    # The stream is what the client got: had the duplicate been sent, it would be in `text`.
    assert "".join(c.text for c in chunks) == text
    # Without strict the default resamples just the same.
    req.constraint.strict = False
    text, _, done, _ = generate(server.stub, req)
    assert text == "[1,3,2]" and done.usage.schema_retries == 1
    # With resampling off the model's duplicate stays, and validation says so.
    req.constraint.resample = False
    text, _, done, _ = generate(server.stub, req)
    assert text == "[1,1,2]" and done.usage.schema_retries == 0
    assert done.schema_validation.result == V.INVALID


def test_server_default_can_turn_resampling_off(make_server) -> None:  # type: ignore[no-untyped-def]
    # `stencild serve --no-resample`: requests that leave resample unset keep
    # the model's duplicate; one that asks, and a strict one, still resample.
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    server, req = _scripted_strict(make_server, "[1,1,2]", {3: "3"}, schema, resample=False)
    req.constraint.strict = False
    text, _, done, _ = generate(server.stub, req)
    assert text == "[1,1,2]" and done.schema_validation.result == V.INVALID
    req.constraint.resample = True
    text, _, done, _ = generate(server.stub, req)
    assert text == "[1,3,2]" and done.usage.schema_retries == 1
    req.constraint.ClearField("resample")
    req.constraint.strict = True
    text, _, done, _ = generate(server.stub, req)
    assert text == "[1,3,2]" and done.schema_validation.result == V.VALID


def test_strict_ends_schema_violation_when_resampling_cannot_help(make_server) -> None:  # type: ignore[no-untyped-def]
    """Items can only be 1 and must be unique: the grammar forces the second 1
    (no choice to resample), so the output breaks the schema and says so."""
    schema = {"type": "array", "items": {"const": 1}, "uniqueItems": True}
    server, req = _scripted_strict(make_server, "[1,1]", {}, schema)
    text, _, done, _ = generate(server.stub, req)
    assert text == "[1,1]" and done.finish_reason == Finish.SCHEMA_VIOLATION
    assert done.schema_validation.result == V.INVALID and done.schema_validation.keyword == "uniqueItems"
    req.constraint.strict = False  # without strict: EOS, with the same verdict
    text, _, done, _ = generate(server.stub, req)
    assert done.finish_reason == Finish.EOS and done.schema_validation.result == V.INVALID


def test_strict_refuses_uniqueItems_it_cannot_track(grammar_server: ServerHandle) -> None:
    # Under anyOf, whether uniqueItems applies depends on the branch: not tracked.
    schema = {"anyOf": [{"type": "array", "uniqueItems": True}, {"type": "string"}]}
    err = _error(grammar_server.stub.Generate(constrained("s", json_schema=json.dumps(schema), strict=True),
                                              timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "uniqueItems" in err.details()


def test_refs_to_other_documents_resolve_from_the_schema_store(make_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # `stencild serve --schema-store PREFIX=DIR`: a $ref by URI reads the
    # document from DIR (never fetched); anything else fails to compile.
    (tmp_path / "colour.json").write_text(json.dumps(
        {"$defs": {"name": {"enum": ["red", "green", "blue"]}}, "$ref": "#/$defs/name"}))
    base = "https://schemas.example.com/"
    server = make_server(engine_factory(schema_store=(f"{base}={tmp_path}",)))
    schema = {"type": "object", "properties": {"colour": {"$ref": base + "colour.json"}},
              "required": ["colour"], "additionalProperties": False}
    text, _, done, _ = generate(server.stub, constrained("c", json_schema=json.dumps(schema)))
    assert json.loads(text)["colour"] in ("red", "green", "blue")
    assert done.finish_reason == Finish.EOS and done.schema_validation.result == V.VALID
    missing = {"$ref": base + "missing.json"}
    err = _error(server.stub.Generate(constrained("m", json_schema=json.dumps(missing)), timeout=TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.json_schema"


def test_validate_constraint_reports_without_generating(grammar_server: ServerHandle) -> None:
    stub = grammar_server.stub
    schema = {"type": "object", "properties": {"tags": UNIQUE}, "required": ["tags"],
              "title": "annotation only", "x-vendor": True}
    resp = stub.ValidateConstraint(pb.ValidateConstraintRequest(
        constraint=pb.Constraint(json_schema=json.dumps(schema))), timeout=TIMEOUT)
    assert resp.grammar_backend == "llguidance"
    assert list(resp.unenforced_keywords) == ["uniqueItems"]
    assert resp.output_validated and resp.compile_seconds >= 0
    again = stub.ValidateConstraint(pb.ValidateConstraintRequest(
        constraint=pb.Constraint(json_schema=json.dumps(schema))), timeout=TIMEOUT)
    assert again.cached
    assert list(again.resampled_keywords) == ["uniqueItems"]  # a default request resamples it
    # Inside an anyOf branch no value can be resampled for it; resample off: nothing is.
    branch = {"anyOf": [{"type": "array", "uniqueItems": True}, {"type": "string"}]}
    resp = stub.ValidateConstraint(pb.ValidateConstraintRequest(
        constraint=pb.Constraint(json_schema=json.dumps(branch))), timeout=TIMEOUT)
    assert "uniqueItems" in resp.unenforced_keywords and not resp.resampled_keywords
    resp = stub.ValidateConstraint(pb.ValidateConstraintRequest(
        constraint=pb.Constraint(json_schema=json.dumps(schema), resample=False)), timeout=TIMEOUT)
    assert list(resp.unenforced_keywords) == ["uniqueItems"] and not resp.resampled_keywords
    with pytest.raises(grpc.RpcError) as info:
        stub.ValidateConstraint(pb.ValidateConstraintRequest(
            constraint=pb.Constraint(json_schema='{"$ref": "#/nowhere"}')), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(info.value.trailing_metadata())[0][0] == "constraint.json_schema"


def test_a_large_constraint_to_validate_is_read_off_the_event_loop(grammar_server: ServerHandle,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A regex's safety scans read the whole source on the loop: an 8 MB one
    # held it (every stream, every health check) for 6-7 s.
    from service.api import generation as generation_module

    threads: list[str] = []
    read = generation_module.constraint_spec

    def recorded(req: pb.GenerateRequest) -> Any:
        threads.append(threading.current_thread().name)
        return read(req)

    monkeypatch.setattr(generation_module, "constraint_spec", recorded)
    loop_thread = grammar_server.runner.thread.name
    for regex in ("[ab]{3}", "(ab|cd)" * 8000):
        resp = grammar_server.stub.ValidateConstraint(pb.ValidateConstraintRequest(
            constraint=pb.Constraint(regex=regex)), timeout=TIMEOUT)
        assert resp.grammar_backend
    assert threads[0] == loop_thread != threads[1]  # small: on the loop; large: off it


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "schema not JSON": ({"json_schema": "{not json"}, "constraint.json_schema"),
    "unknown type": ({"json_schema": '{"type": "nonsense"}'}, "constraint.json_schema"),
    "dangling $ref": ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "constraint.json_schema"),
    "bad regex": ({"regex": "(unclosed"}, "constraint.regex"),
    "empty choice": ({"choice": []}, "constraint.choice.choices"),
    "json_object false": ({"json_object": False}, "constraint.json_object"),
    "bad ebnf": ({"ebnf": "root ::= undefined_rule"}, "constraint.ebnf"),
    "bad lark": ({"lark": "start: ("}, "constraint.lark"),
    "no kind": ({"backend": C.BACKEND_XGRAMMAR}, "constraint.kind"),
    "max_whitespace without flexible": ({"json_object": True, "max_whitespace": 2},
                                        "constraint.max_whitespace"),
    "indent out of range": ({"json_object": True, "whitespace": C.WHITESPACE_PRETTY, "indent": 9},
                            "constraint.indent"),
    "whitespace on a regex": ({"regex": "a+", "whitespace": C.WHITESPACE_PRETTY},
                              "constraint.whitespace"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_constraint_is_invalid_argument_within_a_second(grammar_server: ServerHandle,
                                                                 case: str) -> None:
    fields, path = INVALID[case]
    req = constrained("bad", **fields)
    start = time.monotonic()
    err = _error(grammar_server.stub.Generate(req, timeout=TIMEOUT))
    elapsed = time.monotonic() - start
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == [path]
    assert err.details().startswith(path)
    assert "Traceback" not in err.details() and "<state>" not in err.details()
    assert "\n" not in err.details()
    assert elapsed < 1.0, f"{case}: {elapsed:.2f} s"


@pytest.fixture(scope="module")
def slow_grammar_server(make_module_server) -> ServerHandle:  # type: ignore[no-untyped-def]
    """20 ms per step (streams outlast a compile) and a 1 s compile timeout."""
    return make_module_server(engine_factory(slow_s=0.02, grammar_compile_timeout_s=1.0), warmup_grammar=True)


def test_compile_timeout_fails_only_its_request(slow_grammar_server: ServerHandle) -> None:
    stub = slow_grammar_server.stub
    free = greedy("keep going", max_new_tokens=300)
    free.stopping.ignore_eos = True
    stream = stub.Generate(free, timeout=TIMEOUT)
    arrivals: list[float] = []

    def read() -> None:
        try:
            for msg in stream:
                if msg.HasField("chunk"):
                    arrivals.append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read)
    reader.start()
    while not arrivals:
        time.sleep(0.01)
    slow = constrained("slow", json_schema=json.dumps(nested_any_of(7)), backend=C.BACKEND_XGRAMMAR)
    start = time.monotonic()
    err = _error(stub.Generate(slow, timeout=TIMEOUT))
    end = time.monotonic()
    stream.cancel()
    reader.join(TIMEOUT)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_violations(err.trailing_metadata())[0][0] == "constraint.json_schema"
    assert "timed out" in err.details()
    assert 1.0 <= end - start < 4.0
    during = [t for t in arrivals if start < t < end]
    # 20 ms steps: ~50 in the window; the event loop and engine never stalled.
    assert len(during) >= 10, f"only {len(during)} chunks during the {end - start:.2f} s compile"
    slow_grammar_server.wait_pending(0)
    # The killed worker was replaced: constrained requests still work.
    text, _, done, _ = _generate_once_compiler_is_up(stub, constrained("after", json_schema=json.dumps(PERSON)))
    assert done.finish_reason == Finish.EOS
    jsonschema.validate(json.loads(text), PERSON)


def test_cancel_while_compiling_leaks_nothing(slow_grammar_server: ServerHandle) -> None:
    handle = slow_grammar_server
    state = handle.server.state
    slow = constrained("slow", json_schema=json.dumps(nested_any_of(7, salt="x")),
                       backend=C.BACKEND_XGRAMMAR)
    err = _error(handle.stub.Generate(slow, timeout=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = handle.stub.Generate(slow, timeout=TIMEOUT)  # same spec: shares the compile in flight
    time.sleep(0.2)
    call.cancel()
    assert _error(call).code() == grpc.StatusCode.CANCELLED
    # Nothing reached the engine; the call ends as the server sees the cancel
    # (it counts from its first line: a drain waits for it); the compile is
    # still counted until it ends (timeout).
    loop, compiler = handle.server.engine_loop, state.constraints
    assert loop is not None and compiler is not None
    deadline = time.monotonic() + TIMEOUT
    while state.calls_in_flight:
        assert time.monotonic() < deadline, "the cancelled call is still counted"
        time.sleep(0.01)
    assert loop.num_pending == 0
    while compiler.in_flight:
        assert time.monotonic() < deadline, "the compile never ended"
        time.sleep(0.05)
    assert handle.pages_in_use() == (0, 0)
    compiler = handle.engine_call(lambda e: e.structured.compiler)
    assert len(compiler.worker_pids()) <= compiler.config.compile_workers, \
        "a killed compile worker was not replaced one for one"
    _, _, done, _ = _generate_once_compiler_is_up(handle.stub, constrained("after", choice=["a", "b"]))
    assert done.finish_reason == Finish.EOS


def test_cli_generate_json_schema(grammar_server: ServerHandle, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    rc = main(["generate", "A person:", "--port", str(grammar_server.port), "--json-schema", str(path),
               "--max-new-tokens", "200", "--temperature", "0", "--usage"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    jsonschema.validate(json.loads(out), PERSON)
    assert re.search(r"\[EOS\] .* [1-9][0-9]* forced", err), err
    rc = main(["generate", "x", "--port", str(grammar_server.port), "--regex", "(("])
    assert rc == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_model_info_reports_grammar_settings(grammar_server: ServerHandle) -> None:
    info = grammar_server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.grammar_backend == "auto"
    assert info.grammar_compile_timeout_s == pytest.approx(1.5)


def test_value_check_setup_runs_off_the_loop_and_the_engine_thread(grammar_server: ServerHandle,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A large schema (its output validator is built lazily) with a keyword
    # left to the value checks: their set-up, seconds for a schema of
    # hundreds of KB, runs on a worker thread before the request's context is
    # built on the event loop, never there or on the engine thread.
    from grammar.validation import SchemaValidator
    from grammar.watch_plan import WatchPlan

    where: list[str] = []
    build_nodes, build_full = WatchPlan._build_validators, SchemaValidator._build

    def nodes(self: WatchPlan, root: Any) -> Any:
        where.append(threading.current_thread().name)
        return build_nodes(self, root)

    def full(schema: Any, store: Any) -> Any:
        where.append(threading.current_thread().name)
        return build_full(schema, store)

    monkeypatch.setattr(WatchPlan, "_build_validators", nodes)
    monkeypatch.setattr(SchemaValidator, "_build", staticmethod(full))
    props = {f"field_{i:04d}_{'x' * 40}": {"type": "integer"} for i in range(1500)}
    schema = {"type": "object", "properties": {"tags": UNIQUE, **props}, "required": ["tags"],
              "additionalProperties": False}
    assert len(json.dumps(schema)) > 64 * 1024
    _, _, done, _ = generate(grammar_server.stub, constrained("big", json_schema=json.dumps(schema)))
    assert list(done.unenforced_keywords) == ["uniqueItems"]
    assert len(where) == 2 and all(name.startswith("asyncio") for name in where), where
