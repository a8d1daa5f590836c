"""The `stencild` command: serve, generate, embed, say, make-model.

`serve` (service/cli/serve.py) without --model runs the built-in demo model
(random weights: it produces random text), the demo speech pair unless
--no-speech-model, and the all-MiniLM-L6-v2 embedding model unless
--no-embedding-model. Heavy imports (torch, the engine) happen only in the
subcommands that need them, so `stencild generate`, `embed`
(service/cli/client.py) and `say` (service/cli/say.py) start quickly.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from service.cli.client import add_embed, add_generate, cmd_embed, cmd_generate
from service.cli.say import add_say, cmd_say
from service.cli.serve import add_serve, cmd_serve


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a built-in random-weight checkpoint",
                       description="Write a preset checkpoint (random weights) as a HF directory.")
    p.add_argument("--preset", default="demo",
                   help="demo, demo-speech, bench, tiny-llama, tiny-llama-tied, tiny-mistral, tiny-qwen2, "
                        "tiny-qwen3, tiny-reasoning, or a SNAC decoder: demo-codec, tiny-codec")
    p.add_argument("dir", type=Path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stencild", description="gRPC inference server for "
                                     "language models whose outputs must follow a shape.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_generate(sub)
    add_embed(sub)
    add_say(sub)
    _add_make_model(sub)
    return parser


def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.presets import CODEC_PRESETS, PRESETS, write_preset

    if args.preset not in PRESETS and args.preset not in CODEC_PRESETS:
        print(f"stencild: unknown preset {args.preset!r}; choose from "
              f"{', '.join(sorted([*PRESETS, *CODEC_PRESETS]))}", file=sys.stderr)
        return 2
    out = write_preset(args.preset, args.dir)
    print(f"wrote the {args.preset} preset to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "embed": cmd_embed, "say": cmd_say,
                "make-model": cmd_make_model}
    return handlers[args.command](args)

