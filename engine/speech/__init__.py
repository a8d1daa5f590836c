"""Text to speech on the engine: Orpheus-layout speech LMs and the SNAC decoder."""

from .codec import DecodeWindow, SpeechCodec, write_random_codec
from .context import DEFAULT_SPEECH_SAMPLING, TTSContext
from .generator import AudioGenerationOutput, AudioGenerator
from .layout import CODES_PER_FRAME, SpeechLayout
from .request import MAX_SPEECH_CHARS, SpeechModel, SpeechRequest, SpeechUnavailable, speech_context

__all__ = [
    "CODES_PER_FRAME",
    "MAX_SPEECH_CHARS",
    "SpeechModel",
    "SpeechRequest",
    "SpeechUnavailable",
    "speech_context",
    "DEFAULT_SPEECH_SAMPLING",
    "AudioGenerationOutput",
    "AudioGenerator",
    "DecodeWindow",
    "SpeechCodec",
    "SpeechLayout",
    "TTSContext",
    "write_random_codec",
]
