"""What metrics cost: gRPC throughput at concurrency 16 with metrics on vs off, interleaved.

Two `stencild serve` processes on the same preset, one with `--metrics-port`
(scraped once a second while it serves, harsher than a 15 s Prometheus
interval) and one with `--metrics-port 0`; both log a line per request, as
servers do. The workload is bench/serve.py's (random 128-token prompts, 64
new tokens, greedy, EOS ignored; `--rounds` requests per client, a fresh
prompt set per run so no run feeds another's prefix cache). Runs alternate
off, on, off, on, ... so drift of a shared machine hits both alike; every run
is reported, then the mean of each and the cost.

    .venv/bin/python bench/metrics_overhead.py --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench._server import ServerProcess  # noqa: E402
from bench.serve import make_prompts, run_grpc_level  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper:
    """GET /metrics every `interval` seconds on a thread, while a run lasts."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url, interval
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                resp.read()
            self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3, help="off/on pairs of runs")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench/results/metrics_overhead.json")
    args = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine.presets import ensure_preset

    vocab = json.loads((ensure_preset(args.preset) / "config.json").read_text())["vocab_size"]
    common = ["--preset", args.preset, "--no-embedding-model", "--no-speech-model", "--log-level", "INFO"]
    metrics_port = free_port()
    servers = {"off": ServerProcess([*common, "--metrics-port", "0"]),
               "on": ServerProcess([*common, "--metrics-port", str(metrics_port)])}
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    runs: list[dict[str, float | str | int]] = []
    try:
        addresses = {k: f"127.0.0.1:{s.port}" for k, s in servers.items()}
        for mode, address in addresses.items():
            servers[mode].wait_serving(address)
        warm = make_prompts(args.concurrency, args.prompt_len, vocab, seed=999)
        for address in addresses.values():
            asyncio.run(run_grpc_level(address, [warm], 4))
        for pair in range(args.pairs):
            for mode in ("off", "on"):
                prompts = make_prompts(args.concurrency * args.rounds, args.prompt_len, vocab,
                                       seed=1000 + 10 * pair + (mode == "on"))
                batches = [prompts[r * args.concurrency:(r + 1) * args.concurrency]
                           for r in range(args.rounds)]
                time.sleep(2.0)  # let the other server's threads go quiet
                if mode == "on":
                    with Scraper(url, args.scrape_interval) as scraper:
                        secs, toks, _, _, _ = asyncio.run(run_grpc_level(addresses[mode], batches,
                                                                      args.new_tokens))
                    scrapes = scraper.scrapes
                else:
                    secs, toks, _, _, _ = asyncio.run(run_grpc_level(addresses[mode], batches, args.new_tokens))
                    scrapes = 0
                runs.append({"pair": pair + 1, "metrics": mode, "tok_s": toks / secs, "seconds": secs,
                             "tokens": toks, "scrapes": scrapes})
                print(f"pair {pair + 1} metrics {mode:<3} {toks / secs:7.1f} tok/s "
                      f"({toks} tokens in {secs:5.1f} s, {scrapes} scrapes)", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    mean = {m: sum(float(r["tok_s"]) for r in runs if r["metrics"] == m) / args.pairs for m in ("off", "on")}
    cost = 1 - mean["on"] / mean["off"]
    print(f"mean: off {mean['off']:.1f} tok/s, on {mean['on']:.1f} tok/s, cost {cost:+.1%}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"preset": args.preset, "concurrency": args.concurrency,
                                     "rounds": args.rounds, "prompt_len": args.prompt_len,
                                     "new_tokens": args.new_tokens, "runs": runs, "mean": mean,
                                     "cost": cost}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
