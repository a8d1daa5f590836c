"""Where stencild keeps what it builds: presets and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache directory: $STENCILD_CACHE, else ~/.cache/stencild."""
    env = os.environ.get("STENCILD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "stencild"
