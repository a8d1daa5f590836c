"""Client subcommands of `stencild`: `generate` and `embed` against a running server.

Only grpc and the generated stubs are imported (no torch), so they start quickly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from service.cli.connect import add_connection_args, call_metadata, open_channel
from service.cli.flags import BadFlag, refuse, set_flags

_BACKENDS = ("auto", "xgrammar", "llguidance")
_WHITESPACE = ("compact", "flexible", "pretty")


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running server",
                       description="Send a prompt to a running stencild and stream the text.")
    p.add_argument("prompt", help="the prompt text")
    add_connection_args(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", default=None, help="a system message (implies --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--usage", action="store_true", help="print the finish reason and token counts to stderr")
    p.add_argument("--max-thinking-tokens", type=int, default=None, metavar="N",
                   help="reasoning models: the thought's budget (its text goes to stderr)")
    shape = p.add_argument_group("structured output (at most one)")
    kind = shape.add_mutually_exclusive_group()
    kind.add_argument("--json-schema", type=Path, metavar="FILE", help="a JSON Schema file ('-': stdin)")
    kind.add_argument("--json-object", action="store_true", help="any JSON object")
    kind.add_argument("--regex", help="a regular expression the output must match")
    kind.add_argument("--choice", action="append", help="one allowed output (repeatable)")
    kind.add_argument("--ebnf", type=Path, metavar="FILE", help="an EBNF (GBNF) grammar file, rule `root`")
    kind.add_argument("--lark", type=Path, metavar="FILE", help="a Lark grammar file, rule `start`")
    kind.add_argument("--structural-tag", type=Path, metavar="FILE",
                      help="a structural tag (vLLM's or xgrammar's JSON format) file")
    shape.add_argument("--grammar-backend", choices=_BACKENDS, default=None,
                       help="grammar library (default: the server's)")
    shape.add_argument("--whitespace", choices=_WHITESPACE, default=None,
                       help="JSON layout (default: compact)")
    shape.add_argument("--strict", action="store_true",
                       help="with --json-schema: refuse a schema that cannot be enforced whole, "
                            "and end SCHEMA_VIOLATION if the output still breaks it")
    shape.add_argument("--no-resample", action="store_true",
                       help="with --json-schema: keep values that break a keyword the grammar "
                            "cannot enforce (by default they are resampled), so every token "
                            "streams at once; the finished output is still validated")


def add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embed texts with a running server",
                       description="Embed texts with a running stencild. Prints one vector per "
                                   "input (JSON), or with --similarity the cosine similarities.")
    p.add_argument("texts", nargs="+", help="the texts to embed")
    add_connection_args(p)
    p.add_argument("--dimensions", type=int, default=None, help="keep the first N components")
    p.add_argument("--no-normalize", action="store_true", help="return vectors as pooled")
    p.add_argument("--truncate", action="store_true", help="cut inputs over the model's limit")
    p.add_argument("--similarity", action="store_true",
                   help="print the matrix of cosine similarities instead of the vectors")
    p.add_argument("--usage", action="store_true", help="print the model and token count to stderr")


def _read(path: Path, flag: str) -> str:
    """A schema or grammar file's text ("-": stdin); BadFlag if it cannot be read as UTF-8 text."""
    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BadFlag(flag, err) from None


def _constraint(args: argparse.Namespace, pb: Any) -> Any | None:
    c = pb.Constraint()
    if args.json_schema is not None:
        c.json_schema = _read(args.json_schema, "--json-schema")
    elif args.json_object:
        c.json_object = True
    elif args.regex is not None:
        c.regex = args.regex
    elif args.choice:
        c.choice.choices.extend(args.choice)
    elif args.ebnf is not None:
        c.ebnf = _read(args.ebnf, "--ebnf")
    elif args.lark is not None:
        c.lark = _read(args.lark, "--lark")
    elif args.structural_tag is not None:
        c.structural_tag = _read(args.structural_tag, "--structural-tag")
    else:
        # The constraint's options alone: the server would refuse a constraint
        # with no kind without naming any flag.
        given = [flag for flag, on in (("--grammar-backend", args.grammar_backend is not None),
                                       ("--whitespace", args.whitespace is not None),
                                       ("--strict", args.strict), ("--no-resample", args.no_resample)) if on]
        if given:
            raise BadFlag(given[0], ValueError("needs a constraint: --json-schema, --json-object, --regex, "
                                               "--choice, --ebnf, --lark or --structural-tag"))
        return None
    if args.grammar_backend is not None:
        c.backend = pb.Constraint.Backend.Value(f"BACKEND_{args.grammar_backend.upper()}")
    if args.whitespace is not None:
        c.whitespace = pb.Constraint.Whitespace.Value(f"WHITESPACE_{args.whitespace.upper()}")
    c.strict = args.strict
    if args.no_resample:
        c.resample = False
    return c


def _print_usage(done: Any, pb: Any, constrained: bool) -> None:
    """The finish reason and token counts, and for JSON outputs how the schema
    fared: `[EOS] prompt 5 tokens, completion 20 tokens, 12 forced, 1 resampled;
    schema VALID; not enforced token by token: uniqueItems`."""
    reason = pb.GenerateComplete.FinishReason.Name(done.finish_reason)
    line = f"[{reason}] prompt {done.usage.prompt_tokens} tokens, completion {done.usage.completion_tokens} tokens"
    if constrained:
        line += f", {done.usage.forced_tokens} forced"
    if done.usage.schema_retries:
        line += f", {done.usage.schema_retries} resampled"
    result = done.schema_validation.result
    if result:
        line += f"; schema {pb.SchemaValidation.Result.Name(result)}"
        if result == pb.SchemaValidation.INVALID:
            v = done.schema_validation
            line += f" at '{v.instance_path}' ({v.keyword}): {v.message}"
    if done.unenforced_keywords:
        line += "; not enforced token by token: " + ", ".join(done.unenforced_keywords)
    if done.thought:
        line += (f"; thought {pb.GenerateComplete.Thought.Name(done.thought).removeprefix('THOUGHT_').lower()}, "
                 f"{done.usage.reasoning_tokens} tokens")
    print(line, file=sys.stderr)


def _error(err: Any) -> int:
    print(f"stencild: {err.code().name}: {err.details()}", file=sys.stderr)
    return 1


def _generate_request(args: argparse.Namespace, pb: Any) -> Any:
    """The GenerateRequest of `args`; BadFlag names a flag its field cannot
    hold, or whose schema or grammar file cannot be read."""
    req = pb.GenerateRequest()
    if args.chat or args.system is not None:
        if args.system:
            req.chat.messages.add(role="system", content=args.system)
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    set_flags(args, [("--temperature", req.sampling, "temperature"), ("--top-p", req.sampling, "top_p"),
                     ("--top-k", req.sampling, "top_k"), ("--seed", req.sampling, "seed"),
                     ("--max-new-tokens", req.stopping, "max_new_tokens"),
                     ("--max-thinking-tokens", req.reasoning, "max_thinking_tokens")])
    req.stopping.stop.extend(args.stop)
    req.response.return_token_ids = False
    constraint = _constraint(args, pb)
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    return req


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from service.gen.stencil.v1 import generate_pb2 as pb
    from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc

    try:
        req = _generate_request(args, pb)
        metadata = call_metadata(args)
    except BadFlag as err:
        return refuse(err)
    constrained = req.HasField("constraint")
    with open_channel(args) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(req, timeout=args.timeout, metadata=metadata)
        try:
            for msg in call:
                if msg.HasField("chunk"):
                    if msg.chunk.reasoning:  # a reasoning model's thought, apart from its answer
                        sys.stderr.write(msg.chunk.reasoning)
                        sys.stderr.flush()
                    sys.stdout.write(msg.chunk.text)
                    sys.stdout.flush()
                else:
                    done = msg.complete
                    sys.stdout.write("\n")
                    if args.usage:
                        _print_usage(done, pb, constrained=constrained)
        except KeyboardInterrupt:
            call.cancel()
            sys.stdout.write("\n")
            return 130
        except grpc.RpcError as err:
            sys.stdout.write("\n")
            return _error(err)
    return 0


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def cmd_embed(args: argparse.Namespace) -> int:
    import grpc

    from service.gen.stencil.v1 import embed_pb2 as pb
    from service.gen.stencil.v1 import embed_pb2_grpc as pb_grpc

    req = pb.EmbedRequest(inputs=args.texts, truncate=args.truncate)
    if args.no_normalize:
        req.normalize = False
    try:
        set_flags(args, [("--dimensions", req, "dimensions")])
        metadata = call_metadata(args)
    except BadFlag as err:
        return refuse(err)
    with open_channel(args) as channel:
        try:
            resp = pb_grpc.EmbeddingsStub(channel).Embed(req, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as err:
            return _error(err)
    vectors = [list(e.values) for e in resp.embeddings]
    if args.similarity:
        width = max(len(str(i)) for i in range(len(vectors)))
        for i, text in enumerate(args.texts):
            print(f"[{i:>{width}}] {text}")
        print(" " * (width + 2) + " ".join(f"{f'[{j}]':>7}" for j in range(len(vectors))))
        for i, a in enumerate(vectors):
            print(f"[{i:>{width}}]" + " ".join(f"{cosine(a, b):7.4f}" for b in vectors))
    else:
        for v in vectors:
            print(json.dumps([round(x, 6) for x in v]))
    if args.usage:
        print(f"{resp.model}: {len(vectors)} vectors of {resp.dimensions}, "
              f"{resp.usage.prompt_tokens} prompt tokens", file=sys.stderr)
    return 0
