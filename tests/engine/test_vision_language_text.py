"""The text model of a vision-language checkpoint, served as transformers
runs that model on text alone; the vision tower is never read. Gemma 3 from
4b up is published only as `Gemma3ForConditionalGeneration`: its tensors as
transformers saves them (`language_model.model.*`) or as it names them in
memory (`model.language_model.*`), its sparse `text_config` filled with
transformers' defaults. Qwen2.5-VL: a Qwen2 text model whose multimodal
rotation is the plain one on text, its config in the Hub's flat form or
transformers 5's nested one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import TEXT_CONFIGS, CheckpointError, load_model_config
from engine.presets import ensure_preset

from .reference import assert_engine_matches, greedy_argmax, prompts

ARCH = "Gemma3ForConditionalGeneration"


def _text_config(preset: str, **overrides: Any) -> dict[str, Any]:
    """The config of `preset`'s text model, as a vision-language config's `text_config`."""
    config = json.loads((ensure_preset(preset) / "config.json").read_text())
    return {**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "dtype")},
            **overrides}


def _saved(architecture: str, config: Any, preset: str, out: Path, seed: int) -> tuple[Path, torch.nn.Module]:
    """A random `architecture` model of `config`, saved to `out` beside `preset`'s tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ensure_preset(preset) / name, out / name)
    return out, model


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """tiny-gemma3's text model beside a one-layer SigLIP vision tower. Its
    logits are not capped: transformers' vision-language Gemma 3 leaves them
    as they are whatever the text config says (real Gemma 3 configs cap none)."""
    import transformers

    text = _text_config("tiny-gemma3", model_type="gemma3_text", final_logit_softcapping=None)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=56, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=8191, boi_token_index=8190, eoi_token_index=8189)
    return _saved(ARCH, config, "tiny-gemma3", tmp_path_factory.mktemp("gemma3-vlm"), seed=0)


def test_logits_match_transformers(gemma3_vlm) -> None:
    from safetensors import safe_open

    with safe_open(str(gemma3_vlm[0] / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in names and any(n.startswith("vision_tower") for n in names)
    assert_engine_matches(*gemma3_vlm)


def test_greedy_matches_transformers(gemma3_vlm) -> None:
    path, model = gemma3_vlm
    llm = LLM(str(path), kv_cache_gib=0.05, page_size=4)
    try:
        assert llm.engine.model_config.architecture == ARCH
        batch = prompts(3)
        params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        for prompt, res in zip(batch, llm.generate(batch, params), strict=True):
            assert res.token_ids == list(greedy_argmax(model, tuple(prompt), 12))
    finally:
        llm.close()


def test_tensors_named_as_in_memory_load_the_same(gemma3_vlm, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path, model = gemma3_vlm
    shutil.copytree(path, tmp_path / "renamed")
    file = tmp_path / "renamed" / "model.safetensors"
    tensors = load_file(str(file))
    save_file({n.replace("language_model.model.", "model.language_model."): t for n, t in tensors.items()},
              str(file), metadata={"format": "pt"})
    assert_engine_matches(tmp_path / "renamed", model)


def test_a_sparse_text_config_takes_transformers_defaults() -> None:
    import transformers

    defaults = transformers.Gemma3TextConfig()
    for key, value in TEXT_CONFIGS[ARCH].items():
        assert getattr(defaults, key) == value, key


def _edited(tmp_path: Path, source: Path, edit: Any) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(source, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_the_outer_configs_end_of_sequence_ids_count(gemma3_vlm, tmp_path) -> None:
    # gemma-3-4b-it's form: the ids on the outer config, none in text_config.
    def edit(cfg: dict[str, Any]) -> None:
        cfg["text_config"].pop("eos_token_id", None)
        cfg["eos_token_id"] = [1, 106]

    assert load_model_config(_edited(tmp_path, gemma3_vlm[0], edit)).eos_token_ids[:2] == (1, 106)


def test_a_config_without_a_text_config_is_refused(gemma3_vlm, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="text_config"):
        load_model_config(_edited(tmp_path, gemma3_vlm[0], lambda cfg: cfg.pop("text_config")))


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """tiny-qwen2's text model (q/k/v biases, an untied head) with a
    multimodal rotation in sections of 2, 3 and 3 pairs, beside a one-block
    vision tower."""
    import transformers

    text = _text_config("tiny-qwen2", model_type="qwen2_5_vl_text",
                        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=8191,
                                           video_token_id=8190, vision_start_token_id=8189)
    return _saved("Qwen2_5_VLForConditionalGeneration", config, "tiny-qwen2", tmp_path_factory.mktemp("qwen25-vl"),
                  seed=1)


def test_qwen25_vl_logits_match_transformers(qwen25_vl) -> None:
    assert load_model_config(qwen25_vl[0]).rope.rope_type == "default"
    assert_engine_matches(*qwen25_vl)


def test_qwen25_vl_flat_config_reads_the_same(qwen25_vl, tmp_path) -> None:
    # The Hub's form: the text model's keys at the top, the rotation named "mrope".
    def flatten(cfg: dict[str, Any]) -> None:
        text = cfg.pop("text_config")
        rope = text.pop("rope_parameters")
        cfg.update(text, rope_theta=rope["rope_theta"],
                   rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})

    flat = _edited(tmp_path, qwen25_vl[0], flatten)
    assert "text_config" not in json.loads((flat / "config.json").read_text())
    assert load_model_config(flat) == load_model_config(qwen25_vl[0])
    assert_engine_matches(flat, qwen25_vl[1])


def test_qwen2_vl_logits_match_transformers(tmp_path) -> None:
    # Qwen2-VL's text model is Qwen2.5-VL's: the same Qwen2 with the same rotation.
    import transformers

    text = _text_config("tiny-qwen2", model_type="qwen2_vl_text",
                        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6})
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64,
                                                                              num_heads=2, mlp_ratio=2),
                                        image_token_id=8191, video_token_id=8190, vision_start_token_id=8189)
    path, model = _saved("Qwen2VLForConditionalGeneration", config, "tiny-qwen2", tmp_path, seed=2)
    assert load_model_config(path).architecture == "Qwen2VLForConditionalGeneration"
    assert_engine_matches(path, model)
