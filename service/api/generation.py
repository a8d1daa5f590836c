"""The stencil.v1.Generation servicer."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from engine import GenerationStatus, RequestOutput
from grammar import GrammarError, Matcher
from service.api import convert
from service.api.calls import CallRegistry
from service.api.constraints import constraint_spec
from service.api.schema_check import check_output, tool_calls, wants_validation
from service.engine_loop import EngineFailed, EngineLoop, RequestStream
from service.errors import (
    REQUEST_ID_METADATA,
    Handler,
    Reason,
    current_request_id,
    failed_precondition,
    internal,
    invalid_argument,
    response_too_large,
    rpc_guard,
    unavailable,
)
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.ops.request_log import note_sent
from service.security.auth import scoped_request_id
from service.structured import ConstraintCompiler, ConstraintSpec, compile_error

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Requests larger than this are tokenized on a worker thread, so one long prompt
# does not hold up every other stream on the event loop.
OFF_LOOP_BYTES = 32 * 1024
# How long an Abort waits for what it aborted to leave the engine before it
# answers (a step, or a constraint's compile).
ABORT_WAIT_S = 5.0

T = TypeVar("T")


async def run_maybe_off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def next_outputs(stream: RequestStream, constraint_field: str | None = None
                       ) -> tuple[list[RequestOutput], RequestOutput | None]:
    """A request's next outputs and its final one (None while it runs).

    Ends the call instead when the engine failed (INTERNAL), the request failed
    in the engine (INTERNAL; INVALID_ARGUMENT naming `constraint_field` when its
    grammar hit a library limit) or the server cut it short (UNAVAILABLE).
    """
    try:
        outputs = await stream.next_outputs()
    except EngineFailed:
        raise internal("the engine failed while running this request; see the server log") from None
    except GrammarError as err:
        # An engine process compiles a constraint again when the server's
        # compile did not come with the request (or would not load there).
        raise compile_error(err, constraint_field or "constraint") from None
    final = outputs[-1] if outputs[-1].finished else None
    if final is not None and final.status is GenerationStatus.ERROR:
        if final.error_cause == "constraint" and constraint_field is not None:
            raise invalid_argument(constraint_field, final.error or "the grammar library failed",
                                   Reason.GRAMMAR_LIMIT)
        raise internal(f"generation failed: {final.error or 'engine error'}")
    if final is not None and final.status is GenerationStatus.CANCELLED and stream.shutdown_reason:
        raise unavailable(stream.shutdown_reason, Reason.DRAINING)
    return outputs, final


async def _add_validation(done: pb.GenerateComplete, matcher: Any, text: str, final: RequestOutput,
                          enabled: bool, strict: bool) -> None:
    """Fill a constrained request's schema_validation (and a JSON one's
    unenforced_keywords); a strict request whose complete output the schema
    rejects ends SCHEMA_VIOLATION."""
    done.unenforced_keywords.extend(matcher.unenforced_keywords)
    done.schema_validation.CopyFrom(await check_output(matcher, text, final, enabled))
    if strict and done.schema_validation.result == pb.SchemaValidation.INVALID:
        done.finish_reason = pb.GenerateComplete.SCHEMA_VIOLATION


class ServingState:
    """What the servicers need from the server: the engine once loaded, and
    whether new calls are still taken. Also counts calls in flight (Generate
    and Synthesize streams, Embed calls) so a drain can wait for them.

    `serves_generation` is False for a server started without a generation
    model (embeddings only): its Generation RPCs fail with FAILED_PRECONDITION.
    """

    def __init__(self, model_name: str, server_version: str, serves_generation: bool = True,
                 max_message_bytes: int = 16 * 1024 * 1024):
        self.model_name = model_name
        # The largest message a call may send (gRPC's own check would end it
        # with a bare RESOURCE_EXHAUSTED after the work was done).
        self.max_message_bytes = max_message_bytes
        self.server_version = server_version
        self.serves_generation = serves_generation
        self.engine_loop: EngineLoop | None = None
        # The speech engine's loop when speech has an engine of its own (else
        # None: the generation engine serves speech too, or there is none).
        self.speech_loop: EngineLoop | None = None
        self.constraints: ConstraintCompiler | None = None
        self.validate_output = True  # check finished constrained outputs (--no-validate-output)
        self.draining = False
        self.calls_by_id = CallRegistry()  # Generate and Synthesize calls: what Abort reaches
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def check_fits(self, message: Any, field: str, advice: str) -> None:
        """INVALID_ARGUMENT naming `field` if `message` (a response) is larger
        than the server sends; `advice` says what to ask for instead."""
        size = message.ByteSize()
        if size > self.max_message_bytes:
            raise response_too_large(field, size, self.max_message_bytes, advice)

    def require_ready(self, handle: T | None, alive: Callable[[T], bool], *, served: bool, not_served: str,
                      not_served_reason: str, loading: str, stopped: str) -> T:
        """`handle` if a call may use it: FAILED_PRECONDITION (`not_served`,
        `not_served_reason`) when the server does not serve it, else UNAVAILABLE
        while draining, while it loads (`loading`) or once it has stopped (`stopped`)."""
        if not served:
            raise failed_precondition(not_served, not_served_reason)
        if self.draining:
            raise unavailable("the server is shutting down", Reason.DRAINING)
        if handle is None:
            raise unavailable(loading, Reason.MODEL_LOADING)
        if not alive(handle):
            raise unavailable(stopped, Reason.ENGINE_STOPPED)
        return handle

    def require_engine(self) -> EngineLoop:
        """The engine loop, or UNAVAILABLE while loading, draining or after a failure."""
        return self.require_ready(
            self.engine_loop, lambda loop: loop.alive, served=self.serves_generation,
            not_served="this server serves no generation model (embeddings only)",
            not_served_reason=Reason.NO_GENERATION_MODEL, loading="the model is still loading", stopped="the engine is not running")

    async def compile_constraint(self, constraint: ConstraintSpec | None,
                                 copies: int = 1) -> list[Matcher | None]:
        """`copies` matchers of a request's constraint (None without one; a
        matcher holds its sequence's state, so each sequence needs its own:
        after the first each is a cache hit), then the engine checked again: a
        drain or an engine failure may have begun while the request was
        tokenized or compiled. Nothing is registered yet, so a call cancelled
        here leaves nothing behind."""
        matchers: list[Matcher | None] = [None] * copies
        if constraint is not None:
            assert self.constraints is not None
            for i in range(copies):
                matchers[i] = await self.constraints.compile(constraint)
        self.require_engine()
        return matchers

    @property
    def engine_loops(self) -> list[EngineLoop]:
        """Every running engine loop (generation first)."""
        return [loop for loop in (self.engine_loop, self.speech_loop) if loop is not None]

    @property
    def calls_in_flight(self) -> int:
        return self._calls

    def call_started(self) -> None:
        self._calls += 1
        self._idle.clear()

    def call_finished(self) -> None:
        self._calls -= 1
        if self._calls == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


def counted_call(method: Handler) -> Handler:
    """Count a servicer method's call in its ServingState's calls in flight
    from its first line: a drain then waits for one still tokenizing or
    compiling its constraint (which ends UNAVAILABLE once the drain began)
    rather than stopping the server under it (CANCELLED). Every method that
    may work for long is counted: the streams, Embed, ValidateConstraint
    (a compile of up to --grammar-timeout), Tokenize/Detokenize (off the
    loop when large) and GetTokenizer."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.state.call_started()
        try:
            return await method(self, request, context)
        finally:
            self.state.call_finished()

    return wrapper  # type: ignore[return-value]


class GenerationServicer(pb_grpc.GenerationServicer):
    """Generate, Tokenize, Detokenize, GetModelInfo and Abort over an EngineLoop."""

    def __init__(self, state: ServingState):
        self.state = state

    @rpc_guard
    @counted_call
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        rid = convert.check_request_id(request.request_id)
        current_request_id.set(rid)  # failures from here on carry it
        loop = self.state.require_engine()
        scoped = scoped_request_id(rid)
        # Registered while it prepares: an Abort meanwhile marks it (calls.py).
        call = self.state.calls_by_id.open(scoped)
        try:
            # 1. Check the request and tokenize its prompt (a long one off the loop).
            prepared = await run_maybe_off_loop(request.ByteSize(), convert.prepare_generate,
                                                 request, loop.engine, scoped)
            # 2. Compile its constraint before the engine sees it (a cache hit
            # returns at once); a failure ends only this call.
            [matcher] = await self.state.compile_constraint(prepared.constraint)
        finally:
            # No await from here to the submission: the engine finds it next.
            self.state.calls_by_id.close(scoped, call)
        # 3. Build its context, once, and hand it to the engine thread.
        assert self.state.constraints is not None
        stream = loop.submit_request(prepared.spec, matcher, self.state.constraints.resamples(prepared.constraint),
                                     prepared.reasoning)
        if call.aborted:  # ends CANCELLED at once, as any aborted request
            loop.abort(stream.request_id)
        try:
            await context.send_initial_metadata(((REQUEST_ID_METADATA, rid),))
            field = prepared.constraint.field if prepared.constraint is not None else None
            validate = wants_validation(matcher)
            reader = prepared.tools.reader if prepared.tools is not None else None
            text: list[str] = []  # the whole answer, for its validation and its tool calls
            while True:
                outputs, final = await next_outputs(stream, field)
                if validate:
                    text.extend(o.text for o in outputs)
                chunk = convert.chunk_response(rid, outputs, prepared.options)
                if chunk is not None and len(chunk.chunk.prompt_logprobs):  # the one chunk that can grow so large
                    self.state.check_fits(chunk, "response.prompt_logprobs", "ask for fewer top tokens")
                if chunk is not None:
                    await context.write(chunk)
                note_sent(stream.observed, outputs[-1])
                if chunk is not None and final is None:
                    await loop.pace(stream)  # what comes meanwhile goes out in the next chunk
                if final is not None:
                    done = convert.complete_response(rid, final)
                    if validate:
                        assert matcher is not None and prepared.constraint is not None
                        await _add_validation(done.complete, matcher, "".join(text), final,
                                              self.state.validate_output,
                                              prepared.constraint.strict)
                    if reader is not None:
                        done.complete.tool_calls.extend(await tool_calls(reader, "".join(text)))
                    await context.write(done)
                    return
        finally:
            # Cancelled, deadline passed, client gone, or a failure above: the
            # engine must stop working on it and free its pages now.
            if not stream.finished:
                loop.abort(stream.request_id)

    @rpc_guard
    @counted_call
    async def ValidateConstraint(self, request: pb.ValidateConstraintRequest,
                                 context: grpc.aio.ServicerContext) -> pb.ValidateConstraintResponse:
        self.state.require_engine()
        # Off the loop when large, as Generate prepares: a regex's safety scans
        # read the whole source (~0.8 s a MB; an 8 MB one held the loop 6-7 s).
        constraint = await run_maybe_off_loop(request.ByteSize(), constraint_spec,
                                              pb.GenerateRequest(constraint=request.constraint))
        if constraint is None:
            raise invalid_argument("constraint", "set a constraint to validate")
        compiler = self.state.constraints
        assert compiler is not None
        matcher, cached = await compiler.compile_noting_cache(constraint)
        resampled = matcher.resampled_keywords if compiler.resamples(constraint) else ()
        return pb.ValidateConstraintResponse(
            grammar_backend=matcher.backend, compile_seconds=matcher.compile_seconds, cached=cached,
            unenforced_keywords=list(matcher.unenforced_keywords), resampled_keywords=list(resampled),
            output_validated=matcher.validator is not None and self.state.validate_output,
            validator_message=("output validation is off on this server"
                               if not self.state.validate_output else matcher.validator_error or ""))

    @rpc_guard
    @counted_call
    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        loop = self.state.require_engine()
        response = await run_maybe_off_loop(request.ByteSize(), convert.tokenize, request, loop.engine.tokenizer,
                                            self.state.max_message_bytes)
        self.state.check_fits(response, "text", convert.TOKENIZE_ADVICE)
        return response

    @rpc_guard
    @counted_call
    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        loop = self.state.require_engine()
        # A token is a couple of bytes asked for and up to hundreds of bytes of
        # text: a long request is decoded off the loop, and its answer checked.
        response = await run_maybe_off_loop(request.ByteSize(), convert.detokenize, request, loop.engine.tokenizer,
                                            loop.engine.vocab_size)
        self.state.check_fits(response, "token_ids", "send fewer ids")
        return response

    @rpc_guard
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        loop = self.state.require_engine()
        return convert.model_info(loop.engine, self.state.model_name, self.state.server_version)

    @rpc_guard
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        # Taken while draining too: aborting helps a drain finish.
        if not self.state.serves_generation:
            self.state.require_engine()  # FAILED_PRECONDITION
        loops = self.state.engine_loops
        if not loops:
            raise unavailable("the model is still loading", Reason.MODEL_LOADING)
        # Synthesize streams too, on an engine of their own or not: every loop is
        # asked (an id runs on one of them at most: EngineLoop.peers).
        convert.check_abort_ids(request.request_ids)
        aborted = []
        calls = self.state.calls_by_id
        for rid in dict.fromkeys(request.request_ids):  # each id once, however often it is named
            # Only the caller's own; a vLLM call's other sequences too.
            if calls.abort(scoped_request_id(rid), loops):
                aborted.append(rid)
        # Answer once they have left the engine, so that their ids may be
        # used again at once; a call still compiling its constraint is waited
        # for too, within the same bound.
        remaining = context.time_remaining()
        timeout = ABORT_WAIT_S if remaining is None else min(ABORT_WAIT_S, max(0.0, remaining - 0.05))
        await asyncio.gather(*(calls.wait_ended(scoped_request_id(rid), loops, timeout) for rid in aborted))
        return pb.AbortResponse(aborted_request_ids=aborted)
