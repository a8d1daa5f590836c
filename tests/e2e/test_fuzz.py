"""A seeded fuzzer over the protos: random requests, random bytes, one rule.

Every message is built from the proto descriptors, field by field, with values
drawn from the edges of each type (NaN, infinities, -1, 2**63-1, empty and
10 000-character strings, unknown enum numbers, grammars of random
punctuation), and sent to every RPC a client can call; some calls get random
bytes instead of a message. Whatever comes back, it must not be INTERNAL or
UNKNOWN (a status the server gives only for its own bugs), and when the run
ends the server must still be SERVING, answer a plain request correctly, and
hold no KV pages (the fixture checks that when the session ends).

The run is bounded in time (FUZZ_SECONDS) and seeded, so a failure prints the
seed and the request that caused it, and `STENCILD_FUZZ_SEED=N` replays it.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as _d
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.gen.stencil.v1 import embed_pb2, embed_pb2_grpc, speech_pb2
from service.gen.stencil.v1 import generate_pb2 as pb

from .helpers import ServerHandle, generate, greedy

FUZZ_SECONDS = float(os.environ.get("STENCILD_FUZZ_SECONDS", "25"))
SEED = int(os.environ.get("STENCILD_FUZZ_SEED", "20261123"))
CALL_TIMEOUT_S = 10.0
BUG_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

INTS = (0, 1, -1, 2, 7, 64, 255, 4096, 2**31 - 1, -(2**31), 2**32 - 1)
INTS64 = (*INTS, 2**63 - 1, -(2**63))
FLOATS = (0.0, -0.0, 1.0, 0.5, -1.0, 1e-9, 1e-6, 2.0, 100.0, 1e38, -1e38, 3.4e38,
          float("nan"), float("inf"), float("-inf"))
STRINGS = ("", " ", "a", "hello world", "{", "}", "[", "(", ")", "*", "a**", ".*", "\\",
           "\x00", "\ud7ff", "é", "日本語", "🙂", '{"type": "object"}', '{"type": "string"}',
           '{"$ref": "#"}', '{"type": 5}', "root ::= root", 'root ::= "a" | "b"', "start: start",
           'start: "x"', "[a-z]+", "a{1000000}", "(a|b", "null", "true", "[]", "x" * 10_000)
# Fields whose large values would only make the call slow, not find a bug:
# kept small most of the time so the run covers many requests.
SLOW_FIELDS = {"max_new_tokens": 12, "min_new_tokens": 4, "max_audio_seconds": 1.0,
               "top_logprobs": 3, "logprobs": 3}


class Fuzzer:
    """Random values for protobuf messages, drawn from a seeded generator."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def string(self) -> str:
        rng = self.rng
        if rng.random() < 0.7:
            return rng.choice(STRINGS)
        alphabet = "ab01{}[]()|*+?.,:;\"'\\ \n\tx-_=<>é🙂"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))

    def scalar(self, field: _d.FieldDescriptor) -> Any:
        rng, t = self.rng, field.type
        if t == _d.FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t in (_d.FieldDescriptor.TYPE_FLOAT, _d.FieldDescriptor.TYPE_DOUBLE):
            value = rng.choice(FLOATS) if rng.random() < 0.6 else rng.uniform(-3, 3)
            if t == _d.FieldDescriptor.TYPE_FLOAT and abs(value) > 3.4e38 and value == value:
                value = 3.4e38 if value > 0 else -3.4e38  # out of float range: protobuf refuses it
            return value
        if t == _d.FieldDescriptor.TYPE_STRING:
            return self.string()
        if t == _d.FieldDescriptor.TYPE_BYTES:
            return rng.randbytes(rng.randint(0, 64))
        if t == _d.FieldDescriptor.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return rng.choice(numbers) if rng.random() < 0.85 else rng.choice((99, 12345, -1))
        unsigned = t in (_d.FieldDescriptor.TYPE_UINT32, _d.FieldDescriptor.TYPE_UINT64,
                         _d.FieldDescriptor.TYPE_FIXED32, _d.FieldDescriptor.TYPE_FIXED64)
        wide = t in (_d.FieldDescriptor.TYPE_INT64, _d.FieldDescriptor.TYPE_UINT64,
                     _d.FieldDescriptor.TYPE_SINT64, _d.FieldDescriptor.TYPE_FIXED64,
                     _d.FieldDescriptor.TYPE_SFIXED64)
        value = rng.choice(INTS64 if wide else INTS) if rng.random() < 0.7 else rng.randint(-5, 300)
        bits = 64 if wide else 32
        if unsigned:
            return value % (1 << bits)
        return max(-(1 << (bits - 1)), min((1 << (bits - 1)) - 1, value))

    def fill(self, msg: Message, depth: int = 0) -> Message:
        """Set a random subset of `msg`'s fields (one member of each oneof at most)."""
        rng = self.rng
        chosen_oneofs: set[str] = set()
        for field in msg.DESCRIPTOR.fields:
            oneof = field.containing_oneof
            if oneof is not None:
                if oneof.name in chosen_oneofs or rng.random() < 0.5:
                    continue
                chosen_oneofs.add(oneof.name)
            elif rng.random() < 0.45:
                continue
            self._set(msg, field, depth)
        return msg

    def mutate(self, msg: Message, changes: int) -> Message:
        """Set `changes` random fields, anywhere in `msg`, to random values."""
        for _ in range(changes):
            target = msg
            for _depth in range(4):  # walk down into a sub-message now and then
                nested = [f for f in target.DESCRIPTOR.fields
                          if f.type == _d.FieldDescriptor.TYPE_MESSAGE and not f.is_repeated]
                if not nested or self.rng.random() < 0.4:
                    break
                target = getattr(target, self.rng.choice(nested).name)
            if target.DESCRIPTOR.fields:  # some requests have none
                self._set(target, self.rng.choice(target.DESCRIPTOR.fields), 1)
        return msg

    def _set(self, msg: Message, field: _d.FieldDescriptor, depth: int) -> None:
        rng = self.rng
        is_message = field.type == _d.FieldDescriptor.TYPE_MESSAGE
        if field.is_repeated:
            target = getattr(msg, field.name)
            if is_message and field.message_type.GetOptions().map_entry:
                for _ in range(rng.randint(0, 4)):
                    key_field, value_field = field.message_type.fields
                    key = self.scalar(key_field)
                    if value_field.type == _d.FieldDescriptor.TYPE_MESSAGE:
                        self.fill(target[key], depth + 1)
                    else:
                        target[key] = self.scalar(value_field)
                return
            count = rng.choice((0, 1, 2, 3, 5)) if rng.random() < 0.95 else rng.randint(20, 200)
            for _ in range(count):
                if is_message:
                    if depth < 4:
                        self.fill(target.add(), depth + 1)
                else:
                    target.append(self.scalar(field))
            return
        if is_message:
            if depth < 4:
                self.fill(getattr(msg, field.name), depth + 1)
            return
        value = self.scalar(field)
        cap = SLOW_FIELDS.get(field.name)
        if cap is not None and rng.random() < 0.9 and isinstance(value, (int, float)):
            value = type(value)(rng.uniform(0, cap)) if value == value else value
        setattr(msg, field.name, value)


def _valid_generate(rng: random.Random) -> pb.GenerateRequest:
    """A request that runs, to mutate: most random requests never pass validation."""
    req = greedy(rng.choice(("Hello", "A JSON object:", "")), max_new_tokens=rng.randint(1, 12))
    kind = rng.choice(("none", "json_schema", "json_object", "regex", "choice", "ebnf"))
    if kind == "json_schema":
        req.constraint.json_schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    elif kind == "json_object":
        req.constraint.json_object = True
    elif kind == "regex":
        req.constraint.regex = "[a-c]{1,5}"
    elif kind == "choice":
        req.constraint.choice.choices.extend(["yes", "no"])
    elif kind == "ebnf":
        req.constraint.ebnf = 'root ::= "x" | "y" root'
    if not req.text:
        req.token_ids.ids.extend([1, 2, 3])
    return req


def _valid(request_type: type[Message], rng: random.Random) -> Message:
    if request_type is pb.GenerateRequest:
        return _valid_generate(rng)
    if request_type is embed_pb2.EmbedRequest:
        return embed_pb2.EmbedRequest(inputs=["a cat", "a dog"])
    if request_type is speech_pb2.SynthesizeRequest:
        req = speech_pb2.SynthesizeRequest(input="Hi.")
        req.max_audio_seconds = 0.2
        return req
    if request_type is pb.TokenizeRequest:
        return pb.TokenizeRequest(text="hello there")
    return request_type()


def _calls(handle: ServerHandle, embed: ServerHandle) -> list[tuple[str, type[Message], Callable[..., Any]]]:
    """(method, request type, how to call it and read the whole answer) for each RPC."""
    gen = handle.stub
    speech = handle.speech_stub
    embeddings = embed_pb2_grpc.EmbeddingsStub(embed.channel)

    def stream(call: Callable[..., Any]) -> Callable[..., Any]:
        return lambda req: list(call(req, timeout=CALL_TIMEOUT_S))

    def unary(call: Callable[..., Any]) -> Callable[..., Any]:
        return lambda req: call(req, timeout=CALL_TIMEOUT_S)

    return [
        ("/stencil.v1.Generation/Generate", pb.GenerateRequest, stream(gen.Generate)),
        ("/stencil.v1.Generation/Tokenize", pb.TokenizeRequest, unary(gen.Tokenize)),
        ("/stencil.v1.Generation/Detokenize", pb.DetokenizeRequest, unary(gen.Detokenize)),
        ("/stencil.v1.Generation/GetModelInfo", pb.GetModelInfoRequest, unary(gen.GetModelInfo)),
        ("/stencil.v1.Generation/Abort", pb.AbortRequest, unary(gen.Abort)),
        ("/stencil.v1.Embeddings/Embed", embed_pb2.EmbedRequest, unary(embeddings.Embed)),
        ("/stencil.v1.Speech/Synthesize", speech_pb2.SynthesizeRequest, stream(speech.Synthesize)),
    ]


def _raw(handle: ServerHandle, method: str, payload: bytes, streaming: bool) -> None:
    """Send `payload` as the request bytes of `method`, whatever they are."""
    def ident(data: bytes) -> bytes:
        return data

    if streaming:
        call = handle.channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)
        list(call(payload, timeout=CALL_TIMEOUT_S))
    else:
        handle.channel.unary_unary(method, request_serializer=ident,
                                   response_deserializer=ident)(payload, timeout=CALL_TIMEOUT_S)


@pytest.mark.timeout(FUZZ_SECONDS + 240)
def test_fuzzed_requests_never_break_the_server(speech_server: ServerHandle,
                                                embed_server: ServerHandle) -> None:
    fuzzer = Fuzzer(SEED)
    rng = fuzzer.rng
    calls = _calls(speech_server, embed_server)
    seen: dict[str, int] = {}
    deadline = time.monotonic() + FUZZ_SECONDS
    n = 0
    while time.monotonic() < deadline:
        n += 1
        method, request_type, call = rng.choice(calls)
        target = embed_server if "Embeddings" in method else speech_server
        garbage = rng.random() < 0.15
        if garbage:
            payload = rng.randbytes(rng.randint(1, 200))
            what = f"{len(payload)} random bytes {payload[:32]!r}..."
        else:
            # Half start from a request that runs, with a field or two changed,
            # so the fuzz reaches the engine and the grammar, not only validation.
            if rng.random() < 0.5:
                request = fuzzer.mutate(_valid(request_type, rng), rng.randint(0, 2))
            else:
                request = fuzzer.fill(request_type())
            what = str(request)[:2000]
        try:
            if garbage:
                _raw(target, method, payload, streaming=method.endswith(("Generate", "Synthesize")))
            else:
                call(request)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            assert code not in BUG_CODES, (
                f"call {n} (seed {SEED}) {method} got {code.name}: {err.details()}\nrequest: {what}")
        key = f"{method.rsplit('/', 1)[-1]} {code.name}"
        seen[key] = seen.get(key, 0) + 1
    print(f"fuzz: {n} calls in {FUZZ_SECONDS:g} s, seed {SEED}: {sorted(seen.items())}")
    # The run must have reached past validation, not only bounced off it.
    assert any(k.startswith(("Generate OK", "Synthesize OK", "Embed OK")) for k in seen), seen
    assert any("INVALID_ARGUMENT" in k for k in seen), seen

    for handle in (speech_server, embed_server):
        health = health_pb2_grpc.HealthStub(handle.channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    _, ids, complete, _ = generate(speech_server.stub, greedy("Hello", max_new_tokens=4, stopping={"ignore_eos": True}))
    assert len(ids) == 4 and complete.usage.completion_tokens == 4
    assert speech_server.wait_no_pages() == (0, 0)
    assert speech_server.wait_no_pages(speech=True) == (0, 0)
