"""What crosses the pipes between the server and its engine process.

Server -> engine process: an `EngineProcessSpec` first, then commands
    ("add", Submission) | ("abort", request_id) | ("call", call_id, fn) |
    ("kv_listen", call_id) | ("kv_snapshot", call_id) | ("stop",)
Engine process -> server: ("ready", EngineFacts) or ("load_failed", message,
user_error) first, then
    ("step", outputs, times, StepStats, EngineLoad, ThreadCpu)
                                                      after every engine step
    ("reject", request_id, exception)                 a request refused alone
    ("compiling", request_id) / ("compiled", request_id)
                                                      its constraint compiles in the process first
                                                      (the engine does not hold it meanwhile)
    ("kv", events)                                    the prefix cache's events (once listened to)
    ("result", call_id, ok, value_or_exception)       a call's answer
    ("failed", message)                               the engine died
Everything is pickled (`multiprocessing.connection.Connection`): the objects
are plain dataclasses, numpy arrays, and `RequestOutput` / `SamplingParams`,
which pickle by value (their `__reduce__`).

A `TextContext` never crosses: it holds native grammar matchers. The server
sends what a context is built from (`Submission`, with the server's compile
of a constraint the first time it is seen: the engine process's compiler
loads it rather than compiling it again) and the engine process builds the
context itself. The times the engine writes on a
context, which the server's telemetry reads, come back with the outputs, and
so do the CPU seconds of the process's engine and device threads.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from engine import EngineConfig
from engine.context import RequestTimes, TextContext
from engine.engine import EngineLoad
from engine.reasoning import ReasoningOptions
from engine.requests import RequestSpec
from engine.sampling_params import SamplingParams
from grammar import CompiledExport, GrammarSpec

# (arrival, scheduled, first_token, finished, num_jumped) of one request.
Times = tuple[float | None, float | None, float | None, float | None, int]


@dataclass(frozen=True)
class EngineProcessSpec:
    """What an engine process builds: the engine, its warm-up, and how it logs.

    `setup`: "module:function" names the process calls before it builds the
    engine (benchmarks emulate a device with one; tests inject faults).
    """

    config: EngineConfig
    warmup: bool = True
    warmup_grammar: bool = True
    setup: tuple[str, ...] = ()
    log_level: str = "INFO"
    log_format: str = "text"


@dataclass(frozen=True)
class EngineFacts:
    """What an engine process reports once its engine is built and warm."""

    pid: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    load: EngineLoad
    # The start-up choices, for the server's log.
    attention: str = ""
    mask_threads: int = 1


@dataclass(frozen=True)
class Submission:
    """A checked request as the engine process rebuilds its context: the spec,
    the constraint (its spec and the library the server compiled it with, and
    that compile itself when it was fresh: the engine's compiler loads it
    instead of compiling again), and the options `RequestFactory.context` takes."""

    request_id: str
    prompt: np.ndarray
    params: SamplingParams
    max_length: int
    seed: int
    grammar: tuple[GrammarSpec, str] | None = None
    resample: bool = True
    reasoning: ReasoningOptions | None = None
    compiled: CompiledExport | None = None
    # Whom a compile in the engine process is for (the server's fair queue's
    # tenant): one client's compiles there must not queue another's behind them.
    tenant: str = ""

    @property
    def spec(self) -> RequestSpec:
        return RequestSpec(self.prompt, self.params, self.request_id, self.max_length, self.seed)


def times_of(ctx: TextContext) -> Times:
    t = ctx.times
    return (t.arrival, t.scheduled, t.first_token, t.finished, ctx.grammar.num_jumped)


def mirror_times(ctx: TextContext, times: Times) -> None:
    """Write what the engine process recorded on its context onto the server's copy."""
    ctx.output.times = RequestTimes(*times[:4])
    ctx.grammar.num_jumped = times[4]


def portable_error(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class SendEnd:
    """A pipe's writing end that several threads send on, one whole message at a time."""

    def __init__(self, fd: int):
        self._conn = Connection(fd, readable=False)
        self._lock = threading.Lock()

    def send(self, message: Any) -> bool:
        """Pickle `message` down the pipe; False once the other side is gone."""
        try:
            with self._lock:
                self._conn.send(message)
        except (OSError, ValueError):
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()


class SendQueue:
    """A pipe's writing end fed from a thread of its own: `send` pickles on the
    caller's thread (so a message that cannot be sent fails there) and never
    blocks, even when the reader has stopped reading and the pipe is full (the
    server's event loop sends to its engine process this way: a hung process
    must not stall the loop). Messages are written in order."""

    _CLOSE = b""

    def __init__(self, fd: int, name: str):
        self._conn = Connection(fd, readable=False)
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._gone = False
        self._writer = threading.Thread(target=self._write, name=name, daemon=True)
        self._writer.start()

    def send(self, message: Any) -> bool:
        """Queue `message`; False once a write has failed (the other side is gone)."""
        if self._gone:
            return False
        self._queue.put(bytes(ForkingPickler.dumps(message)))  # what Connection.send writes
        return True

    def close(self) -> None:
        """Close the pipe once what is queued is written (or the other side is gone)."""
        self._queue.put(self._CLOSE)

    def _write(self) -> None:
        while (data := self._queue.get()) is not self._CLOSE:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                self._gone = True
                break
        with contextlib.suppress(OSError):
            self._conn.close()


@dataclass(frozen=True)
class ThreadCpu:
    """CPU seconds the engine process's engine and device threads have used, as
    of a step (None where the platform cannot say): the server exports them as
    its engine and device threads' (`stencil_thread_cpu_seconds`)."""

    engine: float | None = None
    device: float | None = None
