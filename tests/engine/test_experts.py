"""Mixture-of-experts checkpoints (Mixtral, Granite MoE, Qwen2-MoE, Qwen3-MoE, OLMoE): beyond the parity of
tests/engine/test_reference.py, the routing itself (tokens spread over the
experts, some experts unused in a step), the weights as each architecture
scales them, a dense layer beside a sparse one, and decode graphs turned off
(the experts are chosen on the host each layer)."""

from __future__ import annotations

import json
import logging
import shutil
from typing import Any

import pytest
import torch

from engine import graphs as graphs_module
from engine.models.config import CheckpointError, load_model_config
from engine.models.moe import SparseMLP
from engine.presets import ensure_preset

from .reference import assert_greedy_matches, prompts


def test_the_experts_read_as_transformers_reads_them() -> None:
    import transformers

    for preset, layers, renormalize, experts in (("tiny-mixtral", (0, 1), True, 4), ("tiny-qwen3-moe", (1,), False, 6),
                                                 ("tiny-olmoe", (0, 1), False, 4), ("tiny-qwen2-moe", (0, 1), False, 4),
                                                 ("tiny-granitemoe", (0, 1), True, 4)):
        mc = load_model_config(ensure_preset(preset))
        assert (mc.moe_layers, mc.norm_topk_prob) == (layers, renormalize)
        hf = transformers.AutoConfig.from_pretrained(ensure_preset(preset))
        assert mc.num_experts == (getattr(hf, "num_local_experts", None) or hf.num_experts) == experts
        assert mc.experts_per_token == hf.num_experts_per_tok
        assert mc.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", 0)


def test_a_step_routes_tokens_to_several_experts_and_skips_the_rest() -> None:
    # 4 tokens, 2 of 8 experts each: at most 8 of them run, each over its tokens only.
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter = 8, 16, 12
    mlp = SparseMLP(torch.randn(experts, hidden, generator=g), torch.randn(experts, 2 * inter, hidden, generator=g),
                    torch.randn(experts, hidden, inter, generator=g), top_k=2, renormalize=True)
    x = torch.randn(4, hidden, generator=g)
    probs = torch.softmax(x @ mlp.router.T, dim=-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(4):
        for slot in range(2):
            e = int(chosen[t, slot])
            gate, up = (x[t] @ mlp.gate_up[e].T).chunk(2)
            want[t] += weights[t, slot] * (torch.nn.functional.silu(gate) * up) @ mlp.down[e].T
    torch.testing.assert_close(mlp(x), want, atol=1e-4, rtol=1e-4)
    assert 2 < len(set(chosen.flatten().tolist())) < experts  # several experts, not all


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_greedy_and_logprobs_match_transformers_in_batches_and_chunks(make_llm, preset: str) -> None:
    # Mixed prefill/decode steps with an 8-token budget: every step routes a different mix of tokens.
    assert_greedy_matches(make_llm(preset, max_num_batched_tokens=8, page_size=4), preset, prompts(4), 8)


def test_decode_graphs_are_off_and_say_so(make_llm, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        llm = make_llm("tiny-mixtral", cuda_graphs="emulate")
    assert not llm.engine.model.capturable and llm.engine.graphs is None
    assert any("decode graphs: off (the model's experts" in r.getMessage() for r in caplog.records)
    assert graphs_module.graphs_mode("auto", torch.device("cuda"), capturable=False) is None
    assert graphs_module.graphs_mode("auto", torch.device("cuda"), capturable=True) == "capture"


@pytest.mark.parametrize(("edits", "message"), [
    ({"num_experts_per_tok": 7}, "more than the 6 experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"moe_intermediate_size": None}, "expert intermediate size must be a positive integer"),
], ids=["top-k-past-the-experts", "zero-step", "no-expert-size"])
def test_a_malformed_expert_config_is_refused_by_name(tmp_path, edits: dict[str, Any], message: str) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(ensure_preset("tiny-qwen3-moe"), d)
    cfg = {**json.loads((d / "config.json").read_text()), **edits}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load_model_config(d)
