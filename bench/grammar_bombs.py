"""A live stream beside ten slow-to-compile JSON schemas ("grammar bombs").

Starts `stencild serve` on the demo model with `--grammar-timeout 3`, measures
the inter-token gaps of one plain Generate stream alone, then again while ten
clients each send a deeply nested anyOf schema forced to xgrammar (whose
compile time explodes with nesting). Reports every bomb's answer time and
status, and the live stream's p50/p99 gap idle vs under the bombs.

What bounds a bomb: its compile deadline starts when it is queued, so no
answer takes much longer than the timeout however many are queued; compile
workers run at a lower CPU priority than the engine.

    python bench/grammar_bombs.py
    python bench/grammar_bombs.py --bombs 10 --timeout 3 --tokens 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _server import ServerProcess  # noqa: E402


def nested_any_of(depth: int, salt: str, width: int = 2) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {f"{salt}{i}_{j}": schema},
                             "required": [f"{salt}{i}_{j}"]} for j in range(width)]
                  + [{"type": "array", "items": schema}]}
    return schema


def stream_gaps(stub, pb, tokens: int) -> list[float]:  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest(text="A long story:")
    req.sampling.temperature = 0.0
    req.stopping.max_new_tokens = tokens
    req.stopping.ignore_eos = True
    gaps, last = [], None
    for msg in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        if msg.HasField("chunk") and last is not None:
            gaps.append(now - last)
        last = now
    return gaps


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bombs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=3.0, help="--grammar-timeout of the server")
    p.add_argument("--depth", type=int, default=8, help="anyOf nesting of each bomb")
    p.add_argument("--tokens", type=int, default=400, help="tokens of the live stream")
    args = p.parse_args()

    import grpc

    from service.gen.stencil.v1 import generate_pb2 as pb
    from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc

    server = ServerProcess(["--grammar-timeout", str(args.timeout), "--no-embedding-model", "--no-speech-model"])
    try:
        address = f"127.0.0.1:{server.port}"
        server.wait_serving(address)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream_gaps(stub, pb, 32)  # warm-up
            idle = stream_gaps(stub, pb, args.tokens)
            answers: list[tuple[float, str]] = []

            # Built before the live stream starts: this client's own GIL must not
            # stall the stream it measures while it serializes 725 KB schemas.
            requests = []
            for i in range(args.bombs):
                req = pb.GenerateRequest(text="JSON:")
                req.stopping.max_new_tokens = 8
                req.constraint.json_schema = json.dumps(nested_any_of(args.depth, f"b{i}_{time.time_ns()}"))
                req.constraint.backend = pb.Constraint.BACKEND_XGRAMMAR
                requests.append(req)

            def bomb(i: int) -> None:
                req = requests[i]
                start = time.perf_counter()
                try:
                    list(stub.Generate(req, timeout=120))
                    status = "OK"
                except grpc.RpcError as err:
                    status = err.code().name  # type: ignore[attr-defined]
                answers.append((time.perf_counter() - start, status))

            live: list[float] = []
            runner = threading.Thread(target=lambda: live.extend(stream_gaps(stub, pb, args.tokens)))
            runner.start()
            time.sleep(0.3)
            bombs = [threading.Thread(target=bomb, args=(i,)) for i in range(args.bombs)]
            for t in bombs:
                t.start()
            for t in bombs:
                t.join()
            runner.join()
    finally:
        server.stop()
    statuses = sorted({s for _, s in answers})
    print(f"{args.bombs} bombs (anyOf depth {args.depth}, xgrammar, --grammar-timeout {args.timeout:g}): "
          f"answered in {min(a for a, _ in answers):.2f}-{max(a for a, _ in answers):.2f} s, "
          f"statuses {statuses}")
    print("| live stream | inter-token p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|")
    for name, gaps in (("idle", idle), ("beside the bombs", live)):
        print(f"| {name} | {1e3 * statistics.median(gaps):.1f} | {1e3 * pct(gaps, 0.99):.1f} | "
              f"{1e3 * max(gaps):.1f} |")
    print(f"p99 ratio: {pct(live, 0.99) / pct(idle, 0.99):.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
