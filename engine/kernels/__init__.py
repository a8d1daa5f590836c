"""Our kernels: the native CPU extension, and Triton's pointwise kernels for CUDA.

`cpu_ops()` returns the compiled extension, or None when it cannot be built
(no compiler) or is turned off with STENCILD_NO_KERNELS=1; callers then take
the pure-torch path, which the tests also cover. The build lives under the
stencild cache, keyed by the source hash and the CPU, and takes ~30 s once.

`model_ops()` picks, once at start-up, the fused pointwise kernels a model
runs with: the CPU extension on a CPU, the Triton kernels (triton_ops.py)
where Triton runs, else none (torch ops).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

from engine.cpu_features import cpu_flags
from engine.paths import cache_root

log = logging.getLogger(__name__)

_CPU_DIR = Path(__file__).parent / "cpu"
_SOURCES = sorted(_CPU_DIR.glob("*.cpp"))
# Headers change the build too, so they are part of its cache key.
_HASHED = _SOURCES + sorted(_CPU_DIR.glob("*.h"))
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def kernels_disabled() -> bool:
    return os.environ.get("STENCILD_NO_KERNELS", "") not in ("", "0")


def _build_dir() -> Path:
    digest = hashlib.sha256()
    # The build files name the sources by absolute path: two checkouts sharing
    # a cache would rebuild one directory back and forth.
    digest.update(str(_CPU_DIR).encode())
    for src in _HASHED:
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    digest.update(platform.machine().encode())
    # -march=native code is specific to the CPU it was built on.
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(torch.__version__.encode())
    return cache_root() / "kernels" / digest.hexdigest()[:16]


def cpu_ops() -> ModuleType | None:
    """The compiled CPU kernel module, or None if unavailable."""
    if kernels_disabled():
        return None
    with _lock:
        if "cpu" in _loaded:
            return _loaded["cpu"]
        module: ModuleType | None = None
        try:
            from torch.utils.cpp_extension import load

            build = _build_dir()
            build.mkdir(parents=True, exist_ok=True)
            module = load(
                name="stencild_cpu_ops",
                sources=[str(s) for s in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - any build failure means "use the torch path"
            log.warning("CPU kernels unavailable, using the torch path: %s", str(e).splitlines()[0])
            module = None
        _loaded["cpu"] = module
        return module


def model_ops(device: torch.device, dtype: torch.dtype, triton: bool) -> tuple[ModuleType | None, str]:
    """The fused pointwise kernels for a model on `device`, and a line for the
    start-up log. `triton`: the attention probe found Triton working here (on
    CUDA, or in its interpreter); its pointwise kernels are then probed too."""
    if kernels_disabled():
        return None, "torch ops (STENCILD_NO_KERNELS is set)"
    if triton:
        from . import triton_ops

        problem = triton_ops.probe(device, dtype)
        if problem is None:
            return triton_ops, "triton (add+RMSNorm, SiLU*up and rotary embedding, one kernel each)"
        if device.type != "cpu":
            return None, f"torch ops ({problem})"
    if device.type == "cpu":
        ops = cpu_ops()
        return ops, "the CPU extension" if ops is not None else "torch ops (the CPU extension did not build)"
    return None, "torch ops (no Triton on this device)"
