"""Config variants real checkpoints use, read as transformers reads them:
rotary scaling (linear, dynamic, llama3, yarn; old and new config forms),
which layers slide and by how much (tests/engine/test_sliding_window.py
serves them), and an untied head that must be in the weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import CheckpointError, load_model_config
from engine.presets import ensure_preset

from .reference import assert_engine_matches, prompts, variant_checkpoint


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_theta": theta, **scaling}}


ROPES = {
    "linear": ("tiny-llama", _rope(10000.0, rope_type="linear", factor=4.0)),
    "dynamic": ("tiny-llama", _rope(10000.0, rope_type="dynamic", factor=2.0)),
    "llama3-default-original": ("tiny-llama", _rope(500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0)),
    # Qwen2.5's long-context block, with the pretraining length shorter than the prompts.
    "yarn": ("tiny-qwen2", _rope(1000000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    "yarn-attention-factor": ("tiny-qwen3", _rope(10000.0, rope_type="yarn", factor=8.0, attention_factor=1.3,
                                                  beta_fast=16.0, original_max_position_embeddings=32)),
    "yarn-mscale": ("tiny-llama", _rope(10000.0, rope_type="yarn", factor=4.0, mscale=0.8, mscale_all_dim=0.5,
                                        original_max_position_embeddings=24)),
}


@pytest.mark.parametrize("case", list(ROPES))
def test_scaled_rotary_embeddings_match_transformers(tmp_path, case: str) -> None:
    preset, overrides = ROPES[case]
    assert_engine_matches(*variant_checkpoint(preset, overrides, tmp_path / case))


def _edited_matches(preset: str, edit: Callable[[dict[str, Any]], None], out: Path) -> None:
    """A checkpoint whose config.json `edit` changed after saving (as users edit
    them): our logits are those of transformers loading the same directory."""
    from transformers import AutoModelForCausalLM

    variant_checkpoint(preset, {}, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    assert_engine_matches(out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())


def _rope_scaling_beside_rope_parameters(cfg: dict[str, Any]) -> None:
    # A model card's long-context block added to a checkpoint transformers 5 re-saved.
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _top_level_original_length(cfg: dict[str, Any]) -> None:
    # Phi-3's form: the pretraining length outside the block wins over the block's.
    cfg["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg["original_max_position_embeddings"] = 8


def _yarn_null_factor(cfg: dict[str, Any]) -> None:
    # Then the factor is the ratio of the two lengths (128 / 16).
    cfg["max_position_embeddings"] = 128
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": None,
                              "original_max_position_embeddings": 16}


def _olmo3_old_rope_form(cfg: dict[str, Any]) -> None:
    # OLMo 3's released form: one theta and a scaling block, which transformers
    # gives its full-attention layers only (the sliding ones turn plainly by the same theta).
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 5e5
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}


def _mistral_attention_bias(cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = True  # Mistral's attention has no biases whatever the config says


@pytest.mark.parametrize(("preset", "edit"), [
    ("tiny-llama", _rope_scaling_beside_rope_parameters),
    ("tiny-llama", _top_level_original_length),
    ("tiny-llama", _yarn_null_factor),
    ("tiny-mistral", _mistral_attention_bias),
    ("tiny-olmo3", _olmo3_old_rope_form),
], ids=["rope-scaling-beside-rope-parameters", "top-level-original-length", "yarn-null-factor",
        "mistral-attention-bias", "olmo3-old-rope-form"])
def test_config_forms_read_as_transformers_reads_them(tmp_path, preset: str,
                                                      edit: Callable[[dict[str, Any]], None]) -> None:
    # Each was read otherwise: logits off by 1.4-1.8 (the first three), or the
    # checkpoint refused for a bias tensor it need not have.
    _edited_matches(preset, edit, tmp_path / "ckpt")


@pytest.mark.parametrize(("block", "missing"), [
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "dynamic", "factor": None}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
])
def test_a_scaled_rotation_missing_its_numbers_is_refused(tmp_path, block: dict[str, Any], missing: str) -> None:
    # They were read as factor 1.0 (or the default frequency factors): a
    # different model served without a word, where transformers refuses.
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **block}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=missing):
        load_model_config(d)


def test_the_old_rope_scaling_form_reads_the_same(tmp_path) -> None:
    path, _ = variant_checkpoint("tiny-qwen2", ROPES["yarn"][1], tmp_path / "new")
    new = load_model_config(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 1000000.0
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope == new.rope


def test_a_scaled_context_is_served_as_vllm_derives_it(tmp_path) -> None:
    def positions(overrides: dict[str, Any]) -> int:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(ensure_preset("tiny-llama"), d)
        cfg = {**json.loads((d / "config.json").read_text()), "max_position_embeddings": 4096, **overrides}
        (d / "config.json").write_text(json.dumps(cfg))
        return load_model_config(d).max_position_embeddings

    assert positions(_rope(1e4, rope_type="linear", factor=4.0)) == 16384
    assert positions(_rope(1e4, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)) == 8192
    assert positions(_rope(1e4, rope_type="dynamic", factor=2.0)) == 4096
    # Phi-3's 128k context is its max_position_embeddings already.
    assert positions(_rope(1e4, rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                           original_max_position_embeddings=1024)) == 4096


@pytest.mark.parametrize(("preset", "overrides", "windows"), [
    # Qwen2/Qwen3: sliding only when asked for, and only on layers from max_window_layers on.
    ("tiny-qwen2", {"sliding_window": 16}, None),
    ("tiny-qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}, None),
    ("tiny-qwen2", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}, (0, 16)),
    ("tiny-qwen3", {"sliding_window": 16, "use_sliding_window": False}, None),
    ("tiny-qwen3", {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}, None),
    ("tiny-qwen3", {"sliding_window": 16, "use_sliding_window": True,
                    "layer_types": ["full_attention", "sliding_attention"]}, (0, 16)),
    ("tiny-mistral", {"sliding_window": 16}, (16, 16)),
    ("tiny-mistral", {"sliding_window": None}, None),
    # A window as long as the context never binds.
    ("tiny-mistral", {"sliding_window": 512}, None),
    # Phi-3 slides every layer when its config gives a window (no default one).
    ("tiny-phi3", {"sliding_window": 16}, (16, 16)),
    ("tiny-phi3", {"sliding_window": None}, None),
    # Gemma 3: every layer but each sliding_window_pattern-th (6 by default) slides.
    ("tiny-gemma3", {"sliding_window": 8}, (8, 8)),
    ("tiny-gemma3", {"sliding_window": 8, "sliding_window_pattern": 2}, (8, 0)),
    # Gemma 2: every second layer, from the first.
    ("tiny-gemma2", {"sliding_window": 8, "num_hidden_layers": 3}, (8, 0, 8)),
    # Qwen3-MoE: every layer, only with use_sliding_window.
    ("tiny-qwen3-moe", {"sliding_window": 16, "use_sliding_window": False}, None),
    ("tiny-qwen3-moe", {"sliding_window": 16, "use_sliding_window": True}, (16, 16)),
    # Mixtral: every layer when its config gives a window.
    ("tiny-mixtral", {"sliding_window": 16}, (16, 16)),
    # Qwen2-MoE: every second layer from the first, below max_window_layers.
    ("tiny-qwen2-moe", {"sliding_window": 16, "use_sliding_window": True, "num_hidden_layers": 5,
                        "max_window_layers": 3}, (16, 0, 16, 0, 0)),
    # OLMo 3: all but each fourth layer.
    ("tiny-olmo3", {"sliding_window": 8, "num_hidden_layers": 5}, (8, 8, 8, 0, 8)),
    # Qwen's max_window_layers defaults to 28: a deeper model's last layers slide.
    ("tiny-qwen2", {"sliding_window": 16, "use_sliding_window": True, "num_hidden_layers": 30,
                    "max_window_layers": None}, (*[0] * 28, 16, 16)),
    # Llama has no window of its own: a stray key changes nothing.
    ("tiny-llama", {"sliding_window": 16}, None),
], ids=["qwen2-unset", "qwen2-no-sliding-layer", "qwen2-sliding-layer", "qwen3-off", "qwen3-layer-types-off",
        "qwen3-layer-types", "mistral", "mistral-none", "mistral-whole-context", "phi3", "phi3-none",
        "gemma3-default-pattern", "gemma3-pattern-2", "gemma2-every-second", "qwen3-moe-off", "qwen3-moe-on",
        "mixtral", "qwen2-moe-every-second-below", "olmo3-every-fourth-full",
        "qwen2-default-window-layers",
        "llama-stray-window"])
def test_the_sliding_layers_are_those_transformers_slides(tmp_path, preset: str, overrides: dict[str, Any],
                                                          windows: tuple[int, ...] | None) -> None:
    import transformers

    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset(preset), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("layer_types", None)  # as saved by transformers 5, from the preset's own settings
    cfg.update(overrides)
    # An override of None drops the key (sliding_window: null is itself a value).
    cfg = {k: v for k, v in cfg.items() if not (k in overrides and v is None and k != "sliding_window")}
    (d / "config.json").write_text(json.dumps(cfg))
    hf = getattr(transformers, cfg["architectures"][0]).config_class.from_dict(cfg)
    # transformers' windows per layer (Mistral slides every layer; the others those layer_types names),
    # a window as long as the context dropped.
    kinds = ["sliding_attention"] * hf.num_hidden_layers \
        if preset in ("tiny-mistral", "tiny-phi3", "tiny-mixtral", "tiny-qwen3-moe") else \
        getattr(hf, "layer_types", None) or []
    theirs = tuple(hf.sliding_window if kind == "sliding_attention" else 0 for kind in kinds) \
        if hf.sliding_window and hf.sliding_window < hf.max_position_embeddings else ()
    assert (theirs if any(theirs) else None) == windows  # transformers agrees
    mc = load_model_config(d)
    assert mc.sliding_windows == (windows or ())
    assert mc.max_position_embeddings == cfg["max_position_embeddings"]  # a window no longer caps the context


@pytest.mark.parametrize(("preset", "overrides", "message"), [
    ("tiny-mistral", {"sliding_window": -4}, "sliding_window must be a positive integer"),
    ("tiny-mistral", {"sliding_window": "4096"}, "sliding_window must be a positive integer"),
    ("tiny-qwen2", {"sliding_window": 8.5, "use_sliding_window": True, "max_window_layers": 1},
     "sliding_window must be a positive integer"),
    ("tiny-qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": None},
     "max_window_layers must be an integer"),
    ("tiny-qwen3", {"layer_types": ["full_attention"]}, "layer_types must list the kind of each of the 2"),
    ("tiny-llama", {"layer_types": ["chunked_attention", "full_attention"]}, "unsupported layer_types chunked"),
    ("tiny-granite", {"logits_scaling": 0}, "logits_scaling must be a positive number"),
    ("tiny-granite", {"residual_multiplier": "0.22"}, "residual_multiplier must be a positive number"),
    # What our attention does not do is refused, not served wrong.
    ("tiny-gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ("tiny-gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ("tiny-olmoe", {"clip_qkv": 8.0}, "clip_qkv is not supported"),
    ("tiny-gemma3", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
    ("tiny-gemma3", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar must be a positive number"),
    ("tiny-gemma3", {"rope_parameters": {"rope_theta": 1e4}}, "rope_parameters must be given per layer type"),
], ids=["negative-window", "string-window", "fractional-window", "null-window-layers", "short-layer-types",
        "unknown-layer-type", "granite-zero-logits-scaling", "granite-string-multiplier", "gemma2-negative-cap",
        "gemma3-bidirectional", "olmoe-clip-qkv", "gemma3-zero-scalar", "gemma3-null-scalar", "gemma3-flat-rope"])
def test_a_malformed_config_value_is_refused_by_name(tmp_path, preset: str, overrides: dict[str, Any],
                                               message: str) -> None:
    # A window of -4 keys would have been served (or failed with a bare TypeError).
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset(preset), d)
    cfg = {**json.loads((d / "config.json").read_text()), **overrides}
    if "layer_types" not in overrides:
        cfg.pop("layer_types", None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load_model_config(d)


def test_an_untied_config_without_a_head_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    weights = load_file(d / "model.safetensors")
    if "lm_head.weight" in weights:
        del weights["lm_head.weight"]
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    assert not cfg.get("tie_word_embeddings")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        LLM(str(d), kv_cache_gib=0.05)


@pytest.mark.parametrize("same", [True, False], ids=["stored-head-equal", "stored-head-differs"])
def test_a_tied_config_beside_a_stored_head_says_which_head_it_serves(tmp_path, caplog, same: bool) -> None:
    # A fine-tune with a head of its own and the base model's tied config:
    # transformers serves the stored head, vLLM (and we) the embedding. It
    # was silent; now a head that differs is named in the log.
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from .reference import greedy_argmax

    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    weights = load_file(d / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    if same:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    caplog.set_level("WARNING", logger="engine.models.llama")
    llm = LLM(str(d), kv_cache_gib=0.05)
    try:
        warned = [r.getMessage() for r in caplog.records if "lm_head.weight differs" in r.getMessage()]
        assert len(warned) == (0 if same else 1)
        # Either way the embedding is the head: the tied model's greedy tokens.
        del weights["lm_head.weight"]
        tied = tmp_path / "tied"
        shutil.copytree(d, tied)
        save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
        prompt = [5, 17, 33, 2, 9]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))[0]
        hf = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
        assert out.token_ids == list(greedy_argmax(hf, tuple(prompt), 6))
    finally:
        llm.close()


def test_the_rotation_table_covers_the_served_context_only(make_llm) -> None:
    llm = make_llm("tiny-llama", max_model_len=64)
    assert llm.engine.model.rotations.shape[0] == llm.engine.max_model_len == 64


def test_a_context_longer_than_the_models_is_refused() -> None:
    # It was cut to the model's without a word (vLLM refuses it): a prompt
    # the caller thought fitted then failed at request time.
    context = json.loads((ensure_preset("tiny-llama") / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"max_model_len={context + 1} is longer than the model's context"):
        LLM(str(ensure_preset("tiny-llama")), kv_cache_gib=0.05, max_model_len=context + 1)
    llm = LLM(str(ensure_preset("tiny-llama")), kv_cache_gib=0.05, max_model_len=context)
    assert llm.engine.max_model_len == context
    llm.close()


def test_generation_config_sampling_values_are_a_requests_defaults(tmp_path) -> None:
    from .reference import hf_greedy

    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update({"temperature": 0.0, "top_p": 0.95, "top_k": 20, "repetition_penalty": -3.0, "do_sample": True})
    (d / "generation_config.json").write_text(json.dumps(gen))
    assert load_model_config(d).sampling_defaults == {"temperature": 0.0, "top_p": 0.95, "top_k": 20,
                                                      "repetition_penalty": -3.0}
    llm = LLM(str(d), kv_cache_gib=0.05)
    try:
        # As vLLM: the values a request could send (a repetition penalty of -3 could not).
        assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_p": 0.95, "top_k": 20}
        prompt = prompts(1)[0]
        out = llm.generate([prompt])[0]  # no parameters: the model's, greedy here
        assert out.token_ids == hf_greedy("tiny-llama", prompt, len(out.token_ids))
        assert llm.generate([prompt], SamplingParams(max_new_tokens=3))[0].token_ids  # given ones win
    finally:
        llm.close()
    plain = LLM(str(d), kv_cache_gib=0.05, generation_config="vllm")
    try:
        assert plain.engine.sampling_defaults == {}
    finally:
        plain.close()


def test_generation_config_max_new_tokens_is_a_default_cut_to_the_room_left(tmp_path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["max_new_tokens"] = 5
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(d), kv_cache_gib=0.05, max_model_len=32)
    try:
        assert llm.engine.default_max_new_tokens == 5
        ignore = SamplingParams(ignore_eos=True)
        # No parameters: the model's default length, as vLLM's LLM.
        out = llm.generate([[5, 6, 7]], None)[0]
        assert len(out.token_ids) <= 5
        # A prompt that leaves less room than the default gets the room, not an error.
        out = llm.generate([list(range(5, 34))], None)[0]
        assert len(out.token_ids) <= 3
        # Given parameters are the caller's: until the context is full.
        assert len(llm.generate([[5, 6, 7]], ignore)[0].token_ids) == 29
    finally:
        llm.close()
    plain = LLM(str(d), kv_cache_gib=0.05, generation_config="vllm")
    try:
        assert plain.engine.default_max_new_tokens is None
    finally:
        plain.close()


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"])
def test_a_config_missing_a_size_is_refused_by_name(tmp_path, key: str) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg[key]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=key):
        load_model_config(d)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_partial_rotation_is_refused_but_phi3s(tmp_path, where: str) -> None:
    # transformers' Llama has no partial rotation (tests/engine/test_partial_rotary.py serves Phi-3's).
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    if where == "top":
        cfg["partial_rotary_factor"] = 0.5
    else:
        cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {"rope_theta": 10000.0}),
                                  "partial_rotary_factor": 0.5}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        load_model_config(d)


def test_the_tokenizers_eos_ends_generation_beside_the_checkpoints(tmp_path) -> None:
    # Only when the checkpoint named none was the tokenizer's EOS used: a chat
    # fine-tune naming its end-of-turn token only there ran past it. vLLM
    # stops on both.
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-llama"), d)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        (d / name).write_text(json.dumps({**cfg, "eos_token_id": 1}))
    llm = LLM(str(d), kv_cache_gib=0.05)
    try:
        assert llm.tokenizer.hf.eos_token_id == 3
        assert llm.engine.eos_token_ids == {1, 3}
    finally:
        llm.close()


@pytest.mark.parametrize("field", ["kv_cache_gib", "grammar_compile_timeout_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0])
def test_engine_config_refuses_a_size_or_time_that_is_no_number(field: str, value: float) -> None:
    # NaN passed `<= 0`: the cache size failed at load, the timeout at every compile.
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(ensure_preset("tiny-llama")), **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("edits", "act"), [
    ({"hidden_act": "gelu"}, "gelu_pytorch_tanh"),
    ({"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
    ({"hidden_activation": "gelu"}, "gelu"),
], ids=["first-config-form", "updated-config-form", "exact-gelu"])
def test_gemma_reads_its_activation_as_vllm_does(tmp_path, edits: dict[str, Any], act: str) -> None:
    # Gemma 1's first configs said hidden_act "gelu" for a model trained with
    # the tanh approximation: vLLM (and the updated configs' hidden_activation)
    # serve that; exact GELU only where hidden_activation asks for it.
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-gemma"), d)
    cfg = {**json.loads((d / "config.json").read_text()), **edits}
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(d).hidden_act == act
