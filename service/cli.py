"""The `stencild` command: serve, generate, make-model.

`serve` without --model runs the built-in demo model (random weights: it
produces random text). Heavy imports (torch, the engine) happen only in the
subcommands that need them, so `stencild generate` starts quickly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_PORT = 50051


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC",
                       description="Serve a model over gRPC (stencil.v1.Generation, health, reflection).")
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


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running server",
                       description="Send a prompt to a running stencild and stream the text.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--usage", action="store_true", help="print the finish reason and token counts to stderr")


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
    _add_generate(sub)
    _add_make_model(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine import EngineConfig, EngineCore
    from engine.presets import PRESETS, ensure_preset

    from .engine_loop import AdmissionLimits
    from .server import ServerConfig, serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            print(f"stencild: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
            return 2
        model_dir, model_name = args.model, str(args.model)
    else:
        preset = args.preset or "demo"
        if preset not in PRESETS:
            print(f"stencild: unknown preset {preset!r}; choose from {', '.join(sorted(PRESETS))}",
                  file=sys.stderr)
            return 2
        if preset == "demo":
            logging.getLogger("stencild").info("no --model given: serving the built-in demo model "
                                               "(random weights, random text)")
        model_dir, model_name = ensure_preset(preset), preset
    # Passed only when asked, so the CLI works with engines that lack the option.
    extra: dict[str, Any] = {"overlap": False} if args.no_overlap else {}
    try:
        engine_config = EngineConfig(
            model=str(model_dir), device=args.device, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
            page_size=args.page_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, num_steps=args.num_steps, **extra,
        )
        config = ServerConfig(
            host=args.host, port=args.port, grace_period_s=args.grace_period,
            max_message_bytes=int(args.max_message_mb * 1024 * 1024), warmup=not args.no_warmup,
            admission=AdmissionLimits(args.max_pending_requests, args.max_pending_tokens),
        )
    except (ValueError, TypeError) as err:  # TypeError: an option this engine does not have
        print(f"stencild: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(lambda: EngineCore(engine_config), model_name, config))
    except OSError as err:
        print(f"stencild: {err}", file=sys.stderr)
        return 1


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from .gen.stencil.v1 import generate_pb2 as pb
    from .gen.stencil.v1 import generate_pb2_grpc as pb_grpc

    req = pb.GenerateRequest()
    if args.chat:
        if args.system:
            req.chat.messages.add(role="system", content=args.system)
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(req.sampling, name, value)
    req.stopping.max_new_tokens = args.max_new_tokens
    req.stopping.stop.extend(args.stop)
    req.response.return_token_ids = False
    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        call = pb_grpc.GenerationStub(channel).Generate(req, timeout=args.timeout)
        try:
            for msg in call:
                if msg.HasField("chunk"):
                    sys.stdout.write(msg.chunk.text)
                    sys.stdout.flush()
                else:
                    done = msg.complete
                    sys.stdout.write("\n")
                    if args.usage:
                        reason = pb.GenerateComplete.FinishReason.Name(done.finish_reason)
                        print(f"[{reason}] prompt {done.usage.prompt_tokens} tokens, completion "
                              f"{done.usage.completion_tokens} tokens", file=sys.stderr)
        except KeyboardInterrupt:
            call.cancel()
            sys.stdout.write("\n")
            return 130
        except grpc.RpcError as err:
            sys.stdout.write("\n")
            print(f"stencild: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


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
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "make-model": cmd_make_model}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
