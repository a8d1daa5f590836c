"""CPU path dispatch: the choice follows the CPU's features, and the branch a
test machine does not take is covered by mocking the feature check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.models import linear as linear_module
from engine.models.linear import Linear

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def test_onednn_bf16_needs_avx512_or_ne_convert() -> None:
    assert not cpu_features.onednn_bf16_supported(AVX2_ONLY)
    assert not cpu_features.onednn_bf16_supported(AVX2_ONLY | {"avx512f", "avx512bw"})
    assert cpu_features.onednn_bf16_supported(AVX512)
    assert cpu_features.onednn_bf16_supported(AVX2_ONLY | {"avx_ne_convert"})


def _weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    return w, b, x


def test_bf16_linear_without_avx512_takes_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # What an AVX2-only CPU gets: no oneDNN bf16 prepack (it would raise there).
    monkeypatch.setattr(cpu_features, "onednn_bf16_supported", lambda flags=None: False)
    w, b, x = _weights(torch.bfloat16)
    lin = Linear(w, b)
    assert lin.packed is None
    torch.testing.assert_close(lin(x), F.linear(x, w, b))


def test_bf16_linear_with_avx512_is_prepacked(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_features.onednn_bf16_supported():
        pytest.skip("this CPU cannot run oneDNN's bf16 path (covered by the test above)")
    w, b, x = _weights(torch.bfloat16)
    lin = Linear(w, b)
    assert lin.packed is not None
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=3e-2, rtol=2e-2)


def test_fp32_linear_is_prepacked_on_any_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "onednn_bf16_supported", lambda flags=None: False)
    w, b, x = _weights(torch.float32)
    lin = Linear(w, b)
    assert (lin.packed is not None) == linear_module._onednn_usable(w)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_mask_threads_follow_the_usable_cores():
    assert cpu_features.usable_cores() >= 1
    assert [cpu_features.mask_threads_for(n, "cuda") for n in (1, 2, 4, 7, 8, 16, 32, 64, 256)] == \
        [1, 1, 1, 1, 2, 4, 8, 8, 8]
    # On the CPU the forward pass the fill overlaps already takes every core.
    assert {cpu_features.mask_threads_for(n, "cpu") for n in (1, 2, 16, 256)} == {1}
