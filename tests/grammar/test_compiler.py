"""GrammarCompiler: caching, async compiles, auto backend choice, limits, isolation."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import wait

import pytest

from grammar import GrammarCache, GrammarCompiler, GrammarError, GrammarOptions, GrammarSpec, _pool

from ..conftest import process_running
from .conftest import MODEL_VOCAB, STOP_IDS


def nested_any_of(depth: int, width: int = 2, salt: str = "") -> dict:
    """Nested anyOf of objects and arrays: xgrammar's compile time explodes with depth."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {
            "anyOf": [
                {"type": "object", "properties": {f"{salt}k{i}_{j}": schema}, "required": [f"{salt}k{i}_{j}"]}
                for j in range(width)
            ]
            + [{"type": "array", "items": schema}]
        }
    return schema


def test_cache_hit_is_immediate(compiler):
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"cache_me": {"type": "integer"}}}
    )
    first = compiler.compile(spec, backend="xgrammar")
    hits = compiler.cache_info().hits
    fut = compiler.compile_async(spec, backend="xgrammar")
    assert fut.done()  # completed on the caller's thread, no compile
    second = fut.result()
    assert compiler.cache_info().hits > hits
    assert second is not first and second.backend == "xgrammar"


def test_compile_async_runs_off_thread_and_dedupes(compiler):
    specs = [GrammarSpec.regex(f"id-{i}[a-z]{{2,5}}") for i in range(4)]
    before = compiler.counts.run
    futures = [compiler.compile_async(s) for s in specs] + [compiler.compile_async(specs[0])]
    done, _ = wait(futures, timeout=30)
    assert len(done) == len(futures)
    matchers = [f.result() for f in futures]
    assert compiler.counts.run - before == 4  # the repeated spec shared the first one's compile
    assert matchers[0] is not matchers[-1]  # one compile, two matchers
    tok = compiler.tokenizer_data
    assert matchers[2].accept_tokens(tok.encode("id-2abc")) == len(tok.encode("id-2abc"))


@pytest.mark.parametrize(
    "spec, expected",
    [
        (GrammarSpec.json_schema({"type": "integer"}), "llguidance"),
        (GrammarSpec.ebnf('root ::= "a" | "b"'), "xgrammar"),
        (GrammarSpec.lark('start: "a" | "b"'), "llguidance"),
        (GrammarSpec.regex("[0-9]+"), "llguidance"),
        (GrammarSpec.choice(["a", "b"]), "llguidance"),
    ],
)
def test_auto_picks_a_backend_per_kind(compiler, spec, expected):
    assert compiler.compile(spec).backend == expected
    assert compiler.backends_for(spec)[0] == expected


def test_auto_falls_back_when_the_first_backend_cannot_compile(compiler):
    # llguidance refuses patternProperties whose patterns overlap; xgrammar compiles it.
    spec = GrammarSpec.json_schema(
        {"type": "object", "patternProperties": {"a*": {"type": "integer"}, "aaa*": {}}})
    with pytest.raises(GrammarError, match="disjoint"):
        compiler.compile(spec, backend="llguidance")
    matcher = compiler.compile(spec)
    assert matcher.backend == "xgrammar"
    tok = compiler.tokenizer_data
    assert matcher.accept_tokens(tok.encode('{"aa":1}')) == len(tok.encode('{"aa":1}'))
    # The other way round: "pretty" prefers xgrammar, which lacks \p{...}
    # classes: it leaves that pattern to the validator, llguidance enforces it.
    unicode = GrammarSpec.json_schema(
        {"type": "string", "pattern": "^\\p{L}+$"}, GrammarOptions("pretty")
    )
    assert compiler.backends_for(unicode) == ("xgrammar", "llguidance")
    assert compiler.compile(unicode, backend="xgrammar").unenforced_keywords == ("pattern",)
    assert compiler.compile(unicode, backend="auto").backend == "llguidance"


def test_error_when_every_backend_fails_names_both(compiler):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "[z-a]"}}})
    start = time.monotonic()
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec)
    assert time.monotonic() - start < 2.0
    msg = str(info.value)
    assert "[llguidance]" in msg and "[xgrammar]" in msg
    assert info.value.reason == "invalid"


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "strng"}),
        GrammarSpec.json_schema({"type": "string", "pattern": "a(b"}),
        GrammarSpec.regex("a(b"),
        GrammarSpec.ebnf("root ::= undefined_rule"),
        GrammarSpec.lark("start: undefined_rule"),
    ],
)
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_invalid_specs_fail_fast_with_clean_messages(compiler, spec, backend):
    start = time.monotonic()
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec, backend=backend)
    assert time.monotonic() - start < 2.0
    msg = str(info.value)
    assert msg.startswith("cannot compile")
    for leak in ("\n", "Traceback", ".cc:", "<state>", "<grammar>", "/project/"):
        assert leak not in msg
    assert len(msg) <= 300


# Regexes the Rust syntax refuses: xgrammar's parser read them its own way
# (`\\Q.\\E` as Q, any character, E) and auto fell back to it. EBNF (xgrammar's
# dialect) its parser refuses: llguidance's laxer reader made something of it
# under auto (the first of two `root` rules silently dropped).
_REFUSED_BY_THEIR_DIALECT = [
    *[(GrammarSpec.regex(p), b) for p in (r"\0", r"\Q.\E", r"a\Z", r"[\w-z]{2}", r"\o{101}")
      for b in ("auto", "xgrammar", "llguidance")],
    *[(GrammarSpec.ebnf(g), b) for g in ('root ::= "a" | ', 'root ::= "a"\nroot ::= "b"', "root ::= .",
                                         'root ::= | "a"') for b in ("auto", "xgrammar")],
]


@pytest.mark.parametrize("spec, backend", _REFUSED_BY_THEIR_DIALECT)
def test_a_spec_its_own_dialect_refuses_is_refused_by_every_backend(compiler, spec, backend):
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec, backend=backend)
    assert info.value.reason == "invalid"


def test_lark_ignore_that_xgrammar_reads_otherwise_is_refused_there(compiler):
    # xgrammar lets %ignore text trail the last token: its outputs ("ax" under
    # `%ignore "x"`) ended EOS where llguidance's Lark (and the verdict) say INVALID.
    spec = GrammarSpec.lark('start: "a" | "b"\n%ignore "x"  // the comment\n')
    with pytest.raises(GrammarError, match="%ignore"):
        compiler.compile(spec, backend="xgrammar")
    assert compiler.compile(spec).backend == "llguidance"
    quoted = GrammarSpec.lark('start: "%ignore" | "b"\n// %ignore "x"\n')
    assert compiler.compile(quoted, backend="xgrammar").backend == "xgrammar"


def test_cached_failures_are_not_recompiled(compiler):
    spec = GrammarSpec.regex("unclosed[")
    with pytest.raises(GrammarError):
        compiler.compile(spec, backend="xgrammar")
    fut = compiler.compile_async(spec, backend="xgrammar")
    assert fut.done() and isinstance(fut.exception(), GrammarError)


def test_source_size_is_bounded(tokenizer):
    with GrammarCompiler(
        tokenizer,
        vocab_size=MODEL_VOCAB,
        eos_token_ids=STOP_IDS,
        max_source_bytes=1000,
        isolation="thread",
    ) as small:
        with pytest.raises(GrammarError, match="too large") as info:
            small.compile(GrammarSpec.choice([f"option {i}" for i in range(500)]))
        assert info.value.reason == "too_large"
        assert small.compile(GrammarSpec.choice(["a", "b"])).backend == "llguidance"


def test_pathological_schema_times_out_and_compiler_recovers(tokenizer):
    timeout = 1.0
    with GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=timeout,
        compile_workers=1,
    ) as c:
        c.compile(GrammarSpec.regex("warm"), backend="xgrammar")  # worker up
        (worker,) = c.worker_pids()
        spec = GrammarSpec.json_schema(nested_any_of(7))  # ~30 s in xgrammar
        start = time.monotonic()
        with pytest.raises(GrammarError, match="timed out") as info:
            c.compile(spec, backend="xgrammar")
        elapsed = time.monotonic() - start
        assert info.value.reason == "timeout"
        assert timeout <= elapsed < timeout + 2.0
        # The stuck compile was killed, not left burning a core.
        _wait_gone(worker)
        assert worker not in c.worker_pids()
        # Other compiles still work once a fresh worker is up (until then, with
        # this short timeout, they fail as "busy", uncached), and the failure is cached.
        ok = _compile_when_a_worker_is_up(c, GrammarSpec.json_schema({"type": "integer"}), "xgrammar")
        assert ok.accept_tokens(c.tokenizer_data.encode("42")) == 1
        again = time.monotonic()
        with pytest.raises(GrammarError, match="timed out"):
            c.compile(spec, backend="xgrammar")
        assert time.monotonic() - again < 0.5


def test_a_compile_that_waits_for_the_first_worker_still_gets_only_its_timeout(tokenizer):
    """A caller that takes one of a fresh compiler's first workers waits for it
    to start, then has its own budget: the start-up budget (40 s here, 120 by
    default) used to be added to the compile's deadline, so a hostile compile
    on an unwarmed compiler held the worker ~30 s against a 1 s timeout."""
    timeout = 1.0
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": nested_any_of(7), "end": "</f>"}],
           "triggers": ["<f>"]}  # no planning job: the compile itself takes the starting worker
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=timeout,
                         compile_workers=1, worker_startup_timeout_s=40.0) as c:
        fut = c.compile_async(GrammarSpec.structural_tag(tag), backend="xgrammar")
        ready_at = None
        while not fut.done():
            if ready_at is None and c._pool is not None and any(w.ready for w in list(c._pool._all)):
                ready_at = time.monotonic()
            time.sleep(0.02)
        answered = time.monotonic()
        err = fut.exception()
        assert isinstance(err, GrammarError) and err.reason == "timeout" and err.backend == "xgrammar"
        assert ready_at is not None and answered - ready_at < timeout + 2.0


def test_a_fallback_left_without_time_does_not_cache_the_first_refusal(tokenizer):
    """auto: llguidance refuses the schema and xgrammar (which compiles it) is
    left no budget (the compile had queued): the combined error took the
    first's reason, "invalid", and was cached under auto, so every later call
    was refused as invalid. It is a busy timeout now, not cached."""
    spec = GrammarSpec.json_schema({"type": "object", "patternProperties": {"a*": {"type": "integer"}, "aaa*": {}}})
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         compile_timeout_s=2.0, compile_workers=1) as c:
        c.compile(GrammarSpec.regex("warm"), backend="xgrammar")  # worker up
        assert c.backends_for(spec)[0] == "llguidance"
        real = c._compile_one

        def budget_spent_by_llguidance(backend, view, deadline, given=None):  # type: ignore[no-untyped-def]
            try:
                return real(backend, view, deadline, given)
            finally:
                if backend == "llguidance":
                    time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)

        c._compile_one = budget_spent_by_llguidance  # type: ignore[method-assign]
        err = c.compile_async(spec).exception(timeout=30)
        assert isinstance(err, GrammarError) and err.reason == "timeout" and err.backend is None
        del c._compile_one
        assert c.compile(spec).backend == "xgrammar"


def test_a_timeout_under_auto_is_not_remembered_as_the_specs_answer(tokenizer):
    # A compile that timed out once (a loaded server) must not refuse every
    # later request for the schema: auto caches refusals, never timeouts.
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"timed": {"type": "integer"}}})
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread") as c:
        def timed_out(backend, view, deadline, given=None):  # type: ignore[no-untyped-def]
            raise GrammarError("timed out", reason="timeout", backend=backend)

        c._compile_one = timed_out  # type: ignore[method-assign]
        err = c.compile_async(spec).exception(timeout=30)
        assert isinstance(err, GrammarError) and err.reason == "timeout"
        del c._compile_one
        assert c.compile(spec).backend in ("xgrammar", "llguidance")


def test_a_schema_whose_planning_queued_and_then_ran_out_of_time_is_a_busy_timeout(tokenizer, monkeypatch):
    # Under a flood of compiles, a schema that plans in 1.7 s alone was
    # refused as the spec's own timeout (INVALID_ARGUMENT): it had waited in
    # the queue for most of its budget. A busy server says retry later.
    from grammar._worker import PLAN_JOB

    spec = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         compile_timeout_s=2.0, compile_workers=1) as c:
        def timed_out_plan(spec, deadline):  # type: ignore[no-untyped-def]
            raise GrammarError("plan timed out", reason="timeout", backend=PLAN_JOB)

        monkeypatch.setattr(c, "_plan", timed_out_plan)
        with pytest.raises(GrammarError) as info:
            c._resolve(spec, ("xgrammar",), time.monotonic() + 0.5)
        assert info.value.reason == "timeout" and info.value.backend is None, "busy"
        with pytest.raises(GrammarError) as info:
            c._resolve(spec, ("xgrammar",), time.monotonic() + 2.0)
        assert info.value.reason == "timeout" and info.value.backend == "xgrammar"


def test_a_crash_is_cached_only_once_it_repeats(tokenizer):
    """A worker killed mid-compile from outside (the OOM killer, an operator,
    its zygote's end) said nothing of the spec, yet the crash was cached and
    the valid spec refused until evicted. One crash is not cached; a second is
    (a spec that truly crashes workers must not cost one on every call)."""
    spec = GrammarSpec.regex("(a|b)*c" * 40)
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS,
                         compile_timeout_s=60.0, compile_workers=1) as c:
        _compile_when_a_worker_is_up(c, GrammarSpec.regex("warm"), "llguidance")
        key = c._key("llguidance", spec)
        for crash in range(2):
            (pid,) = c.worker_pids()
            c._pool.run = _killing(c._pool.run, pid)  # type: ignore[union-attr, method-assign]
            with pytest.raises(GrammarError, match="crashed") as info:
                c.compile(spec, backend="llguidance")
            assert info.value.backend == "llguidance"
            del c._pool.run  # type: ignore[union-attr]
            _wait_gone(pid)
            assert (c._cache.get(key) is None) == (crash == 0)
            if crash == 0:
                _compile_when_a_worker_is_up(c, GrammarSpec.regex("wait for the new one"), "llguidance")
        start = time.monotonic()
        with pytest.raises(GrammarError, match="crashed"):
            c.compile(spec, backend="llguidance")  # from the cache
        assert time.monotonic() - start < 0.5


def _killing(run, pid: int):  # type: ignore[no-untyped-def]
    """`run` of a pool whose worker `pid` is killed (SIGKILL) as the compile starts."""
    def killed_run(backend, spec, *args):  # type: ignore[no-untyped-def]
        os.kill(pid, signal.SIGKILL)
        return run(backend, spec, *args)
    return killed_run


def test_auto_json_entries_keep_to_the_cache_byte_bound(tokenizer):
    """auto's entry for a JSON schema held the artifact as one byte: cache hits
    kept it recent while its library's entry (whose bytes count) aged out, so
    the cache held far more than its byte bound (12 artifacts of 3 MB under 1 MiB)."""
    from grammar.compiler import _Artifact

    cache = GrammarCache(max_entries=1000, max_bytes=1 << 20)
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread",
                         cache=cache) as c:
        seen: list[GrammarSpec] = []
        for i in range(8):
            seen.append(GrammarSpec.json_schema({"type": "object", "properties": {f"f{i}": {"type": "integer"}},
                                                 "required": [f"f{i}"]}))
            for spec in seen:  # a new schema, then the earlier ones again
                assert c.compile(spec).accept_tokens(c.tokenizer_data.encode(f'{{"f{seen.index(spec)}": 1}}'))
        held = {id(v): v for v, _ in cache._data.values() if isinstance(v, _Artifact)}
        assert sum(a.size_bytes for a in held.values()) <= cache.max_bytes


def test_an_xgrammar_compile_is_sized_by_what_crosses_to_the_parent(tokenizer):
    """xgrammar's memory estimate leaves out the per-rule automata: a schema
    it put at well under 1 MiB sends 3.3 MB of JSON (30 MB one level deeper),
    which the parent then holds. The worker now sizes and limits it by that."""
    from grammar import _worker, _xgr
    from grammar.tokenizer import TokenizerData

    data = TokenizerData(tokenizer, MODEL_VOCAB, list(STOP_IDS))
    worker = _worker.CompileContext(_worker.process_init(data, None))
    spec = GrammarSpec.json_schema(nested_any_of(2))
    payload = worker.compile("xgrammar", spec, 64 << 20)
    assert payload["size"] == len(payload["json"]) > 1 << 20
    assert _xgr.load(payload, data)[1] == len(payload["json"])
    with pytest.raises(GrammarError, match="too large") as info:
        worker.compile("xgrammar", spec, 1 << 20)
    assert (info.value.reason, info.value.backend) == ("too_large", "xgrammar")


def _compile_when_a_worker_is_up(c: GrammarCompiler, spec: GrammarSpec, backend: str,
                                 limit: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while True:
        try:
            return c.compile(spec, backend=backend)
        except GrammarError as e:
            if "busy" not in str(e) or time.monotonic() > deadline:
                raise


def _wait_gone(pid: int, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while process_running(pid):  # (it may vanish while its /proc entry is read)
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {pid} still running")
        time.sleep(0.05)


def test_a_dead_worker_is_replaced_transparently(tokenizer):
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_workers=1) as c:
        c.compile(GrammarSpec.regex("x+"), backend="xgrammar")
        (pid,) = c.worker_pids()
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        m = c.compile(GrammarSpec.regex("y+"), backend="xgrammar")
        assert m.accept_tokens(c.tokenizer_data.encode("yy")) >= 1
        assert pid not in c.worker_pids()


def test_thread_isolation_and_shared_cache(tokenizer, compiler):
    shared = GrammarCache(max_entries=8)
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "boolean"}})
    with (
        GrammarCompiler(
            tokenizer,
            vocab_size=MODEL_VOCAB,
            eos_token_ids=STOP_IDS,
            isolation="thread",
            cache=shared,
        ) as a,
        GrammarCompiler(
            tokenizer,
            vocab_size=MODEL_VOCAB,
            eos_token_ids=STOP_IDS,
            isolation="thread",
            cache=shared,
        ) as b,
    ):
        assert a.worker_pids() == [] and a.compile(spec).backend == "llguidance"
        hits = shared.info().hits
        assert b.compile(spec).backend == "llguidance"
        assert shared.info().hits > hits  # same tokenizer fingerprint -> shared entry
    # A different model vocabulary is a different cache key.
    with GrammarCompiler(
        tokenizer, vocab_size=8192, eos_token_ids=STOP_IDS, isolation="thread", cache=shared
    ) as other:
        assert other.tokenizer_data.fingerprint != compiler.tokenizer_data.fingerprint
        assert other.allocate_bitmask(1).shape[1] == 256
        misses = shared.info().misses
        other.compile(spec)  # compiled for its own vocabulary, not the entry above
        assert shared.info().misses > misses


def test_one_spec_asked_of_two_backends_at_once_compiles_on_each(compiler):
    # Two requests naming different backends for one spec share no compile:
    # each gets the library it asked for.
    spec = GrammarSpec.regex("k-[a-z]{3}-two-backends")
    first = compiler.compile_async(spec, "xgrammar")
    second = compiler.compile_async(spec, "llguidance")
    assert (first.result(30).backend, second.result(30).backend) == ("xgrammar", "llguidance")


def test_cache_is_bounded():
    cache = GrammarCache(max_entries=3, max_bytes=100)
    for i in range(5):
        cache.put(i, f"v{i}", 10)
    assert cache.info().entries == 3 and cache.get(0) is None and cache.get(4) == "v4"
    cache.put("big", "x", 95)
    assert cache.info().bytes <= 100
    cache.put("huge", "x", 1000)  # never stored
    assert cache.get("huge") is None


def test_a_cached_failure_keeps_nothing_of_the_compile_that_found_it():
    # A raised error holds its traceback, whose frames held the compile's job
    # and through it the matchers its callers got: ~80 MB a distinct spec.
    cache = GrammarCache()
    try:
        raise GrammarError("no", reason="invalid", backend="llguidance", final=True)
    except GrammarError as err:
        cache.put("k", err, 512)
    first = cache.get("k")
    assert isinstance(first, GrammarError) and first.__traceback__ is None
    assert (first.reason, first.backend, first.final, str(first)) == ("invalid", "llguidance", True, "no")
    with pytest.raises(GrammarError):
        raise first  # a reader raises its own copy
    again = cache.get("k")
    assert isinstance(again, GrammarError) and again is not first and again.__traceback__ is None


def test_finished_compiles_leave_no_matcher_behind(tokenizer):
    # After a fallback (llguidance refuses the bound, xgrammar compiles it)
    # each matcher stayed alive: the cached refusal's traceback, and the queue's
    # deadline heap until the job's deadline passed, held the job's future.
    import gc
    import weakref

    def schema(i: int) -> GrammarSpec:
        return GrammarSpec.json_schema(json.dumps(
            {"type": "object", "properties": {f"p{i}": {"type": "number", "maximum": 1.7976931348623157e308}}}))

    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread") as c:
        with pytest.raises(GrammarError):
            c.compile(schema(-1), "llguidance")
        alive = []
        for i in range(3):
            matcher = c.compile(schema(i), "auto")
            assert matcher.backend == "xgrammar"
            alive.append(weakref.ref(matcher))
            del matcher
        gc.collect()
        assert [ref() for ref in alive] == [None, None, None]


def test_the_vocabulary_index_of_forced_runs_is_built_with_the_compile(tokenizer, monkeypatch):
    # It was built at an xgrammar matcher's first forced run, on the engine
    # thread: ~250 ms for 8k tokens with every request of the batch waiting.
    import threading

    from grammar import _xgr
    from grammar.tool_calls import Tool, call_constraint

    built_on = []
    build = _xgr._VOCABS._build

    def recording(data):
        built_on.append(threading.current_thread())
        return build(data)

    monkeypatch.setattr(_xgr._VOCABS, "_build", recording)
    for isolation in ("process", "thread"):
        built_on.clear()
        with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation=isolation) as c:
            spec = call_constraint([Tool("f", {"type": "object"})], "f")
            assert spec is not None
            matcher = c.compile(spec, "xgrammar")
            assert len(built_on) == 1 and built_on[0] is not threading.current_thread(), isolation
            assert matcher.forced_tokens()  # '<tool_call>\n{"name": "f", ...': the index is read, not built
            assert len(built_on) == 1


def test_a_schema_nested_past_what_is_walked_is_too_large_in_either_isolation(tokenizer, compiler):
    # It failed as "grammar compile failed (RecursionError)", a library fault
    # by its reason, and with thread isolation the RecursionError itself escaped.
    from grammar._worker import compile_failure

    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    spec = GrammarSpec.json_schema(json.dumps(schema))
    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread") as threaded:
        for c in (compiler, threaded):
            with pytest.raises(GrammarError) as info:
                c.compile(spec, "auto")
            assert info.value.reason == "too_large" and "too deeply nested" in str(info.value)
    assert compile_failure(RecursionError()).reason == "too_large"
    assert compile_failure(MemoryError()).reason == "too_large"
    assert compile_failure(KeyError("x")).reason == "crashed"


def test_a_compile_cancelled_by_a_shutdown_is_no_verdict_on_its_spec(tokenizer, monkeypatch):
    # Thread isolation: the runner's CancelledError became a "crashed" verdict
    # with a backend, cached as the spec's once it happened twice.
    from concurrent.futures import Future

    with GrammarCompiler(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, isolation="thread") as c:
        def cancelled(*args):  # type: ignore[no-untyped-def]
            fut: Future = Future()
            fut.cancel()
            return fut

        assert c._native_runner is not None
        monkeypatch.setattr(c._native_runner, "submit", cancelled)
        for _ in range(2):
            with pytest.raises(GrammarError) as info:
                c.compile(GrammarSpec.regex("cancelled"), "xgrammar")
            assert info.value.reason == "crashed" and info.value.backend is None
        monkeypatch.undo()
        assert c.compile(GrammarSpec.regex("cancelled"), "xgrammar").backend == "xgrammar"


def test_closed_compiler_refuses(tokenizer):
    c = GrammarCompiler(tokenizer, eos_token_ids=STOP_IDS, isolation="thread")
    c.close()
    with pytest.raises(GrammarError, match="closed"):
        c.compile(GrammarSpec.regex("a"))


def test_config_validation(tokenizer):
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, backend="outlines")
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, compile_timeout_s=0)
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, vocab_size=100)
    with pytest.raises(TypeError):
        GrammarCompiler(tokenizer, isolation="thread").compile(json.dumps({"type": "object"}))  # type: ignore[arg-type]


def test_references_are_resolved_or_refused_or_reported(compiler):
    # xgrammar reads unresolved references as "any value" (fails open): a remote
    # one is refused; anchors and embedded $ids are resolved before compiling;
    # $dynamicRef is left to the validator and reported as unenforced.
    with pytest.raises(GrammarError, match="supported"):
        compiler.compile(GrammarSpec.json_schema({"$ref": "http://example.com/schema.json"}),
                         backend="xgrammar")
    tok = compiler.tokenizer_data
    for schema in ({"$id": "http://x.test/root", "$defs": {"a": {"$id": "a.json", "type": "integer"}},
                    "$ref": "a.json"},
                   {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}):
        m = compiler.compile(GrammarSpec.json_schema(schema), backend="xgrammar")
        assert m.unenforced_keywords == ()
        assert m.accept_tokens(tok.encode('"x"')) == 0
    dynamic = {"$dynamicRef": "#items", "$defs": {"i": {"$dynamicAnchor": "items"}}}
    m = compiler.compile(GrammarSpec.json_schema(dynamic), backend="xgrammar")
    assert m.unenforced_keywords == ("$dynamicRef",)
    # Data that merely looks like a reference is fine.
    data = {"const": {"$ref": "http://example.com"}}
    assert compiler.compile(GrammarSpec.json_schema(data), backend="xgrammar")


def test_compiles_queued_behind_a_stuck_one_fail_as_busy_and_spare_the_new_worker(tokenizer, monkeypatch):
    # A bomb holds the only worker past the timeout; the compiles queued behind
    # it run out of time waiting. They must fail as "busy" (not cached, not the
    # spec's fault) within about the timeout, and must not take the replacement
    # worker down with them (one handed a fresh worker with no time left gives
    # it back rather than time out at once and kill it). A worker forked from the
    # zygote is ready too soon for that: workers here start as fresh interpreters
    # (as they do where no zygote runs), whose start-up outlasts the queued ones' time.
    monkeypatch.setattr(_pool, "fork_worker", lambda *args: None)
    timeout = 1.0
    with GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=timeout,
        compile_workers=1,
    ) as c:
        c.compile(GrammarSpec.regex("warm"), backend="xgrammar")  # worker up
        start = time.monotonic()
        bomb = c.compile_async(GrammarSpec.json_schema(nested_any_of(7)), backend="xgrammar")
        time.sleep(0.2)  # the bomb holds the worker (else the cheaper regexes would go first)
        queued = [c.compile_async(GrammarSpec.regex(f"q{i}+"), backend="xgrammar") for i in range(4)]
        for fut in queued:
            err = fut.exception(timeout=30)
            assert isinstance(err, GrammarError) and err.reason == "timeout" and err.backend is None, err
            assert "busy" in str(err)
        assert time.monotonic() - start < timeout + 2.0
        assert isinstance(bomb.exception(timeout=30), GrammarError)
        # One replacement worker, started once and kept: the queued compiles,
        # retried, are answered by it.
        ok = _compile_when_a_worker_is_up(c, GrammarSpec.regex("q0+"), "xgrammar")
        (replacement,) = c.worker_pids()
        for i in range(1, 4):
            assert c.compile(GrammarSpec.regex(f"q{i}+"), backend="xgrammar").backend == "xgrammar"
        assert c.worker_pids() == [replacement] and ok.backend == "xgrammar"


def test_schemas_queued_past_their_deadline_are_not_planned_first(tokenizer):
    # Planning a large schema (normalizing it, listing its keywords) runs on
    # the compile thread; schemas queued behind a stuck compile used to be
    # planned one after the other before finding their time was up.
    timeout = 1.0
    with GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=timeout,
        compile_workers=1,
    ) as c:
        c.compile(GrammarSpec.regex("warm"), backend="xgrammar")  # worker up
        bomb = c.compile_async(GrammarSpec.json_schema(nested_any_of(7)), backend="xgrammar")
        time.sleep(0.2)  # the bomb holds the compile thread
        start = time.monotonic()
        queued = [c.compile_async(GrammarSpec.json_schema(nested_any_of(6, salt=f"q{i}")))
                  for i in range(12)]
        for fut in queued:
            err = fut.exception(timeout=60)
            # Mostly "busy"; one that started with a little time left may
            # have spent it on its own schema.
            assert isinstance(err, GrammarError) and err.reason == "timeout", err
        assert time.monotonic() - start < timeout + 2.0
        assert isinstance(bomb.exception(timeout=30), GrammarError)


def test_a_second_tenants_simple_specs_compile_while_the_firsts_slow_ones_queue(tokenizer):
    # Tenant a sends slow schemas (each would take ~30 s in xgrammar); with two
    # workers, a may run one at a time, so b's regex and small schema find the
    # other worker free and compile at once, not after a's queue.
    timeout = 2.0
    with GrammarCompiler(
        tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=STOP_IDS, compile_timeout_s=timeout,
        compile_workers=2,
    ) as c:
        warm = [c.compile_async(GrammarSpec.regex(f"warm{i}"), "xgrammar", tenant=f"w{i}") for i in range(2)]
        assert all(f.result(timeout=120).backend == "xgrammar" for f in warm)  # both workers up
        start = time.monotonic()
        bombs = [c.compile_async(GrammarSpec.json_schema(nested_any_of(7, salt=f"a{i}")), "xgrammar", tenant="a")
                 for i in range(4)]
        time.sleep(0.3)  # a's first bomb is compiling, the rest are queued
        assert c._queue.tenants()["a"] == (3, 1)
        small = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"],
                 "additionalProperties": False}
        for spec, text in ((GrammarSpec.regex("b-[0-9]{3}"), "b-123"),
                           (GrammarSpec.json_schema(small), '{"b":7}')):
            asked = time.monotonic()
            matcher = c.compile_async(spec, tenant="b").result(timeout=30)
            assert time.monotonic() - asked < 1.0, spec
            tokens = c.tokenizer_data.encode(text)
            assert matcher.accept_tokens(tokens) == len(tokens)
        errors = [f.exception(timeout=30) for f in bombs]
        assert time.monotonic() - start < timeout + 1.5  # every bomb answered at about its deadline
        timeouts = [e for e in errors if isinstance(e, GrammarError) and e.reason == "timeout"]
        assert len(timeouts) == len(errors), errors
        # One ran out of time compiling; the others never had a's place before their deadline.
        assert sorted(e.backend is None for e in timeouts) == [False, True, True, True]
        # a's killed worker is being replaced on a's account: b still has a worker.
        asked = time.monotonic()
        assert c.compile(GrammarSpec.choice(["yes", "no"]), tenant="b").backend == "llguidance"
        assert time.monotonic() - asked < 1.0


def test_queue_limits_refuse_new_compiles_but_never_cache_hits(compiler):
    from grammar.compiler import CompileQueueFull

    spec = GrammarSpec.regex("limit-[0-9]+")
    compiler.compile(spec, tenant="x")
    assert compiler.compile_async(spec, tenant="x", max_pending=0).result(timeout=5)  # a hit: never refused
    refused = compiler.compile_async(GrammarSpec.regex("limit-new"), tenant="x", max_pending=0)
    assert isinstance(refused.exception(timeout=5), CompileQueueFull)
    refused = compiler.compile_async(GrammarSpec.regex("limit-new"), tenant="x", max_pending_per_tenant=0)
    assert isinstance(refused.exception(timeout=5), CompileQueueFull)
    assert compiler.pending_compiles_of("x") == 0
