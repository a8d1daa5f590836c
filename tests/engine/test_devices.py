"""Which devices this process can use (engine/devices.py): checked before anything loads."""

from __future__ import annotations

import pytest
import torch

from engine.devices import require_present
from engine.executor import StepExecutor


def test_the_cpu_is_always_there() -> None:
    require_present("cpu")
    require_present(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_value_error_not_a_failure_inside_torch() -> None:
    with pytest.raises(ValueError, match=r"PyTorch .* sees no CUDA device"):
        require_present("cuda")
    # The device thread refused it inside torch.cuda.Stream (RuntimeError, with a traceback in the log).
    with pytest.raises(ValueError, match="sees no CUDA device"):
        StepExecutor(torch.device("cuda:0"))


def test_a_cuda_index_past_the_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    require_present("cuda")
    require_present("cuda:1")
    with pytest.raises(ValueError, match=r"has 2 CUDA devices \(cuda:0 to cuda:1\)"):
        require_present("cuda:2")


@pytest.mark.parametrize("device", ["cuda:x", "tpu", ""])
def test_a_device_string_torch_cannot_read_is_a_value_error(device: str) -> None:
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
        require_present(device)
