"""Serving benchmark: N concurrent gRPC clients against `stencild serve`, next to
the offline engine on the same workload.

Workload (the one BENCHMARKS.md compares with vLLM): random 128-token prompts, 64 new tokens, greedy,
ignore_eos. At each concurrency C, C closed-loop clients each send `--rounds`
requests one after another; the offline engine runs the same prompts in batches
of C. Prompts differ per concurrency level, so no level feeds the next one's
prefix cache. Reports output tok/s, time to first token and inter-token latency
(gap between consecutive streamed chunks) p50/p99, and gRPC/offline.

The machine may be shared, so each level runs `--repeats` times, alternating
offline and gRPC, and the best run of each path is reported (the latencies are
those of the best gRPC run).

    .venv/bin/python bench/serve.py                       # starts its own server
    .venv/bin/python bench/serve.py --address 127.0.0.1:50051 --skip-offline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402

from bench._server import ServerProcess  # noqa: E402
from service.gen.stencil.v1 import generate_pb2 as pb  # noqa: E402
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

FIRST_REGULAR_TOKEN = 5  # ids below are special tokens of the demo tokenizer


@dataclass
class LevelResult:
    """One concurrency level's numbers."""

    concurrency: int
    requests: int
    output_tokens: int
    grpc_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    offline_tok_s: float | None = None
    ratio: float | None = None
    chunks_per_request: float | None = None


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_REGULAR_TOKEN, vocab, size=(n, length)).tolist()


def request(prompt: list[int], new_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.sampling.temperature = 0.0
    req.stopping.max_new_tokens = new_tokens
    req.stopping.ignore_eos = True
    return req


# -- gRPC path ------------------------------------------------------------------
async def run_client(stub: pb_grpc.GenerationStub, prompts: list[list[int]], new_tokens: int,
                     ttft: list[float], itl: list[float], chunks: list[int]) -> int:
    tokens = 0
    for prompt in prompts:
        start = time.perf_counter()
        last = None
        async for msg in stub.Generate(request(prompt, new_tokens)):
            if not msg.HasField("chunk") or not msg.chunk.token_ids:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - start)
            else:
                itl.append(now - last)
            last = now
            tokens += len(msg.chunk.token_ids)
            chunks.append(1)
    return tokens


async def run_grpc_level(address: str, batches: list[list[list[int]]],
                         new_tokens: int) -> tuple[float, int, list, list, int]:
    """batches[r][c]: the prompt client c sends in round r. Returns (seconds, tokens, ttft, itl, chunks)."""
    concurrency = len(batches[0])
    per_client = [[batches[r][c] for r in range(len(batches))] for c in range(concurrency)]
    ttft: list[float] = []
    itl: list[float] = []
    chunks: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        counts = await asyncio.gather(*(run_client(stub, p, new_tokens, ttft, itl, chunks) for p in per_client))
        elapsed = time.perf_counter() - start
    return elapsed, sum(counts), ttft, itl, len(chunks)


# -- offline path ---------------------------------------------------------------
def run_offline_level(llm, batches: list[list[list[int]]], new_tokens: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    tokens = 0
    start = time.perf_counter()
    for batch in batches:
        tokens += sum(len(o.token_ids) for o in llm.generate(batch, params))
    return time.perf_counter() - start, tokens


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--address", default=None, help="use a running server instead of starting one")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    parser.add_argument("--repeats", type=int, default=2, help="runs per level and path (best is kept)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-overlap", action="store_true", help="engine overlap scheduling off (both paths)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--stream-messages-per-second", type=float, default=None,
                        help="the server's stream message budget (its default when unset)")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench/results/serve.json")
    args = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine.presets import ensure_preset

    model_dir = ensure_preset(args.preset)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    server = None
    if args.address is None:
        serve_args = ["--preset", args.preset, "--device", args.device, "--kv-cache-gib", str(args.kv_cache_gib),
                      "--max-num-seqs", str(args.max_num_seqs), "--log-level", "INFO"]
        if args.stream_messages_per_second is not None:
            serve_args += ["--stream-messages-per-second", str(args.stream_messages_per_second)]
        server = ServerProcess(serve_args + (["--no-overlap"] if args.no_overlap else []))
        address = f"127.0.0.1:{server.port}"
        server.wait_serving(address)
    else:
        address = args.address
    llm = None
    if not args.skip_offline:
        from engine import LLM

        overlap: dict[str, Any] = {"overlap": False} if args.no_overlap else {}
        llm = LLM(str(model_dir), device=args.device, kv_cache_gib=args.kv_cache_gib,
                  max_num_seqs=args.max_num_seqs, **overlap)
    try:
        # Warm both paths with a full-width batch of short requests.
        warm = make_prompts(max(args.concurrency), args.prompt_len, vocab, seed=999)
        asyncio.run(run_grpc_level(address, [warm], 4))
        if llm is not None:
            run_offline_level(llm, [warm], 4)
        results = []
        for level, conc in enumerate(args.concurrency):
            off_tok_s = None
            best = None
            for rep in range(args.repeats):
                # A fresh prompt set per repeat: no run feeds another's prefix cache.
                prompts = make_prompts(conc * args.rounds, args.prompt_len, vocab, seed=100 * level + rep)
                batches = [prompts[r * conc:(r + 1) * conc] for r in range(args.rounds)]
                if llm is not None:
                    secs, toks = run_offline_level(llm, batches, args.new_tokens)
                    off_tok_s = max(off_tok_s or 0.0, toks / secs)
                run = asyncio.run(run_grpc_level(address, batches, args.new_tokens))
                if best is None or run[1] / run[0] > best[1] / best[0]:
                    best = run
            assert best is not None
            secs, toks, ttft, itl, chunks = best
            res = LevelResult(conc, conc * args.rounds, toks, toks / secs, pct(ttft, 50), pct(ttft, 99),
                              pct(itl, 50), pct(itl, 99), off_tok_s,
                              (toks / secs) / off_tok_s if off_tok_s else None, chunks / (conc * args.rounds))
            results.append(res)
            ratio = f"{res.ratio:6.1%}" if res.ratio is not None else "   n/a"
            offline = f"{off_tok_s:8.1f}" if off_tok_s else "     n/a"
            print(f"c={conc:<3} grpc {res.grpc_tok_s:7.1f} tok/s  offline {offline} tok/s  ratio {ratio}  "
                  f"ttft p50/p99 {res.ttft_p50_ms:7.1f}/{res.ttft_p99_ms:7.1f} ms  "
                  f"itl p50/p99 {res.itl_p50_ms:6.1f}/{res.itl_p99_ms:6.1f} ms  "
                  f"chunks/request {res.chunks_per_request:.1f}", flush=True)
    finally:
        if server is not None:
            server.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"preset": args.preset, "device": args.device,
                                     "overlap": not args.no_overlap,
                                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                     "rounds": args.rounds, "repeats": args.repeats, "levels": [asdict(r) for r in results]},
                                    indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
