"""Synthesize conversion without a server: audio encoding, chunks and codes,
voice-prompt and sampling validation."""

from __future__ import annotations

import numpy as np
import pytest

from engine import GenerationStatus, RequestOutput
from engine.presets import PRESETS
from engine.speech import SpeechLayout
from service.api.speech_convert import (
    SPEECH_SAMPLING_DEFAULTS,
    ChunkWriter,
    audio_format,
    check_voice_prompt,
    encode_audio,
    speech_sampling_params,
)
from service.errors import ServiceError
from service.gen.stencil.v1 import speech_pb2 as pb

LAYOUT = SpeechLayout(**PRESETS["demo-speech"].speech_layout)  # type: ignore[arg-type]
Finish = pb.AudioChunk.FinishReason


def test_pcm16_is_clipped_scaled_and_little_endian() -> None:
    x = np.array([-2.0, -1.0, -0.25, 0.0, 0.25, 1.0, 3.0, 1 / 32767], dtype=np.float32)
    raw = encode_audio(x, pb.AUDIO_FORMAT_PCM16)
    assert len(raw) == 2 * len(x)
    got = np.frombuffer(raw, dtype="<i2")
    assert got.tolist() == [-32767, -32767, -8192, 0, 8192, 32767, 32767, 1]
    assert raw[-2:] == b"\x01\x00", "little-endian"


def test_float32_is_kept_as_decoded() -> None:
    x = np.array([-1.5, 0.1, 2.0], dtype=np.float32)
    raw = encode_audio(x, pb.AUDIO_FORMAT_FLOAT32)
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), x), "not clipped, bit-exact"


def test_format_defaults_to_pcm16_and_rejects_unknown_values() -> None:
    assert audio_format(pb.SynthesizeRequest()) == pb.AUDIO_FORMAT_PCM16
    assert audio_format(pb.SynthesizeRequest(format=pb.AUDIO_FORMAT_FLOAT32)) == pb.AUDIO_FORMAT_FLOAT32
    with pytest.raises(ServiceError) as err:
        audio_format(pb.SynthesizeRequest(format=9))  # type: ignore[arg-type]
    assert [f for f, _ in err.value.violations] == ["format"]


def _tokens(codes: list[int], start: int = 0) -> list[int]:
    """Audio tokens for `codes` written from stream position `start`."""
    return [LAYOUT.token_range(start + i)[0] + c for i, c in enumerate(codes)]


def test_chunks_carry_audio_as_it_comes_and_codes_in_whole_frames() -> None:
    writer = ChunkWriter("r1", pb.AUDIO_FORMAT_FLOAT32, 24000, LAYOUT, return_audio_tokens=True)
    codes = list(range(100, 121))  # three frames
    audio = np.linspace(-1, 1, 2048 * 3, dtype=np.float32)
    outs = [
        RequestOutput("r1", token_ids=_tokens(codes[:5])),                   # no audio: no chunk
        RequestOutput("r1", token_ids=_tokens(codes[5:16], 5), audio=audio[:2048]),
        RequestOutput("r1", token_ids=_tokens(codes[16:], 16) + [LAYOUT.end_of_speech],
                      audio=audio[2048:], finished=True, status=GenerationStatus.STOP_TOKEN,
                      prompt_tokens=9),
    ]
    chunks = writer.add(outs[:1]) + writer.add(outs[1:])
    assert [c.index for c in chunks] == [0, 1]
    assert list(chunks[0].audio_tokens) == codes[:14], "two whole frames of the 16 codes so far"
    assert list(chunks[1].audio_tokens) == codes[14:]
    assert np.array_equal(np.frombuffer(b"".join(c.audio for c in chunks), "<f4"), audio)
    assert not chunks[0].final and chunks[1].final
    assert chunks[1].finish_reason == Finish.END_OF_SPEECH
    usage = chunks[1].usage
    assert (usage.prompt_tokens, usage.speech_tokens, usage.audio_samples) == (9, 21, 3 * 2048)
    assert usage.audio_seconds == pytest.approx(3 * 2048 / 24000)


def test_a_cancelled_stream_ends_with_an_empty_final_chunk() -> None:
    writer = ChunkWriter("r2", pb.AUDIO_FORMAT_PCM16, 24000, LAYOUT, return_audio_tokens=False)
    chunks = writer.add([RequestOutput("r2", token_ids=_tokens([1, 2, 3])),
                         RequestOutput("r2", finished=True, status=GenerationStatus.CANCELLED)])
    assert len(chunks) == 1 and chunks[0].final and chunks[0].audio == b""
    assert chunks[0].finish_reason == Finish.CANCELLED and not chunks[0].audio_tokens
    assert chunks[0].usage.speech_tokens == 3 and chunks[0].usage.audio_samples == 0


@pytest.mark.parametrize("codes, transcription, field", [
    ([1, 2, 3], "", "audio_prompt_tokens"),
    ([0] * 7 + [5, 4096] + [0] * 5, "", "audio_prompt_tokens[8]"),
    ([], "words without audio", "audio_prompt_transcription"),
    ([0] * 7, "x" * 2001, "audio_prompt_transcription"),
])
def test_bad_voice_prompts_name_the_field(codes: list[int], transcription: str, field: str) -> None:
    req = pb.SynthesizeRequest(input="hi", audio_prompt_tokens=codes,
                               audio_prompt_transcription=transcription)
    with pytest.raises(ServiceError) as err:
        check_voice_prompt(req, LAYOUT)
    assert [f for f, _ in err.value.violations] == [field]


def test_good_voice_prompt() -> None:
    req = pb.SynthesizeRequest(input="hi", audio_prompt_tokens=[4095] * 14, audio_prompt_transcription="ok")
    assert check_voice_prompt(req, LAYOUT) == [4095] * 14
    assert check_voice_prompt(pb.SynthesizeRequest(input="hi"), LAYOUT) is None


def test_sampling_takes_the_speech_defaults_per_field() -> None:
    params = speech_sampling_params(pb.SynthesizeRequest())
    assert {k: getattr(params, k) for k in SPEECH_SAMPLING_DEFAULTS} == SPEECH_SAMPLING_DEFAULTS
    req = pb.SynthesizeRequest()
    req.sampling.temperature = 0.0  # explicit zero: greedy, not the default
    req.sampling.seed = 7
    params = speech_sampling_params(req)
    assert (params.temperature, params.top_p, params.seed) == (0.0, 0.95, 7)
    req.sampling.top_p = 1.5
    with pytest.raises(ServiceError) as err:
        speech_sampling_params(req)
    assert [f for f, _ in err.value.violations] == ["sampling.top_p"]


def test_a_voice_prompt_longer_than_the_context_is_refused_before_it_is_copied() -> None:
    req = pb.SynthesizeRequest(input="hi", audio_prompt_tokens=[1] * 70)
    assert check_voice_prompt(req, LAYOUT, context=70) == [1] * 70
    with pytest.raises(ServiceError) as err:
        check_voice_prompt(req, LAYOUT, context=69)
    assert [f for f, _ in err.value.violations] == ["audio_prompt_tokens"]
