"""A batch-1 matrix-vector product in Triton, taken per weight shape where it beats cuBLAS.

Decoding one sequence reads every weight once a step for a single row of
activations: the step is a sum of matrix-vector products bound by memory
bandwidth. cuBLAS pads that row to a GEMM tile and picks its tiling by
heuristics; on the H200 an 8B model's decode graph at batch 1 ran at 63 % of
the copy bandwidth, nearly all of it in those GEMMs. This kernel is the plain
bandwidth-bound form: each program owns `block_n` output features and walks
the whole reduction in `block_k` slices, accumulating `w * x` in float32 and
reducing once at the end, so a weight is streamed once with wide loads and
nothing else; the grid is sized from the shape so that the device's SMs all
have work.

Which is faster depends on the GPU, the shape and the library versions, so
it is not assumed: `choose` times cuBLAS (`F.linear`) against each config of
`CONFIGS` for every distinct weight shape of the model, once at start-up, and
keeps this kernel only where it wins clearly (`MARGIN`); the start-up log says
which shapes it took. Only 16-bit weights take it: float32 models keep
cuBLAS's summation order, which the exact-parity tests compare against.
Launch sizes come from shapes only, so it runs inside CUDA graphs; on CPU the
tests run it in Triton's interpreter against a float64 reference.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .triton_base import jit, tl, triton
from .triton_ops import silu_times

log = logging.getLogger(__name__)

# (block_n, block_k, num_warps) tried per shape; block_n is halved until the
# grid covers the SMs twice (see `grid_block_n`). A program holds its
# block_n x block_k tile twice over in registers (the loaded weights and the
# float32 partial sums), so the first three (16k elements, 150-250 registers a
# thread) leave an SM two or three programs; the last three (4-8k elements,
# 56-72 registers) leave it six or more, with as many bytes in flight: which
# streams faster depends on the GPU, so both kinds are timed. None spills
# registers on sm_80 or sm_90 (tests/engine/test_triton_kernels.py).
CONFIGS: tuple[tuple[int, int, int], ...] = (
    (64, 256, 4), (32, 512, 4), (16, 1024, 8), (8, 1024, 8), (4, 1024, 4), (4, 2048, 8))
# Taken only when faster than cuBLAS by this share: timing noise must not flip
# a shape to a kernel that is no better.
MARGIN = 0.03
DTYPES = (torch.float16, torch.bfloat16)


@jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n, k, stride_w, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    rows = cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        if GATED:
            # The input is [gate | up]; the product's input is silu(gate) * up,
            # computed as triton_ops.silu_mul computes it.
            gate = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + k + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = silu_times(gate, up, x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, out.to(y_ptr.dtype.element_ty), mask=col_ok)


@dataclass(frozen=True)
class GemvConfig:
    """How one weight shape runs at batch 1: the block sizes and warps of the launch."""

    block_n: int
    block_k: int
    num_warps: int


def grid_block_n(n: int, block_n: int, num_sms: int) -> int:
    """`block_n`, halved (down to 8) until the grid has twice as many programs as SMs."""
    while block_n > 8 and -(-n // block_n) < 2 * num_sms:
        block_n //= 2
    return block_n


def shape_configs(n: int, num_sms: int) -> list[GemvConfig]:
    """The distinct configs to time for `n` output features: `CONFIGS` with
    block_n fitted to the grid (two may fit to the same launch)."""
    fitted = (GemvConfig(grid_block_n(n, block_n, num_sms), block_k, warps) for block_n, block_k, warps in CONFIGS)
    return list(dict.fromkeys(fitted))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
         gated: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row: x `[1, K]` (unit stride), weight `[N, K]`
    (unit stride along K); returns `[1, N]` in x's dtype. `gated`: x is `[1, 2K]`,
    a gate and an up projection side by side, and the product's input is
    `silu(gate) * up` (a SwiGLU MLP's down projection, without the kernel between)."""
    n, k = weight.shape
    if x.shape != (1, 2 * k if gated else k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row of {2 * k if gated else k} features and a [N, {k}] weight, "
                         f"not {tuple(x.shape)}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = (-(-n // config.block_n),)
    _gemv_kernel[grid](x, weight, bias if bias is not None else y, y, n, k, weight.stride(0),
                       HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                       num_warps=config.num_warps)
    return y


@dataclass(frozen=True)
class ShapeTiming:
    """One weight shape's batch-1 times: cuBLAS's, and each config's (None: it failed)."""

    shape: tuple[int, int]
    cublas_us: float
    configs: tuple[tuple[GemvConfig, float | None], ...]


def pick(timing: ShapeTiming, margin: float = MARGIN) -> GemvConfig | None:
    """The fastest config if it beats cuBLAS by `margin`, else None (cuBLAS)."""
    timed = [(us, cfg) for cfg, us in timing.configs if us is not None]
    if not timed:
        return None
    us, cfg = min(timed, key=lambda t: t[0])
    return cfg if us < timing.cublas_us * (1 - margin) else None


# Weight bytes a timed pass streams at least: more than a GPU's L2 cache (50 MB
# on an H100/H200), so that the timing reads memory as decoding does.
_STREAM_BYTES = 256 << 20
_MAX_COPIES = 64


def _graph_time_us(calls: list[Callable[[], object]], rounds: int = 4) -> float:
    """Mean device time of one call in microseconds, `calls` captured `rounds`
    times over in one CUDA graph: no launch overhead, as in the decode graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and library workspaces, outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls meanwhile are not this capture's business.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (2 * rounds * len(calls))


def time_shape(weight: torch.Tensor, bias: torch.Tensor | None, num_sms: int) -> ShapeTiming:
    """Time cuBLAS and every config on `weight` (CUDA) at batch 1, each in a CUDA
    graph that cycles through enough copies of the weight to miss the L2 cache."""
    n, k = weight.shape
    x = torch.randn(1, k, device=weight.device, dtype=weight.dtype)
    copies = min(_MAX_COPIES, max(1, -(-_STREAM_BYTES // (weight.numel() * weight.element_size()))))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    cublas = _graph_time_us([functools.partial(F.linear, x, w, bias) for w in weights])
    want = F.linear(x, weight, bias).float()
    configs: list[tuple[GemvConfig, float | None]] = []
    for cfg in shape_configs(n, num_sms):
        try:
            got = gemv(x, weight, bias, cfg).float()
            # A kernel that disagrees beyond 16-bit rounding is never taken.
            ok = torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-3)
            configs.append((cfg, _graph_time_us([functools.partial(gemv, x, w, bias, cfg) for w in weights])
                            if ok else None))
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot compile is not taken
            log.debug("gemv config %s failed on %s: %s", cfg, tuple(weight.shape), e)
            configs.append((cfg, None))
    return ShapeTiming((n, k), cublas, tuple(configs))


def gated_problem(weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> str | None:
    """Why the gated form of `config` (the down projection with SiLU x up in
    its kernel, `gemv(gated=True)`) cannot be taken on this weight, or None:
    it must compile here and agree with the activation then the product."""
    n, k = weight.shape
    x = torch.randn(1, 2 * k, device=weight.device, dtype=weight.dtype)
    want = F.linear(F.silu(x[:, :k]) * x[:, k:], weight, bias).float()
    try:
        got = gemv(x, weight, bias, config, gated=True).float()
    except Exception as e:  # noqa: BLE001 - a kernel this GPU cannot compile is not taken
        return f"{type(e).__name__}: {e}"
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-3):
        return f"off by {float((got - want).abs().max()):.3g}"
    return None


def choose(weights: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
           timer: Callable[[torch.Tensor, torch.Tensor | None], ShapeTiming] | None = None,
           check: Callable[[torch.Tensor, torch.Tensor | None, GemvConfig], str | None] | None = None
           ) -> tuple[dict[tuple[int, int], GemvConfig], list[ShapeTiming]]:
    """Per distinct weight shape, the config to run batch 1 with (shapes left out
    keep cuBLAS), and the timings it was chosen from. `timer` times one shape
    (default: `time_shape` on this CUDA device); `check` says why a chosen
    config may not be taken after all (default there: `gated_problem`, since
    the timing runs the plain form only, and a layer may run the gated one)."""
    if timer is None:
        num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        check = check or gated_problem

        def timer(w: torch.Tensor, b: torch.Tensor | None) -> ShapeTiming:
            return time_shape(w, b, num_sms)

    seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for w, b in weights:
        seen.setdefault((w.shape[0], w.shape[1]), (w, b))
    timings = [timer(w, b) for w, b in seen.values()]
    chosen: dict[tuple[int, int], GemvConfig] = {}
    for t in timings:
        cfg = pick(t)
        problem = None if cfg is None or check is None else check(*seen[t.shape], cfg)
        if problem is not None:
            log.warning("batch-1 GEMV: %dx%d keeps cuBLAS: the kernel's gated form failed (%s)",
                        t.shape[0], t.shape[1], problem)
        elif cfg is not None:
            chosen[t.shape] = cfg
    return chosen, timings


def describe(chosen: dict[tuple[int, int], GemvConfig], timings: list[ShapeTiming]) -> str:
    """The start-up log's line: which shapes take the kernel, with both times."""
    parts = []
    for t in timings:
        cfg = chosen.get(t.shape)
        best = min((us for c, us in t.configs if c == cfg and us is not None), default=None)
        who = f"triton {best:.1f} us" if cfg is not None and best is not None else "cuBLAS"
        parts.append(f"{t.shape[0]}x{t.shape[1]}: {who} (cuBLAS {t.cublas_us:.1f} us)")
    return f"batch-1 GEMV: triton for {len(chosen)} of {len(timings)} weight shapes; " + "; ".join(parts)


class LinearLayer(Protocol):
    """What `install` reads and sets on a linear layer (engine/models/linear.py's `Linear`)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    gemv: GemvConfig | None


def install(linears: Sequence[LinearLayer], device: torch.device, dtype: torch.dtype) -> str:
    """Choose per weight shape (CUDA, 16-bit weights, Triton present) and set
    each linear layer's `gemv`; returns the start-up log's line."""
    if device.type != "cuda" or triton is None:
        return "batch-1 GEMV: cuBLAS (no Triton on CUDA here)"
    if dtype not in DTYPES:
        return "batch-1 GEMV: cuBLAS (float32 weights keep cuBLAS's summation order)"
    # (The kernel reads the weight along K with unit stride, as loaded weights are.)
    layers = [lin for lin in linears if lin.weight is not None and lin.weight.stride(1) == 1]
    try:
        chosen, timings = choose((lin.weight, lin.bias) for lin in layers)  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001 - the timing is an optimisation: cuBLAS serves anyway
        log.warning("batch-1 GEMV timing failed (%s: %s); cuBLAS serves every shape", type(e).__name__, e)
        return "batch-1 GEMV: cuBLAS (the start-up timing failed)"
    for lin in layers:
        assert lin.weight is not None
        lin.gemv = chosen.get((lin.weight.shape[0], lin.weight.shape[1]))
    return describe(chosen, timings)
