"""What the host CPU can run: its instruction-set flags, read once.

Users' CPUs differ (some have AVX-512, some only AVX2), and some library paths
refuse to run without particular instructions: oneDNN's prepacked bf16 linear
needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on anything less. Code
that picks a CPU path asks here, and tests mock these functions to cover the
branch the test machine does not take.
"""

from __future__ import annotations

import functools
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
