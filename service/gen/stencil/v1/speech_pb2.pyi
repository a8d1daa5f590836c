from service.gen.stencil.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_FORMAT_UNSPECIFIED: _ClassVar[AudioFormat]
    AUDIO_FORMAT_PCM16: _ClassVar[AudioFormat]
    AUDIO_FORMAT_FLOAT32: _ClassVar[AudioFormat]
AUDIO_FORMAT_UNSPECIFIED: AudioFormat
AUDIO_FORMAT_PCM16: AudioFormat
AUDIO_FORMAT_FLOAT32: AudioFormat

class SynthesizeRequest(_message.Message):
    __slots__ = ("request_id", "input", "audio_prompt_tokens", "audio_prompt_transcription", "sampling", "format", "chunk_frames", "max_audio_seconds", "return_audio_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PROMPT_TRANSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input: str
    audio_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    audio_prompt_transcription: str
    sampling: _generate_pb2.SamplingOptions
    format: AudioFormat
    chunk_frames: int
    max_audio_seconds: float
    return_audio_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., input: _Optional[str] = ..., audio_prompt_tokens: _Optional[_Iterable[int]] = ..., audio_prompt_transcription: _Optional[str] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingOptions, _Mapping]] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., chunk_frames: _Optional[int] = ..., max_audio_seconds: _Optional[float] = ..., return_audio_tokens: _Optional[bool] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("request_id", "index", "audio", "sample_rate", "channels", "format", "audio_tokens", "final", "finish_reason", "usage")
    class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FINISH_REASON_UNSPECIFIED: _ClassVar[AudioChunk.FinishReason]
        END_OF_SPEECH: _ClassVar[AudioChunk.FinishReason]
        LENGTH: _ClassVar[AudioChunk.FinishReason]
        CANCELLED: _ClassVar[AudioChunk.FinishReason]
    FINISH_REASON_UNSPECIFIED: AudioChunk.FinishReason
    END_OF_SPEECH: AudioChunk.FinishReason
    LENGTH: AudioChunk.FinishReason
    CANCELLED: AudioChunk.FinishReason
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    audio: bytes
    sample_rate: int
    channels: int
    format: AudioFormat
    audio_tokens: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    finish_reason: AudioChunk.FinishReason
    usage: SpeechUsage
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., audio: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., audio_tokens: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ..., finish_reason: _Optional[_Union[AudioChunk.FinishReason, str]] = ..., usage: _Optional[_Union[SpeechUsage, _Mapping]] = ...) -> None: ...

class SpeechUsage(_message.Message):
    __slots__ = ("prompt_tokens", "speech_tokens", "audio_seconds", "audio_samples")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEECH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    speech_tokens: int
    audio_seconds: float
    audio_samples: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., speech_tokens: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., audio_samples: _Optional[int] = ...) -> None: ...
