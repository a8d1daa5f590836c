"""Mixture-of-experts checkpoints (Mixtral, Granite MoE, Qwen2-MoE, Qwen3-MoE, OLMoE): beyond the parity of
tests/engine/test_reference.py, the routing itself (tokens spread over the
experts, some experts unused in a step), the weights as each architecture
scales them, a dense layer beside a sparse one; and the two ways of grouping
a step's tokens by expert: on the host's count (CPU; decode graphs off) and
on the device in Triton kernels (here in Triton's interpreter: the same
results, nothing read back, launches sized by shapes alone; decode graphs on).
"""

from __future__ import annotations

import json
import logging
import shutil
from typing import Any

import pytest
import torch

from engine import graphs as graphs_module
from engine.kernels import triton_moe
from engine.models.config import CheckpointError, load_model_config
from engine.models.moe import SparseMLP, group_on_device
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


def test_grouped_on_the_host_decode_graphs_are_off_and_say_so(make_llm, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        llm = make_llm("tiny-mixtral", cuda_graphs="emulate")
    assert not llm.engine.model.capturable and llm.engine.graphs is None
    assert not any(mlp.grouped_on_device for mlp in llm.engine.model.sparse_mlps())
    messages = [r.getMessage() for r in caplog.records]
    assert "experts: grouped on the host (no Triton kernels here); decode graphs off" in messages
    assert any("decode graphs: off (the model's experts" in m for m in messages)
    assert graphs_module.graphs_mode("auto", torch.device("cuda"), capturable=False) is None
    assert graphs_module.graphs_mode("auto", torch.device("cuda"), capturable=True) == "capture"


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe"])
def test_grouped_on_the_device_decode_graphs_replay_them(make_llm, caplog, preset: str) -> None:
    """With the Triton kernels (attention and pointwise) the experts are routed
    and grouped on the device too, the model is capturable and decode steps
    replay the graph path: tokens and log-probabilities as transformers'.
    Qwen2-MoE's shared expert runs beside the routed ones (Mixtral's engine
    on these kernels: tests/engine/test_decode_launches.py)."""
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        llm = make_llm(preset, attention="triton", cuda_graphs="emulate", kv_cache_gib=0.05, max_num_seqs=4,
                       page_size=5)
    mlps = llm.engine.model.sparse_mlps()
    assert mlps and all(mlp.grouped_on_device for mlp in mlps) and llm.engine.model.capturable
    assert any(r.getMessage().startswith("experts: grouped on the device (Triton)") for r in caplog.records)
    assert_greedy_matches(llm, preset, prompts(3), 6)
    assert llm.engine.graphs is not None and sum(llm.engine.graphs.replays.values()) > 0


def test_kernels_that_fail_their_check_leave_the_experts_on_the_host(monkeypatch) -> None:
    layer = _layer(experts=4, hidden=24, inter=20, top_k=2, dtype=torch.float32)

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(triton_moe, "fused_experts", broken)
    line = group_on_device([layer], torch.device("cpu"), torch.float32)
    assert line.startswith("experts: grouped on the host (the Triton expert kernels failed here (RuntimeError")
    assert not layer.grouped_on_device
    monkeypatch.setattr(triton_moe, "fused_experts", lambda x, *args: torch.zeros_like(x))
    assert "disagree with torch" in group_on_device([layer], torch.device("cpu"), torch.float32)
    assert not layer.grouped_on_device


def _layer(experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, shared: int = 0,
           seed: int = 0) -> SparseMLP:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    mlp = SparseMLP(randn(experts, hidden), randn(experts, 2 * inter, hidden, scale=hidden ** -0.5),
                    randn(experts, hidden, inter, scale=inter ** -0.5), top_k=top_k, renormalize=top_k > 1)
    if shared:
        mlp.shared_gate_up = randn(2 * shared, hidden, scale=hidden ** -0.5)
        mlp.shared_down = randn(hidden, shared, scale=shared ** -0.5)
        mlp.shared_gate = randn(1, hidden)
    return mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "shared"), [
    (1, 8, 2, 64, 48, 0),     # a decode row: two blocks of 16 rows, one pair each
    (5, 4, 1, 72, 40, 0),     # top-1; the reduction and the columns end mid-tile
    (9, 6, 3, 40, 136, 24),   # three slots summed; a shared expert beside
    (300, 4, 2, 64, 64, 0),   # a prompt chunk: 64-row blocks
], ids=["decode", "top1-ragged", "top3-shared", "prompt"])
def test_device_grouping_matches_the_host_grouping(dtype: torch.dtype, tokens: int, experts: int, top_k: int,
                                                   hidden: int, inter: int, shared: int) -> None:
    layer = _layer(experts, hidden, inter, top_k, dtype, shared, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = layer(x)
    layer.grouped_on_device = True
    got = layer(x)
    assert got.dtype == dtype and got.shape == want.shape
    # float32: the same products summed in another order. float16: the same
    # roundings, an odd one falling the other way. bfloat16: Triton's
    # interpreter truncates float32 to bfloat16 where a GPU rounds to nearest,
    # so here each rounding may be an ulp off.
    atol, rtol, mean = {torch.float32: (2e-5, 2e-5, 1e-6), torch.float16: (1e-2, 1e-2, 2e-4),
                        torch.bfloat16: (0.05, 0.02, 2e-2)}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    assert (got.float() - want.float()).abs().mean() < mean


def test_long_prompt_chunks_are_grouped_a_slice_at_a_time(monkeypatch) -> None:
    layer = _layer(experts=4, hidden=32, inter=24, top_k=2, dtype=torch.float32)
    x = torch.randn(45, 32, generator=torch.Generator().manual_seed(2))
    want = layer(x)
    layer.grouped_on_device = True
    calls: list[int] = []
    real = triton_moe.route_and_align

    def counted(logits: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append(logits.shape[0])
        return real(logits, *args)

    monkeypatch.setattr(triton_moe, "_MAX_PAIRS", 40)  # 20 tokens of 2 slots a slice
    monkeypatch.setattr(triton_moe, "route_and_align", counted)
    torch.testing.assert_close(layer(x), want, atol=2e-5, rtol=2e-5)
    assert calls == [20, 20, 5]
    assert layer(x[:0]).shape == (0, 32)  # no tokens: nothing routed, nothing launched
    assert calls == [20, 20, 5]


@pytest.mark.parametrize(("experts", "block_m", "renormalize"), [(6, 16, True), (6, 64, False), (128, 16, True)])
def test_routing_puts_every_pair_once_in_blocks_of_one_expert(experts: int, block_m: int, renormalize: bool) -> None:
    g = torch.Generator().manual_seed(block_m)

    def distinct(tokens: int, top_k: int) -> torch.Tensor:
        return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])

    routings = [distinct(tokens, top_k) for tokens, top_k in ((1, 1), (7, 2), (50, 3), (40, 2))]
    routings += [torch.tensor([5, 1]).repeat(33, 1), torch.arange(12).reshape(6, 2) % experts]  # two experts; all
    # More pairs than the kernel takes at once (64 a pass at 128 experts): two passes.
    routings += [distinct(30, 4)]
    for chosen in routings:
        tokens, top_k = chosen.shape
        # Logits that make `chosen` each token's experts, in slot order.
        logits = torch.randn(tokens, experts, generator=g)
        logits.scatter_(1, chosen, 8.0 - torch.arange(top_k, dtype=torch.float32).expand(tokens, top_k))
        weights, rows, block_expert = triton_moe.route_and_align(logits, top_k, renormalize, block_m)
        probs = torch.softmax(logits, dim=-1)
        want = probs.gather(1, chosen)
        if renormalize:
            want = want / want.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(weights, want.flatten(), atol=1e-6, rtol=1e-6)
        pairs = chosen.numel()
        total = triton_moe.max_blocks(pairs, experts, block_m)
        assert rows.dtype == block_expert.dtype == torch.int32
        assert rows.shape == (total * block_m,) and block_expert.shape == (total,)
        flat, by_block = chosen.flatten(), rows.view(total, block_m)
        used = [b for b in range(total) if block_expert[b] < experts]
        assert used == list(range(len(used)))  # used blocks first, then only unused ones
        assert all((by_block[b] == pairs).all() for b in range(len(used), total))
        assert (block_expert[len(used):] == experts).all()
        placed = []
        for b in used:
            real = by_block[b][by_block[b] < pairs].tolist()
            assert real and (flat[real] == block_expert[b]).all()  # each block one expert's
            placed += real
        assert sorted(placed) == list(range(pairs))  # every pair exactly once
        # Expert by expert, each in pair order: the order a stable sort gives.
        assert placed == torch.argsort(flat, stable=True).tolist()
        counts = torch.bincount(flat, minlength=experts)
        assert len(used) == int(((counts + block_m - 1) // block_m).sum())


def test_device_grouping_reads_nothing_back_and_launches_by_shape(monkeypatch) -> None:
    """A device-grouped layer (the router's product, then the launches of the
    routing with the alignment and of both GEMMs) reads no tensor value on the host (on a GPU such a read would wait for the
    layer before and break a graph's capture), and the launch grids are the
    same for any routing of the same number of tokens."""
    from .test_stream_order import HOST_READS

    grids: list[tuple[str, tuple[int, ...]]] = []

    class Launch:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append((self.name, grid))
            return lambda *args, **kwargs: None

    monkeypatch.setattr(triton_moe, "_route_kernel", Launch("route"))
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", Launch("gate_up"))
    monkeypatch.setattr(triton_moe, "_down_kernel", Launch("down"))
    layer = _layer(experts=8, hidden=32, inter=24, top_k=2, dtype=torch.float32, shared=8)
    layer.grouped_on_device = True
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g) * 50]
    for name in HOST_READS:
        def refuse(self: torch.Tensor, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise AssertionError(f"Tensor.{_name} read a value on the host")

        monkeypatch.setattr(torch.Tensor, name, refuse)
    for x in inputs:
        layer(x)
    monkeypatch.undo()
    assert [name for name, _ in grids] == ["route", "gate_up", "down"] * 2
    assert grids[:3] == grids[3:]
    assert grids[0][1] == (1,) and grids[1][1] == (triton_moe.max_blocks(12, 8, 16), 1)


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
