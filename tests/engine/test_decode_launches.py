"""What a batch-1 decode forward pass launches on the CUDA path, counted on CPU.

With Triton attention and the batch-1 GEMV on every linear layer (what the
start-up timing chooses on a GPU wherever it beats cuBLAS), a decoder layer is
nine kernels, all ours: add + RMSNorm, the QKV product, rotary embedding with
the KV cache write, split-KV decode and its merge, the output product, add +
RMSNorm, the gate/up product, and the down product with SiLU x up inside it.
After the forward pass's prologue (the embedding and the first norm) no torch
operator computes anything. A fused path that silently fell back to torch ops would add launches to every layer, the cost the batch-1
target on a GPU is most sensitive to (a decode step is a few hundred small
kernels there), so this pins the sequence, kernel by kernel.

Kernels run in Triton's interpreter; torch operators are seen by a dispatch
mode on the device thread, with views and allocations left out (no kernel).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine import SamplingParams  # noqa: E402
from engine.attention import triton_kernels  # noqa: E402
from engine.kernels import triton_gemv, triton_moe, triton_ops  # noqa: E402
from engine.models import linear  # noqa: E402
from engine.models.llama import LlamaFamilyModel  # noqa: E402

from .reference import assert_greedy_matches, prompts  # noqa: E402

KERNEL_MODULES: tuple[ModuleType, ...] = (triton_ops, triton_gemv, triton_kernels, triton_moe)
# Operators that launch nothing: fresh storage (what a kernel then writes).
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Recorder(TorchDispatchMode):
    """Appends ("torch", name) for each computing operator, unless paused
    (inside one of our kernels, whose interpreter uses torch ops of its own)."""

    def __init__(self, events: list[tuple[str, str]]):
        super().__init__()
        self.events = events
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in ALLOCATIONS:
            self.events.append(("torch", name))
        return func(*args, **(kwargs or {}))


class _Kernel:
    """Stands in for a Triton kernel: `kernel[grid](...)` records its name, then launches it."""

    def __init__(self, name: str, kernel: Any, record: Callable[[str], Any]):
        self.name, self.kernel, self.record = name, kernel, record

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.record(self.name):
                return launch(*args, **kwargs)

        return run


def _record_decode_forwards(monkeypatch) -> list[list[tuple[str, str]]]:
    """From now on, every one-token forward pass appends its events (our kernels and
    torch's computing operators, in order) as one list."""
    forwards: list[list[tuple[str, str]]] = []
    current: dict[str, _Recorder] = {}

    class _Paused:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> None:
            mode = current.get("mode")
            if mode is not None:
                mode.events.append(("triton", self.name))
                mode.paused = True

        def __exit__(self, *exc: object) -> None:
            mode = current.get("mode")
            if mode is not None:
                mode.paused = False

    for module in KERNEL_MODULES:
        for name, obj in list(vars(module).items()):
            # Launched kernels only: device functions they call are JIT functions too.
            if name.endswith("_kernel") and type(obj).__name__ in ("InterpretedFunction", "JITFunction"):
                monkeypatch.setattr(module, name, _Kernel(name, obj, _Paused))
    real_forward = LlamaFamilyModel.forward

    def forward(self, input_ids, *args, **kwargs):  # noqa: ANN001, ANN202
        if input_ids.shape[0] != 1:
            return real_forward(self, input_ids, *args, **kwargs)
        events: list[tuple[str, str]] = []
        mode = current["mode"] = _Recorder(events)
        try:
            with mode:
                return real_forward(self, input_ids, *args, **kwargs)
        finally:
            del current["mode"]
            forwards.append(events)

    monkeypatch.setattr(LlamaFamilyModel, "forward", forward)
    return forwards


def _expected_layer(first: bool, merge: bool) -> list[str]:
    return ([] if first else ["_add_rms_norm_kernel"]) + [
        "_gemv_kernel",  # q, k, v
        "_rotate_write_kv_kernel",  # rotary embedding on q and k, k and v into their pages
        "_decode_kernel",
        *(["_merge_kernel"] if merge else []),
        "_gemv_kernel",  # output projection
        "_add_rms_norm_kernel",
        "_gemv_kernel",  # gate and up
        "_gemv_kernel",  # down, with SiLU(gate) x up computed inside
    ]


@pytest.mark.parametrize("cuda_graphs", ["off", "emulate"])
def test_batch1_decode_layer_is_nine_of_our_kernels(make_llm, monkeypatch, cuda_graphs: str) -> None:
    monkeypatch.setattr(linear, "_onednn_usable", lambda weight: False)  # plain weights, as on CUDA
    llm = make_llm("tiny-llama", attention="triton", cuda_graphs=cuda_graphs, kv_cache_gib=0.05, max_num_seqs=2)
    eng = llm.engine
    assert eng.model.ops is triton_ops and eng.attention.rotates_in_write
    for lin in eng.model.linears():
        lin.gemv = triton_gemv.GemvConfig(16, 64, 4)  # as install() sets it where the kernel wins
    forwards = _record_decode_forwards(monkeypatch)
    [out] = llm.generate([[5, 17, 301, 42, 9]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
    assert len(forwards) == 3, "each decode step after the prefill is one one-token forward pass"

    layers = len(eng.model.layers)
    merge = eng.attention.decode_splits > 1
    expected = [k for i in range(layers) for k in _expected_layer(i == 0, merge)] + ["_add_rms_norm_kernel"]
    for events in forwards:
        kernels = [name for kind, name in events if kind == "triton"]
        assert kernels == expected
        first = events.index(("triton", expected[0]))
        after_prologue = [name for kind, name in events[first:] if kind == "torch"]
        assert not after_prologue, f"torch operators inside the layers: {after_prologue}"
        prologue = [name for _, name in events[:first]]
        assert prologue == ["embedding", "rms_norm"], prologue


def test_batch1_mixture_of_experts_layer_is_its_router_product_and_three_of_our_kernels(make_llm, monkeypatch) -> None:
    """A mixture-of-experts layer grouped on the device (tiny-mixtral: every
    layer sparse) after its attention: the router's product (torch), the
    routing with the grouping, the two grouped GEMMs, and the sum of each
    token's slots (torch); no softmax, top-k or bookkeeping op of torch's
    between them (they were about twenty launches a layer)."""
    monkeypatch.setattr(linear, "_onednn_usable", lambda weight: False)
    llm = make_llm("tiny-mixtral", attention="triton", cuda_graphs="emulate", kv_cache_gib=0.05, max_num_seqs=2)
    eng = llm.engine
    assert all(mlp.grouped_on_device for mlp in eng.model.sparse_mlps())
    for lin in eng.model.linears():
        lin.gemv = triton_gemv.GemvConfig(16, 64, 4)
    forwards = _record_decode_forwards(monkeypatch)
    llm.generate([[5, 17, 301, 42, 9]], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert len(forwards) == 2
    merge = eng.attention.decode_splits > 1
    attention = _expected_layer(False, merge)[:-2]  # up to the norm before the MLP
    moe = ["torch linear", "_route_kernel", "_gate_up_kernel", "_down_kernel", "torch sum"]
    layers = len(eng.model.layers)
    expected = [e for i in range(layers) for e in (attention[1:] if i == 0 else attention) + moe]
    expected += ["_add_rms_norm_kernel"]
    for events in forwards:
        first = events.index(("triton", expected[0]))
        got = [name if kind == "triton" else f"torch {name}" for kind, name in events[first:]]
        assert got == expected
    assert_greedy_matches(llm, "tiny-mixtral", prompts(2), 4)  # and right: transformers' tokens
