"""Structured output in the engine: masks, jump-ahead, and finish reasons."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest

from engine import LLM, SamplingParams, step_masks
from engine.presets import ensure_preset
from grammar import GrammarError, GrammarSpec

from ..conftest import assert_no_page_leak
from .reference import hf_greedy, hf_logits, prompts
from .scripted import scripted

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    engine_llm = LLM(ensure_preset("tiny-llama"))
    yield engine_llm
    assert_no_page_leak(engine_llm)
    engine_llm.close()


def test_json_schema_outputs_validate_and_use_forced_tokens(llm):
    spec = GrammarSpec.json_schema(json.dumps(PERSON))
    params = [SamplingParams(temperature=t, seed=i, max_new_tokens=80) for i, t in enumerate([0, 0.7, 1.0, 1.0])]
    before = llm.engine.pipeline.forward_passes
    outs = llm.generate(["a", "b", "c", "d"], params, constraint=spec)
    passes = llm.engine.pipeline.forward_passes - before
    for out in outs:
        assert out.finish_reason == "eos", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.forced_tokens > 0
    # Keys and punctuation are forced: well over one output token per forward pass.
    assert max(len(o.token_ids) for o in outs) / passes > 1.2


@pytest.mark.parametrize("config", [{}, {"overlap": False}, {"cuda_graphs": "emulate"}])
def test_forced_tokens_have_the_models_logprobs(make_llm, config):
    # Log-probabilities come one per output token, forced ones included: a
    # request asking for them has each forced token sampled under a mask of
    # only it, so every figure is the model's own at its position.
    llm = make_llm("tiny-llama", **config)
    prompt = prompts(2)[1]
    spec = GrammarSpec.json_schema(json.dumps(PERSON))
    with_lp, plain = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_new_tokens=80, logprobs=2),
                                                     SamplingParams(temperature=0, max_new_tokens=80)],
                                  constraint=spec)
    assert with_lp.finish_reason == "eos" and with_lp.text == plain.text
    assert with_lp.forced_tokens > 0 and plain.forced_tokens > 0
    assert [lp.token_id for lp in with_lp.logprobs] == with_lp.token_ids
    ref = hf_logits("tiny-llama", prompt + with_lp.token_ids).log_softmax(-1)
    for i, lp in enumerate(with_lp.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


@pytest.mark.parametrize("config", [{}, {"overlap": False}, {"cuda_graphs": "emulate"}])
def test_a_forced_stop_token_ends_the_output(make_llm, config):
    # A stop token the grammar forces in the middle of a run ends the output
    # as a sampled one does: the run is cut before it and it is sampled.
    llm = make_llm("tiny-llama", **config)
    comma = llm.tokenizer.encode(",", add_special_tokens=False)[-1]
    spec = GrammarSpec.regex(r"hello world, this is forced text[0-9]")
    plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=20), constraint=spec)[0]
    assert comma in plain.token_ids[1:-1] and plain.forced_tokens > 2
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=(comma,)),
                       constraint=spec)[0]
    assert out.finish_reason == "stop_token" and out.stop_reason == comma
    assert out.token_ids == plain.token_ids[:plain.token_ids.index(comma) + 1]
    assert out.text == "hello world" and out.forced_tokens > 0


def test_regex_and_choice(llm):
    pattern = r"[a-z]{2,6}-[0-9]{3}"
    outs = llm.generate(["p", "q"], SamplingParams(temperature=1.0, seed=3, max_new_tokens=30),
                        constraint=GrammarSpec.regex(pattern))
    for out in outs:
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "eos"
    choices = ["red", "green", "blue violet"]
    outs = llm.generate(["r", "s", "t"], SamplingParams(temperature=1.0, seed=5, max_new_tokens=10),
                        constraint=GrammarSpec.choice(choices))
    assert all(o.text in choices and o.finish_reason == "eos" for o in outs)


def test_a_requests_backend_reaches_the_compiler(llm):
    # The engine process compiles what the server sends with the backend the
    # request named; dropped, it compiled with auto's choice instead.
    spec = GrammarSpec.regex("[0-9]+ backend")  # auto: llguidance
    for backend in ("xgrammar", "llguidance"):
        assert llm.engine.structured.compile_async(spec, backend).result(30).backend == backend


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    batch = prompts(4)
    spec = GrammarSpec.json_schema(json.dumps(PERSON))
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    outs = llm.generate(batch, params, constraint=[None, spec, None, spec])
    for i in (0, 2):
        assert outs[i].token_ids == hf_greedy("tiny-llama", batch[i])
    for i in (1, 3):
        jsonschema.validate(json.loads(outs[i].text), PERSON)


def test_cut_by_max_new_tokens_says_length(llm):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=1, max_new_tokens=6),
                       constraint=GrammarSpec.json_schema(json.dumps(schema)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    out = llm.generate(["x"], SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=40),
                       constraint=GrammarSpec.choice(["yes", "no"]))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "eos"


def test_an_ambiguous_grammar_fails_alone_before_it_holds_up_the_batch(llm):
    # Each level doubles the ways to parse "a"s: xgrammar compiles it at once,
    # then its parse state grows with every token (seconds a token within
    # ten), all of it on the engine thread that steps every request.
    depth = 60
    ebnf = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} r{i + 1} | "a"' for i in range(depth)) \
        + f'\nr{depth} ::= "b"'
    params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    hostile, plain = llm.generate(["x", "y"], params, constraint=[GrammarSpec("ebnf", ebnf), None])
    assert hostile.finish_reason == "error" and hostile.error_cause == "constraint"
    assert "steps in a row" in (hostile.error or "")
    assert plain.finish_reason == "length" and len(plain.token_ids) == 64


def _burn(seconds: float) -> None:
    began = time.thread_time()
    while time.thread_time() - began < seconds:
        pass


@pytest.mark.parametrize("slow_calls", ["first", "every other", "all"])
def test_one_slow_grammar_step_passes_and_a_run_of_them_fails(llm, monkeypatch, slow_calls):
    # A library's one-off at first use (a table built lazily), or slow steps
    # apart (a collector's pauses over a long output), must not fail a
    # request: only a grammar slow step after step does.
    from grammar import _xgr

    accept = _xgr.XGrammarMatcher.accept_token
    calls = [0]
    slow = {"first": lambda n: n == 1, "every other": lambda n: n % 2 == 1, "all": lambda n: True}[slow_calls]

    def slow_accept(self, token):
        calls[0] += 1
        if slow(calls[0]):
            _burn(step_masks.GRAMMAR_STEP_LIMIT_S * 1.5)
        return accept(self, token)

    monkeypatch.setattr(_xgr.XGrammarMatcher, "accept_token", slow_accept)
    out = llm.generate(["x"], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
                       constraint=GrammarSpec("ebnf", 'root ::= [a-z]+'))[0]
    if slow_calls != "all":
        assert out.finish_reason == "length" and len(out.token_ids) == 8
    else:
        assert out.finish_reason == "error" and "3 steps in a row" in (out.error or "")
        assert len(out.token_ids) == step_masks.SLOW_STEPS_ALLOWED + 1


def test_a_closed_engine_does_not_start_its_grammar_compiler_again(make_llm):
    # It did: a compile after close started workers, a zygote and four threads
    # that lived until the engine was collected.
    llm = make_llm("tiny-llama")
    structured = llm.engine.structured
    spec = GrammarSpec.regex("[ab]+")
    assert structured.compile(spec) is not None
    llm.close()
    assert structured.closed
    for attempt in (lambda: structured.compile_async(spec), lambda: structured.compile(spec)):
        with pytest.raises(GrammarError, match="closed") as err:
            attempt()
        assert err.value.reason == "crashed" and err.value.backend is None  # the server's, not the spec's
    assert structured._compiler is None


def test_invalid_spec_fails_before_any_request_runs(llm):
    with pytest.raises(GrammarError):
        llm.generate(["x"], SamplingParams(max_new_tokens=5), constraint=GrammarSpec.json_schema('{"type": 12}'))
    with pytest.raises(ValueError):
        llm.generate(["x"], SamplingParams(max_new_tokens=5), constraint=GrammarSpec.regex("(unclosed"))
    assert not llm.engine.has_work()


def test_model_that_wants_invalid_tokens_still_follows_the_grammar(make_llm):
    probe = make_llm("tiny-llama")
    words = probe.tokenizer.encode("hello there, no json at all", add_special_tokens=False)
    # After token 5 the model insists on prose, token after token.
    table = dict(zip([5] + words, words, strict=False))
    llm = make_llm("tiny-llama", wrap_model=scripted(table))
    free = llm.generate([[9, 5]], SamplingParams(temperature=0, max_new_tokens=len(words)))[0]
    assert free.token_ids == words
    spec = GrammarSpec.json_schema(json.dumps(PERSON))
    out = llm.generate([[9, 5]], SamplingParams(temperature=0, max_new_tokens=60), constraint=spec)[0]
    assert out.finish_reason == "eos"
    jsonschema.validate(json.loads(out.text), PERSON)
    llm.close()


def test_mask_threads_change_no_token(make_llm, monkeypatch):
    # Several fill threads (llguidance: a template copy per thread, rows grouped
    # by copy) give the tokens one thread gives, sampled rows included; left
    # unset, the engine asks mask_threads_for with the host's cores.
    from engine import cpu_features
    from engine import engine as engine_module

    spec = GrammarSpec.json_schema(json.dumps(PERSON))
    params = [SamplingParams(temperature=t, seed=i, max_new_tokens=60) for i, t in enumerate([0, 0.8, 1.0] * 3)]
    texts = []
    for threads in (1, 3):
        llm = make_llm("demo", grammar_backend="llguidance", grammar_mask_threads=threads)
        assert llm.engine.structured.mask_threads == threads
        outs = llm.generate([f"prompt {i}" for i in range(len(params))], params, constraint=spec)
        assert {o.finish_reason for o in outs} <= {"eos", "length"}
        texts.append([o.text for o in outs])
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1  # the rows differ, so a row given another's mask would show
    # Unset: one thread for a model on the CPU, however many cores; on an
    # accelerator a quarter of them (the choice itself: test_cpu_dispatch.py).
    monkeypatch.setattr(engine_module, "usable_cores", lambda: 16)
    assert make_llm("demo").engine.structured.mask_threads == 1
    monkeypatch.setattr(engine_module, "mask_threads_for",
                        lambda cores, device_type: cpu_features.mask_threads_for(cores, "cuda"))
    assert make_llm("demo").engine.structured.mask_threads == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_tokens_counts_only_tokens_that_were_output(make_llm, overlap: bool):
    # With log-probabilities the position after a token is marked forced as the
    # mask is filled; a request that ends there (a stop string, an abort) never
    # outputs that token, and it is not counted.
    llm = make_llm("tiny-llama", overlap=overlap)
    eng = llm.engine
    spec = GrammarSpec.regex(r"(cat|dog)-zebra-[0-9]")
    free = llm.generate([[5000, 77, 99]], SamplingParams(temperature=0, max_new_tokens=20), constraint=spec)[0]
    stop = free.text[:3]
    ended = llm.generate([[5000, 77, 99]], SamplingParams(temperature=0, max_new_tokens=20, logprobs=0, stop=(stop,),
                                                           include_stop_str_in_output=True), constraint=spec)[0]
    assert ended.finish_reason == "stop_string"
    assert ended.forced_tokens < len(ended.token_ids)  # its first token is the model's choice
    ctx = eng.make_context([5000, 77, 99], SamplingParams(temperature=0, max_new_tokens=20, logprobs=0),
                           matcher=eng.structured.compile(spec))
    eng.add_request(ctx)
    outs: list[Any] = []
    while not any(o.token_ids for o in outs):
        outs += eng.step()
    eng.abort(ctx.request_id)
    while eng.has_work():
        outs += eng.step()
    tokens: list[int] = sum((o.token_ids for o in outs), [])
    assert outs[-1].finish_reason == "cancelled"
    assert outs[-1].forced_tokens <= len(tokens) - 1


@pytest.mark.parametrize("overlap", [False, True])
def test_min_new_tokens_holds_back_stop_tokens_a_grammar_would_allow(make_llm, overlap: bool):
    # As vLLM: EOS and stop ids wait for min_new_tokens in a constrained
    # output too, while its grammar allows another token.
    llm = make_llm("tiny-llama", overlap=overlap)
    eos = sorted(llm.engine.eos_token_ids)[0]
    spec = GrammarSpec.regex(r"[a-z ]*")
    params = SamplingParams(temperature=0, min_new_tokens=10, max_new_tokens=20, logit_bias={eos: 100.0})
    out = llm.generate([[5, 6, 7]], params, constraint=spec)[0]
    assert len(out.token_ids) == 11 and out.finish_reason == "eos"
    letter = llm.tokenizer.encode("a", add_special_tokens=False)[-1]
    params = SamplingParams(temperature=0, min_new_tokens=10, max_new_tokens=20, logit_bias={letter: 100.0},
                            stop_token_ids=(letter,))
    out = llm.generate([[5, 6, 7]], params, constraint=spec)[0]
    assert len(out.token_ids) == 11 and out.finish_reason == "stop_token"
    # A grammar that must end now ends, min_new_tokens or not.
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, min_new_tokens=10, max_new_tokens=20),
                       constraint=GrammarSpec.choice(["yes", "no"]))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "eos"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_that_dead_ends_fails_its_request_alone_as_the_grammars_fault(make_llm, overlap: bool):
    # Compiles (its start accepts "a"), then allows no token at all: the row
    # sampled token 0, which the matcher refused, a server fault.
    llm = make_llm("tiny-llama", overlap=overlap)
    spec = GrammarSpec.ebnf('root ::= "a" b\nb ::= [^\\x00-\\U0010FFFF]')
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    dead, alive = llm.generate(["hello", "world"], params, constraint=[spec, None])
    assert dead.finish_reason == "error" and dead.error_cause == "constraint"
    assert "allows no token" in (dead.error or "")
    assert alive.finish_reason == "length" and len(alive.token_ids) == 8
