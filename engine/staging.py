"""Host-side step data: its one way onto the device, and the way back.

A step's inputs are built on the engine thread as host tensors only
(`Staging.tensor`: page-locked memory when the model runs on CUDA, so the copy
can be asynchronous); the device thread then moves them with `upload`, on its
own CUDA stream (the executor's), right before it runs the step. No other code
copies step data to the device: every host-to-device copy and every device op
of a step is thereby ordered on that one stream, and the engine thread never
touches the device. A pinned source buffer stays valid until its copy has run:
PyTorch's pinned-memory allocator does not reuse a block while a copy that
reads it is still pending on a stream.

What a step hands back (sampled tokens, log-probabilities) comes the other
way in a `HostCopy`: started on the device thread behind the step's kernels,
read on the engine thread, which waits for an event and never enqueues
device work of its own (its current stream is not the executor's: a copy it
started there would not be ordered after the step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class Staging:
    """Makes the host tensors of a step for a model on `device`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"

    def tensor(self, data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host tensor of `data` (a numpy array or a list), of `dtype` if given."""
        if isinstance(data, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=None if dtype is None else _NUMPY[dtype]))
        else:
            t = torch.tensor(data, dtype=dtype)
        return t.pin_memory() if self.pin else t

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
        """A host buffer filled with `fill` that the engine thread rewrites step
        after step (page-locked on CUDA, as `tensor`'s are). Reusing it is safe
        only once the device has read the last step's contents: its owner
        rewrites it after waiting for that step's result."""
        t = torch.full(shape, fill, dtype=dtype)
        return t.pin_memory() if self.pin else t


# The dtypes step data comes in, for conversions done by numpy on the host.
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def upload(obj: T, device: torch.device) -> T:
    """`obj` with every host tensor in it moved to `device` (dataclasses,
    tuples, lists and dicts are walked; other values are kept). On the CPU it
    is `obj` itself. Call it on the device thread only."""
    if device.type == "cpu":
        return obj
    return _moved(obj, device)


def _moved(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True) if obj.device.type == "cpu" else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            moved = _moved(value, device)
            if moved is not value:
                changes[f.name] = moved
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        items = tuple(_moved(v, device) for v in obj)
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else items
    if isinstance(obj, list):
        return [_moved(v, device) for v in obj]
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj


class HostCopy:
    """Tensors on their way to host memory. Made on the device thread right after
    the kernels that produce them: on CUDA each is copied without blocking, on
    the current (executor's) stream, and an event marks the end; `arrays`,
    called on any thread, waits for that event only. On the CPU the tensors are
    kept as they are. None entries stay None."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]):
        on_cuda = any(t is not None and t.device.type == "cuda" for t in tensors)
        self._tensors = [t if t is None or t.device.type != "cuda" else t.to("cpu", non_blocking=True)
                         for t in tensors]
        self._ready: torch.cuda.Event | None = None
        if on_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def arrays(self) -> list[np.ndarray | None]:
        """The tensors as numpy arrays, once their copies have landed."""
        if self._ready is not None:
            self._ready.synchronize()
        return [None if t is None else t.numpy() for t in self._tensors]
