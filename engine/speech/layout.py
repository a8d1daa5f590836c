"""Where a speech LM keeps its audio tokens (the Orpheus layout).

A 24 kHz SNAC frame is 7 codes across 3 codebooks (1 coarse, 2 middle, 4
fine), written to the token stream in the order c0, c1a, c2a, c2b, c1b, c2c,
c2d. Position k of a frame (0..6) has its own block of `codebook_size` token
ids starting at `audio_token_offset + k * codebook_size`.

Real Orpheus checkpoints use the defaults below. A checkpoint may describe its
own layout in `speech_config.json` (the built-in demo speech model does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CODES_PER_FRAME = 7
SPEECH_CONFIG = "speech_config.json"


@dataclass(frozen=True)
class SpeechLayout:
    """Token ids of a speech LM's markers and audio codes."""

    audio_token_offset: int = 128266
    codebook_size: int = 4096
    start_of_human: int = 128259
    end_of_text: int = 128009
    end_of_human: int = 128260
    start_of_ai: int = 128261
    start_of_speech: int = 128257
    end_of_speech: int = 128258
    end_of_ai: int = 128262

    def __post_init__(self) -> None:
        if self.codebook_size < 1 or self.audio_token_offset < 0:
            raise ValueError("invalid speech layout")

    @property
    def audio_token_end(self) -> int:
        return self.audio_token_offset + CODES_PER_FRAME * self.codebook_size

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError unless the audio tokens and every marker are in the
        vocabulary, and no marker is an audio token."""
        if vocab_size < self.audio_token_end:
            raise ValueError(f"vocabulary of {vocab_size} tokens cannot hold audio tokens up to "
                             f"{self.audio_token_end}")
        for name, token in asdict(self).items():
            if name in ("audio_token_offset", "codebook_size"):
                continue
            if not 0 <= token < vocab_size or self.audio_token_offset <= token < self.audio_token_end:
                raise ValueError(f"marker {name}={token} is not a text token of a {vocab_size}-token vocabulary "
                                 f"(audio tokens are {self.audio_token_offset}..{self.audio_token_end - 1})")

    # -- tokens <-> codes --------------------------------------------------------------
    def token_range(self, position: int) -> tuple[int, int]:
        """[lo, hi) token ids allowed at `position` of the audio stream."""
        lo = self.audio_token_offset + (position % CODES_PER_FRAME) * self.codebook_size
        return lo, lo + self.codebook_size

    def tokens_to_codes(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Audio token ids (a whole number of frames) -> codes [frames, 7]."""
        t = np.asarray(tokens, dtype=np.int64).reshape(-1, CODES_PER_FRAME)
        codes = t - self.audio_token_offset - np.arange(CODES_PER_FRAME) * self.codebook_size
        if (codes < 0).any() or (codes >= self.codebook_size).any():
            raise ValueError("not an audio token stream in this layout")
        return codes

    def codes_to_tokens(self, codes: np.ndarray) -> np.ndarray:
        c = np.asarray(codes, dtype=np.int64).reshape(-1, CODES_PER_FRAME)
        return (c + self.audio_token_offset + np.arange(CODES_PER_FRAME) * self.codebook_size).reshape(-1)

    # -- prompts -------------------------------------------------------------------------
    def prompt(self, text_tokens: Sequence[int], audio_prompt_codes: np.ndarray | None = None,
               transcription_tokens: Sequence[int] | None = None) -> list[int]:
        """The token prompt that makes the model speak `text_tokens`.

        With a voice prompt (codes of reference audio plus its transcription),
        the reference turn comes first so the model continues in that voice.
        """
        out: list[int] = []
        if audio_prompt_codes is not None:
            out += [self.start_of_human, *(transcription_tokens or []), self.end_of_text, self.end_of_human,
                    self.start_of_ai, self.start_of_speech,
                    *self.codes_to_tokens(audio_prompt_codes).tolist(),
                    self.end_of_speech, self.end_of_ai]
        out += [self.start_of_human, *text_tokens, self.end_of_text, self.end_of_human,
                self.start_of_ai, self.start_of_speech]
        return out

    # -- files ---------------------------------------------------------------------------
    def save(self, model_dir: str | Path) -> None:
        (Path(model_dir) / SPEECH_CONFIG).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def for_model(cls, model_dir: str | Path) -> SpeechLayout:
        """The checkpoint's own layout if it has speech_config.json, else Orpheus'."""
        path = Path(model_dir) / SPEECH_CONFIG
        if not path.exists():
            return cls()
        fields = json.loads(path.read_text())
        try:
            return cls(**fields)
        except TypeError as e:  # an unknown or missing key
            raise ValueError(f"{SPEECH_CONFIG}: {e}") from None


def split_codebooks(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [frames, 7] -> the 3 SNAC codebooks [F], [2F], [4F] (Orpheus order)."""
    c = np.asarray(codes, dtype=np.int64).reshape(-1, CODES_PER_FRAME)
    c0 = c[:, 0]
    c1 = c[:, [1, 4]].reshape(-1)
    c2 = c[:, [2, 3, 5, 6]].reshape(-1)
    return c0, c1, c2
