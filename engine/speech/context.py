"""TTSContext: a text context whose output is speech tokens, decoded in chunks."""

from __future__ import annotations

import numpy as np

from engine.context import TextContext
from engine.sampling_params import SamplingParams

from .codec import DecodeWindow
from .layout import CODES_PER_FRAME, SpeechLayout

# Orpheus' recommended sampling, used when a speech request sets none.
DEFAULT_SPEECH_SAMPLING = SamplingParams(temperature=0.6, top_p=0.95, repetition_penalty=1.1)


class TTSContext(TextContext):
    """A speech request (MAX's TTSContext).

    Generated tokens are audio codes, 7 per frame. `decoded_frames` frames have
    been turned into audio and sent. The sampler keeps every position inside
    its codebook's token block, and allows end-of-speech only between frames.
    """

    def __init__(self, *args, layout: SpeechLayout, chunk_frames: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        if chunk_frames < 1:
            raise ValueError("chunk_frames must be >= 1")
        self.layout = layout
        self.chunk_frames = chunk_frames
        self.decoded_frames = 0
        self.audio_samples = 0

    @property
    def produces_text(self) -> bool:
        return False

    # -- sampling rule ---------------------------------------------------------------------
    def allowed_token_range(self) -> tuple[int, int, int | None]:
        """(lo, hi, extra): the next token must be in [lo, hi) or equal `extra`."""
        position = self.end_idx - self.prompt_len
        lo, hi = self.layout.token_range(position)
        at_frame_boundary = position % CODES_PER_FRAME == 0
        return lo, hi, self.layout.end_of_speech if at_frame_boundary else None

    # -- speech tokens -----------------------------------------------------------------------
    def speech_codes(self) -> np.ndarray:
        """Codes [frames, 7] of every complete, known frame."""
        final = self.tokens[self.prompt_len:self.num_final_tokens]
        final = final[final != self.layout.end_of_speech]
        frames = len(final) // CODES_PER_FRAME
        return self.layout.tokens_to_codes(final[: frames * CODES_PER_FRAME])

    def next_speech_tokens(self, audio_chunk_size: int | None = None, buffer: int = 3,
                           lookahead: int = 3) -> DecodeWindow | None:
        """The next window of frames to decode, or None if it is not ready yet.

        It covers up to `audio_chunk_size` new frames (the context's own chunk
        size by default) plus `buffer` already-decoded frames before them and
        `lookahead` frames after them. Once generation has ended, whatever is
        left is decoded without waiting for look-ahead.
        """
        chunk = audio_chunk_size or self.chunk_frames
        codes = self.speech_codes()
        available = len(codes)
        start = self.decoded_frames
        if self.is_done:
            end = min(available, start + chunk)
        elif available >= start + chunk + lookahead:
            end = start + chunk
        else:
            return None
        if end <= start:
            return None
        first = max(0, start - buffer)
        last = min(available, end + lookahead)
        return DecodeWindow(codes[first:last], first, start, end)
