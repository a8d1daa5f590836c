"""Checkpoint loading: sharded files, and clear errors for what we cannot load."""

from __future__ import annotations

import json
import shutil

import numpy as np
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


@pytest.mark.parametrize("change, says", [
    ({"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight"),  # every request failed
    ({"vocab_size": 4096}, "model.embed_tokens.weight"),  # generated ids past the vocabulary
    ({"intermediate_size": 64}, "model.layers.0.mlp.gate_proj.weight"),  # the weights' size won silently
])
def test_weights_that_disagree_with_the_config_are_refused_by_name(copy_of, change, says):
    d = copy_of("tiny-llama")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=f"tensor '{says}' has shape"):
        LLM(d)


def test_quantized_checkpoints_are_refused(copy_of):
    # An FP8 checkpoint loaded, its float8 codes cast to floats and its scales
    # dropped: it served nonsense without a word.
    from safetensors.torch import load_file, save_file

    d = copy_of("tiny-llama")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quant_method=fp8"):
        LLM(d)
    (d / "config.json").write_text(json.dumps(config))  # the weights alone tell it too
    weights = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"'{name}' is stored as torch.float8_e4m3fn"):
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


@pytest.mark.parametrize(("prompt", "says"), [
    ([[1.9, 2.9]], "integers"),  # int() truncated them to [1, 2]
    ([["12", "7"]], "integers"),
    ([[5, 2**70]], "integers in"),  # a bare OverflowError
    ([b"Hello"], "not bytes"),  # read as its bytes
    ([None], "not NoneType"),
    ([{"messages": []}], '"prompt"'),
])
def test_a_prompt_that_is_no_text_or_token_ids_is_refused(make_llm, prompt, says):
    from engine import InvalidRequest

    llm = make_llm("tiny-llama")
    with pytest.raises(InvalidRequest, match=says) as err:
        llm.generate(prompt, SamplingParams(max_new_tokens=2))
    assert err.value.field == "prompt"


def test_vllm_prompt_forms(make_llm):
    # A dict of text or ids (vLLM's TextPrompt / TokensPrompt), and one id
    # list as a single prompt, as vLLM reads them.
    llm = make_llm("tiny-llama")
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    ids = llm.tokenizer.encode("Hello there")
    want = llm.generate([ids], params)[0].token_ids
    assert llm.generate(ids, params)[0].token_ids == want
    assert llm.generate({"prompt_token_ids": ids}, params)[0].token_ids == want
    assert llm.generate([{"prompt": "Hello there"}], params)[0].token_ids == want
    # A numpy array of ids is one prompt too (it was read as one prompt per id);
    # two dimensions are a prompt per row.
    assert [o.token_ids for o in llm.generate(np.array(ids), params)] == [want]
    assert [o.token_ids for o in llm.generate(np.array([ids, ids]), params)] == [want, want]


@pytest.mark.parametrize(("fields", "field"), [
    ({"logprobs": 1.5}, "logprobs"),  # failed inside the sampler, reported as the server's fault
    ({"max_new_tokens": 2.5}, "max_new_tokens"),  # ran 3 tokens
    ({"seed": 1.5}, "seed"),  # the same as seed=1
    ({"top_k": 2.5}, "top_k"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),  # a bare OverflowError
    ({"stop_token_ids": "12"}, "stop_token_ids"),  # became (1, 2)
    ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
    ({"temperature": "hot"}, "temperature"),
])
def test_sampling_params_of_the_wrong_type_are_refused(fields, field):
    from engine import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**fields)
    assert err.value.field == field


def test_sampling_params_take_none_for_no_stops_or_biases():
    params = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)  # type: ignore[arg-type]
    assert params.stop == () and params.stop_token_ids == () and dict(params.logit_bias) == {}


def test_request_failed_pickles_as_itself():
    import pickle

    from engine import RequestFailed

    err = pickle.loads(pickle.dumps(RequestFailed([], [])))
    assert isinstance(err, RequestFailed) and err.failed == []


def test_a_bad_prompt_in_a_batch_leaves_none_of_the_others_running(make_llm):
    from engine import InvalidRequest

    llm = make_llm("tiny-llama", max_model_len=64)
    with pytest.raises(InvalidRequest):
        llm.generate([[5, 6, 7], [8, 9], [5] * 95], SamplingParams(max_new_tokens=4))
    assert not llm.engine.has_work()  # the two good ones were never queued
    assert llm.engine.allocator.num_used == 0


def test_a_preset_cached_by_another_transformers_line_is_written_again(tmp_path, monkeypatch) -> None:
    # A preset written by transformers 4.x (rotary scaling without
    # `rope_parameters`) was reused after an upgrade to 5.x and read wrong.
    from engine import presets

    monkeypatch.setenv("STENCILD_CACHE", str(tmp_path))
    first = presets.ensure_preset("demo")
    marker = json.loads((first / presets.MARKER).read_text())
    (first / "config.json").write_text("{}")  # what the old line wrote, as far as this test goes
    assert presets.ensure_preset("demo") == first and (first / "config.json").read_text() == "{}"
    (first / presets.MARKER).write_text(json.dumps({**marker, "transformers": "4"}))
    again = presets.ensure_preset("demo")
    assert again == first and json.loads((again / presets.MARKER).read_text()) == marker
    assert json.loads((again / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [first.name]  # nothing left aside
