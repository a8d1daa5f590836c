"""Sampling a running server with py-spy, and reading its raw output per thread.

`bench/gpu.py --profile-server` records the gRPC server while 64 streams
run, twice: every sample of a thread that is running, and only samples of the
thread holding the GIL (`--gil`). Side by side they say whether a thread is
slow because of its own work or because it waits for the GIL (the event loop
and the engine thread share one). py-spy is a dev dependency (a wheel to carry
onto a lent GPU machine); without it the profile is skipped.

    python bench/pyspy.py PROFILE.txt        # summarize a raw profile
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


def available() -> str | None:
    """The py-spy executable, if installed: beside this Python, on PATH, or in
    the `bin` beside a path entry (`pip install --target DIR` puts it in DIR/bin)."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    found = shutil.which("py-spy")
    if found is not None:
        return found
    for entry in sys.path:
        candidate = Path(entry or ".") / "bin" / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def record(pid: int, seconds: float, out: Path, gil: bool = False, rate: int = 200) -> subprocess.Popen[bytes] | None:
    """Start sampling process `pid` for `seconds` into `out` (py-spy's raw format); None without py-spy."""
    exe = available()
    if exe is None:
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
           "--threads", "--nonblocking", "--format", "raw", "--output", str(out)]
    if gil:
        cmd.append("--gil")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@dataclass
class ThreadProfile:
    """One thread's samples: in total, by innermost frame, and by any frame on the stack."""

    name: str
    samples: int = 0
    own: collections.Counter[str] = field(default_factory=collections.Counter)
    inclusive: collections.Counter[str] = field(default_factory=collections.Counter)


def _frame(text: str) -> str:
    """`function (path/to/file.py:123)` -> `function (file.py:123)`."""
    name, _, where = text.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def parse(raw: str) -> dict[str, ThreadProfile]:
    """py-spy's raw output: one `thread;frame;...;frame COUNT` line per stack."""
    threads: dict[str, ThreadProfile] = {}
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        prof = threads.setdefault(thread, ThreadProfile(thread))
        n = int(count)
        prof.samples += n
        if frames:
            prof.own[_frame(frames[-1])] += n
        for f in {_frame(f) for f in frames}:
            prof.inclusive[f] += n
    return threads


def summary(raw: str, top: int = 8) -> list[str]:
    """Each thread's sample count, its busiest innermost frames (`own`) and the
    frames most often anywhere on its stack (`in`), busiest thread first."""
    lines = []
    for prof in sorted(parse(raw).values(), key=lambda p: -p.samples):
        lines.append(f"{prof.name}: {prof.samples} samples")
        lines += [f"    own {n:6d}  {frame}" for frame, n in prof.own.most_common(top)]
        # Frames on (nearly) every stack, the thread's entry points, say nothing.
        partial = [(frame, n) for frame, n in prof.inclusive.most_common() if n < 0.8 * prof.samples]
        lines += [f"    in  {n:6d}  {frame}" for frame, n in partial[:top]]
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]).read_text(), int(sys.argv[2]) if len(sys.argv) > 2 else 8)))
