"""What the vLLM protocol's GetModelInfo reports of a checkpoint, without a server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine import EngineConfig, EngineCore
from service.vllm_protocol.info import model_info


@pytest.fixture(scope="module")
def engine(preset) -> Iterator[EngineCore]:
    engine = EngineCore(EngineConfig(str(preset("tiny-llama")), kv_cache_gib=0.02))
    yield engine
    engine.close()


def test_the_checkpoints_sampling_defaults_are_reported_for_the_router(engine: EngineCore, monkeypatch) -> None:
    # The protocol's fields cannot be unset, so a router applies these itself (as for vLLM).
    monkeypatch.setattr(engine, "sampling_defaults", {"temperature": 0.6, "top_k": 20})
    info = model_info(engine, "m")
    assert json.loads(info.default_sampling_params_json) == {"temperature": 0.6, "top_k": 20}
    monkeypatch.setattr(engine, "sampling_defaults", {})
    assert model_info(engine, "m").default_sampling_params_json == ""
