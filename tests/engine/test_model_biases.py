"""Checkpoints whose config asks for biases beyond Qwen2's q/k/v ones load them
all, as transformers builds the same config: Llama's `attention_bias` (q, k, v
and the output projection) and `mlp_bias` (gate, up, down), Qwen3's
`attention_bias`. Every bias is random and non-zero here, so one left out
shows in the logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.presets import ensure_preset

from .reference import engine_logits, prompts


def biased_checkpoint(preset: str, flags: dict[str, bool], out: Path) -> tuple[Path, torch.nn.Module]:
    """`preset`'s architecture with `flags` set, random biases, saved to `out`."""
    import transformers

    source = ensure_preset(preset)
    config = json.loads((source / "config.json").read_text())
    arch = config["architectures"][0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    cfg = config_cls.from_dict({**config, **flags})
    torch.manual_seed(11)
    model = model_cls(cfg).float().eval()
    biases = [name for name, _ in model.named_parameters() if name.endswith(".bias")]
    assert biases, "the flags made no bias"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    return out, model


@pytest.mark.parametrize(("preset", "flags"), [
    ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),
    ("tiny-qwen3", {"attention_bias": True}),
], ids=["llama", "qwen3"])
def test_every_bias_a_config_asks_for_is_loaded(tmp_path, preset: str, flags: dict[str, bool]) -> None:
    path, model = biased_checkpoint(preset, flags, tmp_path / "biased")
    tokens = prompts(2)[1]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([tokens])).logits[0].float()
    llm = LLM(str(path), kv_cache_gib=0.05)
    try:
        got = engine_logits(llm, tokens, [20, 33, 1, 1, 5])
    finally:
        llm.close()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
