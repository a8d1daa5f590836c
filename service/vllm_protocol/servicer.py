"""The `vllm.grpc.engine.VllmEngine` servicer: vLLM's gRPC engine protocol.

Routers that drive fleets of gRPC engines (the Shepherd Model Gateway, the
llm-d endpoint picker) speak this protocol to their workers; serving it on the
same port and engine as `stencil.v1` puts stencild in such a fleet with no
code of ours in the router. Everything goes through the same machinery as
`stencil.v1.Generation`: the same EngineLoop (admission limits, abort on
cancel), the same validation (INVALID_ARGUMENT + BadRequest, fields named in
this proto's terms, service/vllm_protocol/convert.py) and the same constraint compiler.

`n` > 1 runs n sequences: the first one alone until its prompt is computed
(its full pages are then in the prefix cache), then the others, which find the
prompt's pages there and compute only its last, partial page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from engine import EngineCore
from service.api import convert
from service.api.calls import CallHandle
from service.api.embeddings import EmbeddingRuntime, EmbeddingSlot
from service.api.generation import ServingState, counted_call, next_outputs, run_maybe_off_loop
from service.engine_loop import EngineLoop, RequestStream
from service.errors import (
    REQUEST_ID_METADATA,
    Reason,
    ServiceError,
    current_request_id,
    failed_precondition,
    invalid_argument,
    resource_exhausted,
    rpc_guard,
    unavailable,
)
from service.gen.vllm import common_pb2 as cpb
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.gen.vllm import vllm_engine_pb2_grpc as vpb_grpc
from service.ops.health import SERVING, HealthState
from service.ops.request_log import note_refusal, note_sent
from service.security.auth import scoped_request_id
from service.vllm_protocol import convert as vllm_convert
from service.vllm_protocol import info as vllm_info
from service.vllm_protocol.kv_events import KvEventHub, SubscriberGone

log = logging.getLogger(__name__)

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# How long a KV event subscriber dropped while its router reads nothing waits
# to send its status before its call is cancelled.
_DROPPED_STATUS_WAIT_S = 1.0
# What sees or changes every client's state at once (the prefix cache's events
# carry prompt tokens): with API keys, for a key marked `router` only.
ROUTER_METHODS = frozenset({f"/{SERVICE_NAME}/SubscribeKvEvents", f"/{SERVICE_NAME}/FlushCache"})


def _no_profiler() -> ServiceError:
    # Left to grpcio's generated base class, StartProfile and StopProfile
    # answered without the ErrorInfo and request id every other error carries.
    return ServiceError(grpc.StatusCode.UNIMPLEMENTED, "this server has no profiler to start or stop; "
                        "profile it from outside (py-spy, nsys)", Reason.NOT_IMPLEMENTED)


class _Sequence:
    """One of a request's n sequences: its engine stream and what it produced."""

    def __init__(self, index: int, engine_id: str, stream: RequestStream, state: vllm_convert.SequenceState):
        self.index = index
        self.engine_id = engine_id
        self.stream = stream
        self.state = state


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """VllmEngine over the server's EngineLoop, embedding model and KV event hub.

    StartProfile and StopProfile answer UNIMPLEMENTED (NOT_IMPLEMENTED).
    """

    def __init__(self, state: ServingState, embedding: EmbeddingSlot, kv_events: KvEventHub,
                 health: HealthState):
        self.state = state
        self.embedding = embedding
        self.kv_events = kv_events
        self.health = health  # grpc.health.v1's view, which the watchdog keeps
        self.started_at = time.monotonic()
        self.last_receive = 0.0

    # -- Generate ---------------------------------------------------------------
    @rpc_guard
    @counted_call
    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        rid = convert.check_request_id(request.request_id)
        current_request_id.set(rid)
        self.last_receive = time.time()
        loop = self.state.require_engine()
        scoped = scoped_request_id(rid)
        # Registered from now to its end: an Abort while it prepares, or
        # between its sequences' starts, reaches it (service/api/calls.py).
        call = self.state.calls_by_id.open(scoped, early=True)
        try:
            await self._generate(request, context, rid, scoped, loop, call)
        finally:
            self.state.calls_by_id.close(scoped, call)

    async def _generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext, rid: str,
                        scoped: str, loop: EngineLoop, call: CallHandle) -> None:
        prepared = await run_maybe_off_loop(request.ByteSize(), vllm_convert.prepare_generate,
                                             request, loop.engine, scoped)
        matchers = await self.state.compile_constraint(prepared.constraint, len(prepared.specs))
        compiler = self.state.constraints
        assert compiler is not None
        field = prepared.constraint.field if prepared.constraint is not None else None
        sequences: list[_Sequence] = []
        merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        pumps: list[asyncio.Task[None]] = []

        def start(i: int) -> None:
            spec = prepared.specs[i]
            # vLLM's request has no resample field: the server's default applies.
            # The call is admitted whole with its first sequence (room for all n).
            stream = loop.submit_request(spec, matchers[i], compiler.resamples(prepared.constraint),
                                         prepared.reasoning, room_for=len(prepared.specs), admitted=i > 0)
            seq = _Sequence(i, stream.request_id, stream,
                            vllm_convert.SequenceState.start(i, [int(t) for t in spec.prompt]))
            sequences.append(seq)
            pumps.append(asyncio.ensure_future(self._pump(seq, field, merged)))

        call.others = [vllm_convert.sequence_id(scoped, i) for i in range(1, len(prepared.specs))]
        start(0)
        call.submit()
        if call.aborted:  # named by an Abort while it prepared: ends "abort" at once
            loop.abort(sequences[0].engine_id)
        try:
            await context.send_initial_metadata(((REQUEST_ID_METADATA, rid),))
            running = 1
            others_started = len(prepared.specs) == 1
            held: list[tuple[int, Any]] = []  # taken from the queue while merging, not yet handled
            while running:
                i, item = held.pop() if held else await merged.get()
                if isinstance(item, BaseException):
                    raise item
                outputs, final = item
                # What this sequence delivered while the call waited (a paced
                # stream's pause, a slow client) goes out in one message.
                while final is None and not merged.empty():
                    j, more = merged.get_nowait()
                    if j != i or isinstance(more, BaseException):
                        held.append((j, more))
                        break
                    outputs, final = outputs + more[0], more[1]
                if not others_started:
                    # The first sequence's prompt is computed and its pages
                    # published: the others reuse them from the prefix cache.
                    # If it was aborted meanwhile (an Abort finds only it until
                    # now, or nothing once it ended), they start aborted: each
                    # ends "abort" too.
                    others_started = True
                    aborted = sequences[0].stream.abort_sent or call.aborted
                    for j in range(1, len(prepared.specs)):
                        start(j)
                        running += 1
                        if aborted:
                            loop.abort(sequences[-1].engine_id)
                seq = sequences[i]
                new_ids, new_lps = seq.state.add(outputs)
                if request.stream:
                    msg = vllm_convert.chunk(seq.state, new_ids, new_lps, prepared, final is not None)
                    if msg is not None:
                        if msg.chunk.HasField("input_logprobs"):  # the one chunk that can grow so large
                            self._check_fits(msg, prepared)
                        await context.write(msg)
                        note_sent(seq.stream.observed, outputs[-1])
                        if final is None and running == 1:
                            await loop.pace(seq.stream)
                if final is not None:
                    running -= 1
                    msg = vllm_convert.complete(seq.state, final, prepared, request.stream, new_ids, new_lps)
                    if not request.stream or msg.complete.HasField("input_logprobs"):
                        self._check_fits(msg, prepared)
                    await context.write(msg)
        finally:
            if sequences and len(sequences) < len(prepared.specs):
                # Admitted, ended before the others started: their room is free.
                loop.release(len(prepared.specs) - len(sequences), prepared.specs[0].max_length)
            for task in pumps:
                task.cancel()
            # Cancelled, deadline passed, client gone, or a failure: the engine
            # stops every sequence still running and frees its pages now.
            for seq in sequences:
                if not seq.stream.finished:
                    loop.abort(seq.engine_id)

    def _check_fits(self, msg: vpb.GenerateResponse, prepared: vllm_convert.VllmPrepared) -> None:
        """INVALID_ARGUMENT (RESPONSE_TOO_LARGE) for an answer over the server's
        message limit, naming what made it large, rather than a bare
        RESOURCE_EXHAUSTED from gRPC once it is written."""
        if prepared.prompt_logprobs is not None:
            self.state.check_fits(msg, "sampling_params.prompt_logprobs", "ask for fewer top tokens, or none")
        elif prepared.logprobs is not None:
            self.state.check_fits(msg, "sampling_params.logprobs", "ask for fewer top tokens, or stream the answer")
        else:
            self.state.check_fits(msg, "sampling_params.max_tokens", "stream the answer, or ask for fewer tokens")

    @staticmethod
    async def _pump(seq: _Sequence, field: str | None, merged: asyncio.Queue[tuple[int, Any]]) -> None:
        """Move one sequence's outputs onto the call's merged queue (errors too)."""
        try:
            while True:
                outputs, final = await next_outputs(seq.stream, field)
                merged.put_nowait((seq.index, (outputs, final)))
                if final is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the call, which ends with it
            merged.put_nowait((seq.index, exc))

    # -- Abort ------------------------------------------------------------------
    @rpc_guard
    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        """Idempotent: ids that are unknown or already finished are fine."""
        convert.check_abort_ids(request.request_ids)
        loop = self.state.engine_loop
        if loop is None:
            return vpb.AbortResponse()
        for rid in dict.fromkeys(request.request_ids):
            # A call still preparing, and every sequence of an n > 1 call, too;
            # one whose Generate this Abort overtook, when that comes.
            self.state.calls_by_id.abort(scoped_request_id(rid), [loop], remember=True)
        return vpb.AbortResponse()

    # -- Embed ------------------------------------------------------------------
    @rpc_guard
    @counted_call
    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext) -> vpb.EmbedResponse:
        """The embedding model's vector of the input's text.

        The router tokenizes with the generation model's tokenizer, and the
        embedding model has a vocabulary of its own, so the input's text is
        embedded: `original_text` when given, else the ids decoded with the
        generation model's tokenizer.
        """
        if request.request_id:
            current_request_id.set(convert.check_request_id(request.request_id))
        runtime = self._embedding_runtime()
        text = request.tokenized.original_text
        if not text:
            ids = request.tokenized.input_ids
            if not ids:
                raise invalid_argument("tokenized.input_ids", "the input is empty")
            loop = self.state.engine_loop
            if loop is None:
                raise invalid_argument("tokenized.original_text", "required on a server without a generation "
                                                                  "model (token ids cannot be decoded)")
            engine = loop.engine
            # Up to millions of ids fit in a message: checked and decoded off the loop when long.
            text = await run_maybe_off_loop(4 * len(ids), convert.decode_ids, ids, engine.tokenizer, engine.vocab_size,
                                            "tokenized.input_ids")
        from engine.embedding import BatcherClosed, BatcherOverloaded
        from engine.embedding.pipeline import TRUNCATE_HINT
        from engine.errors import InvalidRequest

        try:
            vectors, tokens = await runtime.batcher.embed([text], None, None, False)  # normalized as the checkpoint says
        except InvalidRequest as err:
            # vLLM's EmbedRequest has no truncate to set.
            raise invalid_argument("tokenized", err.description.replace(TRUNCATE_HINT, "; shorten it")) from None
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
        values = [float(v) for v in vectors[0]]
        return vpb.EmbedResponse(embedding=values, prompt_tokens=tokens, embedding_dim=len(values))

    def _embedding_runtime(self) -> EmbeddingRuntime:
        return self.state.require_ready(
            self.embedding.runtime, lambda runtime: runtime.alive, served=self.embedding.enabled,
            not_served="this server serves no embedding model (start it without --no-embedding-model)",
            not_served_reason=Reason.NO_EMBEDDING_MODEL, loading="the embedding model is still loading",
            stopped="the embedding model is not running")

    # -- health and info --------------------------------------------------------
    @rpc_guard
    async def HealthCheck(self, request: vpb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        loop = self.state.engine_loop
        if self.state.draining:
            return vpb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if loop is None:
            return vpb.HealthCheckResponse(healthy=False, message="the model is still loading")
        if not loop.alive:
            return vpb.HealthCheckResponse(healthy=False, message="the engine is not running")
        # What grpc.health.v1 says of this service: NOT_SERVING while the engine hangs.
        if self.health.status(SERVICE_NAME) != SERVING:
            return vpb.HealthCheckResponse(healthy=False, message="not serving: warming up, or the engine "
                                                                  "is not completing its steps")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    @rpc_guard
    async def GetModelInfo(self, request: vpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        loop = self.state.require_engine()
        return vllm_info.model_info(loop.engine, self.state.model_name)

    @rpc_guard
    async def GetServerInfo(self, request: vpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        loop = self.state.require_engine()
        return vllm_info.server_info(loop, self.state.draining, self.last_receive,
                                     time.monotonic() - self.started_at)

    @rpc_guard
    async def GetLoads(self, request: vpb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise invalid_argument("dp_rank", "this server has one data-parallel rank (0)")
        loop = self.state.require_engine()
        return vllm_info.loads(loop, self.state.server_version)

    @rpc_guard
    @counted_call
    async def GetTokenizer(self, request: cpb.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> None:
        """The tokenizer's files as one zip, in chunks; the last carries its SHA-256."""
        loop = self.state.require_engine()
        data, digest = await asyncio.to_thread(vllm_info.tokenizer_zip, Path(loop.engine.config.model))
        size = vllm_info.TOKENIZER_CHUNK_BYTES
        for start in range(0, len(data), size):
            last = start + size >= len(data)
            await context.write(cpb.GetTokenizerChunk(data=data[start:start + size], sha256=digest if last else ""))

    # -- the prefix cache ---------------------------------------------------------
    @rpc_guard
    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> None:
        """The prefix cache's current state, then what each step does to it (kv_events.py)."""
        loop = self.state.require_engine()
        if not self.kv_events.attached:
            raise unavailable("the model is still loading", Reason.MODEL_LOADING)
        if not loop.engine.config.enable_prefix_caching:
            raise failed_precondition("prefix caching is off on this server (--no-prefix-caching)",
                                      Reason.PREFIX_CACHING_OFF)
        await context.send_initial_metadata(())
        # A router that stops reading blocks this handler in a write, where the
        # hub's drop would never be read: the drop cancels the write instead.
        handler = asyncio.current_task()
        dropped = False

        def drop() -> None:
            nonlocal dropped
            dropped = True
            if handler is not None:
                handler.cancel()

        events = self.kv_events.subscribe(request.start_sequence_number, on_drop=drop)
        gone = unavailable("this subscriber fell behind; subscribe again", Reason.QUEUE_FULL)
        try:
            async for batch in events:
                await context.write(batch)
        except SubscriberGone:
            raise gone from None
        except asyncio.CancelledError:
            if not dropped or handler is None:
                raise
            handler.uncancel()
            # The status queues behind the write the router is not reading: it
            # is given a moment, then the call is cancelled without one.
            try:
                async with asyncio.timeout(_DROPPED_STATUS_WAIT_S):
                    await gone.abort(context)
            except TimeoutError:
                raise asyncio.CancelledError() from None
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()

    @rpc_guard
    async def StartProfile(self, request: cpb.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> cpb.ProfileResponse:
        raise _no_profiler()

    @rpc_guard
    async def StopProfile(self, request: cpb.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> cpb.ProfileResponse:
        raise _no_profiler()

    @rpc_guard
    async def FlushCache(self, request: cpb.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> cpb.FlushCacheResponse:
        """Empty the prefix cache: no later request reuses a page computed before
        it. Pages running requests hold stay theirs, unshared, so this disturbs
        none of them and needs no wait for idleness (`timeout_s` is accepted and
        not needed)."""
        loop = self.state.require_engine()
        dropped = await loop.call(EngineCore.flush_prefix_cache)
        return cpb.FlushCacheResponse(success=True, message=f"dropped {dropped} cached pages")
