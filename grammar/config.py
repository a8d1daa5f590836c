"""`CompilerConfig`: the limits and resources of a GrammarCompiler."""

from __future__ import annotations

from dataclasses import dataclass

from .schema_store import SchemaStore


@dataclass(frozen=True)
class CompilerConfig:
    """Limits and resources of a GrammarCompiler (validated at construction).

    compile_timeout_s: wall-clock bound on one compile, fallback included.
    max_source_bytes: largest spec source accepted (UTF-8 bytes).
    max_compiled_bytes: largest compiled grammar kept (xgrammar's estimate).
    cache_entries / cache_bytes: LRU bounds of the compiled-grammar cache.
    isolation: "process" (compiles run in killable worker processes) or
        "thread" (in-process; a timed-out compile keeps running - only for
        trusted grammars or where subprocesses are unavailable).
    compile_workers: worker processes, i.e. compiles that can run at once.
    worker_startup_timeout_s: how long a new worker may take to come up.
    worker_memory_bytes: address-space headroom per worker (None: unlimited).
    mask_threads: native threads used by batch bitmask filling.
    schema_store: documents a schema's `$ref` may name by URI (None: only
        what the schema bundles resolves).
    """

    compile_timeout_s: float = 10.0
    max_source_bytes: int = 1 << 20
    max_compiled_bytes: int = 256 << 20
    cache_entries: int = 256
    cache_bytes: int = 1 << 30
    isolation: str = "process"
    compile_workers: int = 1
    worker_startup_timeout_s: float = 120.0
    worker_memory_bytes: int | None = 4 << 30
    mask_threads: int = 1
    schema_store: SchemaStore | None = None

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
