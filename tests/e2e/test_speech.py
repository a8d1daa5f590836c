"""The Speech service: streamed audio equals one-shot decoding, chunks arrive
while the model still runs, speech and text share the server (and one engine),
cancellation frees pages, errors name the field, `stencild say` writes a WAV."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import wave
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from service.api import speech as speech_module
from service.api.speech import SpeechOptions
from service.api.speech_convert import SPEECH_SAMPLING_DEFAULTS
from service.cli import main
from service.errors import bad_request_violations
from service.gen.stencil.v1 import generate_pb2
from service.gen.stencil.v1 import speech_pb2 as pb
from service.gen.stencil.v1 import speech_pb2_grpc as pb_grpc

from .helpers import (
    TIMEOUT,
    ServerHandle,
    SlowModel,
    engine_factory,
    generate,
    greedy,
    speech_factory,
    synthesize,
)

SPEECH = "stencil.v1.Speech"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Finish = pb.AudioChunk.FinishReason
SAMPLES_PER_FRAME = 2048
# Streaming decodes each chunk with 3 frames of context on both sides, so its
# samples equal one-shot decoding up to float rounding (engine/speech/codec.py).
STREAM_BOUND = 1e-5


def speech_request(text: str = "Streaming speech should be seamless.", seconds: float = 1.5, seed: int = 3,
            **fields: Any) -> pb.SynthesizeRequest:
    req = pb.SynthesizeRequest(input=text, max_audio_seconds=seconds, **fields)
    req.sampling.seed = seed
    return req


def float_audio(chunks: list[pb.AudioChunk]) -> np.ndarray:
    return np.frombuffer(b"".join(c.audio for c in chunks), dtype="<f4")


def pcm_audio(chunks: list[pb.AudioChunk]) -> np.ndarray:
    return np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2")


def codes(chunks: list[pb.AudioChunk]) -> list[int]:
    return [c for chunk in chunks for c in chunk.audio_tokens]


def error(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def test_streamed_audio_equals_one_shot_decoding(speech_server: ServerHandle) -> None:
    req = speech_request(chunk_frames=2, format=pb.AUDIO_FORMAT_FLOAT32, return_audio_tokens=True)
    chunks, _ = synthesize(speech_server.speech_stub, req)
    audio, got_codes = float_audio(chunks), codes(chunks)
    assert len(got_codes) % 7 == 0 and len(got_codes) > 0
    reference = speech_server.decode(got_codes)
    assert audio.shape == reference.shape == (len(got_codes) // 7 * SAMPLES_PER_FRAME,)
    assert np.abs(audio - reference).max() < STREAM_BOUND
    assert len(chunks) >= 4, "streamed in several chunks"
    for i, chunk in enumerate(chunks):
        assert (chunk.index, chunk.sample_rate, chunk.channels) == (i, 24000, 1)
        assert chunk.format == pb.AUDIO_FORMAT_FLOAT32
        assert chunk.final == (i == len(chunks) - 1)
        assert len(chunk.audio) > 0 or chunk.final
        assert len(chunk.audio_tokens) % 7 == 0, "codes come in whole frames"
    usage = chunks[-1].usage
    assert usage.speech_tokens == len(got_codes)
    assert usage.audio_samples == len(audio)
    assert usage.audio_seconds == pytest.approx(len(audio) / 24000)
    assert chunks[-1].finish_reason in (Finish.LENGTH, Finish.END_OF_SPEECH)
    # 1.5 s holds 17 whole frames; the random model may end speech earlier.
    assert len(got_codes) <= 18 * 7
    assert (chunks[-1].finish_reason == Finish.LENGTH) == (len(got_codes) == 17 * 7)

    # The same request as PCM16: the same codes (seeded), and the one-shot
    # decoding quantized, within one step.
    req.format = pb.AUDIO_FORMAT_PCM16
    pcm_chunks, _ = synthesize(speech_server.speech_stub, req)
    assert codes(pcm_chunks) == got_codes
    assert all(c.format == pb.AUDIO_FORMAT_PCM16 for c in pcm_chunks)
    quantized = np.rint(np.clip(reference, -1, 1) * 32767)
    pcm = pcm_audio(pcm_chunks).astype(np.int64)
    assert pcm.shape == quantized.shape
    assert np.abs(pcm - quantized).max() <= 1


def test_first_chunk_arrives_while_the_model_still_runs(speech_server: ServerHandle) -> None:
    engine = speech_server.speech_engine
    loop = speech_server.server.speech.loop
    assert loop is not None
    pending_at_first: list[int] = []
    # Slowed down a little so the comparison holds on a loaded machine too.
    model = engine.model
    assert isinstance(model, SlowModel)
    model.delay_s = 0.004
    try:
        chunks: list[pb.AudioChunk] = []
        times: list[float] = []
        start = time.perf_counter()
        for chunk in speech_server.speech_stub.Synthesize(speech_request(seconds=2.0, chunk_frames=1),
                                                          timeout=TIMEOUT):
            if not chunks:
                pending_at_first.append(loop.num_pending)
            chunks.append(chunk)
            times.append(time.perf_counter() - start)
    finally:
        model.delay_s = 0.0
    assert pending_at_first == [1], "the first chunk came before the request finished in the engine"
    assert chunks[-1].final and len(chunks) >= 8
    # Every chunk is sent as soon as it is decoded: the first well before the
    # last, with several in between.
    assert times[0] < times[len(times) // 2] < times[-1]
    assert times[0] < 0.5 * times[-1]


def test_speech_sampling_defaults_are_the_engines(speech_server: ServerHandle) -> None:
    params = speech_server.speech_engine.make_speech_context("x").sampling_params
    assert {k: getattr(params, k) for k in SPEECH_SAMPLING_DEFAULTS} == SPEECH_SAMPLING_DEFAULTS


def _text_requests() -> list[generate_pb2.GenerateRequest]:
    reqs = []
    for i, prompt in enumerate(["Once upon a time", "The weather today", "A list of numbers: 1, 2,",
                                "Speech and text together"]):
        req = greedy(prompt, max_new_tokens=16 + 4 * i)
        req.stopping.ignore_eos = True
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("which", ["speech_server", "shared_speech_server"])
def test_speech_and_text_concurrently(which: str, request: pytest.FixtureRequest) -> None:
    """Text streams run beside speech streams (on one engine for the shared
    server) and give the same greedy tokens as alone; every stream completes."""
    handle: ServerHandle = request.getfixturevalue(which)
    if which == "shared_speech_server":
        assert handle.server.speech.loop is handle.server.engine_loop, "one engine serves both"
        assert handle.server.state.speech_loop is None
    alone = [generate(handle.stub, r)[1] for r in _text_requests()]
    started = threading.Barrier(4)

    def speak(i: int) -> list[pb.AudioChunk]:
        call = handle.speech_stub.Synthesize(speech_request(f"Voice number {i}.", seconds=1.5, seed=i,
                                                     chunk_frames=2), timeout=TIMEOUT)
        chunks = [next(call)]
        started.wait(TIMEOUT)  # all speech streams are producing audio before the text starts
        return chunks + list(call)

    with ThreadPoolExecutor(8) as pool:
        voices = [pool.submit(speak, i) for i in range(3)]
        started.wait(TIMEOUT)
        texts = [pool.submit(generate, handle.stub, r) for r in _text_requests()]
        assert [f.result()[1] for f in texts] == alone
        for f in voices:
            chunks = f.result()
            assert chunks[-1].final
            assert chunks[-1].usage.audio_samples == len(pcm_audio(chunks)) > 0


@pytest.mark.parametrize("how", ["cancel", "deadline", "disconnect", "abort"])
def test_ending_a_speech_stream_frees_its_pages(speech_server: ServerHandle, how: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stencild.requests")
    loop = speech_server.server.speech.loop
    assert loop is not None
    before = loop.stats.finished.get("cancelled", 0)
    req = speech_request(seconds=30.0, request_id=f"long-speech-{how}")
    channel = grpc.insecure_channel(speech_server.address) if how == "disconnect" else speech_server.channel
    call = pb_grpc.SpeechStub(channel).Synthesize(req, timeout=1.0 if how == "deadline" else TIMEOUT)
    if how == "deadline":
        assert error(lambda: list(call)).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        next(call)
        assert speech_server.pages_in_use(speech=True) != (0, 0), "the request holds pages while it runs"
        if how == "cancel":
            call.cancel()
            assert error(lambda: list(call)).code() == grpc.StatusCode.CANCELLED
        elif how == "disconnect":
            channel.close()
        else:
            aborted = speech_server.stub.Abort(generate_pb2.AbortRequest(request_ids=[req.request_id]))
            assert list(aborted.aborted_request_ids) == [req.request_id]
            last = list(call)[-1]
            assert last.final and last.finish_reason == Finish.CANCELLED
            assert last.usage.audio_seconds < 30
    assert speech_server.wait_no_pages(speech=True) == (0, 0), "the aborted request still holds pages"
    speech_server.wait_pending(0, speech=True)
    assert loop.stats.finished.get("cancelled", 0) == before + 1, "the request was not aborted"
    # Its line counts the audio tokens it produced, however it ended (it said 0 when cut).
    deadline = time.monotonic() + 10  # the line is written as the call ends on the server
    while not (lines := [fields for r in caplog.records if r.name == "stencild.requests"
                         and (fields := getattr(r, "fields", {})).get("request_id") == req.request_id]):
        assert time.monotonic() < deadline, "no request line"
        time.sleep(0.02)
    [line] = lines
    assert 0 < line["completion_tokens"] < 30 * 12 * 7 and line["audio_s"] < 30


def test_a_request_id_is_one_request_across_the_speech_engine(make_server: Callable[..., ServerHandle]) -> None:
    """A Generate and a Synthesize on a speech engine of its own could share an
    id, and one Abort of it ended both."""
    # Generation at 20 ms a step, so its stream outlives the Synthesize call below.
    speech_server = make_server(engine_factory(slow_s=0.02), speech=SpeechOptions("demo-speech", speech_factory()))
    rid = "one-id-two-engines"
    call = speech_server.speech_stub.Synthesize(speech_request(seconds=30.0, request_id=rid), timeout=TIMEOUT)
    next(call)
    err = error(lambda: generate(speech_server.stub, greedy("Hi", max_new_tokens=2, request_id=rid)))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    aborted = speech_server.stub.Abort(generate_pb2.AbortRequest(request_ids=[rid]))
    assert list(aborted.aborted_request_ids) == [rid]
    assert list(call)[-1].finish_reason == Finish.CANCELLED
    speech_server.wait_pending(0, speech=True)
    # And the other way round: a running Generate holds its id from Synthesize.
    req = greedy("Hi", max_new_tokens=500, request_id=rid)
    req.stopping.ignore_eos = True
    stream = speech_server.stub.Generate(req, timeout=TIMEOUT)
    next(stream)
    err = error(lambda: list(speech_server.speech_stub.Synthesize(speech_request(request_id=rid),
                                                                  timeout=TIMEOUT)))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()
    speech_server.wait_pending(0)
    assert generate(speech_server.stub, greedy("Hi", max_new_tokens=2, request_id=rid))[2].usage.completion_tokens


def test_no_speech_model_is_failed_precondition(server: ServerHandle) -> None:
    err = error(lambda: list(server.speech_stub.Synthesize(speech_request(), timeout=TIMEOUT)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=SPEECH)).status == NOT_SERVING


def test_health_and_reflection_list_speech(speech_server: ServerHandle) -> None:
    health = health_pb2_grpc.HealthStub(speech_server.channel)
    for name in ("", "stencil.v1.Generation", SPEECH):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == SERVING, name
    db = ProtoReflectionDescriptorDatabase(speech_server.channel)
    assert SPEECH in set(db.get_services())
    assert db.FindFileContainingSymbol(SPEECH).package == "stencil.v1"


@pytest.mark.parametrize("fields, path", [
    ({"input": ""}, "input"),
    ({"input": "   "}, "input"),
    ({"input": "x" * 2001}, "input"),
    ({"chunk_frames": 0}, "chunk_frames"),
    ({"chunk_frames": 65}, "chunk_frames"),
    ({"max_audio_seconds": 0.0}, "max_audio_seconds"),
    ({"max_audio_seconds": 0.05}, "max_audio_seconds"),  # less than one 85 ms frame
    ({"max_audio_seconds": 301.0}, "max_audio_seconds"),
    ({"audio_prompt_tokens": [1, 2, 3]}, "audio_prompt_tokens"),
    ({"audio_prompt_tokens": [0, 1, 2, 3, 4, 5, 4096]}, "audio_prompt_tokens[6]"),
    ({"audio_prompt_transcription": "no audio"}, "audio_prompt_transcription"),
    ({"format": 7}, "format"),
    ({"request_id": "x" * 300}, "request_id"),
])
def test_invalid_requests_name_the_field(speech_server: ServerHandle, fields: dict[str, Any],
                                         path: str) -> None:
    req = speech_request()
    for name, value in fields.items():
        field = getattr(req, name) if name == "audio_prompt_tokens" else None
        if field is not None:
            field.extend(value)
        else:
            setattr(req, name, value)
    err = error(lambda: list(speech_server.speech_stub.Synthesize(req, timeout=TIMEOUT)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == [path]


@pytest.mark.parametrize("name, value, path", [
    ("temperature", -1.0, "sampling.temperature"),
    ("top_p", 0.0, "sampling.top_p"),
])
def test_invalid_sampling_names_the_field(speech_server: ServerHandle, name: str, value: float,
                                          path: str) -> None:
    req = speech_request()
    setattr(req.sampling, name, value)
    err = error(lambda: list(speech_server.speech_stub.Synthesize(req, timeout=TIMEOUT)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == [path]
    req = speech_request()
    req.sampling.logit_bias[10**6] = 1.0
    err = error(lambda: list(speech_server.speech_stub.Synthesize(req, timeout=TIMEOUT)))
    assert [f for f, _ in bad_request_violations(err.trailing_metadata())] == ["sampling.logit_bias"]


def test_voice_prompt_goes_before_the_text(speech_server: ServerHandle) -> None:
    plain, _ = synthesize(speech_server.speech_stub, speech_request("Say it like me.", seconds=0.5))
    voice = speech_request("Say it like me.", seconds=0.5, audio_prompt_transcription="reference words")
    voice.audio_prompt_tokens.extend(list(range(14)))  # two frames of reference audio
    cloned, _ = synthesize(speech_server.speech_stub, voice)
    transcription = len(speech_server.speech_engine.tokenizer.encode("reference words",
                                                                     add_special_tokens=False))
    grown = cloned[-1].usage.prompt_tokens - plain[-1].usage.prompt_tokens
    assert grown >= 14 + transcription
    assert cloned[-1].usage.audio_samples > 0


def test_say_writes_a_wav_file(speech_server: ServerHandle, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    rc = main(["say", "Hello from stencild.", "-o", str(out), "--port", str(speech_server.port),
               "--max-seconds", "1.0", "--seed", "5", "--chunk-frames", "2", "--usage"])
    err = capsys.readouterr().err
    assert rc == 0, err
    samples = int(err.split(" samples at ")[0].rsplit("(", 1)[1])
    with wave.open(str(out), "rb") as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        assert wav.getnframes() == samples > 0
        assert samples % SAMPLES_PER_FRAME == 0 and samples <= 12 * SAMPLES_PER_FRAME
        assert len(wav.readframes(wav.getnframes())) == 2 * samples
    assert not list(tmp_path.glob("*.part")), "no partial file is left behind"
    # A failed call writes nothing.
    rc = main(["say", "x" * 2001, "-o", str(tmp_path / "bad.wav"), "--port", str(speech_server.port)])
    assert rc == 1 and "INVALID_ARGUMENT" in capsys.readouterr().err
    assert not (tmp_path / "bad.wav").exists() and not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("flag, value", [("--seed", "-1"), ("--chunk-frames", "-4")])
def test_say_names_the_flag_at_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str,
                                     value: str) -> None:
    """A value the request cannot hold is blamed on its own flag (all were
    reported as --voice-codes errors), before any connection is made."""
    assert main(["say", "hi", "-o", str(tmp_path / "x.wav"), "--port", "1", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "--voice-codes" not in err, err


def test_say_fails_a_speech_aborted_on_the_server(speech_server: ServerHandle, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A stream that ends CANCELLED (Generation/Abort) is no whole speech: the
    command exits 1 and leaves no file (it used to rename the cut file into place)."""
    loop = speech_server.server.speech.loop
    assert loop is not None
    out = tmp_path / "cut.wav"
    result: list[int] = []
    say = threading.Thread(target=lambda: result.append(main(
        ["say", "A long speech to abort.", "-o", str(out), "--port", str(speech_server.port),
         "--max-seconds", "30", "--chunk-frames", "1"])))
    say.start()
    deadline = time.monotonic() + TIMEOUT
    while not loop._streams and time.monotonic() < deadline:  # the call reached the engine
        time.sleep(0.01)
    rid = next(iter(loop._streams))
    aborted = speech_server.stub.Abort(generate_pb2.AbortRequest(request_ids=[rid]))
    assert list(aborted.aborted_request_ids) == [rid]
    say.join(TIMEOUT)
    assert result == [1]
    assert "cancelled" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("seconds, frames", [(0.1, 1), (1.0, 11), (1.024, 12)])
def test_never_more_audio_than_asked(speech_server: ServerHandle, seconds: float, frames: int) -> None:
    # 0.05 s used to give 0.085 s of audio and 1 s 1.024 s: a frame too many.
    chunks, _ = synthesize(speech_server.speech_stub, speech_request(seconds=seconds, seed=11))
    samples = sum(len(c.audio) for c in chunks) // 2  # PCM16
    assert samples <= seconds * 24000
    if chunks[-1].finish_reason == pb.AudioChunk.LENGTH:
        assert samples == frames * SAMPLES_PER_FRAME


def test_an_abort_while_the_text_is_prepared_ends_the_speech(speech_server: ServerHandle,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Before its text is tokenized a Synthesize is unknown to the engine: the
    # Abort found nothing (answered []) and the speech ran in full.
    preparing, release = threading.Event(), threading.Event()
    prepare = speech_module.run_maybe_off_loop

    async def held(*args: Any) -> Any:
        preparing.set()
        await asyncio.to_thread(release.wait, TIMEOUT)
        return await prepare(*args)

    monkeypatch.setattr(speech_module, "run_maybe_off_loop", held)
    rid = "abort-while-prepared"
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(lambda: list(speech_server.speech_stub.Synthesize(
            speech_request(seconds=30.0, request_id=rid), timeout=TIMEOUT)))
        assert preparing.wait(TIMEOUT)
        aborted = speech_server.stub.Abort(generate_pb2.AbortRequest(request_ids=[rid]), timeout=TIMEOUT)
        assert list(aborted.aborted_request_ids) == [rid]
        release.set()
        last = call.result(TIMEOUT)[-1]
    assert last.final and last.finish_reason == Finish.CANCELLED
    assert last.usage.audio_seconds < 30
    assert speech_server.wait_no_pages(speech=True) == (0, 0)
