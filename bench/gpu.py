"""GPU benchmark: stencild against the device's bandwidth bound, transformers and its own gRPC server.

One command on a CUDA machine:

1. writes random-weight bf16 checkpoints of TinyLlama-1.1B's shape (hidden 2048,
   intermediate 5632, 22 layers, 32 heads, 4 KV heads) and Llama-3-8B's shape
   with a 32k vocabulary (hidden 4096, intermediate 14336, 32 layers, 32 heads,
   8 KV heads), with transformers, into --out-dir (cached; the demo tokenizer,
   prompts are token ids < 8000);
2. measures the device's copy bandwidth (device-to-device, CUDA events, median)
   and each model's weight bytes read per decode step: the batch-1 bound is
   bandwidth / bytes (tokens/s), and B x that at batch B; and times the grammar
   mask on a batch of 64 rows, the tensor ops against the Triton kernel
   (bench/mask_apply.py);
3. runs stencild offline (`engine.LLM`): decode graphs on/off x overlap on/off x
   batch 1/16/64, and at batch 64 a JSON schema against none and sampling with
   top-p and penalties against greedy; 128-token random prompts, 128 new
   tokens, greedy unless said, ignore_eos, a warm-up first; tokens/s =
   generated tokens / wall time (synchronised), best of --repeat; one more run
   of each at batch 64 is broken down phase by phase (bench/step_phases.py);
4. runs transformers `generate`: eager, static cache, and static cache compiled
   with mode="reduce-overhead" (CUDA graphs), at batch 1 (and 16 unless --quick
   or the 8B shape), warm-ups excluded;
5. runs `stencild serve` on the same GPU: 64 concurrent Generate streams of 128
   tokens against the offline engine at batch 64, and TTFT p50;
6. prints each figure with its share of the bound, the issue's targets marked
   met / not met, a markdown table; writes the log and a JSON of the results
   under --results-dir (device, driver, torch / triton / transformers versions,
   attention and graph choices, and with --with-tests the last line of
   `pytest -q tests/cuda`, run first).

    python bench/gpu.py                          # everything (~15 min on an H100-class GPU)
    python bench/gpu.py --quick                  # the 1.1B shape only, 64 new tokens
    python bench/gpu.py --models 8b --skip-transformers --skip-grpc
    python bench/gpu.py --with-tests
    python bench/gpu.py --with-tests --profile-server --profile-kernels   # and where the time goes
    python bench/gpu.py --models moe --skip-grpc  # a mixture of experts (Mixtral layout), not in the default set

Needs torch with CUDA, triton, transformers, tokenizers, safetensors, numpy and
grpcio (gRPC part), and stencild's own dependencies. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import gc
import inspect
import json
import logging
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.step_phases import StepPhases  # noqa: E402 - after the path

FIRST_REGULAR_TOKEN = 5  # ids below are the demo tokenizer's special tokens
PROMPT_VOCAB = 8000  # prompt ids stay inside the demo tokenizer's 8192
BOS_ID, EOS_ID, PAD_ID = 0, 1, 4  # the demo tokenizer's (engine/presets)
T = TypeVar("T")
DEVICE = "cuda"  # every model of the run (the engines, transformers, the server) runs here


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture shape, or with `experts` Mixtral's (each layer's MLP
    `experts` of `intermediate` width, `experts_per_token` of them a token);
    weights are random."""

    name: str
    label: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    rope_theta: float
    experts: int = 0
    experts_per_token: int = 2


SHAPES: dict[str, ModelShape] = {
    "1.1b": ModelShape("tinyllama-1.1b-shape", "1.1B (TinyLlama shape)", hidden=2048, intermediate=5632,
                       layers=22, heads=32, kv_heads=4, vocab=32000, max_positions=2048, rope_theta=10000.0),
    "8b": ModelShape("llama3-8b-shape-32k-vocab", "8B (Llama-3-8B shape, 32k vocab)", hidden=4096,
                     intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=32000, max_positions=8192,
                     rope_theta=500000.0),
    # Not run by default: a mixture of experts, its tokens grouped on the GPU
    # (engine/kernels/triton_moe.py), decode graphs on against off.
    "moe": ModelShape("mixtral-layout-8x1.1b", "MoE (Mixtral layout, 8 experts of TinyLlama's MLP, 2 a token)",
                      hidden=2048, intermediate=5632, layers=16, heads=32, kv_heads=8, vocab=32000,
                      max_positions=4096, rope_theta=1000000.0, experts=8, experts_per_token=2),
}

# At batch 64: a list of at least 8 records, so no output can complete within
# 128 tokens (a record takes 20+ tokens): every request generates all of its
# tokens with or without the schema, and the two runs compare per request.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 8,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 16},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["id", "name", "role", "active", "tags"],
        "additionalProperties": False,
    },
}
# How long --profile-server samples the server, each of its two passes.
PROFILE_SECONDS = 4.0
# "No slower" allows this much run-to-run noise.
SCHEMA_NOISE = 0.03


# -- output ---------------------------------------------------------------------------


class Report:
    """Prints lines and appends them to the run's log file (engine log lines go there too)."""

    def __init__(self, log_path: Path, budget_s: float | None = None):
        self.log_path = log_path
        # When parts not yet started are skipped (--budget-s), so that a run
        # under a caller's time limit still ends with its tables and JSON.
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        handler = logging.FileHandler(log_path, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.setLevel(logging.INFO)
        root.addHandler(handler)
        for noisy in ("httpx", "urllib3", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def past_deadline(self) -> bool:
        left = self.seconds_left()
        return left is not None and left <= 0

    def raw(self, text: str) -> None:
        """Text for the log file only (a subprocess's whole output)."""
        with self.log_path.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def fmt_rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def fmt_share(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


# -- the machine ----------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - absent or broken: report it as such
        return None
    return str(getattr(mod, "__version__", "unknown"))


def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi, else NVML), or "unknown"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        if out:
            return out.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - NVML is optional
        return "unknown"


def device_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver_version(),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def copy_bandwidth(gib: float = 2.0, iterations: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a device-to-device copy of `gib`
    GiB (bytes read + bytes written over the copy's time; median of
    `iterations`, timed by CUDA events after warm-ups)."""
    import torch

    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / statistics.median(times)


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- checkpoints ----------------------------------------------------------------------


def write_checkpoint(shape: ModelShape, out_dir: Path, device: str | None = None) -> Path:
    """A random-weight bf16 checkpoint of `shape` under out_dir (reused when it
    is already there), written by transformers with the demo tokenizer.

    The model is built on the meta device and materialised on `device` in
    bf16, so an 8B shape takes seconds, not a float32 CPU init."""
    target = out_dir / shape.name
    marker = target / "stencild_gpu_bench.json"
    wanted = asdict(shape)
    device = device or DEVICE
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from engine.presets import TOKENIZER_DIR

    # rope_theta: a field in transformers 4.x, folded into rope_parameters by 5.x.
    fields: dict[str, Any] = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, rms_norm_eps=1e-5, rope_theta=shape.rope_theta,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model: Any
    with torch.device("meta"):
        if shape.experts:
            model = MixtralForCausalLM(MixtralConfig(num_local_experts=shape.experts,
                                                     num_experts_per_tok=shape.experts_per_token, **fields))
        else:
            model = LlamaForCausalLM(LlamaConfig(**fields))
    model = model.to(dtype=torch.bfloat16).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    tmp = out_dir / f".{shape.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs: dict[str, Any] = {"max_shard_size": "5GB"}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x writes safetensors only
    model.save_pretrained(tmp, **kwargs)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, tmp / f)
    (tmp / "stencild_gpu_bench.json").write_text(json.dumps(wanted, indent=2) + "\n")
    del model
    if device != "cpu":
        free_cuda()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint's safetensors files (read from their headers)."""
    sizes: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                sizes[name] = end - start
    return sizes


def bytes_per_decode_step(sizes: dict[str, int], expert_share: float = 1.0) -> int:
    """Weight bytes one decode step of one sequence reads: all of them but the
    input embedding table, of which a step reads one row per sequence (the
    output projection is a separate matrix here and is read whole), and of a
    mixture's experts the `expert_share` a token is routed to."""
    return int(sum(size * (expert_share if ".experts." in name else 1.0) for name, size in sizes.items()
                   if not name.endswith("embed_tokens.weight")))


# -- workload ---------------------------------------------------------------------------


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_REGULAR_TOKEN, PROMPT_VOCAB, size=(n, length)).tolist()


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    """(seconds, tokens) of fn(), synchronised with the GPU on both ends."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


@dataclass
class Figure:
    """One measured throughput."""

    system: str  # "stencild", "transformers", "stencild gRPC"
    model: str  # a SHAPES key
    mode: str
    batch: int
    new_tokens: int
    tok_s: float
    seconds: list[float]
    bound_tok_s: float  # batch x the batch-1 bandwidth bound
    extra: dict[str, Any]

    @property
    def share(self) -> float:
        return self.tok_s / self.bound_tok_s


# -- stencild offline -------------------------------------------------------------------


def run_stencild(key: str, model_dir: Path, args: argparse.Namespace, bound: float, report: Report,
                 info: dict[str, Any], saved: Callable[[list[Figure]], None] | None = None) -> list[Figure]:
    """Graphs on/off x overlap on/off x each batch; with graphs and overlap on,
    also the largest batch under BENCH_SCHEMA. A configuration that fails is
    reported and the others still run; `saved` gets the figures so far after
    each (the run's JSON is rewritten, should it be killed)."""
    figures: list[Figure] = []
    for graphs in ("auto", "off"):
        for overlap in (True, False):
            mode = f"graphs {'on' if graphs == 'auto' else 'off'}, overlap {'on' if overlap else 'off'}"
            if args.default_mode_only and mode != DEFAULT_MODE:
                continue
            figures += guarded(report, f"[{key}] stencild {mode}", _stencild_config, key, model_dir, graphs,
                               overlap, mode, args, bound, report, info) or []
            if saved is not None:
                saved(figures)
    if not args.default_mode_only:
        # The default mode with the model's pointwise steps as plain torch ops:
        # what the fused Triton kernels (engine/kernels/triton_ops.py) are worth,
        # with the batch-1 GEMV (engine/kernels/triton_gemv.py), which comes with them.
        figures += guarded(report, f"[{key}] stencild {UNFUSED_MODE}", _stencild_config, key, model_dir, "auto",
                           True, UNFUSED_MODE, args, bound, report, info, False) or []
    return figures


def _stencild_config(key: str, model_dir: Path, graphs: str, overlap: bool, mode: str, args: argparse.Namespace,
                     bound: float, report: Report, info: dict[str, Any], fused: bool = True) -> list[Figure]:
    """One engine configuration: every batch, and the schema run with graphs and
    overlap on (`fused` False: the model's pointwise steps in torch ops)."""
    import torch

    from engine import LLM, SamplingParams
    from grammar import GrammarSpec

    figures: list[Figure] = []
    max_batch = max(args.batches)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    saved = os.environ.get("STENCILD_NO_KERNELS")
    if not fused:
        os.environ["STENCILD_NO_KERNELS"] = "1"  # read once, when the engine picks its kernels
    try:
        llm = LLM(str(model_dir), device=DEVICE, dtype="bfloat16", cuda_graphs=graphs, overlap=overlap,
                  max_num_seqs=max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
                  **kv_cache_kwargs(args))
    finally:
        if saved is None:
            os.environ.pop("STENCILD_NO_KERNELS", None)
        else:
            os.environ["STENCILD_NO_KERNELS"] = saved
    eng = llm.engine
    report(f"  [{key}] stencild {mode}: engine built in {time.perf_counter() - start:.1f} s; "
           f"attention {eng.attention_choice.name} ({eng.attention_choice.reason}); pointwise kernels "
           f"{eng.ops_choice}; decode graphs "
           f"{'captured, buckets ' + str(eng.graphs.buckets) if eng.graphs is not None else 'off'}; "
           f"grammar mask threads {eng.structured.mask_threads}; {eng.gemv_choice}")
    info["grammar_mask_threads"] = eng.structured.mask_threads
    info.setdefault("gemv", {})[mode] = eng.gemv_choice
    info.setdefault("attention", {})[mode] = {"name": eng.attention_choice.name,
                                              "reason": eng.attention_choice.reason}
    info.setdefault("pointwise_kernels", {})[mode] = eng.ops_choice
    info.setdefault("graphs", {})[mode] = None if eng.graphs is None else \
        {"capture": eng.graphs.capture, "buckets": list(eng.graphs.buckets)}
    runs: list[tuple[int, Any, str, Any]] = [(b, None, mode, params) for b in args.batches]
    default = graphs == "auto" and overlap and fused
    if default:
        runs.append((max_batch, GrammarSpec.json_schema(json.dumps(BENCH_SCHEMA)), mode + ", JSON schema",
                     params))
        runs.append((max_batch, None, mode + SAMPLED_MODE, sampled_params(args.new_tokens)))
    try:
        for batch, constraint, label, run_params in runs:
            # The schema's comparison at the biggest batch also gets its steps' phases.
            phases = default and batch == max_batch and run_params is params
            # One run's failure is recorded; the configuration's other figures still count.
            fig = guarded(report, f"[{key}] stencild {label}, batch {batch}", _stencild_batch, llm, key, label,
                          batch, run_params, constraint, args, bound, phases)
            if fig is None:
                continue
            figures.append(fig)
            report(f"  [{key}] stencild {label}, batch {batch}: {fmt_rate(fig.tok_s)} tok/s "
                   f"({fmt_share(fig.share)} of the {fmt_rate(fig.bound_tok_s)} tok/s bound)"
                   + (f"; forced tokens {fig.extra['forced_tokens']}" if constraint is not None else "")
                   + (f"; decode step {fig.extra['step_ms']:.2f} ms (prefill {fig.extra['prefill_ms']:.1f} ms)"
                      if "step_ms" in fig.extra else "")
                   + (f", its graph {fig.extra['graph_gpu_ms']:.2f} ms of GPU "
                      f"time ({fmt_share(fig.extra['graph_gpu_ms'] / fig.extra['step_ms'])} busy)"
                      if "graph_gpu_ms" in fig.extra else ""))
            if phases:
                report(f"  [{key}] stencild {label}, batch {batch}, step phases: {fig.extra['phases_summary']}")
    finally:
        llm.close()
        del llm, eng
        free_cuda()
        report(f"  [{key}] after closing: {torch.cuda.memory_allocated() / 2**20:.0f} MiB still allocated")
    return figures


def kv_cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The KV cache's size for an engine: --gpu-memory-utilization if given, else --kv-cache-gib."""
    if args.gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": args.gpu_memory_utilization}
    return {"kv_cache_gib": args.kv_cache_gib}


def _stencild_batch(llm: Any, key: str, mode: str, batch: int, params: Any, constraint: Any,
                    args: argparse.Namespace, bound: float, phases: bool = False) -> Figure:
    """One batch size's timed runs; with `phases`, one more run whose steps are
    broken down phase by phase (bench/step_phases.py; not among the timed runs)."""
    eng = llm.engine
    forced = 0

    def once(prompts: list[list[int]]) -> int:
        nonlocal forced
        outs = llm.generate(prompts, params, constraint=constraint)
        forced = sum(o.forced_tokens for o in outs)
        return sum(len(o.token_ids) for o in outs)

    replays_before = sum(eng.graphs.replays.values()) if eng.graphs is not None else 0
    # Warm-up: the same shapes as the timed runs (kernel compiles, autotuning,
    # the schema's grammar compiled and cached).
    once(make_prompts(batch, args.prompt_len, 10_000 + batch))
    times, tokens = [], 0
    for r in range(args.repeat):
        prompts = make_prompts(batch, args.prompt_len, 1000 * batch + r)
        eng.flush_prefix_cache()  # fresh prompts anyway; no run feeds another's prefix cache
        secs, tokens = timed(functools.partial(once, prompts))
        times.append(secs)
    replays = (sum(eng.graphs.replays.values()) - replays_before) if eng.graphs is not None else 0
    extra = {"tokens": tokens, "graph_replays": replays, "forced_tokens": forced,
             "median_tok_s": tokens / statistics.median(times)}
    if constraint is None:
        # The same prompts (the cache flushed) to their first token only: the
        # prefill, which a decode step's time must leave out.
        first_only = replace(params, max_new_tokens=1, min_new_tokens=0)

        def first_tokens(prompts: list[list[int]]) -> int:
            return len(llm.generate(prompts, first_only))

        prefill = []
        for r in range(args.repeat):
            eng.flush_prefix_cache()
            prefill.append(timed(functools.partial(first_tokens, make_prompts(batch, args.prompt_len,
                                                                              1000 * batch + r)))[0])
        extra["prefill_ms"] = 1000 * min(prefill)
        extra["step_ms"] = decode_step_ms(min(times), min(prefill), tokens // batch)
        if eng.graphs is not None and eng.graphs.capture:
            extra["graph_gpu_ms"] = graph_gpu_ms(eng, batch)
    if phases:
        eng.flush_prefix_cache()
        with StepPhases(llm) as timer:
            once(make_prompts(batch, args.prompt_len, 1000 * batch + args.repeat))
        extra["phases_ms"] = timer.per_step_ms()
        extra["phases_summary"] = timer.summary()
    return Figure("stencild", key, mode, batch, args.new_tokens, tokens / min(times), times, batch * bound, extra)


def decode_step_ms(run_s: float, prefill_s: float, new_tokens: int) -> float:
    """One decode step's wall time in ms: a run's time less its prefill's (which
    gives the first token), over the steps after it. The run's whole time over
    its tokens counted the prefill as decode: at batch 64 an 8B's 8,192 prompt
    tokens are ~145 ms of a 1.1 s run, and the GPU looked 82 % busy, not ~94 %."""
    return 1000 * max(run_s - prefill_s, 0.0) / max(new_tokens - 1, 1)


def graph_gpu_ms(eng: Any, batch: int, iterations: int = 50) -> float:
    """GPU time of one decode step's graph (forward pass and logits) for
    `batch` rows, replayed back to back after the timed runs (the static
    buffers as the last step left them), median by CUDA events. Against the
    step's wall time it says how busy the GPU is kept. The replays write keys
    and values to pages the finished requests gave back, so the prefix cache
    is flushed before and after: no cached page is touched."""
    import torch

    graphs = eng.graphs
    bucket = graphs.bucket(batch)
    eng.flush_prefix_cache()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.run(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    eng.flush_prefix_cache()
    return statistics.median(times[5:])


# -- transformers --------------------------------------------------------------------------


def _transformers_modes() -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The generate() modes this transformers offers, and notes on what it lacks."""
    from transformers import GenerationConfig

    notes = []
    static: dict[str, Any] = {"cache_implementation": "static"}
    if hasattr(GenerationConfig(), "disable_compile"):
        # Without it a static cache on CUDA is compiled automatically (4.48+).
        static["disable_compile"] = True
    else:
        notes.append("this transformers has no disable_compile: its 'static' mode may compile on its own")
    compile_config: Any = None
    try:
        from transformers import CompileConfig as compile_config
    except ImportError:
        with contextlib.suppress(ImportError):
            from transformers.generation.configuration_utils import CompileConfig as compile_config
    compiled: dict[str, Any] = {"cache_implementation": "static"}
    if compile_config is not None:
        compiled["compile_config"] = compile_config(mode="reduce-overhead")
    else:
        compiled["_compile_forward"] = True
        notes.append("no CompileConfig: the forward is wrapped in torch.compile(mode='reduce-overhead')")
    return [("eager (dynamic cache)", {}), ("static cache", static),
            ("static cache + CUDA graphs (compile reduce-overhead)", compiled)], notes


def run_transformers(key: str, model_dir: Path, batches: list[int], args: argparse.Namespace, bound: float,
                     report: Report) -> list[Figure]:
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), **{dtype_kw: torch.bfloat16})
    model = model.to(DEVICE).eval()
    modes, notes = _transformers_modes()
    for note in notes:
        report(f"  [{key}] transformers {transformers.__version__}: {note}")
    figures: list[Figure] = []
    plain_forward = model.forward
    try:
        for mode, kwargs in modes:
            if report.past_deadline():
                report(f"  [{key}] transformers {mode} skipped: past the --budget-s deadline")
                continue
            kwargs = dict(kwargs)
            if kwargs.pop("_compile_forward", False):
                model.forward = torch.compile(plain_forward, mode="reduce-overhead", fullgraph=True)
            for batch in batches:
                try:
                    fig = _transformers_batch(model, key, mode, batch, kwargs, args, bound)
                except Exception as e:  # noqa: BLE001 - a mode this version cannot run is reported, not fatal
                    report(f"  [{key}] transformers {mode}, batch {batch}: failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''})")
                    continue
                figures.append(fig)
                report(f"  [{key}] transformers {mode}, batch {batch}: {fmt_rate(fig.tok_s)} tok/s "
                       f"({fmt_share(fig.share)} of the {fmt_rate(fig.bound_tok_s)} tok/s bound)")
            model.forward = plain_forward
    finally:
        del model
        torch._dynamo.reset()
        free_cuda()
    return figures


def _transformers_batch(model: Any, key: str, mode: str, batch: int, kwargs: dict[str, Any],
                        args: argparse.Namespace, bound: float) -> Figure:
    import torch

    n = args.new_tokens
    gen = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD_ID, **kwargs)

    def prompts(seed: int) -> torch.Tensor:
        return torch.tensor(make_prompts(batch, args.prompt_len, seed), device=DEVICE)

    def once(ids: torch.Tensor) -> int:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        assert out.shape == (batch, args.prompt_len + n), out.shape
        return batch * n

    # Warm-ups: a compiled mode compiles on the first call and records its CUDA
    # graphs on the next ones.
    for w in range(3 if "compile_config" in kwargs or "graphs" in mode else 1):
        once(prompts(20_000 + w))
    times = []
    for r in range(args.repeat):
        ids = prompts(2000 * batch + r)
        secs, _ = timed(functools.partial(once, ids))
        times.append(secs)
    tokens = batch * n
    return Figure("transformers", key, mode, batch, n, tokens / min(times), times, batch * bound,
                  {"median_tok_s": tokens / statistics.median(times)})


# -- gRPC -----------------------------------------------------------------------------------


def run_grpc(key: str, model_dir: Path, args: argparse.Namespace, bound: float, report: Report,
             engine_process: bool = False) -> Figure | None:
    """`stencild serve` on this GPU (the offline engine's settings): C concurrent
    Generate streams of one request each; best of --repeat after two warm-ups.
    `engine_process`: with --engine-process (the engine core in a process of its own)."""
    from bench._server import EngineSteps, ServerProcess, engine_steps, free_port
    from bench.serve import pct, run_grpc_level

    conc = args.grpc_concurrency
    metrics_port = free_port()
    kv = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)] \
        if args.gpu_memory_utilization is not None else ["--kv-cache-gib", str(args.kv_cache_gib)]
    serve_args = ["--model", str(model_dir), "--device", DEVICE, "--dtype", "bfloat16", *kv,
                  "--max-num-seqs", str(max(conc, *args.batches)),
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-speech-model",
                  "--no-embedding-model", "--metrics-port", str(metrics_port), "--log-level", "INFO",
                  *(["--engine-process"] if engine_process else [])]
    tag = f"{key}, engine process" if engine_process else key
    start = time.perf_counter()
    server = ServerProcess(serve_args)
    address = f"127.0.0.1:{server.port}"
    try:
        left = report.seconds_left()
        server.wait_serving(address, timeout=900.0 if left is None else max(60.0, min(900.0, left)))
        report(f"  [{tag}] stencild serve up in {time.perf_counter() - start:.1f} s ({' '.join(serve_args[2:])})")
        asyncio.run(run_grpc_level(address, [make_prompts(conc, args.prompt_len, 30_000)], 8))
        asyncio.run(run_grpc_level(address, [make_prompts(conc, args.prompt_len, 30_001)], args.new_tokens))
        best: tuple[float, int, list[float], list[float], int] | None = None
        best_steps: EngineSteps | None = None
        times = []
        for r in range(args.repeat):
            before = engine_steps(metrics_port)
            run = asyncio.run(run_grpc_level(address, [make_prompts(conc, args.prompt_len, 3000 + r)],
                                             args.new_tokens))
            times.append(run[0])
            if best is None or run[1] / run[0] > best[1] / best[0]:
                best, best_steps = run, engine_steps(metrics_port).since(before)
        assert best_steps is not None
        # Slower steps, or more of them (requests admitted over several)? The offline run's are in its figure.
        report(f"  [{tag}] gRPC best run: {best_steps.describe()} (the server's metrics)")
        if args.profile_server and not engine_process:
            guarded(report, f"[{key}] --profile-server", profile_grpc, key, server, address, args, report)
    finally:
        server.stop()
        free_cuda()
    assert best is not None
    secs, tokens, ttft, itl, messages = best
    mode = f"{conc} concurrent streams" + (", engine process" if engine_process else "")
    return Figure("stencild gRPC", key, mode, conc, args.new_tokens, tokens / secs, times,
                  conc * bound, {"tokens": tokens, "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
                                 "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
                                 "messages_per_request": messages / conc, "server_steps": best_steps.steps,
                                 "server_step_ms": 1e3 * best_steps.seconds / max(best_steps.steps, 1),
                                 "server_cpu_ms_per_step": best_steps.cpu_ms_per_step()})


def grammar_mask(report: Report, vocabs: tuple[int, ...] = (32000, 128256), batch: int = 64) -> list[dict[str, Any]]:
    """The grammar mask applied to a step's logits (bench/mask_apply.py): the
    grammar package's tensor ops, which the engine used on CUDA before, against
    the Triton kernel it takes now, per vocabulary and kind of mask."""
    import torch

    from bench.mask_apply import compare

    rows = []
    for vocab in vocabs:
        for row in compare(torch.device(DEVICE), batch, vocab, kinds=("json", "random"), iters=10, repeat=3):
            report(f"  grammar mask, batch {batch} over {vocab:,} tokens ({row['mask']} mask): "
                   f"{1e3 * row['before_ms']:,.1f} us before, {1e3 * row['now_ms']:,.1f} us now")
            rows.append(row)
    return rows


def profile_kernels(key: str, model_dir: Path, report: Report) -> list[str]:
    """bench/gpu_profile.py's table for batch 1 (eager steps: the kernels a decode graph replays)."""
    from bench.gpu_profile import kernel_table

    lines = kernel_table(model_dir, batch=1, prompt_len=16, steps=16, top=25, device=DEVICE)
    report(f"  [{key}] kernels of a batch-1 decode step:")
    for line in lines:
        report("    " + line)
    free_cuda()
    return lines


def profile_grpc(key: str, server: Any, address: str, args: argparse.Namespace, report: Report) -> None:
    """py-spy on the server while the same streams run again (bench/pyspy.py): every
    running thread's samples, then only the GIL holder's; raw files beside the log."""
    from bench import pyspy
    from bench.serve import run_grpc_level

    if pyspy.available() is None:
        report(f"  [{key}] --profile-server: py-spy is not installed; no profile")
        return
    conc = args.grpc_concurrency
    for gil in (False, True):
        out = report.log_path.with_name(f"{report.log_path.stem}-{key}-grpc-{'gil' if gil else 'threads'}.txt")
        proc = pyspy.record(server.proc.pid, PROFILE_SECONDS, out, gil=gil)
        assert proc is not None
        rounds = 0
        while proc.poll() is None:  # keep the streams running for as long as py-spy samples
            asyncio.run(run_grpc_level(address, [make_prompts(conc, args.prompt_len, 5000 + rounds)],
                                       args.new_tokens))
            rounds += 1
        if proc.returncode != 0 or not out.exists():
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            report(f"  [{key}] py-spy failed ({proc.returncode}): {err[:300]}")  # its start: the error, not a backtrace
            report.raw(err)
            continue
        report(f"  [{key}] server profile, {'GIL holder only' if gil else 'running threads'} "
               f"({rounds} rounds of {conc} streams): {out.name}")
        for line in pyspy.summary(out.read_text()):
            report("    " + line)


# -- tests ------------------------------------------------------------------------------------


# Each test's name as it runs and every failure's report, so a run stopped at its
# time limit still says what passed, what failed and where it hung; a stuck
# test fails alone (pytest-timeout; faulthandler dumps the stacks first).
TEST_ARGS = ("-v", "-rfE", "-p", "no:cacheprovider", "-o", "timeout=150", "-o", "faulthandler_timeout=140")


def run_tests(report: Report, cap_s: float | None = None) -> dict[str, Any]:
    """`pytest -q tests/cuda` with CUDA required, for at most `cap_s` seconds (and
    not past the --budget-s deadline); its last line and exit status."""
    env = {**os.environ, "STENCILD_TEST_DEVICE": "cuda"}
    start = time.perf_counter()
    limits = [x for x in (report.seconds_left(), cap_s) if x is not None]
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", *TEST_ARGS, "tests/cuda"],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                             timeout=max(min(limits), 1.0) if limits else None)
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        report.raw("---- pytest tests/cuda (stopped at its time limit) ----\n" + out)
        summary = (f"stopped after {time.perf_counter() - start:.0f} s "
                   "(the --budget-s deadline or --tests-budget-s)")
        report(f"tests/cuda: {summary}")
        return {"summary": summary, "returncode": None}
    output = res.stdout + res.stderr
    report.raw("---- pytest tests/cuda ----\n" + output + "---- end of pytest ----")
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    summary = lines[-1].strip() if lines else f"no output (exit status {res.returncode})"
    report(f"tests/cuda: {summary} (exit status {res.returncode}, {time.perf_counter() - start:.0f} s)")
    return {"summary": summary, "returncode": res.returncode}


# -- targets -----------------------------------------------------------------------------------


def _pick(figures: list[Figure], system: str, model: str, batch: int, mode: str | None = None) -> Figure | None:
    for f in figures:
        if f.system == system and f.model == model and f.batch == batch and (mode is None or f.mode == mode):
            return f
    return None


DEFAULT_MODE = "graphs on, overlap on"
UNFUSED_MODE = DEFAULT_MODE + ", torch pointwise ops"
# At the largest batch, the default mode also samples as a chat client would
# (temperature, top-p, penalties) against greedy: what sampling costs a step.
SAMPLED_MODE = ", sampled (T 0.8, top-p 0.95, repetition 1.1, frequency 0.2)"


def sampled_params(new_tokens: int) -> Any:
    """The sampled run's parameters (SAMPLED_MODE)."""
    from engine import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2, seed=7,
                          max_new_tokens=new_tokens, ignore_eos=True)


def targets(figures: list[Figure], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The issue's targets, each with its figure and whether it is met (None: not measured)."""
    out: list[dict[str, Any]] = []
    biggest = max(args.batches)

    def add(name: str, figure: str, met: bool | None) -> None:
        out.append({"target": name, "figure": figure, "met": met})

    f = _pick(figures, "stencild", "8b", 1, DEFAULT_MODE)
    add("8B batch 1 >= 70 % of the bandwidth bound",
        f"{fmt_rate(f.tok_s)} tok/s = {fmt_share(f.share)} of {fmt_rate(f.bound_tok_s)}" if f else "not measured",
        f.share >= 0.70 if f else None)

    ours = _pick(figures, "stencild", "1.1b", 1, DEFAULT_MODE)
    hf = [x for x in figures if x.system == "transformers" and x.model == "1.1b" and x.batch == 1]
    best_hf = max(hf, key=lambda x: x.tok_s) if hf else None
    graphs_hf = next((x for x in hf if "CUDA graphs" in x.mode), None)
    ref = graphs_hf or best_hf
    if ours and ref:
        ratio = ours.tok_s / ref.tok_s
        add("1.1B batch 1 >= 1.5x transformers' best mode (static cache + CUDA graphs)",
            f"{fmt_rate(ours.tok_s)} vs {fmt_rate(ref.tok_s)} tok/s ({ref.mode}) = {ratio:.2f}x"
            + (f"; transformers' fastest here: {best_hf.mode}" if best_hf is not None and best_hf is not ref else ""),
            ratio >= 1.5 and (best_hf is None or ours.tok_s >= 1.5 * best_hf.tok_s))
    else:
        add("1.1B batch 1 >= 1.5x transformers' best mode (static cache + CUDA graphs)", "not measured", None)

    f = _pick(figures, "stencild", "1.1b", 64, DEFAULT_MODE)
    add("1.1B batch 64 >= 10,000 tok/s", f"{fmt_rate(f.tok_s)} tok/s" if f else "not measured",
        f.tok_s >= 10_000 if f else None)

    for model in ("1.1b", "8b"):
        on = _pick(figures, "stencild", model, 1, DEFAULT_MODE)
        off = _pick(figures, "stencild", model, 1, "graphs off, overlap on")
        if on or off or model == "1.1b":
            add(f"graphs on >= 1.5x off at batch 1 ({model})",
                f"{fmt_rate(on.tok_s)} vs {fmt_rate(off.tok_s)} tok/s = {on.tok_s / off.tok_s:.2f}x"
                if on and off else "not measured", on.tok_s >= 1.5 * off.tok_s if on and off else None)

    for model in ("1.1b", "8b"):
        plain = _pick(figures, "stencild", model, biggest, DEFAULT_MODE)
        schema = _pick(figures, "stencild", model, biggest, DEFAULT_MODE + ", JSON schema")
        if plain or schema or model == "1.1b":
            if plain and schema:
                per_plain = min(plain.seconds)
                per_schema = min(schema.seconds)
                text = (f"batch {biggest}, {plain.new_tokens} tokens each: {per_schema:.2f} s with the schema vs "
                        f"{per_plain:.2f} s without ({per_schema / per_plain:.2f}x; allowance "
                        f"{100 * SCHEMA_NOISE:.0f} % for noise)")
                met: bool | None = per_schema <= per_plain * (1 + SCHEMA_NOISE)
            else:
                text, met = "not measured", None
            add(f"JSON schema at batch {biggest} no slower per request than no schema ({model})", text, met)

    for model in ("1.1b", "8b"):
        # The better of the two ways to serve (engine thread, engine process).
        served = [f for f in figures if f.system == "stencild gRPC" and f.model == model
                  and f.batch == args.grpc_concurrency]
        g = max(served, key=lambda f: f.tok_s) if served else None
        off = _pick(figures, "stencild", model, args.grpc_concurrency, DEFAULT_MODE)
        if g or model == "1.1b":
            add(f"gRPC at concurrency {args.grpc_concurrency} >= 90 % of offline ({model})",
                f"{fmt_rate(g.tok_s)} vs {fmt_rate(off.tok_s)} tok/s = {fmt_share(g.tok_s / off.tok_s)} "
                f"({g.mode}); TTFT p50 {g.extra['ttft_p50_ms']:.0f} ms" if g and off else "not measured",
                g.tok_s >= 0.9 * off.tok_s if g and off else None)
    return out


def figure_notes(f: Figure, figures: list[Figure]) -> str:
    """The table's notes: gRPC's TTFT and share of offline, a schema run's forced
    tokens, what the fused pointwise kernels gain over torch ops."""
    if f.system == "stencild gRPC":
        off = _pick(figures, "stencild", f.model, f.batch, DEFAULT_MODE)
        share = f"{fmt_share(f.tok_s / off.tok_s)} of offline; " if off else ""
        return f"{share}TTFT p50 {f.extra['ttft_p50_ms']:.0f} ms"
    if f.system == "stencild" and "schema" in f.mode:
        return f"{f.extra['forced_tokens']} forced tokens"
    if f.system == "stencild" and f.mode.endswith(SAMPLED_MODE):
        greedy = _pick(figures, "stencild", f.model, f.batch, f.mode[:-len(SAMPLED_MODE)])
        return f"{f.tok_s / greedy.tok_s:.2f}x greedy's tok/s" if greedy else ""
    if f.system == "stencild" and f.mode == UNFUSED_MODE:
        fused = _pick(figures, "stencild", f.model, f.batch, DEFAULT_MODE)
        return (f"the fused kernels and the batch-1 GEMV (default mode) run {fused.tok_s / f.tok_s:.2f}x this"
                if fused else "")
    return ""


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "not met"


# -- main ---------------------------------------------------------------------------------------


def guarded(report: Report, what: str, fn: Callable[..., T], *fn_args: Any) -> T | None:
    """fn(*fn_args), or None when it fails: the failure is reported (its
    traceback goes to the log) and the rest of the benchmark still runs. Past
    the run's deadline (--budget-s) the part is skipped and reported so."""
    if report.past_deadline():
        report(f"  {what} skipped: past the --budget-s deadline")
        return None
    try:
        return fn(*fn_args)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - one part's failure is a result, not the end
        report(f"  {what} failed: {type(e).__name__}: {str(e)[:300]}")
        report.raw(traceback.format_exc())
        with contextlib.suppress(Exception):  # a broken device: the next part will say so
            free_cuda()
        return None


class HardStop(threading.Thread):
    """A part started before the --budget-s deadline can run far past it (a
    compile, a hung stream): `after_s` seconds from the start this writes the
    tables and JSON of what was measured, kills any server still running and
    ends the process, so a run under a caller's time limit still leaves them."""

    def __init__(self, report: Report, after_s: float, write: Callable[[], None],
                 exit: Callable[[int], Any] = os._exit):  # noqa: A002 - what it calls at the end
        super().__init__(name="bench-hard-stop", daemon=True)
        self.report, self.after_s, self.write, self.exit = report, after_s, write, exit

    def run(self) -> None:
        time.sleep(max(self.after_s, 0.0))
        from bench._server import ServerProcess

        self.report(f"\nhard stop: {self.after_s:.0f} s after the start a part is still running; "
                    "writing what was measured and exiting")
        with contextlib.suppress(Exception):
            ServerProcess.kill_all()
        try:
            self.write()
        finally:
            self.exit(3)


def default_out_dir() -> Path:
    cache = os.environ.get("STENCILD_CACHE")
    return Path(cache) / "gpu-bench" if cache else Path("/tmp/stencild-gpu-bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=None,
                   help="model shapes to run (default: 1.1b and 8b; --quick: 1.1b)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (--quick: 64)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per figure, best kept (default 3; --quick 2)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache of each engine (GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="size each engine's KV cache from this share of the GPU's memory instead")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--grpc-concurrency", type=int, default=64)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the checkpoints are written (default $STENCILD_CACHE/gpu-bench or /tmp)")
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--quick", action="store_true", help="the 1.1B shape only, 64 new tokens, 2 repeats")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-grpc", action="store_true")
    p.add_argument("--profile-server", action="store_true",
                   help="after the gRPC runs, sample the server with py-spy (bench/pyspy.py) while they run again")
    p.add_argument("--profile-kernels", action="store_true",
                   help="per model, the kernels of an eager batch-1 decode step by GPU time (bench/gpu_profile.py)")
    p.add_argument("--with-tests", action="store_true", help="run `pytest -q tests/cuda` first and record it")
    p.add_argument("--tests-budget-s", type=float, default=240.0, metavar="SECONDS",
                   help="stop `pytest tests/cuda` after SECONDS, so a slow or stuck test leaves the benchmark its time")
    p.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                   help="parts not started within SECONDS of the start are skipped (and pytest stopped there), "
                        "so a run under a time limit still writes its tables and JSON")
    p.add_argument("--overrun-s", type=float, default=75.0, metavar="SECONDS",
                   help="with --budget-s: a part still running this long past the deadline is cut short; "
                        "the tables and JSON of what was measured are written and the run exits")
    p.add_argument("--default-mode-only", action="store_true",
                   help=f"stencild offline in its default mode only ({DEFAULT_MODE})")
    args = p.parse_args(argv)
    args.models = args.models or (["1.1b"] if args.quick else ["1.1b", "8b"])
    args.new_tokens = args.new_tokens or (64 if args.quick else 128)
    args.repeat = args.repeat or (2 if args.quick else 3)
    args.out_dir = args.out_dir or default_out_dir()
    args.batches = sorted(set(args.batches))
    return args


def cuda_problem() -> str | None:
    """Why this process cannot benchmark a GPU, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device: torch {torch.__version__} ({build}) sees no GPU"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(f"bench/gpu.py: {problem}; this benchmark needs a CUDA GPU.", file=sys.stderr)
        return 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The kernel profile (torch.profiler) runs before transformers' CUDA graphs in this
    # process: CUPTI torn down after a profile can crash a later capture.
    os.environ.setdefault("TEARDOWN_CUPTI", "0")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    report = Report(args.results_dir / f"gpu-{stamp}.log", args.budget_s)
    info = device_info()
    report(f"# stencild GPU benchmark, {stamp}")
    report(f"device {info['device']} (sm {info['capability']}, {info['memory_gib']} GiB), driver {info['driver']}, "
           f"CUDA runtime {info['cuda_runtime']}; torch {info['torch']}, triton {info['triton']}, "
           f"transformers {info['transformers']}")
    report(f"workload: {args.prompt_len}-token random prompts, {args.new_tokens} new tokens, greedy, ignore_eos; "
           f"batches {args.batches}; best of {args.repeat} after a warm-up; models {args.models}")
    results: dict[str, Any] = {"when": stamp, "device": info, "args": {k: str(v) if isinstance(v, Path) else v
                                                                       for k, v in vars(args).items()}}
    figures: list[Figure] = []
    models: dict[str, Any] = {}
    partial: list[Figure] = []  # the model's stencild figures while its configurations run
    if args.budget_s is not None:
        HardStop(report, args.budget_s + args.overrun_s,
                 lambda: summarize(figures + partial, args, report, {**results, "models": models}, stamp)).start()
    if args.with_tests:
        results["tests"] = run_tests(report, args.tests_budget_s)

    bandwidth = copy_bandwidth()
    report(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (device-to-device, read + write, median of 10)")
    results["bandwidth_bytes_s"] = bandwidth
    results["grammar_mask"] = guarded(report, "grammar mask", grammar_mask, report)

    def saved(so_far: list[Figure]) -> None:
        partial[:] = so_far
        write_json(figures + partial, args, results, models, stamp)

    for key in args.models:
        shape = SHAPES[key]
        report(f"\n## {shape.label}")
        if report.past_deadline():
            report("  skipped: past the --budget-s deadline")
            continue
        start = time.perf_counter()
        model_dir = write_checkpoint(shape, args.out_dir)
        sizes = tensor_bytes(model_dir)
        total = sum(sizes.values())
        per_step = bytes_per_decode_step(sizes, shape.experts_per_token / shape.experts if shape.experts else 1.0)
        bound = bandwidth / per_step
        report(f"  checkpoint {model_dir} ready in {time.perf_counter() - start:.1f} s: {total / 1e9:.2f} GB of "
               f"weights, {per_step / 1e9:.2f} GB read per decode step (all but the input embeddings)")
        report(f"  batch-1 bandwidth bound: {bound:,.0f} tok/s ({bandwidth / 1e9:,.0f} GB/s / {per_step / 1e9:.2f} GB)")
        info_m: dict[str, Any] = {"checkpoint": str(model_dir), "weight_bytes": total, "bytes_per_step": per_step,
                                  "bound_tok_s": bound}
        models[key] = info_m
        figures += guarded(report, f"[{key}] stencild offline", run_stencild,
                           key, model_dir, args, bound, report, info_m, saved) or []
        partial.clear()
        write_json(figures, args, results, models, stamp)  # what is measured so far, should the run be killed
        if args.profile_kernels:
            info_m["kernels_batch1"] = guarded(report, f"[{key}] kernel profile", profile_kernels, key, model_dir,
                                               report)
        for engine_process in (() if args.skip_grpc else (False, True)):
            g = guarded(report, f"[{key}] gRPC", run_grpc, key, model_dir, args, bound, report, engine_process)
            if g is not None:
                figures.append(g)
                off = _pick(figures, "stencild", key, g.batch, DEFAULT_MODE)
                share = f"{fmt_share(g.tok_s / off.tok_s)} of offline batch {g.batch}" if off else "no offline figure"
                report(f"  [{key}] gRPC {g.mode}: {fmt_rate(g.tok_s)} tok/s ({share}; {fmt_share(g.share)} of the "
                       f"bound); TTFT p50 {g.extra['ttft_p50_ms']:.0f} ms, p99 {g.extra['ttft_p99_ms']:.0f} ms")
            write_json(figures, args, results, models, stamp)
        # Transformers last: its comparison's target is met; the open ones are measured above.
        if not args.skip_transformers:
            hf_batches = [1] if args.quick or key == "8b" else [b for b in (1, 16) if b in args.batches] or [1]
            figures += guarded(report, f"[{key}] transformers", run_transformers,
                               key, model_dir, hf_batches, args, bound, report) or []
        write_json(figures, args, results, models, stamp)

    results["models"] = models
    summarize(figures, args, report, results, stamp)
    return 0


def write_json(figures: list[Figure], args: argparse.Namespace, results: dict[str, Any], models: dict[str, Any],
               stamp: str) -> Path:
    """The run's JSON beside its log: its figures and targets so far."""
    results["models"] = models
    results["figures"] = [{**asdict(f), "share_of_bound": f.share} for f in figures]
    results["targets"] = targets(figures, args)
    json_path = args.results_dir / f"gpu-{stamp}.json"
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return json_path


def summarize(figures: list[Figure], args: argparse.Namespace, report: Report, results: dict[str, Any],
              stamp: str) -> None:
    """The run's table of figures and of targets, and its JSON beside the log."""
    json_path = write_json(figures, args, results, results.get("models", {}), stamp)
    goals = results["targets"]

    report("\n## Results\n")
    report("| model | system | mode | batch | tok/s | share of bound | notes |")
    report("|---|---|---|---:|---:|---:|---|")
    for f in figures:
        report(f"| {f.model} | {f.system} | {f.mode} | {f.batch} | {fmt_rate(f.tok_s)} | {fmt_share(f.share)} | "
               f"{figure_notes(f, figures)} |")
    report("\nBound: batch x (copy bandwidth / weight bytes read per decode step); KV-cache reads are not in it.\n")
    report("| target | figure | verdict |")
    report("|---|---|---|")
    for goal in goals:
        report(f"| {goal['target']} | {goal['figure']} | {verdict(goal['met'])} |")
    if "tests" in results:
        report(f"\ntests/cuda: {results['tests']['summary']}")
    report(f"\nwrote {report.log_path} and {json_path}")


if __name__ == "__main__":
    sys.exit(main())
