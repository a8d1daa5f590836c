"""gRPC serving vs the offline engine with the device emulated: the host's share alone.

On a GPU the device does the math while the host runs the engine thread, the
device thread's launches and the event loop, all under one GIL; on a CPU the
model's compute hides that. Here the model's forward pass returns zeros (no
CPU) and then sleeps `--device-ms` (no CPU, no GIL), as a decode graph
replaying on a GPU would, or with `--device-model deadline` only sets when the
step's tokens will be ready (bench/device_emulation.py: the device thread's
own work then overlaps the device's time). Everything else is the real code: the
scheduler, step inputs, sampling, postprocessing, the gRPC server and its
streams. So this measures, on any machine, how much of a device-bound step the
serving path loses, and what a change to it does.

Workload as bench/gpu.py's gRPC figure: C concurrent streams of one request
each (random prompts, greedy, EOS ignored) against the offline engine with C
prompts in one batch. Reports both throughputs, their ratio, time to first
token, messages per request, and each side's engine steps (the server's from
its metrics endpoint): how many, how long a step took, and the CPU time each
thread spent per step (the server's event loop, engine and device threads; the
offline engine's caller and device threads): with one GIL between them, the
CPU figures are the steadier measure of what a change to the serving path
costs or saves.

    python bench/serve_emulated.py                    # 64 streams, 2.5 ms a step
    python bench/serve_emulated.py --device-ms 4 --concurrency 16 64
    python bench/serve_emulated.py --device-ms 1 --server-arg=--engine-process
    python bench/serve_emulated.py --device-ms 2.5 --device-model deadline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.device_emulation import MODELS  # noqa: E402

DEVICE_MS_ENV = "STENCILD_BENCH_DEVICE_MS"
DEVICE_MODEL_ENV = "STENCILD_BENCH_DEVICE_MODEL"


def install_from_env() -> None:
    """Emulate the device as the benchmark's environment says (the server's, the
    offline engine's and an engine process's set-up)."""
    from bench.device_emulation import install

    install(float(os.environ[DEVICE_MS_ENV]), os.environ.get(DEVICE_MODEL_ENV, "sleep"))


def serve() -> int:
    """`python -m bench.serve_emulated serve ...`: `stencild serve` on the emulated device
    (with --engine-process, in the engine process too)."""
    from service.cli import main as cli_main

    install_from_env()
    argv = sys.argv[1:]
    if "--engine-process" in argv:
        argv += ["--engine-setup", "bench.serve_emulated:install_from_env"]
    return cli_main(argv)


def offline(model_dir: Path, prompts: list[list[int]], new_tokens: int,
            repeat: int) -> tuple[float, float, int, dict[str, float]]:
    """The offline engine's best tok/s, and that run's seconds, engine steps and
    CPU seconds of its two threads (the caller's, which steps the engine, and
    the device thread)."""
    from bench.serve import run_offline_level
    from engine import LLM
    from service.ops.metrics import thread_cpu_seconds

    install_from_env()
    llm = LLM(str(model_dir), kv_cache_gib=1.0, max_num_seqs=len(prompts))
    device = llm.engine.executor.thread

    def cpu() -> dict[str, float]:
        out = {"engine_0": time.thread_time()}
        seconds = thread_cpu_seconds(device) if device is not None else None
        if seconds is not None:
            out["device_0"] = seconds
        return out

    try:
        run_offline_level(llm, [prompts], 4)  # warm-up
        best: tuple[float, float, int, dict[str, float]] = (0.0, 0.0, 0, {})
        for _ in range(repeat):
            # The gRPC side sends fresh prompts each repeat: no prefix-cache hits here either.
            llm.engine.flush_prefix_cache()
            passes, before = llm.engine.pipeline.forward_passes, cpu()
            secs, tokens = run_offline_level(llm, [prompts], new_tokens)
            if tokens / secs > best[0]:
                used = {k: v - before[k] for k, v in cpu().items()}
                best = (tokens / secs, secs, llm.engine.pipeline.forward_passes - passes, used)
    finally:
        llm.close()
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-ms", type=float, default=2.5, help="emulated device time per step")
    p.add_argument("--device-model", choices=MODELS, default="sleep",
                   help="sleep: each forward pass sleeps on the device thread; deadline: it only sets when "
                        "its result is ready, and reading the step's tokens waits for that "
                        "(bench/device_emulation.py)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=4, help="runs per figure, best kept")
    p.add_argument("--preset", default="tiny-llama")
    p.add_argument("--server-arg", action="append", default=[], help="one more `stencild serve` argument")
    p.add_argument("--json", type=Path, default=REPO_ROOT / "bench/results/serve_emulated.json")
    args = p.parse_args()

    import multiprocessing as mp

    from bench._server import ServerProcess, engine_steps, free_port
    from bench.serve import make_prompts, pct, run_grpc_level
    from engine.presets import ensure_preset

    os.environ[DEVICE_MS_ENV] = str(args.device_ms)
    os.environ[DEVICE_MODEL_ENV] = args.device_model
    model_dir = ensure_preset(args.preset)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    results = []
    for conc in args.concurrency:
        prompts = make_prompts(conc, args.prompt_len, vocab, seed=conc)
        # The offline engine in a child, so this process stays a plain client.
        with mp.get_context("spawn").Pool(1) as pool:
            off, off_secs, off_steps, off_cpu = pool.apply(offline, (model_dir, prompts, args.new_tokens,
                                                                     args.repeat))
        metrics_port = free_port()
        server = ServerProcess(["--preset", args.preset, "--kv-cache-gib", "1", "--max-num-seqs", str(conc),
                                "--no-speech-model", "--no-embedding-model", "--metrics-port", str(metrics_port),
                                "--log-level", "INFO", *args.server_arg], module="bench.serve_emulated")
        address = f"127.0.0.1:{server.port}"
        try:
            server.wait_serving(address)
            asyncio.run(run_grpc_level(address, [make_prompts(conc, args.prompt_len, vocab, 999)], 4))
            best = None
            for r in range(args.repeat):
                before = engine_steps(metrics_port)
                run = asyncio.run(run_grpc_level(address, [make_prompts(conc, args.prompt_len, vocab, 100 + r)],
                                                 args.new_tokens))
                if best is None or run[1] / run[0] > best[0][1] / best[0][0]:
                    best = (run, engine_steps(metrics_port).since(before))
        finally:
            server.stop()
        assert best is not None
        (secs, tokens, ttft, _, messages), steps = best
        row = {"concurrency": conc, "device_ms": args.device_ms, "device_model": args.device_model,
               "offline_tok_s": round(off),
               "grpc_tok_s": round(tokens / secs), "ratio": round(tokens / secs / off, 3),
               "ttft_p50_ms": round(pct(ttft, 50), 1), "ttft_p99_ms": round(pct(ttft, 99), 1),
               "messages_per_request": round(messages / conc, 1),
               "server_steps": steps.steps, "server_step_ms": round(1e3 * steps.seconds / max(steps.steps, 1), 2),
               "offline_steps": off_steps, "offline_step_ms": round(1e3 * off_secs / max(off_steps, 1), 2),
               "server_cpu_ms_per_step": steps.cpu_ms_per_step(),
               "offline_cpu_ms_per_step": {k: round(1e3 * v / max(off_steps, 1), 3) for k, v in off_cpu.items()}}
        results.append(row)
        print(f"c={conc:<3} device {args.device_ms} ms/step ({args.device_model}): grpc {row['grpc_tok_s']:,} tok/s, offline "
              f"{row['offline_tok_s']:,} tok/s = {row['ratio']:.1%}; TTFT p50/p99 {row['ttft_p50_ms']}/"
              f"{row['ttft_p99_ms']} ms; {row['messages_per_request']} messages a request\n"
              f"      server: {steps.describe()}\n      offline: {off_steps} steps, {row['offline_step_ms']} ms a "
              f"step; CPU ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in row["offline_cpu_ms_per_step"].items()),
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"preset": args.preset, "prompt_len": args.prompt_len,
                                     "new_tokens": args.new_tokens, "levels": results}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:2] == ["serve"] else main())
