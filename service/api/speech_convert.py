"""Proto <-> engine for Synthesize: validate a request, build its speech context,
encode audio, and turn the engine's per-step outputs into AudioChunk messages.

Validation errors name the offending field as google.rpc.BadRequest does
(`input`, `chunk_frames`, `audio_prompt_tokens[3]`, `sampling.top_p`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine import EngineCore, GenerationStatus, InvalidRequest, RequestOutput, SamplingParams
from engine.speech import (
    CODES_PER_FRAME,
    DEFAULT_SPEECH_SAMPLING,
    MAX_SPEECH_CHARS,
    SpeechLayout,
    TTSContext,
)
from service.api.convert import FIELD_PATHS, invalid_request, sampling_kwargs
from service.errors import invalid_argument
from service.gen.stencil.v1 import speech_pb2 as pb

# Unset sampling fields take the engine's speech defaults (Orpheus' values),
# filled in per field, so a request that only sets a seed still samples like
# Orpheus.
SPEECH_SAMPLING_DEFAULTS: dict[str, float] = {
    name: getattr(DEFAULT_SPEECH_SAMPLING, name) for name in ("temperature", "top_p", "repetition_penalty")
}
DEFAULT_CHUNK_FRAMES = 4
DEFAULT_MAX_AUDIO_SECONDS = 30.0
PCM16_SCALE = 32767.0
CHANNELS = 1

Format = pb.AudioFormat
Finish = pb.AudioChunk.FinishReason
FINISH_REASONS: dict[GenerationStatus, pb.AudioChunk.FinishReason] = {
    GenerationStatus.STOP_TOKEN: Finish.END_OF_SPEECH,  # the end-of-speech marker
    GenerationStatus.MAXIMUM_LENGTH: Finish.LENGTH,
    GenerationStatus.CONTEXT_LENGTH: Finish.LENGTH,
    GenerationStatus.CANCELLED: Finish.CANCELLED,
}


@dataclass(frozen=True)
class PreparedSpeech:
    """A validated Synthesize request and its engine context."""

    context: TTSContext
    format: pb.AudioFormat  # PCM16 or FLOAT32
    return_audio_tokens: bool

    @property
    def request_id(self) -> str:
        return self.context.request_id


# -- requests -----------------------------------------------------------------
def speech_sampling_params(req: pb.SynthesizeRequest) -> SamplingParams:
    """SamplingParams from `sampling`; unset fields take the speech defaults."""
    kwargs = {**SPEECH_SAMPLING_DEFAULTS, **sampling_kwargs(req.sampling)}
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except InvalidRequest as err:
        raise invalid_argument(FIELD_PATHS.get(err.field, err.field), err.description) from None


def check_voice_prompt(req: pb.SynthesizeRequest, layout: SpeechLayout, context: int | None = None
                       ) -> list[int] | None:
    """The voice prompt's codes, validated (index of the first bad code named);
    more codes than a `context` of that many tokens holds are refused before
    they are copied (millions held the GIL, and the event loop, ~0.2 s)."""
    if context is not None and len(req.audio_prompt_tokens) > context:
        raise invalid_argument("audio_prompt_tokens", f"{len(req.audio_prompt_tokens)} codes; the context "
                                                      f"holds {context} tokens, a code each")
    codes = list(req.audio_prompt_tokens)
    if not codes:
        if req.audio_prompt_transcription:
            raise invalid_argument("audio_prompt_transcription",
                                   "a transcription needs audio_prompt_tokens (the audio it transcribes)")
        return None
    if len(codes) % CODES_PER_FRAME:
        raise invalid_argument("audio_prompt_tokens", f"{len(codes)} codes are not whole frames of "
                                                      f"{CODES_PER_FRAME}")
    bad = np.flatnonzero(np.asarray(codes, dtype=np.int64) >= layout.codebook_size)
    if bad.size:
        i = int(bad[0])
        raise invalid_argument(f"audio_prompt_tokens[{i}]", f"code {codes[i]} is outside the "
                                                            f"codebook [0, {layout.codebook_size})")
    if len(req.audio_prompt_transcription) > MAX_SPEECH_CHARS:
        raise invalid_argument("audio_prompt_transcription", f"at most {MAX_SPEECH_CHARS} characters")
    return codes


def audio_format(req: pb.SynthesizeRequest) -> pb.AudioFormat:
    fmt = req.format
    if fmt == Format.AUDIO_FORMAT_UNSPECIFIED:
        return Format.AUDIO_FORMAT_PCM16
    if fmt not in (Format.AUDIO_FORMAT_PCM16, Format.AUDIO_FORMAT_FLOAT32):
        raise invalid_argument("format", f"unknown audio format {fmt}; use PCM16 or FLOAT32")
    return fmt


def prepare_synthesize(req: pb.SynthesizeRequest, engine: EngineCore, request_id: str) -> PreparedSpeech:
    """Validate a Synthesize request and build its TTSContext (no engine state is touched).

    `engine` must serve speech (`engine.serves_speech`).
    """
    assert engine.speech_layout is not None
    fmt = audio_format(req)
    params = speech_sampling_params(req)
    codes = check_voice_prompt(req, engine.speech_layout, engine.max_model_len)
    chunk_frames = req.chunk_frames if req.HasField("chunk_frames") else DEFAULT_CHUNK_FRAMES
    seconds = req.max_audio_seconds if req.HasField("max_audio_seconds") else DEFAULT_MAX_AUDIO_SECONDS
    try:
        ctx = engine.requests.make_speech_context(req.input, params, request_id, chunk_frames=chunk_frames,
                                         max_audio_seconds=seconds, audio_prompt_codes=codes,
                                         audio_prompt_transcription=req.audio_prompt_transcription)
    except InvalidRequest as err:
        raise invalid_request(err) from None
    return PreparedSpeech(ctx, fmt, req.return_audio_tokens)


# -- responses ----------------------------------------------------------------
def encode_audio(samples: np.ndarray, fmt: pb.AudioFormat) -> bytes:
    """Mono float samples as little-endian PCM16 (clipped to [-1, 1]) or float32 bytes."""
    x = np.asarray(samples, dtype=np.float32)
    if fmt == Format.AUDIO_FORMAT_FLOAT32:
        return x.astype("<f4", copy=False).tobytes()
    return np.rint(np.clip(x, -1.0, 1.0) * PCM16_SCALE).astype("<i2").tobytes()


class ChunkWriter:
    """Builds one stream's AudioChunk messages from the engine's outputs.

    One chunk per output that carries audio, sent as it arrives; the final
    output always makes a chunk (with whatever audio it brought). Speech tokens
    are turned into codes and sent in whole frames only.
    """

    def __init__(self, request_id: str, fmt: pb.AudioFormat, sample_rate: int, layout: SpeechLayout,
                 return_audio_tokens: bool):
        self.request_id = request_id
        self.format = fmt
        self.sample_rate = sample_rate
        self.layout = layout
        self.return_audio_tokens = return_audio_tokens
        self.index = 0
        self.samples = 0
        self._tokens: list[int] = []  # audio-code tokens so far (end-of-speech left out)
        self._codes_sent = 0  # tokens already sent as codes (a multiple of 7)

    @property
    def speech_tokens(self) -> int:
        return len(self._tokens)

    def _new_codes(self) -> list[int]:
        whole = len(self._tokens) // CODES_PER_FRAME * CODES_PER_FRAME
        if whole == self._codes_sent:
            return []
        codes = self.layout.tokens_to_codes(self._tokens[self._codes_sent:whole])
        self._codes_sent = whole
        return codes.reshape(-1).tolist()

    def add(self, outputs: Sequence[RequestOutput]) -> list[pb.AudioChunk]:
        """The chunks for these outputs (in order); the last is final if the request ended."""
        chunks = []
        eos = self.layout.end_of_speech
        for out in outputs:
            self._tokens += [t for t in out.token_ids if t != eos]
            has_audio = out.audio is not None and len(out.audio) > 0
            if not (has_audio or out.finished):
                continue
            chunk = pb.AudioChunk(request_id=self.request_id, index=self.index,
                                  sample_rate=self.sample_rate, channels=CHANNELS, format=self.format)
            if has_audio:
                assert out.audio is not None
                chunk.audio = encode_audio(out.audio, self.format)
                self.samples += len(out.audio)
            if self.return_audio_tokens:
                chunk.audio_tokens.extend(self._new_codes())
            if out.finished:
                chunk.final = True
                chunk.finish_reason = FINISH_REASONS.get(out.status, Finish.FINISH_REASON_UNSPECIFIED)
                chunk.usage.CopyFrom(pb.SpeechUsage(
                    prompt_tokens=out.prompt_tokens, speech_tokens=self.speech_tokens,
                    audio_seconds=self.samples / self.sample_rate, audio_samples=self.samples))
            self.index += 1
            chunks.append(chunk)
        return chunks
