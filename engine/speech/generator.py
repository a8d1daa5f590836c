"""AudioGenerator: speech tokens to audio chunks, batched across requests (MAX's name).

Token generation for speech requests is the engine's ordinary job: they are
scheduled, batched and preempted with text requests on the same KV cache.
This stage turns each request's new frames into audio once a chunk (plus its
look-ahead) is ready, decoding all ready requests together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .codec import SpeechCodec
from .context import TTSContext


@dataclass
class AudioGenerationOutput:
    """One decoded chunk of one request."""

    request_id: str
    audio: np.ndarray  # float32 mono samples
    final: bool


class AudioGenerator:
    """Decodes ready speech chunks with the codec."""

    def __init__(self, codec: SpeechCodec):
        self.codec = codec

    @property
    def decoder_sample_rate(self) -> int:
        return self.codec.sample_rate

    @property
    def samples_per_frame(self) -> int:
        return self.codec.samples_per_frame

    def ready(self, contexts: Sequence[TTSContext]) -> list[TTSContext]:
        """The contexts of `contexts` with a chunk ready to decode: host data only,
        so a caller can skip the device when there is none (most steps)."""
        return [ctx for ctx in contexts
                if ctx.next_speech_tokens(None, self.codec.lookback, self.codec.lookahead) is not None]

    def next_chunk(self, batch: Mapping[str, TTSContext] | Sequence[TTSContext]) -> dict[str, AudioGenerationOutput]:
        """Decode the next ready chunk of every context in `batch` (each its
        own chunk size). Call repeatedly until nothing is returned to drain
        finished requests.
        """
        contexts = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        ready = []
        for ctx in contexts:
            window = ctx.next_speech_tokens(None, self.codec.lookback, self.codec.lookahead)
            if window is not None:
                ready.append((ctx, window))
        if not ready:
            return {}
        audio = self.codec.decode([w for _, w in ready])
        out = {}
        for (ctx, window), samples in zip(ready, audio, strict=True):
            ctx.decoded_frames = window.keep_end
            ctx.audio_samples += len(samples)
            final = ctx.is_done and ctx.decoded_frames >= len(ctx.speech_codes())
            out[ctx.request_id] = AudioGenerationOutput(ctx.request_id, samples, final)
        return out

    def drain(self, contexts: Sequence[TTSContext]) -> dict[str, np.ndarray]:
        """Decode everything ready (all of it, for finished contexts), concatenated per request.

        All or nothing: if a decode fails part way, every context is put back
        where it was, so a retry decodes its frames again (none is skipped)."""
        start = [(ctx, ctx.decoded_frames, ctx.audio_samples) for ctx in contexts]
        pieces: dict[str, list[np.ndarray]] = {}
        try:
            while True:
                got = self.next_chunk(contexts)
                if not got:
                    break
                for rid, chunk in got.items():
                    pieces.setdefault(rid, []).append(chunk.audio)
        except BaseException:
            for ctx, frames, samples in start:
                ctx.decoded_frames, ctx.audio_samples = frames, samples
            raise
        return {rid: np.concatenate(p) for rid, p in pieces.items()}
