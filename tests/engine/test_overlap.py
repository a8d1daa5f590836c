"""Overlap scheduling: the same outputs with overlap on and off, no page leaks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import SamplingParams
from grammar import GrammarSpec

from .reference import hf_greedy, prompts

SCHEMA = GrammarSpec.json_schema(json.dumps({
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["alpha", "beta", "gamma"]},
                   "name": {"type": "string", "maxLength": 6}},
    "required": ["id", "tag", "name"],
}))
REGEX = GrammarSpec.regex(r"[a-f]{3,8}(-[0-9]{2}){1,3}")


def mixed_workload(stop: str | None = None) -> tuple[list[list[int]], list[SamplingParams], list[GrammarSpec | None]]:
    batch = prompts(8)
    params: list[SamplingParams] = []
    specs: list[GrammarSpec | None] = []
    for i in range(len(batch)):
        if i in (1, 5):
            params.append(SamplingParams(temperature=0, max_new_tokens=48))
            specs.append(SCHEMA)
        elif i == 3:
            params.append(SamplingParams(temperature=0, max_new_tokens=40))
            specs.append(REGEX)
        elif i == 6:
            params.append(SamplingParams(temperature=0.9, seed=11, max_new_tokens=20, ignore_eos=True,
                                         frequency_penalty=0.7, repetition_penalty=1.2))
            specs.append(None)
        else:
            # Finish at different steps.
            params.append(SamplingParams(temperature=0, max_new_tokens=5 + 4 * i, ignore_eos=True,
                                         stop=(stop,) if stop and i == 2 else ()))
            specs.append(None)
    return batch, params, specs


def outputs(llm, batch, params, specs):
    return [(o.token_ids, o.text, o.finish_reason, o.forced_tokens)
            for o in llm.generate(batch, params, constraint=specs)]


@pytest.mark.parametrize("speculative", [False, True])
def test_mixed_batch_identical_with_and_without_overlap(make_llm, speculative):
    on = make_llm("tiny-llama", overlap=True, speculative_constrained=speculative)
    off = make_llm("tiny-llama", overlap=False)
    assert on.engine.pipeline.overlap and not off.engine.pipeline.overlap
    batch, params, specs = mixed_workload()
    reference = outputs(off, batch, params, specs)
    # A stop string taken from request 2's own output, a few tokens in.
    stop = reference[2][1][6:9]
    batch, params, specs = mixed_workload(stop=stop)
    a, b = outputs(off, batch, params, specs), outputs(on, batch, params, specs)
    assert a == b
    assert a[2][2] == "stop_string"
    assert a[1][3] > 0 and a[5][3] > 0  # the JSON requests used forced tokens
    assert a[0][0] == hf_greedy("tiny-llama", batch[0], 5)
    on.close()
    off.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_each_finished_request_is_released_once(make_llm, overlap):
    """Release walks the scheduler's queues: a finished request goes through it
    once, whether a stop rule, a stop string or its length ended it."""
    llm = make_llm("tiny-llama", overlap=overlap)
    batch, params, specs = mixed_workload()
    stop = outputs(llm, batch, params, specs)[2][1][6:9]
    batch, params, specs = mixed_workload(stop=stop)
    removed: list[str] = []
    scheduler = llm.engine.scheduler
    remove = scheduler.remove

    def counting(ctx):
        removed.append(ctx.request_id)
        remove(ctx)

    scheduler.remove = counting
    result = outputs(llm, batch, params, specs)
    assert result[2][2] == "stop_string"
    assert len(removed) == len(set(removed)) == len(batch)


def test_preemption_with_overlap(make_llm):
    per_page = 2 * 2 * 16 * 2 * 16 * 4
    kwargs = dict(kv_cache_gib=12 * per_page / 2**30, max_model_len=192)
    on = make_llm("tiny-llama", overlap=True, **kwargs)
    batch = prompts(8)
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    results = on.generate(batch, params)
    assert on.engine.scheduler.num_preemptions > 0
    for prompt, res in zip(batch, results, strict=True):
        assert res.token_ids == hf_greedy("tiny-llama", prompt)


def run_with_aborts(llm, batch, params, abort_at: dict[int, int]):
    """Step the engine, aborting request i at step abort_at[i]; collect outputs."""
    eng = llm.engine
    ids = []
    for p in batch:
        ctx = eng.make_context(p, params)
        eng.add_request(ctx)
        ids.append(ctx.request_id)
    got: dict[str, list[int]] = {r: [] for r in ids}
    reasons: dict[str, str | None] = {}
    step = 0
    while eng.has_work():
        for i, when in abort_at.items():
            if when == step:
                eng.abort(ids[i])
        for out in eng.step():
            got[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return [got[r] for r in ids], [reasons[r] for r in ids]


def test_aborts_mid_stream_leave_others_unchanged(make_llm):
    batch = prompts(8)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    off = make_llm("tiny-llama", overlap=False)
    on = make_llm("tiny-llama", overlap=True)
    aborts = {1: 3, 4: 6, 6: 1}
    tokens_off, reasons_off = run_with_aborts(off, batch, params, aborts)
    tokens_on, reasons_on = run_with_aborts(on, batch, params, aborts)
    for i in range(8):
        if i in aborts:
            assert reasons_on[i] == reasons_off[i] == "cancelled"
            # Whatever was streamed before the abort is a prefix of the full answer.
            full = hf_greedy("tiny-llama", batch[i], 24)
            assert tokens_on[i] == full[:len(tokens_on[i])]
        else:
            assert tokens_on[i] == tokens_off[i] == hf_greedy("tiny-llama", batch[i], 24)


@pytest.mark.parametrize("seed", [0, 1])
def test_abort_storm_never_leaks_or_double_frees(make_llm, seed):
    per_page = 2 * 2 * 16 * 2 * 16 * 4
    llm = make_llm("tiny-llama", overlap=True, kv_cache_gib=24 * per_page / 2**30, max_model_len=160,
                   max_num_batched_tokens=64)
    eng = llm.engine
    rng = np.random.default_rng(seed)
    batch = [rng.integers(5, 8000, size=int(n)).tolist() for n in rng.integers(2, 60, size=32)]
    specs = [SCHEMA if i % 5 == 0 else None for i in range(32)]
    matchers = [eng.structured.compile(s) if s else None for s in specs]
    ids = []
    for p, m in zip(batch, matchers, strict=True):
        ctx = eng.make_context(p, SamplingParams(temperature=0.8, seed=1, max_new_tokens=40), matcher=m)
        eng.add_request(ctx)
        ids.append(ctx.request_id)
    finished = set()
    while eng.has_work():
        for rid in rng.choice(ids, size=3, replace=False):
            if rng.random() < 0.3:
                eng.abort(str(rid))  # aborting twice, or after the end, is harmless
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished.add(out.request_id)
        eng.allocator.check_consistency()
    assert finished == set(ids)
    llm.close()


@pytest.mark.parametrize("whitespace", ["compact", "pretty"])
def test_xgrammar_forced_text_with_overlap(make_llm, whitespace):
    """xgrammar may allow several tokenizations of forced text; the in-flight
    step must still sample exactly the token that the appended ones follow."""
    from grammar import GrammarOptions

    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["name", "tags", "ok"], "additionalProperties": False})
    spec = GrammarSpec.json_schema(schema, GrammarOptions(whitespace=whitespace))
    # Speculative scheduling of constrained requests exercises forced tokens
    # appended behind an in-flight placeholder.
    on = make_llm("tiny-llama", overlap=True, grammar_backend="xgrammar", speculative_constrained=True)
    off = make_llm("tiny-llama", overlap=False, grammar_backend="xgrammar")
    params = [SamplingParams(temperature=0.8, seed=s, max_new_tokens=80) for s in range(16)]
    prompts_ = [[5 + s, 9] for s in range(16)]
    a = on.generate(prompts_, params, constraint=spec)
    b = off.generate(prompts_, params, constraint=spec)
    for x, y in zip(a, b, strict=True):
        assert x.error is None and x.finish_reason in ("eos", "length"), x.error
        assert x.token_ids == y.token_ids
        if x.finish_reason == "eos":
            json.loads(x.text)
    on.close()
    off.close()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_next_step_is_built_during_the_fill_and_queued_after_it(make_llm, backend):
    """With overlap, step N+1's sampling waits for its grammar mask, which
    only needs the matchers moved on by step N's tokens, and step N+2's
    forward pass waits for N+1's sampling. So N+2 is scheduled and built
    while N+1's mask is filled (not after it, which kept the device idle for
    the build after every sample), queued right behind N+1's sampling, and
    N's outputs are detokenized and built last, off the device's path.
    (Constrained requests scheduled ahead of their last token, as with graphs.)"""
    llm = make_llm("tiny-llama", overlap=True, speculative_constrained=True, grammar_backend=backend)
    eng = llm.engine
    calls: list[str] = []
    fill, report, step = eng.masks.fill, eng.postprocessor.outputs, eng.step
    prepare, submit = eng.pipeline.prepare, eng.pipeline.submit

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            # "r": outputs built for requests a step moved on ("-": none to build).
            calls.append(name if name != "r" or args[0] else "-")
            return fn(*args, **kwargs)
        return wrapped

    def filling(*args, **kwargs):
        calls.append("f")
        try:
            return fill(*args, **kwargs)
        finally:
            calls.append("F")

    def queued(launched):  # "q": a step's forward pass queued (once per step)
        if launched.job is None:
            calls.append("q")
        return submit(launched)

    eng.masks.fill = filling
    eng.postprocessor.outputs = recording("r", report)
    eng.step = recording("s", step)
    eng.pipeline.prepare = recording("p", prepare)
    eng.pipeline.submit = queued
    params = SamplingParams(temperature=0, max_new_tokens=48)
    outs = llm.generate(prompts(3), params, constraint=SCHEMA)
    assert all(o.token_ids for o in outs)
    steps = "".join(calls).split("s")[1:]  # what each step called, in order
    steady = [s for s in steps if "f" in s and "p" in s and "r" in s]
    assert len(steady) >= 10, steps
    assert all(s.index("f") < s.index("p") < s.index("F") < s.index("q") < s.index("r") for s in steady), steps


def test_llguidance_fills_on_its_thread_while_the_engine_builds_the_next_step(make_llm):
    """llguidance's batch fill releases the GIL: it runs on the mask thread
    while the engine thread schedules and builds the next step."""
    import threading

    llm = make_llm("tiny-llama", overlap=True, speculative_constrained=True, grammar_backend="llguidance")
    eng = llm.engine
    built = threading.Event()
    overlapped: list[bool] = []
    filler_fill, prepare = eng.masks.filler.fill, eng.pipeline.prepare

    def fill_waiting_for_a_build(*args, **kwargs):
        if threading.current_thread() is not engine_thread:
            # Sequential (on the engine thread) no build could start meanwhile.
            overlapped.append(built.wait(2))
            built.clear()
        return filler_fill(*args, **kwargs)

    def build(*args, **kwargs):
        built.set()
        return prepare(*args, **kwargs)

    engine_thread = threading.current_thread()  # the offline LLM steps on its caller's thread
    eng.masks.filler.fill = fill_waiting_for_a_build
    eng.pipeline.prepare = build
    outs = llm.generate(prompts(4), SamplingParams(temperature=0, max_new_tokens=24), constraint=SCHEMA)
    assert all(o.token_ids and o.error is None for o in outs)
    assert sum(overlapped) >= 10, overlapped


def test_the_device_thread_never_waits_for_the_engine_thread(make_llm):
    """A constrained step's sampling is a device job of its own, submitted once
    its mask is filled, so work sent to the device thread while such a step is
    in flight, mask unfilled, still runs (a speech chunk's decode is sent so):
    the device thread never blocks on the engine thread."""
    llm = make_llm("tiny-llama", overlap=True, speculative_constrained=True, grammar_backend="xgrammar")
    eng = llm.engine
    submit = eng.pipeline.submit
    waits: list[bool] = []  # per step queued behind a step in flight: whether its mask was unfilled

    def submit_then_call_the_device(step):
        queued = step.job is None
        step = submit(step)
        grammar = step.inputs.grammar if step.inputs is not None else None
        if queued and grammar is not None and not grammar.is_set:  # its mask is not filled yet
            waits.append(True)
            assert eng.executor.submit(lambda: "ran").result(timeout=10) == "ran"
        return step

    eng.pipeline.submit = submit_then_call_the_device
    outs = llm.generate(prompts(3), SamplingParams(temperature=0, max_new_tokens=32), constraint=SCHEMA)
    assert all(o.token_ids for o in outs)
    assert len(waits) >= 10
