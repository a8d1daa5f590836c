"""`stencild serve` in a subprocess: SIGTERM drains (health NOT_SERVING, new calls
UNAVAILABLE, the streams in flight finish), then the process exits 0; SIGHUP
without TLS is ignored. Out of the
box it also serves the embedding model and the demo speech pair (demo-speech +
demo-codec, the one test that runs the full-size random SNAC decoder)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.presets import ensure_preset
from service.gen.stencil.v1 import embed_pb2, embed_pb2_grpc, speech_pb2, speech_pb2_grpc
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc

from .helpers import TIMEOUT, ServeProcess, greedy

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero() -> None:
    model = ensure_preset("tiny-llama")
    server = ServeProcess("--model", str(model), "--kv-cache-gib", "0.05", "--grace-period", "120")
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        health = health_pb2_grpc.HealthStub(channel)
        grpc.channel_ready_future(channel).result(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status != SERVING:
            assert time.monotonic() < deadline, "never became SERVING"
            time.sleep(0.05)
        # Once loaded, the start-up heap is out of the garbage collector's walks.
        assert int(server.wait_for(r"start-up heap frozen: (\d+) objects").group(1)) > 10_000
        # Out of the box, the default embedding model is served next to the generation model.
        embedded = embed_pb2_grpc.EmbeddingsStub(channel).Embed(
            embed_pb2.EmbedRequest(inputs=["hello"]), timeout=TIMEOUT)
        assert embedded.dimensions == 384 and embedded.model == "all-MiniLM-L6-v2"
        # ... and the demo speech pair.
        health_of = lambda name: health.Check(health_pb2.HealthCheckRequest(service=name),  # noqa: E731
                                              timeout=TIMEOUT).status
        assert health_of("stencil.v1.Speech") == SERVING
        speech = speech_pb2_grpc.SpeechStub(channel)
        speak = speech_pb2.SynthesizeRequest(input="Hello.", max_audio_seconds=2.0)
        speak.sampling.seed = 1
        first = list(speech.Synthesize(speak, timeout=TIMEOUT))
        assert first[-1].final and first[-1].usage.audio_samples > 0
        assert (first[0].sample_rate, first[0].channels) == (24000, 1)
        # A Synthesize stream in flight is waited for too.
        spoken = speech.Synthesize(speak, timeout=TIMEOUT * 3)
        next(spoken)
        stub = pb_grpc.GenerationStub(channel)
        # Most of the context: long enough that the checks below happen during the drain.
        req = greedy("a long answer", max_new_tokens=480)
        req.stopping.ignore_eos = True
        call = stub.Generate(req, timeout=TIMEOUT * 3)
        next(call)
        # Without TLS SIGHUP has nothing to reload: it ended the server at once, undrained.
        server.proc.send_signal(signal.SIGHUP)
        server.wait_for("SIGHUP: nothing to reload")
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == SERVING
        server.proc.send_signal(signal.SIGTERM)
        while health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status != NOT_SERVING:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(greedy("too late"), timeout=TIMEOUT))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            list(speech.Synthesize(speak, timeout=TIMEOUT))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(spoken)
        assert rest[-1].final
        assert rest[-1].usage.audio_samples == first[-1].usage.audio_samples, "seeded: the same audio"
        msgs = list(call)
        assert msgs[-1].complete.finish_reason == pb.GenerateComplete.FinishReason.LENGTH
        assert msgs[-1].complete.usage.completion_tokens == 480
        assert server.proc.wait(TIMEOUT) == 0, "".join(server.log)
        # The frozen heap was thawed before exit: nothing reported as leaked.
        time.sleep(0.5)  # the log's last lines
        assert not any("leaked" in line for line in server.log), "".join(server.log[-20:])
        channel.close()
    finally:
        server.kill()
