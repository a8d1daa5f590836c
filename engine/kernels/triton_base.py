"""What every Triton module of the engine shares: the optional import and its helpers.

Triton ships with CUDA builds of PyTorch but not with CPU-only installs, so
modules that define kernels import it from here and decorate with `jit`,
which leaves the function undecorated when Triton is missing. Triton's
interpreter (`TRITON_INTERPRET=1`, read when a kernel is decorated) runs the
same kernels on the CPU; that is how CI tests them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs of PyTorch may lack Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["dot", "interpreted", "jit", "next_pow2", "tl", "triton", "triton_available"]


def triton_available() -> bool:
    """Whether Triton can be imported (it ships with CUDA builds of PyTorch)."""
    return triton is not None


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when Triton is installed (the defining module imports without it)."""
    return triton.jit(fn) if triton is not None else fn


def interpreted(kernel: Any) -> bool:
    """Whether `kernel` was decorated for Triton's interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in float32; at full precision for float32 operands
    (IEEE), which tl.dot would otherwise round to TF32 on a GPU."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
