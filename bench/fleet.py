"""What a router in front costs: one worker behind SMG vs the same worker direct.

Starts one `stencild serve` (the demo model unless `--preset`) and an
unmodified Shepherd Model Gateway (`smg launch`, round robin) in front of it,
then runs the same workload two ways, interleaved, in one run:

- **direct**: stencil.v1 `Generate` over gRPC to the worker (token ids in, the
  prompt tokenized by the bench, as a router would);
- **via SMG**: streaming `/v1/completions` (the OpenAI API) against the
  router, which tokenizes, speaks vLLM's gRPC engine protocol to the worker and
  detokenizes (plain http.client, reading only what it needs, so the client's own
  parsing is not charged to the router).

Workload: fixed prompts of about 64 tokens, `--new-tokens` (64) greedy tokens
with EOS ignored (`ignore_eos`, vLLM's extra field, which SMG forwards), at
concurrency 1 and 16. Reported: time to first token (p50) and output tokens/s
for each path, and the router's cost in both.

    .venv/bin/python bench/fleet.py
    .venv/bin/python bench/fleet.py --preset bench --rounds 3
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from _server import ServerProcess  # noqa: E402

PROMPT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
                "seven", "wizards", "quietly", "judge", "boxing", "matches", "near", "the",
                "old", "harbour", "before", "dawn"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_router(worker_port: int, tokenizer: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`smg launch` in front of one worker; (the process, its base URL)."""
    smg = Path(sys.executable).parent / "smg"
    command = [str(smg)] if smg.exists() else [sys.executable, "-m", "smg"]
    port = free_port()
    proc = subprocess.Popen([*command, "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--worker-urls", f"grpc://127.0.0.1:{worker_port}",
                             "--tokenizer-path", str(tokenizer), "--policy", "round_robin",
                             "--prometheus-port", str(free_port()), "--log-level", "warn",
                             "--worker-wedge-secs", "120"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def prompts(n: int, words: int) -> list[str]:
    """`n` distinct prompts (no prefix shared past the first word, so the
    prefix cache favours neither path)."""
    out = []
    for i in range(n):
        body = [PROMPT_WORDS[(i * 7 + j * 3) % len(PROMPT_WORDS)] for j in range(words)]
        out.append(f"{i}: " + " ".join(body))
    return out


def _drive(texts: list[str], concurrency: int, one: Callable[[str], tuple[float | None, int]]
           ) -> tuple[list[float], int, float]:
    """Run `one(text) -> (time to first token or None, tokens)` over `texts`,
    `concurrency` at a time: (TTFTs, total tokens, seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, texts))
    elapsed = time.perf_counter() - start
    # A stream whose first token went unseen has no TTFT; counted as 0 it pulled the median down.
    missing = sum(first is None for first, _ in results)
    if missing:
        raise RuntimeError(f"{missing} of {len(results)} streams never showed a first token: their TTFT is unknown")
    return [first for first, _ in results if first is not None], sum(n for _, n in results), elapsed


def run_direct(address: str, texts: list[str], new_tokens: int, concurrency: int
               ) -> tuple[list[float], int, float]:
    import grpc

    from service.gen.stencil.v1 import generate_pb2 as pb
    from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)

    def one(text: str) -> tuple[float | None, int]:
        req = pb.GenerateRequest(text=text)
        req.sampling.temperature = 0.0
        req.stopping.max_new_tokens = new_tokens
        req.stopping.ignore_eos = True
        start = time.perf_counter()
        first = None
        n = 0
        for msg in stub.Generate(req, timeout=600):
            if msg.HasField("chunk") and msg.chunk.token_ids:
                if first is None:
                    first = time.perf_counter() - start
                n += len(msg.chunk.token_ids)
        return first, n

    try:
        return _drive(texts, concurrency, one)
    finally:
        channel.close()


def run_router(base: str, model: str, texts: list[str], new_tokens: int, concurrency: int
               ) -> tuple[list[float], int, float]:
    # Raw streaming HTTP (the standard library's), parsing only the usage
    # event: on two cores the client's own work would otherwise count as the
    # router's.
    import http.client
    from urllib.parse import urlsplit

    host = urlsplit(base)
    if host.hostname is None:
        raise ValueError(f"no host name in the router's address {base!r}")
    hostname = host.hostname

    def one(text: str) -> tuple[float | None, int]:
        body = {"model": model, "prompt": text, "max_tokens": new_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        start = time.perf_counter()
        first = None
        n = 0
        conn = http.client.HTTPConnection(hostname, host.port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"router answered {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and '"text":"' in line and '"text":""' not in line:
                first = time.perf_counter() - start
            if '"usage":{' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
        conn.close()
        return first, n

    return _drive(texts, concurrency, one)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="serve this preset instead of the demo model")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="alternating direct/router runs per concurrency")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--json", type=Path, default=REPO_ROOT / "bench/results/fleet.json")
    args = p.parse_args()

    try:
        import smg  # noqa: F401
    except ImportError:
        sys.exit("smg is not installed (`make setup` installs it)")
    from engine.presets import ensure_preset

    preset = args.preset or "demo"
    model_dir = ensure_preset(preset)
    worker = ServerProcess(["--preset", preset, "--metrics-port", "0", "--no-embedding-model",
                            "--no-speech-model", "--grace-period", "1"])
    router = None
    results: dict[str, dict[str, float]] = {}
    try:
        address = f"127.0.0.1:{worker.port}"
        worker.wait_serving(address)
        assert worker.port is not None
        router, base = start_router(worker.port, model_dir)
        model = preset  # a preset is served under its own name
        deadline = time.monotonic() + 120
        while True:  # ready once a completion goes through
            try:
                run_router(base, model, ["warm up"], 4, 1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or router.poll() is not None:
                    raise
                time.sleep(0.5)
        run_direct(address, ["warm up"], 4, 1)
        for c in (int(x) for x in args.concurrency.split(",")):
            n = max(4, 2 * c)
            runs: dict[str, list[tuple[list[float], int, float]]] = {"direct": [], "smg": []}
            for r in range(args.rounds):
                order = ("direct", "smg") if r % 2 == 0 else ("smg", "direct")
                for path in order:
                    # Fresh for every run: the two paths share the worker, and the
                    # second to send a round's prompts found them in its prefix cache.
                    texts = [f"p{order.index(path)}r{r}c{c} {t}" for t in prompts(n, args.prompt_words)]
                    if path == "direct":
                        runs[path].append(run_direct(address, texts, args.new_tokens, c))
                    else:
                        runs[path].append(run_router(base, model, texts, args.new_tokens, c))
            for path, rs in runs.items():
                ttft = statistics.median(t for r in rs for t in r[0])
                tps = sum(r[1] for r in rs) / sum(r[2] for r in rs)
                results[f"{path} c={c}"] = {"ttft_p50_ms": 1e3 * ttft, "tokens_per_s": tps}
                print(f"{path:6s} c={c:<3d} TTFT p50 {1e3 * ttft:8.1f} ms   {tps:8.1f} tok/s", flush=True)
            d, s = results[f"direct c={c}"], results[f"smg c={c}"]
            print(f"        c={c:<3d} router: TTFT {s['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms, "
                  f"throughput {100 * (s['tokens_per_s'] / d['tokens_per_s'] - 1):+.1f} %", flush=True)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        worker.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"preset": preset, "new_tokens": args.new_tokens,
                                     "results": results}, indent=2))


if __name__ == "__main__":
    main()
