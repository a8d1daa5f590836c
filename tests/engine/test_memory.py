"""The KV cache's share of a GPU (engine/memory.py), with the device's memory report faked on CPU."""

from __future__ import annotations

import pytest
import torch

from engine import memory

GIB = 2**30


def fake_device(monkeypatch: pytest.MonkeyPatch, free: int, total: int) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        calls.append("mem_get_info")
        return free, total
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return calls


def budget(utilization: float, **sizes: int) -> float:
    shape = {"max_tokens": 2048, "max_seqs": 64, "hidden": 4096, "intermediate": 14336, "vocab": 128256}
    return memory.kv_budget_gib(torch.device("cuda"), utilization, **{**shape, **sizes})


def test_the_share_is_utilization_less_what_is_used_and_a_steps_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_device(monkeypatch, free=120 * GIB, total=140 * GIB)  # 20 GiB in use: weights, context
    got = budget(0.9)
    # Cached but unheld blocks are returned before free memory is read.
    assert calls == ["empty_cache", "mem_get_info"]
    activations = 2048 * (6 * 4096 + 3 * 14336) * 4 + 64 * 128256 * memory._SAMPLING_BYTES \
        + memory.PROMPT_LOGPROB_ROWS * 128256 * 10
    want = (0.9 * 140 * GIB - 20 * GIB - activations - memory._FIXED_HEADROOM) / GIB
    assert got == pytest.approx(want)
    assert 100 < got < 106  # an 8B model's 90 % of an H200, less its weights and ~1.4 GiB


def test_the_estimate_grows_with_the_batch_and_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, free=70 * GIB, total=80 * GIB)
    assert budget(0.9, max_seqs=256) < budget(0.9)
    assert budget(0.9, vocab=256000) < budget(0.9)
    assert budget(0.9, max_tokens=8192) < budget(0.9)


@pytest.mark.parametrize("free, utilization", [(8 * GIB, 0.9), (76 * GIB, 0.05)])
def test_no_room_left_is_refused_with_what_is_in_use(monkeypatch: pytest.MonkeyPatch, free: int,
                                                     utilization: float) -> None:
    # Another process holds most of the device, or the share is below what is in use.
    fake_device(monkeypatch, free=free, total=80 * GIB)
    with pytest.raises(ValueError, match=r"leaves no memory for the KV cache \(\d+\.\d GiB of 80\.0 GiB in use\)"):
        budget(utilization)
