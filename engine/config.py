"""Engine configuration (frozen, validated at construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from grammar import SchemaStore

from .devices import DeviceOptions, validate_device_dtype
from .reasoning import PARSERS


@dataclass(frozen=True)
class EngineConfig(DeviceOptions):
    """Everything needed to build an engine for one model.

    dtype None means float32 on CPU and bfloat16 on CUDA. kv_cache_gib sizes the
    page tensor, unless gpu_memory_utilization (CUDA: the share of the GPU's
    memory the engine may fill, weights included, as in vLLM) sizes it from
    what is left once the model is loaded; max_model_len None means the
    model's own context length. attention: "auto" (chosen at start-up by
    probing the device and PyTorch), "torch" or "triton". cuda_graphs: "auto"
    (decode steps replay CUDA graphs on CUDA), "off" (`--enforce-eager`), or
    "emulate" (the graph path's static buffers without capture, on any
    device: how CPU tests run it).
    num_steps > 1 lets decode-only batches run several steps per schedule
    (overlap off only). overlap runs the forward pass of step N+1 while the
    host processes step N.
    """

    model: str
    device: str = "cpu"
    dtype: str | None = None
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float | None = None
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # "auto": a request's unset sampling values come from the checkpoint's
    # generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty), as vLLM's default; "vllm": the engine's own defaults.
    generation_config: str = "auto"
    num_steps: int = 1
    attention: str = "auto"
    cuda_graphs: str = "auto"
    overlap: bool = True
    # Schedule constrained requests before their last token is known (see
    # SchedulerConfig.speculative_constrained); off: forced runs take one pass.
    # None: on where decode graphs run, which feed forced runs a token per step
    # anyway (SchedulerConfig.decode_shaped), so waiting would only cost overlap.
    speculative_constrained: bool | None = None
    # CPU fp32: a second, blocked copy of the weights for batches of <= 16 tokens
    # (decoding ~1.6x faster at batch 1; doubles fp32 weight memory).
    cpu_small_batch_gemm: bool = True
    grammar_backend: str = "auto"
    grammar_compile_timeout_s: float = 10.0
    # Native threads filling a step's bitmask rows (grammar.CompilerConfig.
    # mask_threads); None: chosen from the host's cores and the device at
    # start-up (cpu_features.mask_threads_for), and logged.
    grammar_mask_threads: int | None = None
    # Documents a JSON schema's `$ref` may name by URI, as "URI_PREFIX=DIR"
    # (grammar.schema_store): read from disk, never fetched.
    schema_store: tuple[str, ...] = ()
    # A SNAC codec directory: makes a speech LM checkpoint serve speech requests.
    speech_codec: str | None = None
    # A reasoning parser (reasoning.PARSERS: "deepseek_r1", "qwen3"): a
    # request's constraint then starts after the model's thought, and
    # outputs report the thought and the answer apart. None: no parser.
    reasoning_parser: str | None = None
    # The thinking budget of requests that set none (reasoning.py): once a
    # thought has this many tokens its end marker is forced. None: no budget.
    max_thinking_tokens: int | None = None

    def __post_init__(self) -> None:
        validate_device_dtype(self.device, self.dtype)
        if not 0 < self.kv_cache_gib < math.inf:
            raise ValueError("kv_cache_gib must be > 0 and finite")
        if not 1 <= self.page_size <= 64:
            raise ValueError("page_size must be in [1, 64]")
        if self.attention not in ("auto", "torch", "triton"):
            raise ValueError("attention must be auto, torch or triton")
        if self.cuda_graphs not in ("auto", "off", "emulate"):
            raise ValueError("cuda_graphs must be auto, off or emulate")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError("generation_config must be auto or vllm")
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ValueError("gpu_memory_utilization must be in (0, 1]")
            if self.torch_device.type != "cuda":
                raise ValueError("gpu_memory_utilization applies to CUDA devices only")
        if self.grammar_backend not in ("auto", "xgrammar", "llguidance"):
            raise ValueError("grammar_backend must be auto, xgrammar or llguidance")
        if not 0 < self.grammar_compile_timeout_s < math.inf:
            raise ValueError("grammar_compile_timeout_s must be > 0 and finite")
        if self.grammar_mask_threads is not None and self.grammar_mask_threads < 1:
            raise ValueError("grammar_mask_threads must be >= 1")
        SchemaStore.parse(self.schema_store)  # ValueError: a bad mapping or a missing directory
        if self.overlap and self.num_steps > 1:
            raise ValueError("num_steps > 1 needs overlap=False")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        # Checked again by the scheduler, but only after the weights and the cache are loaded.
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of "
                             f"{', '.join(sorted(PARSERS))}")
        if self.max_thinking_tokens is not None:
            if self.reasoning_parser is None:
                raise ValueError("max_thinking_tokens needs a reasoning parser")
            if self.max_thinking_tokens < 0:
                raise ValueError("max_thinking_tokens must be >= 0")
