"""Checking a speech request and building its `TTSContext`."""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidRequest
from engine.requests import check_params_token_ids
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

from .context import DEFAULT_SPEECH_SAMPLING, TTSContext
from .generator import AudioGenerator
from .layout import CODES_PER_FRAME, SpeechLayout

MAX_SPEECH_CHARS = 2000


class SpeechUnavailable(RuntimeError):
    """A speech request reached an engine without a speech model and codec."""


@dataclass(frozen=True)
class SpeechModel:
    """What an engine speaks with: the speech LM's token layout and the audio decoder."""

    layout: SpeechLayout
    audio: AudioGenerator


@dataclass(frozen=True)
class SpeechRequest:
    """A Synthesize request as the engine takes it."""

    text: str
    params: SamplingParams | None = None
    request_id: str | None = None
    chunk_frames: int = 4
    max_audio_seconds: float = 30.0
    audio_prompt_codes: Sequence[int] | np.ndarray | None = None  # [F * 7] or [F, 7]
    audio_prompt_transcription: str = ""


def speech_context(req: SpeechRequest, speech: SpeechModel, tokenizer: Tokenizer, vocab_size: int,
                   max_model_len: int, eos_token_ids: frozenset[int]) -> TTSContext:
    """Check a speech request and build its context; InvalidRequest names the field.

    Audio prompt codes (voice cloning) are SNAC codes, 7 per frame in the
    Orpheus order, each in [0, codebook_size). Default sampling follows
    Orpheus: temperature 0.6, top_p 0.95, repetition_penalty 1.1.
    """
    layout, audio = speech.layout, speech.audio
    text = req.text
    if not text.strip():
        raise InvalidRequest("input", "the text to speak is empty")
    if len(text) > MAX_SPEECH_CHARS:
        raise InvalidRequest("input", f"at most {MAX_SPEECH_CHARS} characters, got {len(text)}")
    if not 1 <= req.chunk_frames <= 64:
        raise InvalidRequest("chunk_frames", "must be in [1, 64]")
    if not 0 < req.max_audio_seconds <= 300:
        raise InvalidRequest("max_audio_seconds", "must be in (0, 300]")
    codes = None
    if req.audio_prompt_codes is not None and len(req.audio_prompt_codes):  # a list or an array
        codes = np.asarray(req.audio_prompt_codes, dtype=np.int64)
        if codes.size % CODES_PER_FRAME or (codes < 0).any() or (codes >= layout.codebook_size).any():
            raise InvalidRequest("audio_prompt_tokens", f"need whole frames of {CODES_PER_FRAME} codes in "
                                                        f"[0, {layout.codebook_size})")
    # Orpheus tokenizes the text with its special tokens (BOS after
    # start-of-human); tokenizers that add none are unaffected.
    text_tokens = tokenizer.encode(text)
    transcription = tokenizer.encode(req.audio_prompt_transcription, add_special_tokens=False)
    prompt = layout.prompt(text_tokens, codes, transcription)
    # Audio comes in whole frames; never more than asked: round down.
    frames = math.floor(req.max_audio_seconds * audio.decoder_sample_rate / audio.samples_per_frame)
    if frames < 1:
        frame_s = audio.samples_per_frame / audio.decoder_sample_rate
        raise InvalidRequest("max_audio_seconds", f"shorter than one frame of audio ({frame_s:.3f} s)")
    base = req.params or DEFAULT_SPEECH_SAMPLING
    check_params_token_ids(base, vocab_size)
    # max_new_tokens (offline API) bounds the audio further; it never lifts max_audio_seconds.
    wanted = frames * CODES_PER_FRAME
    if base.max_new_tokens is not None:
        if base.max_new_tokens < CODES_PER_FRAME:
            raise InvalidRequest("max_new_tokens", f"a frame of audio is {CODES_PER_FRAME} tokens")
        wanted = min(wanted, base.max_new_tokens // CODES_PER_FRAME * CODES_PER_FRAME)
    room = (max_model_len - len(prompt)) // CODES_PER_FRAME * CODES_PER_FRAME
    if room < CODES_PER_FRAME:
        raise InvalidRequest(_too_long(layout, text_tokens, codes, max_model_len),
                             "the prompt is too long for the speech model's context")
    params = dataclasses.replace(base, max_new_tokens=min(wanted, room),
                                 stop_token_ids=(*base.stop_token_ids, layout.end_of_speech),
                                 ignore_eos=True, logprobs=None, prompt_logprobs=None)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    assert params.max_new_tokens is not None
    kwargs = {"request_id": req.request_id} if req.request_id else {}
    return TTSContext(tokens=np.asarray(prompt), max_length=len(prompt) + params.max_new_tokens,
                      sampling_params=params, eos_token_ids=eos_token_ids, seed=seed,
                      layout=layout, chunk_frames=req.chunk_frames, **kwargs)


def _too_long(layout: SpeechLayout, text_tokens: list[int], codes: np.ndarray | None, max_model_len: int) -> str:
    """The field to name for a prompt with no room for a frame of audio: the
    text when it alone leaves none, else the part of the voice prompt that
    does (its codes, or its transcription when the codes alone fit)."""
    def fits(prompt: list[int]) -> bool:
        return len(prompt) + CODES_PER_FRAME <= max_model_len

    if codes is None or not fits(layout.prompt(text_tokens)):
        return "input"
    return "audio_prompt_transcription" if fits(layout.prompt(text_tokens, codes)) else "audio_prompt_tokens"
