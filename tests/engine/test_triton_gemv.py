"""The batch-1 Triton matrix-vector kernel (engine/kernels/triton_gemv.py): its
results against a float64 reference in every config, the per-shape choice
against cuBLAS's time, and a linear layer's dispatch to it.

Without CUDA the kernel runs in Triton's interpreter; on a GPU the same tests
run there, and `install` times real shapes (tests/cuda)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.kernels import triton_gemv as tg  # noqa: E402
from engine.models.linear import Linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# One rounding of the output (bfloat16 keeps 8 bits, float16 11), on sums of
# products whose order differs from the reference's.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _weights(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", tg.CONFIGS)
def test_every_config_computes_the_product(dtype, config):
    block_n, block_k, warps = config
    # Shapes that leave a partial block of outputs and of the reduction.
    for n, k, bias in ((block_n * 2 + 3, block_k + 40, False), (max(1, block_n - 5), 2 * block_k + 7, True)):
        x, w, b = _weights(n, k, dtype, bias)
        got = tg.gemv(x, w, b, tg.GemvConfig(block_n, block_k, warps))
        assert got.shape == (1, n) and got.dtype == dtype
        want = _reference(x, w, b)
        tol = TOL[dtype]
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol * float(want.abs().max())), (n, k, bias)


def test_only_one_row_with_unit_stride_is_taken():
    x, w, _ = _weights(16, 64, torch.float32, False)
    cfg = tg.GemvConfig(16, 64, 4)
    with pytest.raises(ValueError):
        tg.gemv(torch.cat([x, x]), w, None, cfg)
    with pytest.raises(ValueError):
        tg.gemv(x, w.t().contiguous().t(), None, cfg)


def test_the_grid_covers_the_sms_twice_before_blocks_shrink_below_eight():
    assert tg.grid_block_n(28672, 64, 132) == 64  # 448 programs already
    assert tg.grid_block_n(6144, 64, 132) == 16  # 96 -> 192 -> 384
    assert tg.grid_block_n(4096, 64, 132) == 8  # 256 at 16: one more halving
    assert tg.grid_block_n(100, 64, 132) == 8  # never below 8


def test_configs_fitted_to_one_launch_are_timed_once():
    small = tg.shape_configs(4096, 132)  # every block_n of 16 or more fits down to 8
    assert len(small) == len(set(small)) and tg.GemvConfig(8, 1024, 8) in small
    assert len(small) < len(tg.CONFIGS)
    assert len(tg.shape_configs(28672, 132)) == len(tg.CONFIGS)  # wide enough for every block_n


def _timing(shape, cublas, *times):
    configs = tuple((tg.GemvConfig(16 * (i + 1), 256, 4), us) for i, us in enumerate(times))
    return tg.ShapeTiming(shape, cublas, configs)


def test_a_shape_takes_the_fastest_config_only_if_it_clearly_beats_cublas():
    assert tg.pick(_timing((8, 8), 10.0, 9.0, 8.0, None)) == tg.GemvConfig(32, 256, 4)
    assert tg.pick(_timing((8, 8), 10.0, 9.8)) is None  # within the margin: cuBLAS stays
    assert tg.pick(_timing((8, 8), 10.0, None, None)) is None  # nothing ran
    assert tg.pick(_timing((8, 8), 10.0, 12.0)) is None


def test_choose_times_each_distinct_shape_once_and_describes_the_choice():
    weights = [(torch.empty(96, 32), None), (torch.empty(64, 32), None), (torch.empty(96, 32), None)]
    timed = []

    def timer(w, b):
        timed.append(tuple(w.shape))
        return _timing(tuple(w.shape), 10.0, 7.5 if w.shape[0] == 96 else 11.0)

    chosen, timings = tg.choose(weights, timer)
    assert timed == [(96, 32), (64, 32)]
    assert chosen == {(96, 32): tg.GemvConfig(16, 256, 4)}
    line = tg.describe(chosen, timings)
    assert line.startswith("batch-1 GEMV: triton for 1 of 2 weight shapes")
    assert "96x32: triton 7.5 us (cuBLAS 10.0 us)" in line and "64x32: cuBLAS (cuBLAS 10.0 us)" in line


def test_a_chosen_config_whose_gated_form_fails_keeps_cublas(monkeypatch):
    # The timing runs the plain form only; the down projection runs the gated one.
    weights = [(torch.randn(96, 32, dtype=torch.bfloat16), None), (torch.randn(64, 32, dtype=torch.bfloat16), None)]

    def timer(w, b):
        return _timing(tuple(w.shape), 10.0, 7.5)

    assert tg.gated_problem(*weights[0], tg.GemvConfig(16, 256, 4)) is None  # the real kernel (interpreter)
    chosen, _ = tg.choose(weights, timer, check=tg.gated_problem)
    assert set(chosen) == {(96, 32), (64, 32)}
    real = tg.gemv

    def gated_broken(x, weight, bias, config, gated=False):
        out = real(x, weight, bias, config, gated)
        return out + 1.0 if gated and weight.shape[0] == 64 else out

    monkeypatch.setattr(tg, "gemv", gated_broken)
    chosen, _ = tg.choose(weights, timer, check=tg.gated_problem)
    assert set(chosen) == {(96, 32)}


def test_install_leaves_a_cpu_or_float32_model_on_the_library():
    layer = Linear(torch.randn(8, 8), prepack=False)
    assert tg.install([layer], torch.device("cpu"), torch.bfloat16).startswith("batch-1 GEMV: cuBLAS")
    assert layer.gemv is None


def test_time_shape_times_cublas_and_each_config_and_drops_those_that_fail_or_disagree(monkeypatch):
    # The CUDA-graph timer is faked (it needs a GPU); the kernel runs for real.
    timed: list[int] = []

    def graph_time_us(calls, rounds=4):
        calls[0]()  # the first weight copy, as captured
        timed.append(len(calls))
        return 10.0 + len(timed)

    real = tg.gemv
    configs = tg.shape_configs(40, 2)
    broken, wrong = configs[0], configs[1]

    def gemv(x, weight, bias, config, gated=False):
        if config == broken:
            raise RuntimeError("out of resources")  # a config this GPU cannot compile
        out = real(x, weight, bias, config, gated)
        return out * 1.5 if config == wrong else out

    monkeypatch.setattr(tg, "_graph_time_us", graph_time_us)
    monkeypatch.setattr(tg, "gemv", gemv)
    _, w, b = _weights(40, 24, torch.bfloat16, True)
    timing = tg.time_shape(w, b, num_sms=2)
    assert timing.shape == (40, 24) and timing.cublas_us == 11.0
    # Copies enough to stream past the L2 cache, at most _MAX_COPIES of them.
    assert set(timed) == {tg._MAX_COPIES}
    assert [c for c, _ in timing.configs] == configs
    times = dict(timing.configs)
    assert times[broken] is None and times[wrong] is None
    assert all(us is not None for c, us in timing.configs if c not in (broken, wrong))
    assert len(timed) == 1 + len(configs) - 2  # cuBLAS, then each config that ran and agreed


def test_install_on_cuda_sets_each_layers_config_and_keeps_cublas_when_timing_fails(monkeypatch):
    # The device is only named: `choose` (which times on the GPU) is faked.
    wide, narrow = Linear(torch.randn(16, 8), prepack=False), Linear(torch.randn(8, 8), prepack=False)
    cfg = tg.GemvConfig(8, 256, 4)
    timings = [_timing((16, 8), 10.0, 5.0), _timing((8, 8), 10.0, 12.0)]
    monkeypatch.setattr(tg, "choose", lambda weights: ({(16, 8): cfg}, timings))
    line = tg.install([wide, narrow], torch.device("cuda"), torch.bfloat16)
    assert (wide.gemv, narrow.gemv) == (cfg, None)
    assert line.startswith("batch-1 GEMV: triton for 1 of 2 weight shapes")
    assert tg.install([wide], torch.device("cuda"), torch.float32).endswith("keep cuBLAS's summation order)")

    def fails(weights):
        raise RuntimeError("CUDA error: out of memory")
    monkeypatch.setattr(tg, "choose", fails)
    wide.gemv = None
    assert tg.install([wide, narrow], torch.device("cuda"), torch.float16) == \
        "batch-1 GEMV: cuBLAS (the start-up timing failed)"
    assert wide.gemv is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_linear_layer_takes_the_kernel_for_one_row_only(dtype):
    x, w, b = _weights(40, 96, dtype, True, seed=3)
    layer = Linear(w, b, prepack=False)
    plain = layer(x)
    layer.gemv = tg.GemvConfig(16, 64, 4)
    one = layer(x)
    tol = TOL[dtype]
    want = _reference(x, w, b)
    assert torch.allclose(one.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.allclose(one.double(), plain.double(), rtol=2 * tol, atol=2 * tol * float(want.abs().max()))
    rows = torch.cat([x, x])
    assert torch.equal(layer(rows), F.linear(rows, w, b))  # two rows: the library, untouched
    # A row that is a strided view reaches the kernel contiguous.
    wide = torch.cat([x, x], dim=1)[:, ::2]
    assert torch.allclose(layer(wide).double(), _reference(wide, w, b), rtol=tol,
                          atol=tol * float(want.abs().max()) * 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", tg.CONFIGS[::2])
def test_the_gated_product_is_the_activation_kernel_then_the_product(dtype, config):
    """`gated`: silu(gate) * up computed as the kernel loads its input, rounded as
    the activation kernel rounds it: the same bits as that kernel, then gemv."""
    from engine.kernels import triton_ops

    block_n, block_k, warps = config
    cfg = tg.GemvConfig(block_n, block_k, warps)
    n, k = block_n + 3, block_k + 24
    gen = torch.Generator().manual_seed(5)
    gate_up = (2 * torch.randn(1, 2 * k, generator=gen)).to(DEVICE, dtype)
    for bias in (False, True):
        _, w, b = _weights(n, k, dtype, bias, seed=6)
        fused = tg.gemv(gate_up, w, b, cfg, gated=True)
        assert torch.equal(fused, tg.gemv(triton_ops.silu_mul(gate_up), w, b, cfg))
        act = F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
        want = _reference(act, w, b)
        tol = TOL[dtype]
        assert torch.allclose(fused.double(), want, rtol=2 * tol, atol=2 * tol * float(want.abs().max()))
    with pytest.raises(ValueError):
        tg.gemv(gate_up[:, :k].contiguous(), w, b, cfg, gated=True)


@pytest.mark.parametrize("cuda_graphs", ["off", "emulate"])
def test_at_batch_one_the_down_projection_takes_the_activation_in_its_kernel(make_llm, monkeypatch, cuda_graphs):
    """A whole Triton engine at batch 1 (eagerly, and through the decode graphs'
    static-buffer path) with every layer on the GEMV: the down projection runs
    gated, one kernel instead of two, and the tokens and their log-probabilities
    are those of the two-kernel path."""
    from engine import SamplingParams
    from engine.kernels import triton_ops
    from engine.models import linear

    monkeypatch.setattr(linear, "_onednn_usable", lambda weight: False)  # keep plain weights, as on CUDA
    llm = make_llm("tiny-llama", attention="triton", cuda_graphs=cuda_graphs, kv_cache_gib=0.05, max_num_seqs=2)
    assert llm.engine.model.ops is triton_ops
    for lin in llm.engine.model.linears():
        lin.gemv = tg.GemvConfig(16, 64, 4)
    plain_gemv, gated = tg.gemv, []

    def counting(*args, **kwargs):
        gated.append(kwargs.get("gated", False))
        return plain_gemv(*args, **kwargs)

    monkeypatch.setattr(tg, "gemv", counting)
    # Three tokens: two decode steps (the interpreter takes seconds a step over the vocabulary's head).
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=2)
    prompt = [5, 17, 301, 42, 9]
    [fused] = llm.generate([prompt], params)
    layers = len(llm.engine.model.layers)
    assert gated.count(True) >= layers * 2  # every decode step's every layer
    monkeypatch.setattr(Linear, "gated_row", lambda self, gate_up: None)
    gated.clear()
    [plain] = llm.generate([prompt], params)
    assert True not in gated
    assert fused.token_ids == plain.token_ids
    assert fused.logprobs == plain.logprobs
