"""The compile worker: a child process that turns specs into picklable payloads.

Forked by the zygote (`_zygote`) for `_pool.WorkerProcess`, or started as
`python -c ...` where there is none (`start_compile_process`, which starts the
zygote too), with two inherited pipe file descriptors. Protocol (pickled messages over
`multiprocessing.connection.Connection`):

    parent -> child   init dict (tokenizer JSON, xgrammar TokenizerInfo JSON, ...)
    child  -> parent  ("ready", pid)
    parent -> child   ("compile", job_id, backend, spec, max_compiled_bytes)
    child  -> parent  ("ok", job_id, payload, seconds) | ("error", job_id, message or GrammarError, reason)

The child exits when the parent closes its pipe, and is killed by the kernel
(PR_SET_PDEATHSIG) if the parent dies while the child is stuck in native code.
`CompileContext` is also used in-process by the compiler's "thread" isolation.
The parent builds the init dict with `process_init` (or `thread_init`), from
the pieces each owner provides: `TokenizerData` its library-neutral facts,
`_xgr` the serialized TokenizerInfo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import GrammarError
from .productive import RECURSIVE_KINDS, check_completable
from .spec import KIND_LABELS, GrammarSpec

if TYPE_CHECKING:
    from .schema_store import SchemaStore
    from .tokenizer import TokenizerData

# How much lower than the server a compile worker runs (see `nice(1)`), from
# its first instruction: start-up and compiles are background work, and the
# engine's steps come first on a busy CPU.
COMPILE_NICENESS = 10
# The job that plans a JSON spec (schema_plan.prepare_views) instead of compiling it.
PLAN_JOB = "plan"

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
# The niceness is applied first: importing torch and the grammar libraries is
# a second or more of CPU, background work like the compiles themselves.
_BOOT = (
    "import importlib, os, sys; os.nice(int(sys.argv[1])); sys.path.insert(0, sys.argv[2]); "
    "module, entry = sys.argv[3].split(':'); "
    "getattr(importlib.import_module(module), entry)(*map(int, sys.argv[4:]))"
)


def start_compile_process(entry: str, args: Sequence[int], pass_fds: Sequence[int]) -> subprocess.Popen[bytes]:
    """A `python -c` child that runs `entry` ("grammar.module:function") on the
    int `args`, at COMPILE_NICENESS, inheriting `pass_fds`: a compile worker
    where no zygote forks one, or the zygote itself (not `multiprocessing`,
    which would re-import the server's `__main__`)."""
    env = dict(os.environ)
    # One compile uses one core; keep torch/tokenizers in the child from
    # starting thread pools it never uses (and the zygote from forking with
    # threads running).
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return subprocess.Popen(
        [sys.executable, "-c", _BOOT, str(COMPILE_NICENESS), _PACKAGE_PARENT, entry, *map(str, args)],
        pass_fds=tuple(pass_fds),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        # Native libraries log warnings to stderr; they are not ours to show.
        stderr=subprocess.DEVNULL,
        env=env,
    )


def process_init(data: TokenizerData, memory_limit_bytes: int | None,
                 schema_store: SchemaStore | None = None) -> dict[str, Any]:
    """The init message of a worker process: what it needs to rebuild both
    backends' tokenizers, in picklable form."""
    from . import _xgr

    return {
        # llguidance's LLTokenizer is rebuilt from these three.
        "tokenizer_json": data.tokenizer_json,
        "vocab_size": data.vocab_size,
        "eos_token_ids": list(data.eos_token_ids),
        # xgrammar's TokenizerInfo cannot be rebuilt from the tokenizer JSON
        # alone (it needs the transformers tokenizer), so it travels as JSON.
        "xgr_info_json": _xgr.tokenizer_info_json(data),
        "memory_limit_bytes": memory_limit_bytes,
        "schema_store": schema_store,
    }


def thread_init(data: TokenizerData, schema_store: SchemaStore | None = None) -> dict[str, Any]:
    """The init dict of an in-process `CompileContext`: the parent's own tokenizer objects."""
    from . import _llg, _xgr

    return {"xgr_info": _xgr.tokenizer_info(data), "llg_tokenizer": _llg.ll_tokenizer(data),
            "schema_store": schema_store, "tokenizer_json": data.tokenizer_json,
            "eos_token_ids": data.eos_token_ids}


def compile_failure(e: Exception) -> GrammarError:
    """What a compile that raised `e` tells its caller: a GrammarError as it
    is; running out of memory or of stack (a spec nested past what a library
    walks) is the spec's size; anything else a library failure."""
    if isinstance(e, GrammarError):
        return e
    if isinstance(e, MemoryError):
        return GrammarError("grammar is too large to compile", reason="too_large")
    if isinstance(e, RecursionError):
        return GrammarError("grammar is too deeply nested to compile", reason="too_large")
    return GrammarError(f"grammar compile failed ({type(e).__name__})", reason="crashed")


class CompileContext:
    """Compiles specs for either backend, building each backend's tokenizer on first use."""

    def __init__(self, init: dict[str, Any], *, serialize: bool = True) -> None:
        self._init = init
        self._serialize = serialize
        self._xgr_compiler: Any = None
        self._llg_tokenizer: Any = init.get("llg_tokenizer")
        self._token_facts: Any = None  # _llg.TokenFacts, for Lark token references

    def prepare(self) -> None:
        """Build both libraries' tokenizer objects now, not in the first compile:
        a worker reports ready only once it can compile at full speed, so a
        fresh worker's set-up is never charged to a spec's compile timeout."""
        self._xgrammar_compiler()
        self._llguidance_tokenizer()

    def _xgrammar_compiler(self) -> Any:
        from . import _xgr

        if self._xgr_compiler is None:
            info = self._init.get("xgr_info")
            if info is None:
                info = _xgr.tokenizer_info_from_json(self._init["xgr_info_json"])
            self._xgr_compiler = _xgr.new_compiler(info)
        return self._xgr_compiler

    def _llguidance_tokenizer(self) -> Any:
        from . import _llg

        if self._llg_tokenizer is None:
            self._llg_tokenizer = _llg.build_tokenizer(
                self._init["tokenizer_json"], self._init["vocab_size"], self._init["eos_token_ids"]
            )
        return self._llg_tokenizer

    def compile(self, backend: str, spec: GrammarSpec, max_compiled_bytes: int) -> dict[str, Any]:
        if backend == PLAN_JOB:
            return _plan(spec, self._init.get("schema_store"))
        if spec.kind == "structural_tag":
            from .schema_plan import tag_view

            spec = tag_view(spec, backend, self._init.get("schema_store"))
        if backend == "xgrammar":
            return self._compile_xgrammar(spec, max_compiled_bytes)
        if backend == "llguidance":
            return self._compile_llguidance(spec, max_compiled_bytes)
        raise GrammarError(f"unknown backend {backend!r}")

    def _compile_xgrammar(self, spec: GrammarSpec, max_bytes: int) -> dict[str, Any]:
        from . import _xgr

        compiled = _xgr.compile_native(self._xgrammar_compiler(), spec)
        size = int(compiled.memory_size_bytes)
        if size > max_bytes:
            raise GrammarError(
                f"compiled grammar is too large ({size >> 20} MiB > {max_bytes >> 20} MiB)",
                reason="too_large",
                backend="xgrammar",
            )
        if not self._serialize:
            return {"compiled": compiled, "size": size}
        # xgrammar's estimate leaves out the per-rule automata, which can make
        # the serialized grammar (and what the parent rebuilds from it) tens
        # of times larger: the text is what counts.
        try:
            text = compiled.serialize_json()
        except (MemoryError, RuntimeError) as e:  # std::bad_alloc under the worker's memory limit
            if isinstance(e, RuntimeError) and "alloc" not in str(e):
                raise
            raise GrammarError("compiled grammar is too large to send", reason="too_large",
                               backend="xgrammar") from None
        if len(text) > max_bytes:
            raise GrammarError(f"compiled grammar is too large ({len(text) >> 20} MiB > {max_bytes >> 20} MiB)",
                               reason="too_large", backend="xgrammar")
        return {"json": text, "size": max(size, len(text))}

    def _compile_llguidance(self, spec: GrammarSpec, max_bytes: int) -> dict[str, Any]:
        from . import _llg

        tokenizer = self._llguidance_tokenizer()
        grammar = _llg.grammar_text(spec)
        if len(grammar) > max_bytes:
            raise GrammarError("grammar is too large", reason="too_large", backend="llguidance")
        _check_accepts_something(spec)
        if "<" in grammar and spec.kind in ("lark", "ebnf"):
            if self._token_facts is None:
                self._token_facts = _llg.TokenFacts.read(self._init["tokenizer_json"], self._init["eos_token_ids"])
            _llg.check_token_refs(spec, grammar, self._token_facts)
        _llg.check(tokenizer, spec, grammar)
        return {"grammar": grammar, "size": len(grammar)}


def _check_accepts_something(spec: GrammarSpec) -> None:
    """Refuse, for llguidance too, a grammar whose start can never be completed.

    llguidance catches a start rule that only recurses, but not a JSON object
    that requires itself; xgrammar's conversion of the same spec shows both.
    Where xgrammar cannot convert the spec, llguidance's own checks stand.
    """
    if spec.kind not in RECURSIVE_KINDS:
        return
    from . import _xgr

    try:
        text = str(_xgr.build_grammar(spec))
    except Exception:  # noqa: BLE001 - a spec only llguidance reads
        return
    check_completable(text, KIND_LABELS[spec.kind], "llguidance", dead_ends=False)


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # non-Linux: rely on pipe EOF only
        pass
    if os.getppid() != parent_pid:  # parent already gone before prctl
        os._exit(0)


def _limit_memory(extra_bytes: int | None) -> None:
    # Applied after imports, as headroom over what the worker already maps, so
    # a runaway compile fails (or dies) here instead of swapping the host.
    if not extra_bytes:
        return
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = mapped + extra_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError, ImportError):
        pass


def _plan(spec: GrammarSpec, store: SchemaStore | None) -> dict[str, Any]:
    from .schema_plan import prepare_views
    from .spec import BACKENDS

    prepared = prepare_views(spec, BACKENDS, store)
    assert prepared is not None, "only JSON specs are planned"
    views, unenforced, watch = prepared
    return {"views": views, "unenforced": unenforced, "watch": watch,
            "size": sum(v.source_size for v in views.values())}


def main(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """Entry point of the worker process."""
    _die_with_parent(parent_pid)
    from multiprocessing.connection import Connection

    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    try:
        init = inbox.recv()
    except (EOFError, OSError):
        return
    # Import both libraries up front so the first compile is not charged for it.
    import llguidance  # noqa: F401
    import xgrammar  # noqa: F401

    ctx = CompileContext(init)
    ctx.prepare()
    _limit_memory(init.get("memory_limit_bytes"))
    # (The process already runs COMPILE_NICENESS lower than the server: the
    # boot line of _pool sets it before any import.)
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return
        if not isinstance(msg, tuple) or not msg or msg[0] != "compile":
            continue
        _, job_id, backend, spec, max_bytes = msg
        start = time.perf_counter()
        try:
            payload = ctx.compile(backend, spec, max_bytes)
            reply: tuple[Any, ...] = ("ok", job_id, payload, time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - a library bug must not take the worker down
            err = compile_failure(e)
            reply = ("error", job_id, err, err.reason)  # the error itself: it keeps `final`
        try:
            outbox.send(reply)
        except (OSError, ValueError):
            return
