"""Shared fixtures: tiny checkpoints, engines that are checked for page leaks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Keep tests off the user's cache and make them reproducible across runs.
os.environ.setdefault("STENCILD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _test_device_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's interpreter (chosen when they
# are first imported): CPU tests check the very kernels CUDA runs.
if not _test_device_has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM  # noqa: E402
from engine.presets import ensure_preset  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs `stencild serve` in-process configures the root logger
    (service.ops.request_log.configure_logging): undo it, so the servers of later
    tests do not print every request line into the test output."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def preset() -> Callable[[str], Path]:
    return ensure_preset


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before or while read
        return False


def assert_no_page_leak(llm: LLM) -> None:
    """Every page is free or held only by the prefix cache once nothing runs."""
    eng = llm.engine
    alloc = eng.allocator
    alloc.check_consistency()
    assert not eng.scheduler.has_work(), "requests still queued"
    assert eng.kv_manager.num_active == 0, "a finished request still holds pages"
    assert alloc.num_used == 0, f"{alloc.num_used} pages still referenced"
    assert alloc.num_free == alloc.num_pages


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Build LLMs on presets; after the test, check none of them leaked a page."""
    made: list[LLM] = []

    def factory(name: str = "tiny-llama", **kwargs) -> LLM:
        llm = LLM(ensure_preset(name), **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        assert_no_page_leak(llm)
        llm.close()
