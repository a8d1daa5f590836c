"""What the host CPU can run: its instruction-set flags, read once.

Users' CPUs differ (some have AVX-512, some only AVX2), and some library paths
refuse to run without particular instructions: oneDNN's prepacked bf16 linear
needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on anything less. Code
that picks a CPU path asks here, and tests mock these functions to cover the
branch the test machine does not take.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# The instructions oneDNN's bf16 reorder and GEMM require (either set).
_ONEDNN_BF16_AVX512 = frozenset({"avx512bw", "avx512vl", "avx512dq"})
_ONEDNN_BF16_NE_CONVERT = "avx_ne_convert"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def onednn_bf16_supported(flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN's prepacked bf16 linear runs on this CPU (or on `flags`)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:  # not Linux: ask torch what it dispatches to
        import torch

        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return _ONEDNN_BF16_NE_CONVERT in flags or flags >= _ONEDNN_BF16_AVX512


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def mask_threads_for(cores: int, device_type: str) -> int:
    """Grammar-mask threads for a host with `cores` usable cores whose model
    runs on `device_type`: on an accelerator, a quarter of the cores (1 to 8;
    the event loop, the engine and device threads and the compile workers keep
    the rest); on the CPU one, since the forward pass the fill overlaps already
    takes every core (measured on 2 cores: a second fill thread, no faster)."""
    if device_type == "cpu":
        return 1
    return max(1, min(8, cores // 4))
