"""The engine's grammar compile service: `StructuredOutput`.

A constrained request's spec is compiled into a matcher before its context is
made: by the service on the event loop (`compile_async`, awaited without
blocking the loop; service/structured.py), or by the offline `LLM` on its own
thread. The compiler (grammar.GrammarCompiler: cache, fair queue per tenant,
killable worker processes) is started on first use; every method here is
thread-safe. The per-step mask path is `step_masks.StepMasks`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from grammar import CompiledExport, GrammarCompiler, GrammarError, GrammarSpec, Matcher, SchemaStore

from .config import EngineConfig


class StructuredOutput:
    """The engine's grammar compile service: a lazily started compiler, thread-safe."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 backend: str = "auto", compile_timeout_s: float = 10.0,
                 schema_store: SchemaStore | None = None, mask_threads: int = 1,
                 export_compiled: bool = False):
        self._hf_tokenizer = hf_tokenizer
        self.schema_store = schema_store
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.backend = backend
        self.compile_timeout_s = compile_timeout_s
        # Threads of a step's batch mask fill; llguidance grammars keep a
        # template copy per thread (grammar.CompilerConfig.mask_threads).
        self.mask_threads = mask_threads
        # A server whose engine runs in another process hands it its fresh
        # compiles (grammar/export.py) so the engine does not compile them again.
        self.export_compiled = export_compiled
        self._compiler: GrammarCompiler | None = None
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, config: EngineConfig, hf_tokenizer: Any, vocab_size: int,
                   eos_token_ids: Iterable[int], mask_threads: int = 1,
                   export_compiled: bool = False) -> StructuredOutput:
        """The compile service an engine with `config` uses (and the server's
        view of an engine in another process: the same grammars, the same cache
        keys, with `export_compiled`)."""
        return cls(hf_tokenizer, vocab_size, sorted(eos_token_ids), config.grammar_backend,
                   config.grammar_compile_timeout_s, SchemaStore.parse(config.schema_store), mask_threads,
                   export_compiled)

    @property
    def compiler(self) -> GrammarCompiler:
        """The GrammarCompiler, started on first use (it spawns a worker process)."""
        with self._lock:
            if self._closed:
                # Not started again: a compile racing the engine's close started a
                # new compiler (workers, zygote, threads) that lived until collected.
                raise GrammarError("the grammar compiler is closed", reason="crashed")
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._hf_tokenizer, backend=self.backend,
                                                 vocab_size=self.vocab_size,
                                                 eos_token_ids=self.eos_token_ids,
                                                 compile_timeout_s=self.compile_timeout_s,
                                                 schema_store=self.schema_store,
                                                 mask_threads=self.mask_threads,
                                                 export_compiled=self.export_compiled)
            return self._compiler

    def compile_async(self, spec: GrammarSpec, backend: str | None = None,
                      given: CompiledExport | None = None, tenant: str = "") -> Future[Matcher]:
        """A future matcher for `spec`; fails with GrammarError.

        Thread-safe; a cache hit is already done. `backend` overrides the
        engine's default ("auto", "xgrammar" or "llguidance"); `given` is the
        server's compile of it, loaded rather than compiled again; `tenant`
        whom it is for, in the compiler's fair queue.
        """
        return self.compiler.compile_async(spec, backend, tenant, given=given)

    def compile(self, spec: GrammarSpec, backend: str | None = None) -> Matcher:
        return self.compiler.compile(spec, backend)

    @property
    def closed(self) -> bool:
        """Closed with its engine: `compiler` raises GrammarError ("crashed": the server's, not the spec's)."""
        return self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._compiler is not None:
                self._compiler.close()
                self._compiler = None

    # -- per step -------------------------------------------------------------
