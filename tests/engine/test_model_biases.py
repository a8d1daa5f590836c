"""Checkpoints whose config asks for biases beyond Qwen2's q/k/v ones load them
all, as transformers builds the same config: Llama's `attention_bias` (q, k, v
and the output projection) and `mlp_bias` (gate, up, down), Qwen3's
`attention_bias`. Every bias is random and non-zero here, so one left out
shows in the logits."""

from __future__ import annotations

import pytest
import torch

from .reference import assert_engine_matches, variant_checkpoint


def _random_biases(model: torch.nn.Module) -> None:
    biases = [name for name, _ in model.named_parameters() if name.endswith(".bias")]
    assert biases, "the flags made no bias"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.5)


@pytest.mark.parametrize(("preset", "flags"), [
    ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),
    ("tiny-qwen3", {"attention_bias": True}),
], ids=["llama", "qwen3"])
def test_every_bias_a_config_asks_for_is_loaded(tmp_path, preset: str, flags: dict[str, bool]) -> None:
    assert_engine_matches(*variant_checkpoint(preset, flags, tmp_path / "biased", seed=11, init=_random_biases))
