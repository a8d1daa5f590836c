"""The embedding runtime's thread discipline, without a server."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.executor import StepExecutor
from service.api.embeddings import DevicePipeline


class FakePipeline:
    max_length = 8

    def __init__(self) -> None:
        self.threads: dict[str, threading.Thread] = {}

    def prepare(self, texts: Any, *args: Any) -> str:
        self.threads["prepare"] = threading.current_thread()
        return "request"

    def forward(self, sequences: Any) -> torch.Tensor:
        self.threads["forward"] = threading.current_thread()
        return torch.ones(len(sequences), 4)

    def finish(self, pooled: Sequence[torch.Tensor], request: Any) -> Any:
        self.threads["finish"] = threading.current_thread()
        return torch.cat(list(pooled)).numpy()


def test_tensor_work_runs_on_the_device_thread_tokenizing_does_not() -> None:
    executor = StepExecutor(torch.device("cpu"))
    try:
        fake = FakePipeline()
        wrapped = DevicePipeline(fake, executor)  # type: ignore[arg-type]
        device = executor.call(threading.current_thread)
        request = wrapped.prepare(["a"])
        assert request == "request"
        pooled = wrapped.forward([[1, 2], [3]])
        assert wrapped.finish([pooled], request).shape == (2, 4)
        assert wrapped.max_length == 8  # everything else is the pipeline's
        assert fake.threads == {"prepare": threading.current_thread(), "forward": device,
                                "finish": device}
    finally:
        executor.close()
