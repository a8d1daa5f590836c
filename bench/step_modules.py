"""Which of the project's modules one decode step runs code in, per thread.

Builds an engine on the tiny-llama preset (CPU), runs four requests past their
prompts, then profiles three decode steps (`sys.setprofile` on the engine
thread, here the caller's, and on the device thread) and prints, per thread,
the modules whose functions were called. With `--json-schema` the four
requests are constrained by a small JSON schema, so the grammar's step path
shows too. A measure of how much of the code a newcomer must read to follow a
step (issue 28: before/after in BENCHMARKS.md).

    python bench/step_modules.py [--json-schema]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                     "n": {"type": "integer"}},
                                     "required": ["name", "n"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-schema", action="store_true", help="constrain the requests by a JSON schema")
    args = p.parse_args(argv)

    from engine import EngineCore, SamplingParams
    from engine.config import EngineConfig
    from engine.presets import ensure_preset
    from grammar import GrammarSpec

    eng = EngineCore(EngineConfig(model=str(ensure_preset("tiny-llama")), kv_cache_gib=0.05))
    spec = GrammarSpec.json_schema(json.dumps(SCHEMA))
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for _ in range(4):
        matcher = eng.structured.compile(spec) if args.json_schema else None
        eng.add_request(eng.make_context([5, 6, 7, 8, 9], params, matcher=matcher))
    for _ in range(6):  # the prompts, then decode steps
        eng.step()
    root, bench = str(REPO_ROOT), str(REPO_ROOT / "bench")
    modules: dict[str, set[str]] = collections.defaultdict(set)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(root) and not path.startswith(bench) and "/.venv/" not in path:
            modules[threading.current_thread().name].add(os.path.relpath(path, root))

    eng.executor.call(lambda: sys.setprofile(profile))
    sys.setprofile(profile)
    for _ in range(3):
        eng.step()
    sys.setprofile(None)
    eng.executor.call(lambda: sys.setprofile(None))
    eng.close()
    for thread, names in sorted(modules.items()):
        print(f"{thread}: {len(names)} modules: {', '.join(sorted(names))}")
    print(f"all threads: {len(set().union(*modules.values()))} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
