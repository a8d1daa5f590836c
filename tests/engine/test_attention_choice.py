"""Attention is chosen once, at start-up, from probes of the device and PyTorch:
each choice with its probes injected, the real probe of the Triton kernels
(here in Triton's interpreter), and engines on each backend against transformers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from engine import LLM, attention
from engine.attention import HeadShape, TorchAttention, choose_attention, probe_triton, triton_check
from engine.attention.cpu_kernel import KernelAttention
from engine.config import EngineConfig
from engine.kernels import triton_ops
from engine.models.config import load_model_config
from engine.presets import ensure_preset

from .reference import assert_greedy_matches, prompts

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _yes() -> bool:
    return True


def _no() -> bool:
    return False


def _works() -> str | None:
    return None


def _broken() -> str | None:
    return "no Triton here"


@pytest.mark.parametrize(("device", "prefer", "cpu_kernel", "triton", "expected"), [
    (CUDA, "auto", _no, _works, "triton"),
    (CUDA, "auto", _no, _broken, "torch"),
    (CPU, "auto", _yes, _broken, "cpu-kernel"),
    (CPU, "auto", _no, _broken, "torch"),
    (CPU, "torch", _yes, _works, "torch"),
    (CUDA, "torch", _no, _works, "torch"),
    (CPU, "triton", _yes, _works, "triton"),
])
def test_each_choice(device, prefer, cpu_kernel, triton, expected) -> None:
    choice = choose_attention(device, torch.float32, prefer, cpu_kernel=cpu_kernel, triton=triton)
    assert choice.name == expected
    assert choice.reason
    if expected == "torch" and prefer == "auto" and device.type == "cuda":
        assert "no Triton here" in choice.reason, "the log says why Triton was not taken"
    assert choice.graph_capturable == (expected == "triton")


def test_triton_asked_for_but_unusable_is_an_error() -> None:
    with pytest.raises(ValueError, match="no Triton here"):
        choose_attention(CUDA, torch.bfloat16, "triton", cpu_kernel=_no, triton=_broken)
    with pytest.raises(ValueError, match="attention must be one of"):
        choose_attention(CPU, torch.float32, "flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_triton_probe_runs_the_kernels(dtype: torch.dtype, monkeypatch) -> None:
    assert probe_triton(CPU, dtype) is None  # the interpreter (tests/conftest.py)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CUDA" in (probe_triton(CPU, dtype) or "")


@pytest.mark.parametrize("shape", [HeadShape(32, 8, 128, 16), HeadShape(12, 12, 80, 3), HeadShape(4, 1, 256, 1)])
def test_the_probe_runs_at_the_models_shape(shape: HeadShape) -> None:
    """Llama-3-8B's heads, an odd head_dim with an odd page size, a wide head with one token a page."""
    assert probe_triton(CPU, torch.bfloat16, shape) is None


def test_the_probe_turns_down_kernels_that_compute_wrong_results(monkeypatch) -> None:
    shape = HeadShape(4, 2, 32, 4)

    def off_by_a_little(*args, **kwargs):  # what a miscompiled split merge might return
        return real(*args, **kwargs) + 0.1

    real = triton_check.paged_attention
    monkeypatch.setattr(triton_check, "paged_attention", off_by_a_little)
    assert "RuntimeError: decode differs from exact attention by 0.1" in (probe_triton(CPU, torch.float32, shape) or "")

    def nan_prefill(q, *args, **kwargs):
        out = real(q, *args, **kwargs)
        return out if args[5] == 1 else out * float("nan")  # args[5]: max_q

    monkeypatch.setattr(triton_check, "paged_attention", nan_prefill)
    assert "prefill differs" in (probe_triton(CPU, torch.float32, shape) or "")
    monkeypatch.setattr(triton_check, "paged_attention", real)
    monkeypatch.setattr(triton_check, "rotate_write_kv", lambda *args: None)
    assert "rotate_write_kv differs from exact rotation" in (probe_triton(CPU, torch.float32, shape) or "")
    monkeypatch.setattr(triton_check, "write_kv", lambda *args: None)
    assert "write_kv stored keys or values in the wrong cache rows" in (probe_triton(CPU, torch.float32, shape) or "")


def test_the_probe_fills_both_decode_splits_at_the_default_page_size(monkeypatch) -> None:
    # A merge that kept only the first split's keys (a key block of 64, whole
    # pages) must be caught at 16 tokens a page in 16-bit types, as it was not
    # when every probed sequence fit in one split.
    real = triton_check.paged_attention

    def first_split_only(q, kv_blocks, layer, block_table, lens, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("num_splits") == 2:
            lens = lens.clamp(max=64)
        return real(q, kv_blocks, layer, block_table, lens, *args, **kwargs)

    monkeypatch.setattr(triton_check, "paged_attention", first_split_only)
    assert "split decode differs" in (probe_triton(CPU, torch.bfloat16, HeadShape(4, 2, 32, 16)) or "")


def test_an_engine_probes_triton_at_its_models_shape(monkeypatch) -> None:
    probed = []

    def probe(device, dtype, shape):
        probed.append(shape)
        return "not today"

    monkeypatch.setattr(attention, "probe_triton", probe)
    path = ensure_preset("tiny-qwen3")
    with pytest.raises(ValueError, match="--attention triton: not today"):
        LLM(path, attention="triton", kv_cache_gib=0.05, page_size=5)
    mc = load_model_config(path)
    assert probed == [HeadShape(mc.num_heads, mc.num_kv_heads, mc.head_dim, 5)]


@pytest.mark.parametrize(("attention", "backend"), [("auto", KernelAttention), ("torch", TorchAttention)])
def test_cpu_engines_log_their_choice(make_llm, caplog, attention, backend) -> None:
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        llm = make_llm("tiny-llama", attention=attention, kv_cache_gib=0.05)
    assert isinstance(llm.engine.attention, backend)
    assert any(r.getMessage().startswith(f"attention: {llm.engine.attention_choice.name} (") for r in caplog.records)


@pytest.mark.parametrize(("preset", "cuda_graphs"), [("tiny-llama", "off"), ("tiny-llama", "emulate"),
                                                     ("tiny-qwen2", "off"), ("tiny-qwen3", "emulate"),
                                                     ("tiny-gemma3", "emulate"), ("tiny-gemma2", "off"),
                                                     ("tiny-olmo2", "emulate")])
def test_a_triton_engine_matches_transformers(make_llm, caplog, monkeypatch, preset: str, cuda_graphs: str) -> None:
    """The Triton kernels in a whole engine (in the interpreter here): attention
    and the fused pointwise kernels, mixed prefill/decode batches eagerly,
    decode steps through the graph path; q/k/v biases (Qwen2) and q/k norms
    (Qwen3); Gemma 3's sliding layer, with its own rotation, beside a full one;
    Gemma 2's capped scores; OLMo 2's q/k norms over all heads, rotated in the write.
    Every layer's rotary embedding happens in its cache write."""
    from engine.attention import triton_backend

    writes = {"rotating": 0, "plain": 0}

    def counted(name, fn):
        def call(*args):
            writes[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(triton_backend, "rotate_write_kv", counted("rotating", triton_backend.rotate_write_kv))
    monkeypatch.setattr(triton_backend, "write_kv", counted("plain", triton_backend.write_kv))
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        llm = make_llm(preset, attention="triton", cuda_graphs=cuda_graphs, kv_cache_gib=0.05, max_num_seqs=4,
                       page_size=5)
    assert llm.engine.attention.name == "triton"
    assert llm.engine.model.ops is triton_ops
    assert any(r.getMessage().startswith("pointwise kernels: triton") for r in caplog.records)
    assert_greedy_matches(llm, preset, prompts(3), 6)
    if cuda_graphs == "emulate":
        assert llm.engine.graphs is not None and sum(llm.engine.graphs.replays.values()) > 0
    assert writes["rotating"] > 0 and writes["plain"] == 0


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(model="x", cuda_graphs="always")
    with pytest.raises(ValueError, match="CUDA devices only"):
        EngineConfig(model="x", gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EngineConfig(model="x", device="cuda", gpu_memory_utilization=1.5)
    # Refused before any weight is loaded (the scheduler refused them after).
    limits: dict[str, Any] = {"max_num_seqs": 0, "max_num_batched_tokens": 0, "num_steps": -1}
    for name, value in limits.items():
        with pytest.raises(ValueError, match=name):
            EngineConfig(model="x", overlap=False, **{name: value})


@pytest.mark.parametrize("limits", [dict(max_model_len=2), dict(max_model_len=3),
                                    dict(page_size=1, kv_cache_gib=3 * 2 * 2 * 2 * 16 * 4 / 2**30)])
def test_the_warm_up_fits_the_shortest_context(make_llm, limits) -> None:  # type: ignore[no-untyped-def]
    """A context of 2 or 3 tokens (asked for, or all a tiny cache holds) is
    accepted, and the server's warm-up then failed on it at start-up."""
    from engine.warmup import warm_up

    llm = make_llm("tiny-llama", **limits)
    assert llm.engine.max_model_len in (2, 3)
    warm_up(llm.engine)
