"""`GrammarCompiler`: specs in, per-request matchers out - cached, bounded, off-thread.

Flow of `compile_async(spec)`:
1. cache lookup by (tokenizer fingerprint, backend, spec); a hit (or a cached
   failure) completes the returned future at once, on the caller's thread;
2. otherwise one compile per distinct (spec, backend) is in flight at a time
   (concurrent callers share it), queued for its caller's tenant in a
   `_queue.FairQueue` (each tenant runs at most `compiles_per_tenant` at
   once, the tenant served least recently goes first, a tenant's cheapest
   spec first) and run on a compiler thread that hands the work to a worker
   process (`_pool`). Its deadline, `compile_timeout_s`, starts when the
   compile is queued: time spent waiting for its turn or a worker counts, and
   one still queued at its deadline fails then, as busy;
3. with backend "auto" the spec's preferred library is tried first and the
   other one if the first cannot compile it, both within the same deadline;
4. the compiled artifact is cached and each caller gets a fresh `Matcher`.

A caller that stops waiting cancels its future; a queued compile that nobody
waits for any more leaves the queue, so abandoned compiles never delay others.

Why a fair queue: with one queue in arrival order, a client that sends slow
specs (deeply nested anyOf schemas, minutes each in xgrammar) keeps every
worker busy and everyone else's constraints wait behind them until their own
deadline. With a place per tenant fewer than the workers, another tenant's
spec starts as soon as it is queued; a tenant whose compile times out keeps
its place until the worker killed for it has been replaced (the respawn is
its cost, not the others').

Locking: `_lock` guards `_inflight` only; the queue's own lock is taken
inside it, never the other way round. No future callback is ever added or
triggered while it is held, because a future that is already done runs a new
callback at once, on the same thread, and the callbacks here take the lock.

Backend choice for "auto": EBNF -> xgrammar, Lark -> llguidance (their native
syntaxes); regex and choice -> llguidance (its lazily built lexer compiles
them in about a millisecond); JSON -> the library that accepted more valid
instances of the JSON-Schema-Test-Suite (see `JSON_ORDER` and
bench/grammar_conformance.py); "pretty" JSON -> xgrammar, which alone enforces
the indentation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from . import _llg, _xgr
from ._pool import WorkerPool
from ._queue import FairQueue, Job
from ._worker import PLAN_JOB, CompileContext, compile_failure, process_init, thread_init
from .bitmask import BitmaskFiller, allocate_bitmask
from .cache import CacheInfo, GrammarCache
from .config import CompilerConfig
from .errors import GrammarError
from .export import CompiledExport, ExportSlot, portable_payload
from .matcher import Matcher
from .output_check import OutputCheck
from .schema_plan import SchemaPlan, plan_for, with_validator
from .spec import BACKENDS, JSON_KINDS, GrammarSpec
from .tag_watch import TagPlan
from .tokenizer import TokenizerData

log = logging.getLogger(__name__)

# A compile that timed out is cached as a failure only if it had (nearly) the
# whole timeout; one whose budget went on queueing may succeed another time.
_FULL_BUDGET = 0.9
# Specs remembered as having crashed a worker once (a second crash is cached).
_CRASHES_KEPT = 1024
# From bench/grammar_conformance.py on the draft 2020-12 suite (see BENCHMARKS.md).
JSON_ORDER = ("llguidance", "xgrammar")
_KIND_ORDER = {
    "regex": ("llguidance", "xgrammar"),
    "choice": ("llguidance", "xgrammar"),
    "ebnf": ("xgrammar", "llguidance"),
    "lark": ("llguidance", "xgrammar"),
    # xgrammar reads every structural-tag format; llguidance only triggered
    # tags of JSON schemas (structural_tag.to_lark).
    "structural_tag": ("xgrammar", "llguidance"),
}
# Inside a string a schema bounds in length (maxLength, minLength), or whose
# pattern counts a repetition past 128 (where xgrammar stops unrolling it),
# xgrammar 0.2.8 takes milliseconds a mask (1-6 ms a row inside a
# maxLength-16 string with an 8k vocabulary, 4-11 ms inside a {10,200}
# pattern with a 32k one; upstream mlc-ai/xgrammar#852) where llguidance
# takes tens of microseconds: at batch 64 that was 40-90 ms of mask fill a
# step. So a JSON schema, or a structural tag's (tool parameters), with such
# strings goes to llguidance first, pretty JSON and tool calls included;
# xgrammar still takes what llguidance cannot compile.
_SLOW_STRINGS_ORDER = ("llguidance", "xgrammar")
_LENGTH_KEYWORDS = ('"maxLength"', '"minLength"')
_COUNTED = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")
_UNROLLED_COUNT = 128


def slow_strings_on_xgrammar(spec: GrammarSpec) -> bool:
    """Whether a JSON schema or structural tag has strings whose masks are
    slow on xgrammar: a length bound, or a counted repetition past 128 (read
    from its text: a property so named counts too, which only moves it to
    llguidance first)."""
    if spec.kind not in ("json_schema", "structural_tag") or not isinstance(spec.source, str):
        return False
    text = spec.source
    if any(word in text for word in _LENGTH_KEYWORDS):
        return True
    return '"pattern"' in text and any(int(m.group(2) or m.group(1)) > _UNROLLED_COUNT
                                       for m in _COUNTED.finditer(text))


class CompileQueueFull(GrammarError):
    """A new compile refused at once: too many are queued or running, in all or
    for its tenant (see `compile_async`). Not the spec's fault, never cached."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="timeout")


@dataclass(frozen=True, eq=False)
class _Artifact:
    backend: str
    spec: GrammarSpec
    native: Any  # xgrammar CompiledGrammar, or llguidance template LLMatcher
    size_bytes: int
    # llguidance with several mask threads: more template LLMatchers of the
    # same grammar, each with a lexer of its own (CompilerConfig.mask_threads).
    replicas: tuple[Any, ...] = ()
    # JSON kinds: what the grammar leaves to the validator, and the validator.
    unenforced: tuple[str, ...] = ()
    validator: Any = None  # SchemaValidator (JSON kinds) or OutputCheck (the others)
    validator_error: str | None = None
    watch: Any = None  # grammar.value_watch.WatchPlan
    tags: TagPlan | None = None  # structural tags: the value checks inside their tags
    compile_seconds: float = 0.0
    # A fresh compile's result for another process (CompilerConfig.export_compiled);
    # never kept in the cache: the first matcher of that compile takes it.
    export: ExportSlot | None = None


@dataclass(frozen=True)
class CompileCounts:
    """What a compiler's cache misses cost: library compiles run, and compiles
    loaded from another compiler's export instead (`compile_async(given=)`)."""

    run: int = 0
    loaded: int = 0


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer into Matchers.

    tokenizer: a `transformers` fast tokenizer. backend: "auto", "xgrammar" or
    "llguidance" (the default for `compile`; each call may override it).
    vocab_size: the model's vocabulary size (mask width), >= the tokenizer's.
    eos_token_ids: the model's stop tokens. config / **options: `CompilerConfig`.
    cache: a `GrammarCache` to share between compilers (default: a private one).

    Thread-safe. Call `close()` (or use as a context manager) to stop workers.
    """

    def __init__(
        self,
        tokenizer: Any,
        backend: str = "auto",
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        *,
        config: CompilerConfig | None = None,
        cache: GrammarCache | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ValueError("pass either config or keyword options, not both")
        self.config = config or CompilerConfig(**options)
        self.backend = _check_backend(backend)
        self.tokenizer_data = TokenizerData(
            tokenizer, vocab_size, None if eos_token_ids is None else list(eos_token_ids)
        )
        self.vocab_size = self.tokenizer_data.vocab_size
        cfg = self.config
        self._cache = cache or GrammarCache(cfg.cache_entries, cfg.cache_bytes)
        # Compiles queued or running: each queue job counts, per tenant, the
        # callers waiting for it (`Job.waiters`).
        self._inflight: dict[tuple[GrammarSpec, str], Job] = {}
        self._crashed_once: dict[Any, None] = {}  # keys whose compile crashed once (oldest first)
        self._lock = threading.Lock()
        self._queue = FairQueue(cfg.compile_workers, cfg.compiles_per_tenant, "grammar-compile")
        self._filler = BitmaskFiller(self.tokenizer_data, cfg.mask_threads)
        self._replica_turn = itertools.count()  # next() is atomic under the GIL
        self._counts = CompileCounts()
        self._counts_lock = threading.Lock()
        self._pool: WorkerPool | None = None
        self._native_runner: ThreadPoolExecutor | None = None
        if cfg.isolation == "process":
            init = process_init(self.tokenizer_data, cfg.worker_memory_bytes, cfg.schema_store)
            self._pool = WorkerPool(init, cfg.compile_workers, cfg.worker_startup_timeout_s)
        else:
            self._ctx = CompileContext(thread_init(self.tokenizer_data, cfg.schema_store), serialize=False)
            self._native_runner = ThreadPoolExecutor(
                cfg.compile_workers, thread_name_prefix="grammar-native"
            )
        self._finalizer = weakref.finalize(
            self, _shutdown, self._pool, self._queue, self._native_runner
        )

    # ---- compiling ---------------------------------------------------------

    def compile(self, spec: GrammarSpec, backend: str | None = None, tenant: str = "") -> Matcher:
        """Compile (or fetch from cache) and return a fresh matcher; GrammarError on failure."""
        return self.compile_async(spec, backend, tenant).result()

    def compile_async(self, spec: GrammarSpec, backend: str | None = None, tenant: str = "", *,
                      max_pending: int | None = None,
                      max_pending_per_tenant: int | None = None,
                      given: CompiledExport | None = None) -> Future[Matcher]:
        """Like `compile`, without blocking: the future is already done on a cache hit.

        `tenant` names whom the compile is for (any string; the service passes
        the caller's API key or connection): compiles are queued fairly
        between tenants (see the module docstring). A compile already in
        flight for another tenant is shared, and queued for this one too.
        A spec that needs a new compile while `max_pending` distinct compiles
        are queued or running, or `max_pending_per_tenant` that this tenant
        waits for, fails at once with CompileQueueFull; cache hits and
        compiles already in flight are never refused.

        Cancel the returned future to stop waiting: a compile nobody waits for
        any more is taken off the queue if it has not started.

        `given`: another compiler's export of this spec's compile (see
        grammar/export.py); on a cache miss it is loaded instead of compiling,
        if it is of this tokenizer, of the backend the compile would use and of
        the spec as that backend compiles it (`CompiledExport.fits`).
        """
        out: Future[Matcher] = Future()
        try:
            artifact, joined = self._artifact_future(spec, _check_backend(backend or self.backend), tenant,
                                                     max_pending, max_pending_per_tenant, given)
        except GrammarError as e:
            out.set_exception(e)
            return out

        def deliver(done: Future[_Artifact]) -> None:
            if out.done():  # the caller cancelled
                return
            try:
                result: Matcher | BaseException = self._new_matcher(done.result())
            except BaseException as e:  # GrammarError, or a bug surfaced to the caller
                result = e
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                if isinstance(result, BaseException):
                    out.set_exception(result)
                else:
                    out.set_result(result)

        if joined is not None:
            key, pending = joined

            def on_done(f: Future[Matcher]) -> None:
                if f.cancelled():
                    self._abandon(key, pending, tenant)

            out.add_done_callback(on_done)
        artifact.add_done_callback(deliver)
        return out

    @property
    def counts(self) -> CompileCounts:
        """Library compiles run and exports loaded so far."""
        with self._counts_lock:
            return self._counts

    def _count(self, **more: int) -> None:
        with self._counts_lock:
            c = self._counts
            self._counts = CompileCounts(c.run + more.get("run", 0), c.loaded + more.get("loaded", 0))

    @property
    def pending_compiles(self) -> int:
        """Distinct compiles queued or running."""
        with self._lock:
            return len(self._inflight)

    def pending_compiles_of(self, tenant: str) -> int:
        """Distinct compiles queued or running that `tenant` waits for."""
        with self._lock:
            return self._pending_of(tenant)

    def _pending_of(self, tenant: str) -> int:
        return sum(1 for job in self._inflight.values() if job.waiters.get(tenant))

    def backends_for(self, spec: GrammarSpec, backend: str | None = None) -> tuple[str, ...]:
        """The backends tried for `spec`, in order."""
        backend = _check_backend(backend or self.backend)
        if backend != "auto":
            return (backend,)
        # Read for the kinds xgrammar would otherwise lead (this runs for
        # every request, cached compile or not: compact JSON skips the scan).
        if spec.kind in JSON_KINDS:
            if spec.options.whitespace != "pretty":
                return JSON_ORDER
            return _SLOW_STRINGS_ORDER if slow_strings_on_xgrammar(spec) else ("xgrammar", "llguidance")
        if spec.kind == "structural_tag" and slow_strings_on_xgrammar(spec):
            return _SLOW_STRINGS_ORDER
        return _KIND_ORDER[spec.kind]

    def _artifact_future(
        self, spec: GrammarSpec, backend: str, tenant: str,
        max_pending: int | None = None, max_pending_per_tenant: int | None = None,
        given: CompiledExport | None = None,
    ) -> tuple[Future[_Artifact], tuple[tuple[GrammarSpec, str], Job] | None]:
        """The artifact's future, and the in-flight compile the caller now
        waits on, with its key (None for a cache hit)."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"expected a GrammarSpec, got {type(spec).__name__}")
        if self._finalizer.alive is False:
            raise GrammarError("grammar compiler is closed", reason="crashed")
        size = spec.source_size
        if size > self.config.max_source_bytes:
            raise GrammarError(
                f"grammar source is too large ({size} bytes; "
                f"limit {self.config.max_source_bytes})",
                reason="too_large",
            )
        order = self.backends_for(spec, backend)
        cached = self._from_cache(spec, order, backend)
        if cached is not None:
            return cached, None
        key = (spec, backend)
        timeout = self.config.compile_timeout_s
        with self._lock:
            pending = self._inflight.get(key)
            created = pending is None
            if pending is None:
                if max_pending is not None and len(self._inflight) >= max_pending:
                    raise CompileQueueFull(f"{len(self._inflight)} constraints are compiling")
                mine = self._pending_of(tenant) if max_pending_per_tenant is not None else 0
                if max_pending_per_tenant is not None and mine >= max_pending_per_tenant:
                    raise CompileQueueFull(f"{mine} of this client's constraints are compiling")
                deadline = time.monotonic() + timeout
                try:
                    # The cost that orders a tenant's queue: the spec's size.
                    job = self._queue.submit(tenant, size, deadline,
                                             lambda: self._resolve(spec, order, deadline, given),
                                             lambda: _busy(timeout))
                except RuntimeError:  # shut down by a concurrent close()
                    raise GrammarError("grammar compiler is closed", reason="crashed") from None
                pending = self._inflight[key] = job
            else:
                self._queue.join(pending, tenant)
        if created:
            # Outside the lock: a compile that already ended runs this at once.
            pending.future.add_done_callback(lambda f: self._forget(key, f))
        return pending.future, (key, pending)

    def _forget(self, key: tuple[GrammarSpec, str], fut: Future[_Artifact]) -> None:
        with self._lock:
            pending = self._inflight.get(key)
            if pending is not None and pending.future is fut:
                del self._inflight[key]

    def _abandon(self, key: tuple[GrammarSpec, str], pending: Job, tenant: str) -> None:
        """A caller stopped waiting; drop the compile if it was the last and it has not started."""
        with self._lock:
            if not self._queue.leave(pending, tenant):
                return
            if self._inflight.get(key) is pending:
                del self._inflight[key]  # a new caller starts afresh
        pending.future.cancel()  # outside the lock: its callbacks run here

    def _cache_failure(self, key: Any, error: GrammarError) -> None:
        """Cache `error` as the verdict on `key`. A crash counts once it
        repeats: a worker also dies of what is not its spec's doing (the OOM
        killer, an operator, the end of its zygote), and a spec that truly
        crashes it would otherwise cost a worker on every call."""
        if error.reason == "crashed":
            with self._lock:
                if key not in self._crashed_once:
                    self._crashed_once[key] = None
                    if len(self._crashed_once) > _CRASHES_KEPT:
                        del self._crashed_once[next(iter(self._crashed_once))]
                    return
                del self._crashed_once[key]
        self._cache.put(key, error, 512)

    def _key(self, backend: str, spec: GrammarSpec) -> tuple[str, str, GrammarSpec]:
        return (self.tokenizer_data.fingerprint, backend, spec)

    def _from_cache(self, spec: GrammarSpec, order: tuple[str, ...],
                    backend: str) -> Future[_Artifact] | None:
        if backend == "auto" and spec.kind in JSON_KINDS:
            # auto's choice for a JSON spec depends on the schema (see _resolve),
            # so it is cached under its own key.
            entry = self._cache.get(self._key("auto", spec))
            if isinstance(entry, _Chosen):
                # The chosen library's own entry, which holds (and counts) the
                # artifact; reading it keeps it as recent as its choice.
                entry = self._cache.get(entry.key)
            if entry is None:
                return None
            return _done(entry) if isinstance(entry, _Artifact) else _done(None, entry)
        errors: list[GrammarError] = []
        for b in order:
            entry = self._cache.get(self._key(b, spec))
            if entry is None:
                return None
            if isinstance(entry, _Artifact):
                return _done(entry)
            errors.append(entry)
        return _done(None, _combine(errors))

    def schema_plan(self, spec: GrammarSpec, deadline: float | None = None) -> SchemaPlan | None:
        """The normalized views, unenforced keywords and validator of a JSON spec
        (None for other kinds); computed once and cached. GrammarError when the
        schema cannot be normalized, or (with a compile worker and a
        `deadline`) is not prepared by then; its `backend` is then PLAN_JOB."""
        if spec.kind not in JSON_KINDS:
            return None
        key = ("plan", spec)
        entry = self._cache.get(key)
        if isinstance(entry, GrammarError):
            raise entry
        if entry is not None:
            return entry  # type: ignore[no-any-return]
        try:
            plan = self._plan(spec, deadline)
        except GrammarError as e:
            if e.reason != "timeout" and e.backend is not None:
                self._cache_failure(key, e)
            raise
        assert plan is not None
        if plan.watch is not None:
            # Resampling requests read their output's bytes (vocab.token_bytes):
            # build the table here, off the engine thread and the event loop.
            _xgr.vocab_index(self.tokenizer_data)
        self._cache.put(key, plan, plan.size_bytes)
        return plan

    def _plan(self, spec: GrammarSpec, deadline: float | None) -> SchemaPlan | None:
        if self._pool is None:
            return plan_for(spec, BACKENDS, self.config.schema_store)
        if deadline is None:
            deadline = time.monotonic() + self.config.compile_timeout_s
        status, _, payload, detail = self._pool.run(PLAN_JOB, spec, self.config.max_compiled_bytes, deadline,
                                                    self._queue.hold)
        if status == "error":
            raise GrammarError(str(payload), reason=detail, backend=PLAN_JOB)
        return with_validator(spec, payload["views"], payload["unenforced"], payload["watch"],
                              self.config.schema_store)

    def _resolve(self, spec: GrammarSpec, order: tuple[str, ...], deadline: float,
                 given: CompiledExport | None = None) -> _Artifact:
        if spec.kind not in JSON_KINDS:
            return self._resolve_order(spec, order, deadline, None, given=given)
        if deadline <= time.monotonic() and self._cache.get(("plan", spec)) is None:
            # Queued past its deadline behind other compiles: planning a large
            # schema takes a while on this thread, and the answer is "busy"
            # however it ends. Every compile queued behind would wait for it.
            raise _busy(self.config.compile_timeout_s)
        auto = len(order) > 1
        planning = time.monotonic()
        try:
            plan = self.schema_plan(spec, deadline)
        except GrammarError as e:
            if e.reason == "timeout" and e.backend is None:  # never reached a worker
                raise _busy(self.config.compile_timeout_s) from None
            if e.reason == "timeout":
                if deadline - planning < _FULL_BUDGET * self.config.compile_timeout_s:
                    # It waited its turn behind other compiles, and the rest
                    # of the budget was too short: a busy server, not the spec.
                    raise _busy(self.config.compile_timeout_s) from None
                if e.backend == PLAN_JOB:
                    # Its worker had (nearly) the whole budget and was killed at
                    # the end: the schema's cost, cached as a compile's timeout
                    # is (else every retry would cost a worker the full timeout).
                    self._cache_failure(("plan", spec), e)
                raise GrammarError(f"grammar compile timed out after {self.config.compile_timeout_s:g} s "
                                   "(preparing the schema)", reason="timeout", backend=order[0]) from None
            e = GrammarError(str(e), reason=e.reason, backend=order[0])
            if auto:
                self._cache_failure(self._key("auto", spec), e)
            raise e from None
        assert plan is not None
        if deadline <= time.monotonic():
            if time.monotonic() - planning < _FULL_BUDGET * self.config.compile_timeout_s:
                raise _busy(self.config.compile_timeout_s)  # the queue ate most of it
            # Its own planning used the budget: the spec's cost, not a busy
            # server's (not cached: a quieter server may plan it in time).
            raise GrammarError(f"grammar compile timed out after {self.config.compile_timeout_s:g} s "
                               "(preparing the schema)", reason="timeout", backend=order[0])
        if auto:
            # Prefer the library that enforces more of this schema, not merely
            # the first that compiles it.
            order = plan.order(order)
        try:
            artifact = self._resolve_order(spec, order, deadline, plan,
                                           time.monotonic() - planning, given)
        except GrammarError as e:
            if auto and e.reason != "timeout" and e.backend is not None:
                self._cache_failure(self._key("auto", spec), e)
            raise
        if auto:
            self._cache.put(self._key("auto", spec), _Chosen(self._key(artifact.backend, spec)), 1)
        return artifact

    def _resolve_order(self, spec: GrammarSpec, order: tuple[str, ...], deadline: float,
                       plan: SchemaPlan | None, plan_seconds: float = 0.0,
                       given: CompiledExport | None = None) -> _Artifact:
        timeout = self.config.compile_timeout_s
        errors: list[GrammarError] = []
        for b in order:
            key = self._key(b, spec)
            entry = self._cache.get(key)
            if isinstance(entry, _Artifact):
                return entry
            if isinstance(entry, GrammarError):
                errors.append(entry)
                if entry.final:
                    break
                continue
            budget = deadline - time.monotonic()
            if budget <= 0:
                # Spent waiting for a worker (or on the first backend): the
                # server was busy, which says nothing about the spec. Not cached.
                errors.append(_busy(timeout))
                break
            started = time.monotonic()
            try:
                view = spec if plan is None else plan.views[b]
                fits = given is not None and given.fits(self.tokenizer_data.fingerprint, b, view)
                artifact = self._compile_one(b, view, deadline, given if fits else None)
                if plan is not None:
                    artifact = dataclasses.replace(
                        artifact, spec=spec, unenforced=plan.unenforced[b],
                        validator=plan.validator, validator_error=plan.validator_error,
                        watch=plan.watch)
                else:  # its finished outputs are checked by a matcher of the spec's own semantics
                    tags = TagPlan(str(spec.source), b, self.config.schema_store) \
                        if spec.kind == "structural_tag" else None
                    artifact = dataclasses.replace(artifact, validator=OutputCheck(spec, self.config.schema_store),
                                                   tags=tags)
                artifact = dataclasses.replace(artifact, compile_seconds=time.monotonic() - started)
            except GrammarError as e:
                if e.reason == "timeout":
                    # Without a backend it never got a worker in time: the
                    # server was busy, which says nothing about the spec.
                    e = _busy(timeout) if e.backend is None else GrammarError(
                        f"grammar compile timed out after {timeout:g} s", reason="timeout", backend=b)
                # Worker start-up or shutdown trouble is not the spec's doing,
                # nor is a timeout on a budget cut by queueing: not cached.
                # (Planning the schema is the spec's own cost: it counts as budget.)
                full_budget = budget + plan_seconds >= _FULL_BUDGET * timeout
                if e.backend is not None and (e.reason != "timeout" or full_budget):
                    self._cache_failure(key, e)
                errors.append(e)
                if e.reason == "timeout" or e.final:
                    break  # the deadline is spent, or the spec accepts nothing: no fallback
                continue
            self._cache.put(key, _stored(artifact), artifact.size_bytes)
            return artifact
        raise _combine(errors)

    def _compile_one(self, backend: str, spec: GrammarSpec, deadline: float,
                     given: CompiledExport | None = None) -> _Artifact:
        if given is not None:
            try:
                artifact = self._load(backend, spec, given.payload)
            except Exception as e:  # noqa: BLE001 - a payload this build cannot read: compile it here
                log.warning("could not load a compiled %s grammar (%s: %s); compiling it instead",
                            backend, type(e).__name__, e)
            else:
                self._count(loaded=1)
                return artifact
        self._count(run=1)
        limit = self.config.max_compiled_bytes
        if self._pool is not None:
            status, _, payload, detail = self._pool.run(backend, spec, limit, deadline, self._queue.hold)
            if status == "error":
                raise GrammarError(str(payload), reason=detail, backend=backend,
                                   final=isinstance(payload, GrammarError) and payload.final)
        else:
            assert self._native_runner is not None
            fut = self._native_runner.submit(self._ctx.compile, backend, spec, limit)
            try:
                # On timeout the thread runs on: see CompilerConfig.isolation.
                payload = fut.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise GrammarError(
                    "grammar compile timed out", reason="timeout", backend=backend
                ) from None
            except FutureCancelled:  # the runner was shut down: no verdict on the spec
                raise GrammarError("the grammar compiler is closed", reason="crashed") from None
            except Exception as e:  # as a worker process reports it
                err = compile_failure(e)
                raise GrammarError(str(err), reason=err.reason, backend=backend, final=err.final) from None
        try:
            artifact = self._load(backend, spec, payload)
        except GrammarError:
            raise
        except Exception as e:  # a library failure rebuilding the result, not the user's
            raise GrammarError(
                f"grammar compile failed ({type(e).__name__})", reason="crashed", backend=backend
            ) from None
        return self._with_export(artifact, backend, spec, payload) if self.config.export_compiled else artifact

    def _with_export(self, artifact: _Artifact, backend: str, spec: GrammarSpec, payload: dict) -> _Artifact:
        """`artifact` with its export; without, if one cannot be made (an
        optional saving: the compile itself succeeded)."""
        try:
            export = CompiledExport(self.tokenizer_data.fingerprint, backend, spec, portable_payload(payload))
        except Exception as e:  # noqa: BLE001 - the other side compiles it instead
            log.warning("could not export a compiled %s grammar (%s: %s)", backend, type(e).__name__, e)
            return artifact
        return dataclasses.replace(artifact, export=ExportSlot(export))

    def _load(self, backend: str, spec: GrammarSpec, payload: dict) -> _Artifact:
        tok = self.tokenizer_data
        if backend == "xgrammar":
            # Its matchers' forced runs read the vocabulary index (which tokens
            # extend a token): built here, once per tokenizer, not on the
            # engine thread at the first forced run (~250 ms for 8k tokens,
            # holding up every request of the batch).
            _xgr.vocab_index(tok)
            if "compiled" in payload:
                return _Artifact(backend, spec, payload["compiled"], payload["size"])
            return _Artifact(backend, spec, *_xgr.load(payload, tok))
        ll_tok = _llg.ll_tokenizer(tok)
        templates = [_llg.new_template(ll_tok, spec, payload["grammar"])
                     for _ in range(self.config.mask_threads)]
        # Each template's lexer cache grows as masks are computed; a rough bound.
        size = len(templates) * (16 * payload["size"] + (256 << 10))
        return _Artifact(backend, spec, templates[0], size, tuple(templates[1:]))

    def _new_matcher(self, artifact: _Artifact) -> Matcher:
        matcher: Matcher
        if artifact.backend == "xgrammar":
            matcher = _xgr.XGrammarMatcher(artifact.spec, self.tokenizer_data, artifact.native)
        else:
            # Requests take the template copies in turn (one copy: always the same).
            replica = next(self._replica_turn) % (1 + len(artifact.replicas))
            template = artifact.replicas[replica - 1] if replica else artifact.native
            matcher = _llg.LLGuidanceMatcher(artifact.spec, self.tokenizer_data, template)
            matcher.replica = replica
        matcher.unenforced_keywords = artifact.unenforced
        matcher.validator = artifact.validator
        matcher.validator_error = artifact.validator_error
        matcher.watch_plan = artifact.watch
        matcher.tag_plan = artifact.tags
        matcher.compile_seconds = artifact.compile_seconds
        matcher.export = artifact.export.take() if artifact.export is not None else None
        return matcher

    # ---- bitmasks ----------------------------------------------------------

    def allocate_bitmask(self, batch_size: int, *, pin_memory: bool = False) -> torch.Tensor:
        """An all-allowed int32 CPU bitmask [batch_size, ceil(vocab_size/32)]."""
        return allocate_bitmask(batch_size, self.vocab_size, pin_memory=pin_memory)

    def fill_bitmasks(
        self,
        matchers: Sequence[Matcher | None],
        bitmask: torch.Tensor,
        rows: Sequence[int] | None = None,
    ) -> None:
        """Fill `bitmask[rows[i]]` for `matchers[i]` in one native batch call per backend.

        None entries (unconstrained requests) get all-allowed rows.
        """
        self._filler.fill(matchers, bitmask, rows)

    @property
    def filler(self) -> BitmaskFiller:
        """The bitmask filler behind `fill_bitmasks` (its `row_filler` is the
        shortest path for one matcher, which the engine's one-row steps take)."""
        return self._filler


    # ---- housekeeping ------------------------------------------------------

    def cache_info(self) -> CacheInfo:
        return self._cache.info()

    def worker_pids(self) -> list[int]:
        """Process ids of the compile workers (empty with thread isolation)."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        """Stop the compile workers and threads; further compiles fail."""
        self._finalizer()

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stored(artifact: _Artifact) -> _Artifact:
    """What the cache keeps of an artifact: not its export, whose size it does
    not count and which only the compile's own matchers carry."""
    return artifact if artifact.export is None else dataclasses.replace(artifact, export=None)


def _check_backend(backend: str) -> str:
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"unknown grammar backend {backend!r}; use auto, xgrammar or llguidance")
    return backend


@dataclass(frozen=True)
class _Chosen:
    """auto's cache entry for a JSON spec: the key of the library it chose.
    (Holding the artifact itself, counted as one byte, kept it alive after
    its library's entry, the one whose bytes count, was evicted.)"""

    key: Any


def _combine(errors: list[GrammarError]) -> GrammarError:
    if len(errors) == 1:
        return errors[0]
    first = errors[0]
    parts = []
    for i, e in enumerate(errors):
        text = str(e)
        if i and text.startswith("cannot compile"):
            text = text.split(": ", 1)[1]  # the label is already in the first message
        parts.append(f"{text} [{e.backend}]" if e.backend else text)
    # A fallback that ran out of time (or never got a worker: no backend) has
    # no verdict on the spec: the whole is that timeout, never cached as invalid.
    last = errors[-1]
    reason, backend = (last.reason, last.backend) if last.reason == "timeout" else (first.reason, first.backend)
    return GrammarError("; ".join(parts), reason=reason, backend=backend, final=any(e.final for e in errors))


def _done(value: Any, error: BaseException | None = None) -> Future[Any]:
    fut: Future[Any] = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
    return fut


def _shutdown(
    pool: WorkerPool | None, queue: FairQueue, runner: ThreadPoolExecutor | None
) -> None:
    if pool is not None:
        pool.close()
    queue.close()
    if runner is not None:
        runner.shutdown(wait=False, cancel_futures=True)


def _busy(timeout: float) -> GrammarError:
    """The error of a compile that never got its turn in time (no backend: not
    the spec's fault, never cached)."""
    return GrammarError(f"grammar compile timed out after {timeout:g} s (the compiler was busy)",
                        reason="timeout")
