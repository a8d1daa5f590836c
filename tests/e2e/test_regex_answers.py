"""Regex answers never break their regex silently: the issue's four cases with
the demo model, offline (4 seeds, temperature 1) and over gRPC.

- `[^\\x00-\\x{10FFFF}]` and `a[^\\x00-\\x{10FFFF}]` match no string: refused
  (INVALID_ARGUMENT "accepts no string"), never handed to the other library;
- `[a-z&&[^aeiou]]{4}` and `[[:alpha:]]{3}`: xgrammar read them otherwise
  ("l]]]]"); it refuses them now, and auto reads them with llguidance;
- every finished answer gets a verdict (`schema_validation`) from the Rust
  regex semantics, whichever library generated it.
"""

from __future__ import annotations

import grpc
import pytest
from regex_rs import Regex

from engine import LLM, SamplingParams
from engine.presets import ensure_preset
from grammar import GrammarError, GrammarSpec
from service.gen.stencil.v1 import generate_pb2 as pb

from .helpers import TIMEOUT, ServerHandle, engine_factory, generate

C, V = pb.Constraint, pb.SchemaValidation
NO_STRING = [r"[^\x00-\x{10FFFF}]", r"a[^\x00-\x{10FFFF}]"]
MISREAD = [r"[a-z&&[^aeiou]]{4}", r"[[:alpha:]]{3}"]


def _matches(pattern: str, text: str) -> bool:
    return Regex(r"\A(?:" + pattern + r")\z").find(text, None) is not None


@pytest.fixture(scope="module")
def demo(make_module_server) -> ServerHandle:  # type: ignore[no-untyped-def]
    return make_module_server(engine_factory("demo"), model_name="demo", warmup_grammar=True)


def _request(pattern: str, seed: int, backend: pb.Constraint.Backend = C.BACKEND_UNSPECIFIED) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text="Answer:")
    req.sampling.temperature = 1.0
    req.sampling.seed = seed
    req.stopping.max_new_tokens = 16
    req.constraint.regex = pattern
    req.constraint.backend = backend
    return req


@pytest.mark.parametrize("pattern", NO_STRING)
def test_a_regex_no_string_matches_is_refused(demo: ServerHandle, pattern: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(demo.stub, _request(pattern, 0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "accepts no string" in (err.value.details() or "")


@pytest.mark.parametrize("pattern", MISREAD)
def test_syntax_xgrammar_misreads_is_refused_there_and_read_right_by_auto(demo: ServerHandle,
                                                                         pattern: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(demo.stub, _request(pattern, 0, C.BACKEND_XGRAMMAR))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "differently from the Rust regex syntax" in (err.value.details() or "")
    for seed in range(4):
        text, _, done, _ = generate(demo.stub, _request(pattern, seed))
        assert done.grammar_backend == "llguidance"
        if done.finish_reason == pb.GenerateComplete.EOS:
            assert _matches(pattern, text), text
            assert done.schema_validation.result == V.VALID


def test_every_regex_answer_gets_a_verdict(demo: ServerHandle) -> None:
    pattern = r"[a-f]{2,5}-\d{2}"
    for backend in (C.BACKEND_XGRAMMAR, C.BACKEND_LLGUIDANCE):
        for seed in range(3):
            text, _, done, _ = generate(demo.stub, _request(pattern, seed, backend), timeout=TIMEOUT)
            assert done.finish_reason == pb.GenerateComplete.EOS, done
            assert _matches(pattern, text)
            assert done.schema_validation.result == V.VALID, done.schema_validation


def test_offline_four_seeds() -> None:
    for backend in ("auto", "xgrammar"):
        llm = LLM(ensure_preset("demo"), kv_cache_gib=0.05, grammar_backend=backend)
        try:
            for pattern in NO_STRING:
                with pytest.raises(GrammarError, match="accepts no string|differently"):
                    llm.generate(["Answer:"], SamplingParams(max_new_tokens=8), constraint=GrammarSpec.regex(pattern))
            for pattern in MISREAD:
                spec = GrammarSpec.regex(pattern)
                if backend == "xgrammar":
                    with pytest.raises(GrammarError, match="differently from the Rust regex syntax"):
                        llm.generate(["Answer:"], SamplingParams(max_new_tokens=8), constraint=spec)
                    continue
                params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=16) for s in range(4)]
                for out in llm.generate(["Answer:"] * 4, params, constraint=spec):
                    assert out.finish_reason != "eos" or _matches(pattern, out.text), out.text
        finally:
            llm.close()
