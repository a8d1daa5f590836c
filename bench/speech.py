"""Text to speech: time to first audio and real-time factor, concurrency 1 and 8.

Runs the built-in speech pair (demo-speech LM + demo-codec, the SNAC 24 kHz
architecture with random weights) on the offline engine. Every request asks
for --seconds of audio (the random model never stops early). Time to first
audio is from submission to the first decoded chunk; RTF is wall time from
submission to the last chunk divided by the audio duration (< 1 is faster
than real time).

    python bench/speech.py
    python bench/speech.py --concurrency 1 8 --seconds 4 --chunk-frames 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def run(llm, concurrency: int, seconds: float, chunk_frames: int) -> dict[str, float]:
    from engine import SamplingParams

    eng = llm.engine
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    samples: dict[str, int] = {}
    for i in range(concurrency):
        ctx = eng.make_speech_context(f"Benchmark sentence number {i}, spoken aloud.",
                                      SamplingParams(temperature=0.6, top_p=0.95, seed=i),
                                      chunk_frames=chunk_frames, max_audio_seconds=seconds)
        eng.add_request(ctx)
    while eng.has_work():
        for out in eng.step():
            if out.audio is not None:
                now = time.perf_counter() - start
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                samples[out.request_id] = samples.get(out.request_id, 0) + len(out.audio)
    rate = eng.audio.decoder_sample_rate
    rtf = [last[r] / (samples[r] / rate) for r in last]
    total_audio = sum(samples.values()) / rate
    return {"ttfa_p50": float(np.median(list(first.values()))), "ttfa_max": max(first.values()),
            "rtf_p50": float(np.median(rtf)), "audio_s_per_s": total_audio / max(last.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--chunk-frames", type=int, default=4)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    from engine import LLM
    from engine.presets import ensure_preset

    llm = LLM(ensure_preset("demo-speech"), device=args.device, speech_codec=str(ensure_preset("demo-codec")))
    llm.synthesize("warm up", max_audio_seconds=0.5)
    print(f"demo-speech + demo-codec on {args.device}; {args.seconds} s of audio per request, "
          f"chunks of {args.chunk_frames} frames ({args.chunk_frames * 2048 / 24000 * 1000:.0f} ms)")
    print("| concurrency | time to first audio p50 (s) | max (s) | RTF p50 | audio seconds per second |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        r = run(llm, c, args.seconds, args.chunk_frames)
        print(f"| {c} | {r['ttfa_p50']:.3f} | {r['ttfa_max']:.3f} | {r['rtf_p50']:.3f} | {r['audio_s_per_s']:.2f} |",
              flush=True)
    llm.close()


if __name__ == "__main__":
    main()
