"""Random-weight checkpoints in the Hugging Face layout, written by `transformers`.

Nothing can be downloaded at run time, so tests, benchmarks and the demo server
use checkpoints made here: real architectures (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, Gemma 3),
random weights from a fixed seed, saved as safetensors with the committed demo
tokenizer. `write_preset` writes one to a directory; `ensure_preset` caches it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.paths import cache_root

TOKENIZER_DIR = Path(__file__).parent / "tokenizer"
# Bumped whenever a preset's weights or files change, so caches refresh.
PRESET_VERSION = 1

# Token ids fixed by the committed tokenizer (see train_tokenizer.SPECIAL_TOKENS).
BOS_ID, END_OF_TEXT_ID, IM_START_ID, IM_END_ID, PAD_ID = 0, 1, 2, 3, 4

# The "reasoning" tokenizer: the demo tokenizer plus the markers of a reasoning
# model's thought and of Hermes/Qwen tool calls, as added tokens that are not
# special (as in Qwen3's tokenizer), right after the demo vocabulary.
REASONING_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
THINK_ID, END_THINK_ID, TOOL_CALL_ID, END_TOOL_CALL_ID = 8192, 8193, 8194, 8195
# A Qwen3-style chat template: tools in the system turn, and the assistant turn
# opened inside a thought (`<think>` in the prompt) unless the template
# argument enable_thinking is false (then the thought is given closed).
REASONING_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    """A named model shape; `config` holds the fields of the HF config class."""

    architecture: str
    config: dict[str, Any]
    seed: int = 0
    # Raising the init scale spreads the logits of a random model, so greedy
    # choices are not decided by rounding noise.
    initializer_range: float = 0.02
    generation_config: dict[str, Any] = field(default_factory=dict)
    # Speech LMs: token ids of the speech markers and audio codes (see engine.speech.layout).
    speech_layout: dict[str, int] | None = None
    # "demo": the committed tokenizer; "reasoning": it plus REASONING_TOKENS
    # and REASONING_CHAT_TEMPLATE.
    tokenizer: str = "demo"
    # Mixture-of-experts routers' weights scaled by this: a token's chosen
    # experts then lead the others by more than 16-bit rounding moves a
    # router's logits, so a bfloat16 run picks the experts float32 does. (At
    # the common init tiny-mixtral's bfloat16 log-probabilities, ours and
    # transformers', were up to 0.9 apart and from float32's; scaled by 8,
    # 0.08.)
    router_scale: float = 1.0
    # Norm weights drawn around 1 (1 + this x N(0, 1)) instead of transformers'
    # ones: a norm applied to the wrong dims, or its weights in the wrong
    # order, then changes the logits.
    norm_jitter: float = 0.0


def _llama_like(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "vocab_size": 8192,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": END_OF_TEXT_ID,
        "pad_token_id": PAD_ID,
    }
    base.update(overrides)
    return base


_TEST_INIT = 0.08
ROUTER_SCALE = 8.0

PRESETS: dict[str, Preset] = {
    # ~10M parameters: the model `stencild serve` runs when no --model is given.
    "demo": Preset(
        "LlamaForCausalLM",
        _llama_like(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=10,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
        seed=1234,
        initializer_range=_TEST_INIT,
    ),
    # A speech LM in the Orpheus layout: the demo vocabulary, then speech markers
    # (8192..8197), then 7 x 4096 audio-code tokens from 8208.
    "demo-speech": Preset(
        "LlamaForCausalLM",
        _llama_like(
            vocab_size=8208 + 7 * 4096,
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        seed=777,
        initializer_range=_TEST_INIT,
        speech_layout={
            "audio_token_offset": 8208, "codebook_size": 4096, "start_of_human": 8192,
            "end_of_text": IM_END_ID, "end_of_human": 8193, "start_of_ai": 8194,
            "start_of_speech": 8196, "end_of_speech": 8197, "end_of_ai": 8195,
        },
    ),
    # The benchmark model of BENCHMARKS.md (the one compared with vLLM): 111M parameters, fp32.
    "bench": Preset(
        "LlamaForCausalLM",
        _llama_like(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
        seed=4321,
    ),
    # Tiny checkpoints, one per supported architecture feature.
    "tiny-llama": Preset(
        "LlamaForCausalLM",
        _llama_like(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
        seed=1,
        initializer_range=_TEST_INIT,
    ),
    "tiny-llama-tied": Preset(
        "LlamaForCausalLM",
        _llama_like(tie_word_embeddings=True, num_key_value_heads=1),
        seed=2,
        initializer_range=_TEST_INIT,
    ),
    "tiny-mistral": Preset(
        "MistralForCausalLM",
        _llama_like(sliding_window=None, head_dim=16),
        seed=3,
        initializer_range=_TEST_INIT,
    ),
    "tiny-qwen2": Preset(
        "Qwen2ForCausalLM",
        # A vocabulary larger than the tokenizer's, as real checkpoints pad it.
        _llama_like(vocab_size=8320, use_sliding_window=False, rope_theta=1000000.0),
        seed=4,
        initializer_range=_TEST_INIT,
    ),
    "tiny-qwen3": Preset(
        "Qwen3ForCausalLM",
        # Qwen3 sets head_dim apart from hidden_size / num_heads.
        _llama_like(head_dim=32, tie_word_embeddings=True, use_sliding_window=False),
        seed=5,
        initializer_range=_TEST_INIT,
        norm_jitter=0.2,  # its per-head q/k norms' weights, permuted as the heads are, then count
    ),
    # Phi-3: q|k|v and gate|up fused in the checkpoint, and (as Phi-3-mini's
    # 2047 of 4096) a sliding window shorter than the tests' longer prompts.
    "tiny-phi3": Preset(
        "Phi3ForCausalLM",
        _llama_like(sliding_window=24),
        seed=7,
        initializer_range=_TEST_INIT,
    ),
    # Granite: granite-3.1-2b's multipliers (embedding x12, each block's
    # output x0.22, scores x1/64 instead of 1/sqrt(16), logits / 8).
    "tiny-granite": Preset(
        "GraniteForCausalLM",
        _llama_like(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                    logits_scaling=8.0, tie_word_embeddings=True),
        seed=8,
        initializer_range=_TEST_INIT,
    ),
    # Gemma 3 (text): sandwich norms stored as (w - 1), GELU, sqrt(hidden) x the
    # embedding, scores x 1/sqrt(24), soft-capped logits, and a sliding layer
    # (window 16, theta 1e4) beside a full one (theta 1e6, linear x2).
    "tiny-gemma3": Preset(
        "Gemma3ForCausalLM",
        _llama_like(head_dim=32, tie_word_embeddings=True, sliding_window=16, query_pre_attn_scalar=24,
                    final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        seed=9,
        initializer_range=_TEST_INIT,
        norm_jitter=0.2,
    ),
    # Mixture-of-experts MLPs: Mixtral's (2 of 4 experts per token, on every
    # layer) and Qwen3-MoE's (q/k norms; 3 of 6 experts, their weights not
    # rescaled, on the second layer only; the first a dense MLP).
    "tiny-mixtral": Preset(
        "MixtralForCausalLM",
        _llama_like(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
        seed=12,
        initializer_range=_TEST_INIT,
        router_scale=ROUTER_SCALE,
    ),
    "tiny-qwen3-moe": Preset(
        "Qwen3MoeForCausalLM",
        _llama_like(head_dim=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
                    norm_topk_prob=False, mlp_only_layers=[0], use_sliding_window=False),
        seed=13,
        initializer_range=_TEST_INIT,
        router_scale=ROUTER_SCALE,
    ),
    # Granite MoE: Granite's four multipliers and 2 of 4 experts on every
    # layer, stored stacked.
    "tiny-granitemoe": Preset(
        "GraniteMoeForCausalLM",
        _llama_like(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                    logits_scaling=8.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
        seed=18,
        initializer_range=_TEST_INIT,
        router_scale=ROUTER_SCALE,
    ),
    # Qwen2-MoE: Qwen2's q/k/v biases, 2 of 4 experts on every layer beside a
    # shared expert scaled by its sigmoid gate.
    "tiny-qwen2-moe": Preset(
        "Qwen2MoeForCausalLM",
        _llama_like(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    shared_expert_intermediate_size=64, use_sliding_window=False),
        seed=17,
        initializer_range=_TEST_INIT,
        router_scale=ROUTER_SCALE,
    ),
    # OLMoE: Llama's blocks with OLMo's q/k norms over all heads, and 2 of 4
    # experts on every layer, their weights not rescaled.
    "tiny-olmoe": Preset(
        "OlmoeForCausalLM",
        _llama_like(num_experts=4, num_experts_per_tok=2, intermediate_size=48, norm_topk_prob=False),
        seed=16,
        initializer_range=_TEST_INIT,
        router_scale=ROUTER_SCALE,
        norm_jitter=0.2,
    ),
    # OLMo 2: no norm before the attention or the MLP, norms on their outputs,
    # and q/k norms over all heads at once.
    "tiny-olmo2": Preset(
        "Olmo2ForCausalLM",
        _llama_like(),
        seed=14,
        initializer_range=_TEST_INIT,
        norm_jitter=0.2,
    ),
    # OLMo 3: OLMo 2's blocks, a sliding layer (window 16, theta 1e4) beside a
    # full one (theta 5e5, yarn x2 over 256 positions).
    "tiny-olmo3": Preset(
        "Olmo3ForCausalLM",
        _llama_like(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5e5,
                                                        "original_max_position_embeddings": 256},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        seed=15,
        initializer_range=_TEST_INIT,
        norm_jitter=0.2,
    ),
    # Gemma (1): Llama's blocks with norms stored as (w - 1), GELU and a
    # sqrt(hidden) x embedding.
    "tiny-gemma": Preset(
        "GemmaForCausalLM",
        _llama_like(head_dim=32, tie_word_embeddings=True),
        seed=11,
        initializer_range=_TEST_INIT,
    ),
    # Gemma 2: Gemma 3's norms, GELU, scaled embedding and capped logits with
    # one rotation, no q/k norms, every second layer sliding (window 16), and
    # attention scores capped too, at 2 (Gemma 2's own 50 would not bind on
    # scores this small: a model served without the cap would pass).
    "tiny-gemma2": Preset(
        "Gemma2ForCausalLM",
        _llama_like(head_dim=32, tie_word_embeddings=True, sliding_window=16, query_pre_attn_scalar=24,
                    final_logit_softcapping=30.0, attn_logit_softcapping=2.0),
        seed=10,
        initializer_range=_TEST_INIT,
    ),
    # A reasoning model's shape: the tiny Qwen3 with a tokenizer that has
    # `<think>`, `</think>`, `<tool_call>` and `</tool_call>` as single tokens
    # and a chat template that opens the assistant turn inside a thought
    # (tests of --reasoning-parser and of tool calls; random weights).
    "tiny-reasoning": Preset(
        "Qwen3ForCausalLM",
        _llama_like(vocab_size=8208, head_dim=32, tie_word_embeddings=True, use_sliding_window=False,
                    max_position_embeddings=1024),
        seed=6,
        initializer_range=_TEST_INIT,
        tokenizer="reasoning",
    ),
}

ARCHITECTURE_PRESETS = ["tiny-llama", "tiny-llama-tied", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-phi3",
                        "tiny-granite", "tiny-gemma", "tiny-gemma2", "tiny-gemma3", "tiny-mixtral", "tiny-qwen3-moe",
                        "tiny-olmo2", "tiny-olmo3", "tiny-olmoe", "tiny-qwen2-moe",
                        "tiny-granitemoe"]

# Randomly initialised SNAC audio decoders: the 24 kHz architecture, and a
# narrow one (same rates and frame size) that decodes fast in tests.
CODEC_PRESETS: dict[str, dict[str, Any]] = {
    "demo-codec": {"seed": 24},
    "tiny-codec": {"seed": 25, "config": {"decoder_dim": 128}},
}


def _config_class(architecture: str) -> Any:
    import transformers

    model_cls = getattr(transformers, architecture)
    return model_cls.config_class, model_cls


def write_preset(name: str, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write preset `name` as an HF checkpoint directory and return its path."""
    import torch

    if name in CODEC_PRESETS:
        from engine.speech.codec import SNAC_24KHZ, write_random_codec

        spec = CODEC_PRESETS[name]
        out = write_random_codec(out_dir, seed=spec["seed"], config={**SNAC_24KHZ, **spec.get("config", {})})
        _mark(out, name)
        return out
    if name not in PRESETS:
        choices = ", ".join(sorted([*PRESETS, *CODEC_PRESETS]))
        raise ValueError(f"unknown preset {name!r}; choose from {choices}")
    preset = PRESETS[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls = _config_class(preset.architecture)
    config = config_cls(**preset.config, initializer_range=preset.initializer_range)
    torch.manual_seed(preset.seed)
    model = model_cls(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".router.weight")):
                param.mul_(preset.router_scale)
            elif preset.norm_jitter and param_name.endswith("norm.weight"):
                param.add_(preset.norm_jitter * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [END_OF_TEXT_ID, IM_END_ID]
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(preset.tokenizer, out)
    if preset.speech_layout is not None:
        from engine.speech.layout import SpeechLayout

        SpeechLayout(**preset.speech_layout).save(out)
    _mark(out, name)
    return out


MARKER = "stencild_preset.json"


def _writer() -> dict[str, object]:
    """What wrote a preset: its version, and the transformers release line
    whose `save_pretrained` wrote its config (5.x writes rotary scaling as
    `rope_parameters`, 4.x did not: a cache from one is stale for the other)."""
    import transformers

    return {"version": PRESET_VERSION, "transformers": transformers.__version__.split(".")[0]}


def _mark(out: Path, name: str) -> None:
    (out / MARKER).write_text(json.dumps({"preset": name, **_writer()}) + "\n")


def _current(target: Path) -> bool:
    """Whether `target` holds a whole preset this code and transformers wrote."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and all(marker.get(k) == v for k, v in _writer().items())


def _write_tokenizer(variant: str, out: Path) -> None:
    """The tokenizer files of a preset (see `Preset.tokenizer`)."""
    if variant == "demo":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER_DIR / f, out / f)
        return
    if variant != "reasoning":
        raise ValueError(f"unknown tokenizer variant {variant!r}")
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    ids = [tok.token_to_id(t) for t in REASONING_TOKENS]
    if ids != [THINK_ID, END_THINK_ID, TOOL_CALL_ID, END_TOOL_CALL_ID]:
        raise RuntimeError(f"the reasoning tokens got ids {ids}")
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = REASONING_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def ensure_preset(name: str) -> Path:
    """Return a cached checkpoint directory for preset `name`, writing it on
    first use (and again over one another transformers release line wrote)."""
    target = cache_root() / "models" / f"{name}-v{PRESET_VERSION}"
    if _current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so concurrent callers never see
    # a half-written checkpoint; a stale one is moved aside first.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=target.parent))
    try:
        write_preset(name, tmp)
        with contextlib.suppress(OSError):  # absent, or another caller moved it
            target.rename(stale / "old")
        try:
            tmp.rename(target)
        except OSError:
            if not _current(target):
                raise
    finally:
        for path in (tmp, stale):
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
    return target
