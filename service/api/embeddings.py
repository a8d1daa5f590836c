"""The stencil.v1.Embeddings servicer and the embedding model it serves.

One device thread. libgomp slows small GEMMs by 10-35% on a 2-core machine
once two different threads have run OpenMP regions, so the embedding model is
built, warmed up and run on the generation engine's device thread
(`EngineCore.executor`) when a generation model is served, and on one
dedicated `StepExecutor` thread otherwise. The `EmbeddingBatcher` keeps its own
worker thread for merging requests; only the model work is handed over (see
`DevicePipeline`). Embedding passes then interleave with generation steps on
that one thread instead of competing with them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from engine.embedding import (
    BatcherClosed,
    BatcherOverloaded,
    EmbeddingBatcher,
    EmbeddingConfig,
    EmbeddingPipeline,
    EmbedRequest,
)
from engine.errors import InvalidRequest
from engine.executor import StepExecutor
from service.api.generation import ServingState, counted_call
from service.errors import (
    Reason,
    invalid_argument,
    resource_exhausted,
    rpc_guard,
    unavailable,
)
from service.gen.stencil.v1 import embed_pb2 as pb
from service.gen.stencil.v1 import embed_pb2_grpc as pb_grpc
from service.ops.request_log import note_refusal

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embeddings"].full_name
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


class DevicePipeline:
    """An EmbeddingPipeline whose tensor work runs on a device thread.

    The batcher calls `prepare` (tokenization only: stays on the caller's
    thread), `forward` and `finish` (torch: handed to the device thread); the
    rest is read straight from the pipeline.
    """

    def __init__(self, pipeline: EmbeddingPipeline, executor: StepExecutor):
        self.pipeline = pipeline
        self.executor = executor

    def forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.executor.call(lambda: self.pipeline.forward(sequences))

    def finish(self, pooled: Sequence[torch.Tensor], request: EmbedRequest) -> np.ndarray:
        return self.executor.call(lambda: self.pipeline.finish(pooled, request))

    def __getattr__(self, name: str) -> Any:  # prepare, config, max_length, dimension, ...
        return getattr(self.pipeline, name)


@dataclass(frozen=True)
class EmbeddingOptions:
    """Which embedding model to serve and how much work may be queued for it.

    max_pending_tokens: input tokens queued before new calls get
    RESOURCE_EXHAUSTED; a call of more tokens is invalid (an idle server
    takes any call within it)."""

    config: EmbeddingConfig = EmbeddingConfig()
    max_pending_tokens: int = 256 * 1024

    @property
    def model_name(self) -> str:
        """The name clients see: the directory's name, never its path on the server."""
        return Path(self.config.model).resolve().name if self.config.model else DEFAULT_MODEL_NAME


class EmbeddingRuntime:
    """A loaded embedding model, its batcher and the device thread it runs on."""

    def __init__(self, pipeline: EmbeddingPipeline, executor: StepExecutor, owns_executor: bool,
                 options: EmbeddingOptions, alive: Callable[[], bool]):
        self.pipeline = pipeline
        self.executor = executor
        self.options = options
        # The batcher only duck-types the pipeline (prepare, forward, finish, ...).
        device_pipeline = cast(EmbeddingPipeline, DevicePipeline(pipeline, executor))
        self.batcher = EmbeddingBatcher(device_pipeline,
                                        max_pending_tokens=max(options.max_pending_tokens,
                                                               pipeline.max_length))
        self._owns_executor = owns_executor
        self._alive = alive
        self._closed = False

    @classmethod
    def load(cls, options: EmbeddingOptions, executor: StepExecutor | None = None,
             alive: Callable[[], bool] | None = None, warmup: bool = True) -> EmbeddingRuntime:
        """Build the model on `executor`'s thread (a new dedicated one if None).

        `alive` tells whether a shared executor's owner (the generation
        engine) still runs; a dead owner has closed the device thread.
        """
        owns = executor is None
        device = executor or StepExecutor(options.config.torch_device)
        try:
            pipeline = device.call(lambda: EmbeddingPipeline(options.config))
            if warmup:
                device.call(lambda: pipeline.embed(["warm-up", "a somewhat longer warm-up input"]))
        except BaseException:
            if owns:
                device.close()
            raise
        return cls(pipeline, device, owns, options, alive or (lambda: True))

    @property
    def alive(self) -> bool:
        return not self._closed and self._alive()

    @property
    def forward_passes(self) -> int:
        return self.batcher.forward_passes

    def stalled_for(self) -> float:
        """Seconds the forward pass in flight has run (0 when none does): the watchdog's measure."""
        return self.batcher.stalled_for()

    @property
    def threads(self) -> list[threading.Thread | None]:
        """The threads a hung pass would be found in: the batcher's and the device thread."""
        return [self.batcher.thread, self.executor.thread]

    def close(self) -> None:
        """Fail queued requests, wait for a pass in flight, stop an owned device thread.

        Blocking: call off the event loop, before a shared device thread is closed.
        """
        if self._closed:
            return
        self._closed = True
        self.batcher.close(drain=False, timeout=30)
        if self._owns_executor:
            self.executor.close()


class EmbeddingSlot:
    """Where the servicer finds the runtime: None while loading, or never
    (`enabled` False) on a server started without an embedding model."""

    def __init__(self, options: EmbeddingOptions | None):
        self.options = options
        self.runtime: EmbeddingRuntime | None = None

    @property
    def enabled(self) -> bool:
        return self.options is not None


class EmbeddingsServicer(pb_grpc.EmbeddingsServicer):
    """Embed over an EmbeddingRuntime; concurrent calls share forward passes."""

    def __init__(self, state: ServingState, slot: EmbeddingSlot):
        self.state = state
        self.slot = slot

    def _require(self) -> EmbeddingRuntime:
        return self.state.require_ready(
            self.slot.runtime, lambda runtime: runtime.alive, served=self.slot.enabled,
            not_served="this server serves no embedding model (start it without --no-embedding-model)",
            not_served_reason=Reason.NO_EMBEDDING_MODEL, loading="the embedding model is still loading", stopped="the embedding model is not running")

    @rpc_guard
    @counted_call
    async def Embed(self, request: pb.EmbedRequest, context: Any) -> pb.EmbedResponse:
        runtime = self._require()
        normalize = request.normalize if request.HasField("normalize") else None  # the checkpoint's
        dimensions = request.dimensions if request.HasField("dimensions") else None
        self._check_answer_fits(runtime, len(request.inputs), dimensions)
        try:
            vectors, tokens = await runtime.batcher.embed(request.inputs, normalize, dimensions,
                                                          request.truncate)
        except InvalidRequest as err:
            raise invalid_argument(err.field, err.description) from None
        except BatcherOverloaded as err:
            note_refusal("embedding_max_pending_tokens")
            raise resource_exhausted(f"the embedding queue is full ({err}); retry later",
                                     Reason.EMBEDDING_QUEUE_FULL) from None
        except BatcherClosed:
            raise unavailable("the server is shutting down", Reason.DRAINING) from None
        except Exception:
            if not runtime.alive:  # the device thread went away with a failed engine
                raise unavailable("the embedding model is not running", Reason.ENGINE_STOPPED) from None
            raise
        # Large responses are built off the loop (tens of thousands of floats).
        build = _response if vectors.size < 65536 else _response_off_loop
        return await build(vectors, tokens, runtime.options.model_name)


    def _check_answer_fits(self, runtime: EmbeddingRuntime, inputs: int, dimensions: int | None) -> None:
        """Refuse, before any work, a call whose vectors would not fit in one
        message (RESPONSE_TOO_LARGE on `inputs`)."""
        dim = runtime.pipeline.dimension
        if dimensions is not None and 1 <= dimensions < dim:
            dim = dimensions
        per_vector = 4 * dim + _VECTOR_FRAMING
        limit = self.state.max_message_bytes
        if inputs * per_vector + _RESPONSE_FRAMING > limit:
            most = max(1, (limit - _RESPONSE_FRAMING) // per_vector)
            raise invalid_argument("inputs", f"{inputs} vectors of {dim} floats would be over the server's "
                                             f"message limit of {limit} bytes; send at most {most} inputs a call",
                                   Reason.RESPONSE_TOO_LARGE)


# Bytes an Embedding adds to its packed floats, and an EmbedResponse to its embeddings (an upper bound).
_VECTOR_FRAMING = 16
_RESPONSE_FRAMING = 1024


async def _response(vectors: np.ndarray, tokens: int, model: str) -> pb.EmbedResponse:
    return _build(vectors, tokens, model)


async def _response_off_loop(vectors: np.ndarray, tokens: int, model: str) -> pb.EmbedResponse:
    return await asyncio.to_thread(_build, vectors, tokens, model)


def _build(vectors: np.ndarray, tokens: int, model: str) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=[pb.Embedding(values=row) for row in vectors.tolist()],
        dimensions=int(vectors.shape[1]),
        usage=pb.EmbedUsage(prompt_tokens=tokens),
        model=model,
    )
