"""The stencil.v1.Speech servicer and where it finds its engine.

A speech model runs in one of two ways:

- shared: the generation engine itself serves speech (its checkpoint is a
  speech LM and its EngineConfig has `speech_codec`), so text and speech
  requests share one scheduler and KV cache (`--speech-model` = `--model`);
- separate: a second EngineCore with its own EngineLoop (admission,
  cancellation, drain), built on the generation engine's device thread, so
  all model work still runs on one thread (see engine/executor.py).

Either way a Synthesize call is an ordinary engine request whose outputs carry
audio: each decoded chunk is encoded and written to the stream as soon as the
engine loop delivers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine import EngineCore
from engine.executor import StepExecutor
from service.api.convert import check_request_id
from service.api.generation import ServingState, counted_call, next_outputs, run_maybe_off_loop
from service.api.speech_convert import ChunkWriter, prepare_synthesize
from service.engine_loop import EngineLoop
from service.errors import REQUEST_ID_METADATA, Reason, current_request_id, rpc_guard, unavailable
from service.gen.stencil.v1 import speech_pb2 as pb
from service.gen.stencil.v1 import speech_pb2_grpc as pb_grpc
from service.ops.request_log import note_sent
from service.security.auth import scoped_request_id

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Speech"].full_name

# Builds a separate speech engine on the given device thread (None: its own).
SpeechEngineFactory = Callable[[StepExecutor | None], EngineCore]


@dataclass(frozen=True)
class SpeechOptions:
    """Which speech model a server serves.

    `engine_factory` None: the generation engine serves speech itself (shared).
    """

    model_name: str
    engine_factory: SpeechEngineFactory | None = None

    @property
    def shared(self) -> bool:
        return self.engine_factory is None


class SpeechSlot:
    """Where the servicer finds the speech engine's loop: None while loading, or
    never (`enabled` False) on a server started without a speech model."""

    def __init__(self, options: SpeechOptions | None):
        self.options = options
        self.loop: EngineLoop | None = None
        # Whether everything the speech engine needs still runs (a separate
        # speech engine borrows the generation engine's device thread).
        self.alive: Callable[[], bool] = lambda: self.loop is not None and self.loop.alive

    @property
    def enabled(self) -> bool:
        return self.options is not None


class SpeechServicer(pb_grpc.SpeechServicer):
    """Synthesize over the speech engine's EngineLoop."""

    def __init__(self, state: ServingState, slot: SpeechSlot):
        self.state = state
        self.slot = slot

    def _require(self) -> EngineLoop:
        return self.state.require_ready(
            self.slot.loop, lambda _loop: self.slot.alive(), served=self.slot.enabled,
            not_served="this server serves no speech model (start it with --speech-model DIR --codec DIR)",
            not_served_reason=Reason.NO_SPEECH_MODEL, loading="the speech model is still loading",
            stopped="the speech engine is not running")

    @rpc_guard
    @counted_call
    async def Synthesize(self, request: pb.SynthesizeRequest, context: grpc.aio.ServicerContext) -> None:
        rid = check_request_id(request.request_id)
        current_request_id.set(rid)  # failures from here on carry it
        loop = self._require()
        engine = loop.engine
        scoped = scoped_request_id(rid)
        call = self.state.calls_by_id.open(scoped)  # an Abort while it prepares marks it (calls.py)
        try:
            prepared = await run_maybe_off_loop(request.ByteSize(), prepare_synthesize, request, engine, scoped)
        finally:
            self.state.calls_by_id.close(scoped, call)  # no await from here to the submission
        if self.state.draining:  # the drain began while the text was tokenized
            raise unavailable("the server is shutting down", Reason.DRAINING)
        stream = loop.submit(prepared.context)
        if call.aborted:  # ends CANCELLED at once, as any aborted request
            loop.abort(prepared.context.request_id)
        try:
            await context.send_initial_metadata(((REQUEST_ID_METADATA, rid),))
            assert engine.audio is not None and engine.speech_layout is not None
            writer = ChunkWriter(rid, prepared.format, engine.audio.decoder_sample_rate,
                                 engine.speech_layout, prepared.return_audio_tokens)
            while True:
                outputs, final = await next_outputs(stream)
                for chunk in writer.add(outputs):
                    await context.write(chunk)
                if outputs:  # the call's line then counts what it produced however it ends
                    note_sent(stream.observed, outputs[-1])
                if final is not None:
                    return
        finally:
            # Cancelled, deadline passed, client gone, or a failure above: the
            # engine must stop working on it and free its pages now.
            if not stream.finished:
                loop.abort(prepared.context.request_id)
