"""Text to speech: time to first audio and real-time factor, concurrency 1 and 8.

By default through gRPC: starts `stencild serve` (the demo text model beside
the built-in speech pair, demo-speech LM + demo-codec, the SNAC 24 kHz
architecture with random weights; no embedding model) and sends C concurrent
Synthesize calls (PCM16) per level. `--offline` runs the same workload on the
offline engine instead (no server, no gRPC). Every request asks for --seconds
of audio (the random model never stops early). Time to first audio is from
sending the request to the first chunk with audio; RTF is the time from sending
to the last chunk divided by the audio's duration (< 1 is faster than real
time); audio seconds per second is all audio over the level's wall time.

    .venv/bin/python bench/speech.py                       # gRPC, starts its own server
    .venv/bin/python bench/speech.py --offline             # the offline engine
    .venv/bin/python bench/speech.py --address 127.0.0.1:50051 --concurrency 1 8 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench._server import ServerProcess  # noqa: E402

TEXT = "Benchmark sentence number {i}, spoken aloud."


def summary(first: list[float], last: list[float], seconds: list[float], wall: float) -> dict[str, float]:
    rtf = [t / s for t, s in zip(last, seconds, strict=True)]
    return {"ttfa_p50": float(np.median(first)), "ttfa_max": max(first), "rtf_p50": float(np.median(rtf)),
            "audio_s_per_s": sum(seconds) / wall}


# -- gRPC path ------------------------------------------------------------------
async def _speak(stub, i: int, args: argparse.Namespace) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    from service.gen.stencil.v1 import speech_pb2 as pb

    req = pb.SynthesizeRequest(input=TEXT.format(i=i), format=pb.AUDIO_FORMAT_PCM16,
                               chunk_frames=args.chunk_frames, max_audio_seconds=args.seconds)
    req.sampling.seed = i
    start = time.perf_counter()
    first = last = None
    seconds = 0.0
    async for chunk in stub.Synthesize(req):
        now = time.perf_counter() - start
        if chunk.audio and first is None:
            first = now
        last = now
        if chunk.final:
            seconds = chunk.usage.audio_seconds
    assert first is not None and last is not None and seconds > 0
    return first, last, seconds


async def run_grpc(address: str, concurrency: int, args: argparse.Namespace) -> dict[str, float]:
    import grpc

    from service.gen.stencil.v1 import speech_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpeechStub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(*(_speak(stub, i, args) for i in range(concurrency)))
        wall = time.perf_counter() - start
    first, last, seconds = (list(x) for x in zip(*results, strict=True))
    return summary(first, last, seconds, wall)


# -- offline path ---------------------------------------------------------------
def run_offline(llm, concurrency: int, args: argparse.Namespace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    eng = llm.engine
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    samples: dict[str, int] = {}
    for i in range(concurrency):
        ctx = eng.make_speech_context(TEXT.format(i=i), SamplingParams(temperature=0.6, top_p=0.95,
                                                                       repetition_penalty=1.1, seed=i),
                                      chunk_frames=args.chunk_frames, max_audio_seconds=args.seconds)
        eng.add_request(ctx)
    while eng.has_work():
        for out in eng.step():
            if out.audio is not None and len(out.audio):
                now = time.perf_counter() - start
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                samples[out.request_id] = samples.get(out.request_id, 0) + len(out.audio)
    wall = max(last.values())
    rate = eng.audio.decoder_sample_rate
    ids = list(last)
    return summary([first[r] for r in ids], [last[r] for r in ids], [samples[r] / rate for r in ids], wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seconds", type=float, default=4.0, help="audio per request")
    p.add_argument("--chunk-frames", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--offline", action="store_true", help="the offline engine instead of gRPC")
    p.add_argument("--address", default=None, help="a running server (default: start one)")
    p.add_argument("--preset", default="demo", help="the text model of the server it starts")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    server = None
    llm = None
    if args.offline:
        from engine import LLM
        from engine.presets import ensure_preset

        llm = LLM(ensure_preset("demo-speech"), device=args.device, kv_cache_gib=args.kv_cache_gib,
                  speech_codec=str(ensure_preset("demo-codec")))
        llm.synthesize("warm up", max_audio_seconds=0.5)
        path = "offline engine"
    else:
        if args.address is None:
            server = ServerProcess(["--preset", args.preset, "--device", args.device,
                                    "--kv-cache-gib", str(args.kv_cache_gib), "--no-embedding-model"])
            args.address = f"127.0.0.1:{server.port}"
            server.wait_serving(args.address, service="stencil.v1.Speech")
        path = f"gRPC ({args.address})"
    try:
        print(f"demo-speech + demo-codec on {args.device}, {path}; {args.seconds} s of audio per request, "
              f"chunks of {args.chunk_frames} frames ({args.chunk_frames * 2048 / 24000 * 1000:.0f} ms)")
        print("| concurrency | time to first audio p50 (s) | max (s) | RTF p50 | audio seconds per second |")
        print("|---|---|---|---|---|")
        if llm is None:  # one short call warms the connection and the server's first request
            asyncio.run(run_grpc(args.address, 1, argparse.Namespace(**{**vars(args), "seconds": 0.5})))
        for c in args.concurrency:
            r = run_offline(llm, c, args) if llm is not None else asyncio.run(run_grpc(args.address, c, args))
            print(f"| {c} | {r['ttfa_p50']:.3f} | {r['ttfa_max']:.3f} | {r['rtf_p50']:.3f} "
                  f"| {r['audio_s_per_s']:.2f} |", flush=True)
    finally:
        if server is not None:
            server.stop()
        if llm is not None:
            llm.close()


if __name__ == "__main__":
    main()
