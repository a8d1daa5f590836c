"""`CompilerConfig`: the limits and resources of a GrammarCompiler."""

from __future__ import annotations

from dataclasses import dataclass

from .schema_store import SchemaStore


@dataclass(frozen=True)
class CompilerConfig:
    """Limits and resources of a GrammarCompiler (validated at construction).

    compile_timeout_s: wall-clock bound on one compile, fallback included.
    max_source_bytes: largest spec source accepted (UTF-8 bytes).
    max_compiled_bytes: largest compiled grammar kept (xgrammar: its serialized size with
        process isolation, else its own estimate; llguidance: the grammar text).
    cache_entries / cache_bytes: LRU bounds of the compiled-grammar cache.
    isolation: "process" (compiles run in killable worker processes) or
        "thread" (in-process; a timed-out compile keeps running - only for
        trusted grammars or where subprocesses are unavailable).
    compile_workers: worker processes, i.e. compiles that can run at once.
        One tenant (see `GrammarCompiler.compile_async`) may run one fewer
        (at least 1), so its slow compiles always leave a worker to the others.
    worker_startup_timeout_s: how long a new worker may take to come up.
    worker_memory_bytes: address-space headroom per worker (None: unlimited).
    mask_threads: native threads used by batch bitmask filling. With more
        than one, each llguidance grammar also keeps that many template
        copies, and its requests' matchers are spread over them: copies of
        one template share its lexer, whose lock let a second thread add
        nothing (64 rows of one schema: 1.34 ms with one thread, 1.51 with
        two); with a template per thread two threads took 0.72 ms.
    schema_store: documents a schema's `$ref` may name by URI (None: only
        what the schema bundles resolves).
    export_compiled: give each matcher of a fresh compile its result in
        picklable form (`Matcher.export`, grammar/export.py), for a compiler
        in another process to load instead of compiling again.
    """

    compile_timeout_s: float = 10.0
    max_source_bytes: int = 1 << 20
    max_compiled_bytes: int = 256 << 20
    cache_entries: int = 256
    cache_bytes: int = 1 << 30
    isolation: str = "process"
    compile_workers: int = 2
    worker_startup_timeout_s: float = 120.0
    worker_memory_bytes: int | None = 4 << 30
    mask_threads: int = 1
    schema_store: SchemaStore | None = None
    export_compiled: bool = False

    @property
    def compiles_per_tenant(self) -> int:
        """How many compiles one tenant may run at once."""
        return max(1, self.compile_workers - 1)

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError("compile_timeout_s must be positive")
        if self.isolation not in ("process", "thread"):
            raise ValueError("isolation must be 'process' or 'thread'")
        for name in ("max_source_bytes", "max_compiled_bytes", "cache_entries", "cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.compile_workers < 1 or self.mask_threads < 1:
            raise ValueError("compile_workers and mask_threads must be >= 1")
        if not self.worker_startup_timeout_s > 0:
            raise ValueError("worker_startup_timeout_s must be positive")
