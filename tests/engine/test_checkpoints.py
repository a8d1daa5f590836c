"""Checkpoint loading: sharded files, and clear errors for what we cannot load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import CheckpointError, load_model_config
from engine.presets import ensure_preset

from .reference import GREEDY, hf_greedy, hf_model, prompts


@pytest.fixture
def copy_of(tmp_path):
    def copy(name: str):
        dst = tmp_path / name
        shutil.copytree(ensure_preset(name), dst)
        return dst

    return copy


def test_sharded_safetensors_load(tmp_path):
    dst = tmp_path / "sharded"
    model = hf_model("tiny-llama")
    model.save_pretrained(dst, safe_serialization=True, max_shard_size="200KB")
    src = ensure_preset("tiny-llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    assert (dst / "model.safetensors.index.json").exists()
    assert len(list(dst.glob("*.safetensors"))) > 1
    llm = LLM(dst)
    prompt = prompts(1)[0]
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy("tiny-llama", prompt)


@pytest.mark.parametrize("index", ["{not json", '["a"]', '{"metadata": {}}', '{"weight_map": {"x": 1}}'])
def test_a_broken_shard_index_is_a_checkpoint_error(copy_of, index):
    # A file that is not JSON raised the decoder's own error (no file named).
    from engine.models.weights import WeightSource

    d = copy_of("tiny-llama")
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        WeightSource(d)


def test_unsupported_architecture_is_named(copy_of):
    d = copy_of("tiny-llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_model_config(d)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"])
def test_missing_file_is_named(copy_of, missing):
    d = copy_of("tiny-llama")
    (d / missing).unlink()
    with pytest.raises(CheckpointError, match=missing.replace("model.", "") if "safetensors" in missing else missing):
        LLM(d)


def test_missing_tensor_is_named(copy_of):
    from safetensors.torch import load_file, save_file

    d = copy_of("tiny-llama")
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(d)


def test_missing_model_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM("/nonexistent/model")


def test_old_style_rope_fields_are_read(copy_of):
    d = copy_of("tiny-llama")
    cfg = json.loads((d / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (d / "config.json").write_text(json.dumps(cfg))
    mc = load_model_config(d)
    assert mc.rope.rope_type == "llama3" and mc.rope.theta == 500000.0 and mc.rope.factor == 8.0
    prompt = prompts(1)[0]
    assert LLM(d).generate([prompt], GREEDY)[0].token_ids == hf_greedy("tiny-llama", prompt)


def test_engine_rejects_bad_requests(make_llm):
    from engine import InvalidRequest

    llm = make_llm("tiny-llama", max_model_len=64)
    eng = llm.engine
    cases = {
        "prompt": ([], SamplingParams()),
        "max_new_tokens": ([5] * 60, SamplingParams(max_new_tokens=10)),
        "stop_token_ids": ([5], SamplingParams(stop_token_ids=(999999,))),
    }
    for field, (prompt, params) in cases.items():
        with pytest.raises(InvalidRequest) as err:
            eng.make_context(prompt, params)
        assert err.value.field == field
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        eng.make_context([5, 8192], SamplingParams())
    with pytest.raises(InvalidRequest, match="context"):
        eng.make_context([5] * 64, SamplingParams())
    assert torch.get_num_threads() >= 1


def test_a_bad_prompt_in_a_batch_leaves_none_of_the_others_running(make_llm):
    from engine import InvalidRequest

    llm = make_llm("tiny-llama", max_model_len=64)
    with pytest.raises(InvalidRequest):
        llm.generate([[5, 6, 7], [8, 9], [5] * 95], SamplingParams(max_new_tokens=4))
    assert not llm.engine.has_work()  # the two good ones were never queued
    assert llm.engine.allocator.num_used == 0
