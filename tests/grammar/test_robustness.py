"""Regressions from a hostile-client harness: compiler deadlock, abandoned
compiles, large constraints whose mask and matcher disagreed, grammars that
accept nothing, and regexes the two backends read differently."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future

import pytest

from grammar import GrammarCompiler, GrammarError, GrammarSpec
from grammar._queue import Job
from grammar.productive import analyze

from .conftest import BACKENDS, MODEL_VOCAB, STOP_IDS, feed


def _in_thread(fn, timeout: float = 20.0):
    """Run fn() on a thread; fail (instead of hanging the suite) if it never returns."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call never returned (deadlock)"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def thread_compiler(tokenizer):
    # One compile thread: the tests below queue compiles behind a busy one.
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation="thread", compile_timeout_s=5.0, compile_workers=1) as c:
        yield c


def test_compile_finished_before_its_callback_is_registered_does_not_deadlock(thread_compiler):
    # The queue finishes the compile before submit() returns: the in-flight
    # bookkeeping callback then runs at once, on this thread. It used to run
    # under the compiler's lock, which it takes again: the caller (the event
    # loop, in the server) blocked for ever.
    c = thread_compiler

    def submit_done(tenant, cost, deadline, run, expired):
        job = Job(run, Future(), cost, deadline, expired, seq=0, state="done")
        try:
            job.future.set_result(run())
        except BaseException as e:  # noqa: BLE001
            job.future.set_exception(e)
        return job

    c._queue.submit = submit_done  # type: ignore[method-assign]
    fut = _in_thread(lambda: c.compile_async(GrammarSpec.regex("(unbalanced")))
    with pytest.raises(GrammarError, match="regex"):
        fut.result(timeout=5)
    ok = _in_thread(lambda: c.compile_async(GrammarSpec.regex("[a-c]+")))
    assert ok.result(timeout=5).backend in BACKENDS
    assert c.pending_compiles == 0


def _slow_compiles(c: GrammarCompiler, seconds: dict[str, float]) -> list[str]:
    """Make regex compiles take `seconds[source]`; returns the log of compiles that ran."""
    ran: list[str] = []
    real = c._compile_one

    def compile_one(backend, spec, timeout, given=None):
        ran.append(spec.source)
        time.sleep(seconds.get(spec.source, 0.0))
        return real(backend, spec, timeout, given)

    c._compile_one = compile_one  # type: ignore[method-assign]
    return ran


def test_an_abandoned_compile_leaves_the_queue(thread_compiler):
    c = thread_compiler
    ran = _slow_compiles(c, {"a+": 1.0})
    first = c.compile_async(GrammarSpec.regex("a+"))
    time.sleep(0.2)  # the one compile thread is busy with it now
    abandoned = c.compile_async(GrammarSpec.regex("b+"))
    waited = c.compile_async(GrammarSpec.regex("c+"))
    assert c.pending_compiles == 3
    assert abandoned.cancel()
    assert c.pending_compiles == 2
    assert first.result(timeout=10).backend and waited.result(timeout=10).backend
    with pytest.raises(CancelledError):
        abandoned.result()
    assert ran == ["a+", "c+"]  # the abandoned one never compiled
    assert c.pending_compiles == 0


def test_a_compile_shared_by_two_callers_runs_while_one_waits(thread_compiler):
    c = thread_compiler
    ran = _slow_compiles(c, {"a+": 0.5, "d+": 0.0})
    busy = c.compile_async(GrammarSpec.regex("a+"))
    time.sleep(0.1)
    one = c.compile_async(GrammarSpec.regex("d+"))
    two = c.compile_async(GrammarSpec.regex("d+"))
    assert one.cancel()
    assert two.result(timeout=10).backend and busy.result(timeout=10)
    assert ran == ["a+", "d+"]


def test_queue_wait_counts_against_the_timeout_and_is_not_cached(tokenizer):
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         isolation="thread", compile_timeout_s=0.5, compile_workers=1) as c:
        seconds = {"a+": 1.0}
        _slow_compiles(c, seconds)
        busy = c.compile_async(GrammarSpec.regex("a+"))
        queued = c.compile_async(GrammarSpec.regex("e+"))
        start = time.monotonic()
        with pytest.raises(GrammarError, match="busy") as err:
            queued.result(timeout=10)
        assert err.value.reason == "timeout"
        assert time.monotonic() - start < 2.0
        busy.exception(timeout=10)
        # The failure was the queue's, not the spec's: compiled fine once idle.
        assert c.compile(GrammarSpec.regex("e+")).backend in BACKENDS


def test_distinct_failing_constraints_beside_each_other_never_hang(compiler):
    futures = [compiler.compile_async(GrammarSpec.regex(f"(unbalanced{i}")) for i in range(40)]
    for fut in futures:
        with pytest.raises(GrammarError):
            fut.result(timeout=60)
    assert compiler.pending_compiles == 0


# -- large constraints: every mask the matcher allows, it accepts ---------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_choice_of_2000_options_runs_to_the_end(compiler, backend):
    choices = [f"option-{i}" for i in range(2000)]
    matcher = compiler.compile(GrammarSpec.choice(choices), backend=backend)
    bitmask = compiler.allocate_bitmask(1)
    tok = compiler.tokenizer_data
    for text in ("option-1999", "option-7", "option-1582"):
        matcher.reset()
        assert feed(matcher, tok.encode(text), bitmask), text
        assert matcher.can_terminate() and matcher.accept_token(STOP_IDS[0])
    matcher.reset()
    assert not feed(matcher, tok.encode("option-2000"), bitmask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lark_rule_of_5000_alternatives_runs_to_the_end(compiler, backend):
    alternatives = " | ".join(f'"t{i}"' for i in range(5000))
    matcher = compiler.compile(GrammarSpec.lark(f"start: {alternatives}\n"), backend=backend)
    bitmask = compiler.allocate_bitmask(1)
    tok = compiler.tokenizer_data
    for text in ("t4999", "t0", "t123"):
        matcher.reset()
        forced = matcher.forced_tokens()
        assert all(matcher.accept_token(t) for t in forced)
        rest = tok.encode(text)[len(forced):] if forced else tok.encode(text)
        assert feed(matcher, rest, bitmask), text
        assert matcher.accept_token(STOP_IDS[0])


# -- grammars that accept no string --------------------------------------------------------------
NOTHING = [
    GrammarSpec.ebnf("root ::= root"),
    GrammarSpec.ebnf('root ::= root "a"'),
    GrammarSpec.lark("start: start"),
    GrammarSpec.lark("start: x\nx: y\ny: x"),
    GrammarSpec.lark("start: start start"),
    GrammarSpec.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    # No finite JSON value: an object that requires an object like itself.
    GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}},
                             "required": ["a"]}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", NOTHING, ids=lambda s: repr(s.source)[:30])
def test_a_grammar_that_accepts_nothing_is_refused(compiler, spec, backend):
    with pytest.raises(GrammarError, match="accepts no string") as err:
        compiler.compile(spec, backend=backend)
    assert err.value.reason == "invalid"


def test_xgrammar_refuses_a_dead_end_that_llguidance_survives(compiler):
    # Valid strings exist ("b"), but after "a" nothing can ever complete:
    # xgrammar's forced-string search would grow "ccc..." until memory runs out.
    spec = GrammarSpec.ebnf('root ::= "a" x | "b"\nx ::= "c" x')
    with pytest.raises(GrammarError, match="rule x can never be completed"):
        compiler.compile(spec, backend="xgrammar")
    matcher = compiler.compile(spec, backend="llguidance")
    assert matcher.accept_tokens(compiler.tokenizer_data.encode("b")) == 1
    assert compiler.compile(spec).backend == "llguidance"  # auto falls back


def test_productivity_analysis_reads_xgrammar_printouts():
    import xgrammar as xgr

    tree = xgr.Grammar.from_json_schema(
        '{"type":"object","properties":{"kids":{"type":"array","items":{"$ref":"#"}}},'
        '"required":["kids"]}')
    result = analyze(str(tree))
    assert result is not None and result.root_productive and not result.dead_rules
    assert analyze("root ::= Unknown[[syntax") is None  # unknown: no verdict, no refusal


# -- regexes the backends would read differently --------------------------------------------------
@pytest.mark.parametrize("pattern", ["a**", "a+*", "a{2}{3}", "x*?+"])
def test_stacked_repetitions_are_refused(pattern):
    with pytest.raises(GrammarError, match="two repetition operators"):
        GrammarSpec.regex(pattern)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lazy_repetitions_and_nested_groups_compile(compiler, backend):
    tok = compiler.tokenizer_data
    for pattern, text in (("a+?b", "aab"), ("(a*)*b", "aab"), (r"[*+]+", "*+*")):
        matcher = compiler.compile(GrammarSpec.regex(pattern), backend=backend)
        assert matcher.accept_tokens(tok.encode(text)) == len(tok.encode(text))
        assert matcher.can_terminate()


def test_counted_repetitions_above_the_limit_are_refused():
    from grammar.spec import MAX_REPETITION

    GrammarSpec.regex(f"a{{{MAX_REPETITION}}}")
    for pattern in (f"a{{{MAX_REPETITION + 1}}}", f"[0-9]{{2,{10 * MAX_REPETITION}}}"):
        with pytest.raises(GrammarError, match="above the limit"):
            GrammarSpec.regex(pattern)
    GrammarSpec.regex(r"a\{1000000\}")  # escaped braces are text


def test_a_large_schema_that_is_not_json_is_refused_when_planned(compiler):
    # Past EDGE_PARSE_CHARS the JSON is parsed in the compile worker, not at the edge.
    from grammar.spec import EDGE_PARSE_CHARS

    source = '{"type": "object", "description": "' + "x" * EDGE_PARSE_CHARS + '"'  # unterminated
    spec = GrammarSpec.json_schema(source)
    with pytest.raises(GrammarError, match="not valid JSON"):
        compiler.compile(spec)


def test_a_lazy_validator_is_built_on_first_use_and_reports_an_unreadable_schema():
    from grammar.validation import SchemaValidator

    lazy = SchemaValidator.lazy('{"type": "integer", "minimum": 3}')
    assert not lazy.built
    assert lazy.validate_text("5").valid and lazy.built
    result = lazy.validate_text("2")
    assert result.checked and not result.valid and result.keyword == "minimum"
    broken = SchemaValidator.lazy('{"type": 12}')
    outcome = broken.validate_text("1")
    assert not outcome.checked and "cannot read" in outcome.message
    # Found unreadable once, it is not built again on every use.
    assert broken.built
    broken._source = None  # a second build would fail its assertion
    assert not broken.validate_text("1").checked
    broken.prepare()  # never raises


def test_a_schema_whose_planning_takes_the_whole_timeout_is_cached(tokenizer, monkeypatch):
    """A compile timeout with the full budget is cached; a planning timeout was
    not, so every retry of the same schema cost a worker the whole timeout
    (killed and replaced). The planning job is made to time out here."""
    from grammar._worker import PLAN_JOB

    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=2.0,
                         compile_workers=1) as c:
        c.compile(GrammarSpec.regex("warm"), backend="xgrammar")  # worker up
        assert c._pool is not None
        run = c._pool.run
        plans: list[float] = []

        def stuck_planning(job, spec, max_bytes, deadline, hold):  # type: ignore[no-untyped-def]
            if job != PLAN_JOB or "stuck" not in str(spec.source):
                return run(job, spec, max_bytes, deadline, hold)
            plans.append(time.monotonic())
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise GrammarError("grammar compile timed out", reason="timeout", backend=PLAN_JOB)

        monkeypatch.setattr(c._pool, "run", stuck_planning)
        spec = GrammarSpec.json_schema({"type": "object", "title": "stuck"})
        for _ in range(3):
            with pytest.raises(GrammarError, match="preparing the schema") as err:
                c.compile(spec)
            assert err.value.reason == "timeout"
        assert len(plans) == 1, "the timed-out planning was run again"
        assert c.compile(GrammarSpec.json_schema({"type": "integer"})).backend in BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_of_of_many_enums_plans_in_linear_time(tokenizer, backend):
    """Overlap of the branches' literals was tested pairwise: a oneOf of 100
    enums of 100 values (35 KB) took tens of seconds to plan and timed out."""
    schema = {"oneOf": [{"enum": list(range(i * 100, (i + 1) * 100))} for i in range(100)]}
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=10.0,
                         compile_workers=1) as c:
        matcher = c.compile(GrammarSpec.json_schema(schema), backend=backend)
        assert "oneOf" not in matcher.unenforced_keywords  # the branches are disjoint: oneOf is anyOf
        assert matcher.accept_tokens(c.tokenizer_data.encode("9999")) == len(c.tokenizer_data.encode("9999"))
