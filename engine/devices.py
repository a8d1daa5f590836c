"""Device and dtype options shared by the engine's pipelines (text, embeddings, speech)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = (None, "auto", "float32", "bfloat16", "float16")


def validate_device_dtype(device: str, dtype: str | None) -> None:
    """Raise ValueError for a device other than cpu/cuda[:n] or an unknown dtype name."""
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")


def require_present(device: str | torch.device) -> None:
    """ValueError unless this process can use `device`: a CUDA device on a
    machine or PyTorch build without one failed inside the first CUDA call,
    after the server had started."""
    try:
        device = torch.device(device)
    except RuntimeError:  # "cuda:x"
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device {device}: PyTorch {torch.__version__} ({build}) sees no CUDA device")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {device}: this machine has {count} CUDA device{'s' * (count > 1)} "
                         f"(cuda:0 to cuda:{count - 1})")


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


class SideStream:
    """Where a model that shares the device thread with the engine (the speech
    codec, an embedding model) queues its kernels: on CUDA a stream of its own,
    so reading its results back waits for its kernels only, not for the
    engine's step in flight on the executor's stream; on CPU nothing changes.
    Its inputs come from the host, so nothing orders it after the engine's
    steps; make it once the model is loaded: it is ordered after what the
    calling thread has queued so far (the weights' copies among it)."""

    def __init__(self, device: torch.device):
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make it the calling thread's current stream for the block."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield
