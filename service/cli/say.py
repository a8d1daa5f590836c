"""`stencild say`: speak text with a running server into a WAV file.

Asks for 16-bit PCM and writes each chunk to the file as it arrives (the
header is patched as the file grows). Only grpc and the generated stubs are
imported (no torch, no numpy), so it starts quickly.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import wave
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from service.cli.connect import add_connection_args, call_metadata, open_channel
from service.cli.flags import BadFlag, refuse, set_flags

PCM16_BYTES = 2


def add_say(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("say", help="speak text with a running server into a WAV file",
                       description="Send text to a running stencild (stencil.v1.Speech/Synthesize) "
                                   "and write the streamed audio as a 16-bit mono WAV file.")
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", type=Path, required=True, help="the WAV file to write ('-': stdout)")
    add_connection_args(p)
    p.add_argument("--max-seconds", type=float, default=None, help="longest audio (server default: 30)")
    p.add_argument("--chunk-frames", type=int, default=None, help="frames per streamed chunk (1-64)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--voice-codes", type=Path, default=None, metavar="FILE",
                   help="voice prompt: SNAC codes of reference audio (a JSON list, 7 per frame, "
                        "Orpheus order)")
    p.add_argument("--voice-text", default="", help="what the voice prompt says")
    p.add_argument("--usage", action="store_true",
                   help="print the finish reason, speech tokens and audio length to stderr")


def _request(args: argparse.Namespace, pb: Any) -> Any:
    """The SynthesizeRequest of `args`; BadFlag names the flag at fault."""
    req = pb.SynthesizeRequest(input=args.text, format=pb.AUDIO_FORMAT_PCM16,
                               audio_prompt_transcription=args.voice_text)
    if args.voice_codes is not None:
        try:
            req.audio_prompt_tokens.extend(int(c) for c in json.loads(args.voice_codes.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise BadFlag("--voice-codes", err) from None
    set_flags(args, [("--max-seconds", req, "max_audio_seconds"), ("--chunk-frames", req, "chunk_frames"),
              ("--temperature", req.sampling, "temperature"), ("--top-p", req.sampling, "top_p"),
              ("--repetition-penalty", req.sampling, "repetition_penalty"), ("--seed", req.sampling, "seed")])
    return req


def _write_wav(chunks: Iterable[Any], out: BinaryIO) -> Any:
    """Write the stream's chunks to `out` as a WAV file, each as it arrives; return
    the final chunk (None if the stream ended without one)."""
    final = None
    wav: wave.Wave_write | None = None
    try:
        for chunk in chunks:
            if wav is None:
                wav = wave.open(out, "wb")  # noqa: SIM115 - closed below, after the last chunk
                wav.setnchannels(chunk.channels)
                wav.setsampwidth(PCM16_BYTES)
                wav.setframerate(chunk.sample_rate)
            wav.writeframes(chunk.audio)
            if chunk.final:
                final = chunk
    finally:
        if wav is not None:
            wav.close()  # patches the header with the final length
    return final


def _check_output(output: Path) -> None:
    """Refuse, before the server speaks, an output that cannot be written
    (a folder that does not exist, a folder itself): the audio was made, then
    lost to a traceback."""
    if str(output) == "-":
        return
    if output.is_dir():
        raise BadFlag("--output", ValueError(f"{output} is a folder; give a file name"))
    if not output.parent.is_dir():
        raise BadFlag("--output", ValueError(f"no folder {output.parent}"))


def cmd_say(args: argparse.Namespace) -> int:
    import grpc

    from service.gen.stencil.v1 import speech_pb2 as pb
    from service.gen.stencil.v1 import speech_pb2_grpc as pb_grpc

    try:
        req = _request(args, pb)
        metadata = call_metadata(args)
        _check_output(args.output)
    except BadFlag as err:
        return refuse(err)
    # A file is written under a temporary name and renamed once complete; stdout
    # cannot seek back to patch the header, so its file is built in memory.
    part = None if str(args.output) == "-" else Path(f"{args.output}.part")
    try:
        with open_channel(args) as channel:
            call = pb_grpc.SpeechStub(channel).Synthesize(req, timeout=args.timeout, metadata=metadata)
            if part is None:
                buffer = io.BytesIO()
                final = _write_wav(call, buffer)
                sys.stdout.buffer.write(buffer.getvalue())
                sys.stdout.flush()
            else:
                with open(part, "wb") as out:
                    final = _write_wav(call, out)
                if final is not None and final.finish_reason != pb.AudioChunk.CANCELLED:
                    os.replace(part, args.output)
    except KeyboardInterrupt:  # leaving the channel cancels the call
        return 130
    except grpc.RpcError as err:
        print(f"stencild: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except OSError as err:  # the file could not be written after all (full disk, permissions)
        print(f"stencild: cannot write {args.output}: {err}", file=sys.stderr)
        return 1
    finally:
        if part is not None and part.exists():
            part.unlink()
    if final is None:
        print("stencild: the stream ended without its final chunk", file=sys.stderr)
        return 1
    if final.finish_reason == pb.AudioChunk.CANCELLED:  # aborted on the server (Generation/Abort)
        print("stencild: the speech was cancelled before its end", file=sys.stderr)
        return 1
    if args.usage:
        reason = pb.AudioChunk.FinishReason.Name(final.finish_reason)
        u = final.usage
        print(f"[{reason}] {u.speech_tokens} speech tokens, {u.audio_seconds:.3f} s of audio "
              f"({u.audio_samples} samples at {final.sample_rate} Hz) -> {args.output}", file=sys.stderr)
    return 0
