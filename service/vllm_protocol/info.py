"""What the vLLM protocol's info RPCs report: model, server, loads, tokenizer files.

All of it is read from the engine's own state: `GetLoads` from
`EngineCore.load()` (the scheduler's queues and the KV pages in use, the same
numbers as `/metrics`), `GetModelInfo` from the checkpoint the engine loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from engine import EngineCore
from service.engine_loop import EngineLoop
from service.gen.vllm import vllm_engine_pb2 as vpb

# The files a Hugging Face tokenizer loads from its directory (the router
# builds its tokenizer from them); weights and the model config stay behind,
# except config.json, which tokenizer loaders read for the model type.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "config.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "vocab.txt")
TOKENIZER_CHUNK_BYTES = 512 * 1024


def _checkpoint_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def model_info(engine: EngineCore, served_name: str) -> vpb.GetModelInfoResponse:
    """The model's facts; `tokenizer_path` is the checkpoint directory on this
    host (a router on the same host loads it; elsewhere it calls GetTokenizer)."""
    model_dir = Path(engine.config.model).resolve()
    cfg = _checkpoint_config(model_dir)
    hf = engine.tokenizer.hf
    return vpb.GetModelInfoResponse(
        model_path=str(model_dir),
        is_generation=True,
        max_context_length=engine.max_model_len,
        vocab_size=engine.vocab_size,
        supports_vision=False,
        served_model_name=served_name,
        tokenizer_path=str(model_dir),
        model_type=str(cfg.get("model_type", "")),
        architectures=[str(a) for a in cfg.get("architectures", [engine.model_config.architecture])],
        eos_token_ids=sorted(engine.eos_token_ids),
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else -1,
        bos_token_id=hf.bos_token_id if hf.bos_token_id is not None else -1,
        max_req_input_len=engine.max_model_len - 1,
        # The checkpoint's generation_config.json sampling values, as vLLM
        # reports them: a router (SMG) applies them to requests that leave
        # them unset, since this protocol's fields cannot say "unset".
        default_sampling_params_json=(json.dumps(engine.sampling_defaults, separators=(",", ":"), sort_keys=True)
                                      if engine.sampling_defaults else ""),
    )


def server_info(loop: EngineLoop, paused: bool, last_receive: float, uptime_s: float) -> vpb.GetServerInfoResponse:
    cfg = loop.engine.config
    return vpb.GetServerInfoResponse(
        active_requests=loop.num_pending,
        is_paused=paused,
        last_receive_timestamp=last_receive,
        uptime_seconds=uptime_s,
        server_type="vllm-grpc",  # the protocol spoken; the engine is stencild's own
        data_parallel_size=1,
        kv_cache_dtype="auto",
        block_size=cfg.page_size,
        model_dtype=str(cfg.torch_dtype),
        max_num_seqs=cfg.max_num_seqs,
        # With a reasoning parser a request's grammar waits for the thought's
        # end (unless grammar_from_first_token): "after_reasoning", as vLLM
        # reports it with enable_in_reasoning off.
        engine_reasoning_parser=cfg.reasoning_parser or "",
        constrained_decoding_start="after_reasoning" if cfg.reasoning_parser else "first_token",
    )


def loads(loop: EngineLoop, version: str) -> vpb.GetLoadsResponse:
    """One rank's load from the engine's counters. Requests admitted that the
    engine thread has not picked up yet count as waiting."""
    engine = loop.engine
    load = engine.load()
    waiting = load.waiting + max(0, loop.num_pending - load.running - load.waiting)
    page = engine.config.page_size
    return vpb.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=version,
        dp_rank_count=1,
        loads=[vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=load.running,
            num_waiting_reqs=waiting,
            num_total_reqs=load.running + waiting,
            num_used_tokens=load.kv_pages_used * page,
            max_total_num_tokens=load.kv_pages_total * page,
            token_usage=load.kv_usage,
            max_running_requests=engine.config.max_num_seqs,
            utilization=load.kv_usage,
        )],
    )


def tokenizer_zip(model_dir: Path) -> tuple[bytes, str]:
    """The tokenizer's files as a zip archive (flat, deterministic) and its SHA-256."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            path = model_dir / name
            if path.is_file():
                # A fixed timestamp: the same files always make the same archive.
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()
