"""Device and dtype options shared by the engine's pipelines (text, embeddings, speech)."""

from __future__ import annotations

import torch

DTYPES = (None, "auto", "float32", "bfloat16", "float16")


def validate_device_dtype(device: str, dtype: str | None) -> None:
    """Raise ValueError for a device other than cpu/cuda[:n] or an unknown dtype name."""
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")


def resolve_dtype(device: torch.device, dtype: str | None) -> torch.dtype:
    """None/"auto" means float32 on CPU and bfloat16 on CUDA."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class DeviceOptions:
    """Mixin for frozen config dataclasses with `device` and `dtype` fields."""

    device: str
    dtype: str | None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.torch_device, self.dtype)
