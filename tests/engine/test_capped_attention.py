"""Gemma 2's capped attention scores (each score s, q.k times the scale,
becomes c * tanh(s / c) before the softmax) end to end: tiny-gemma2 caps
them at 2, low enough to bind on its scores, and is served token for token as
transformers runs it on every path that scores keys, beyond the default one
(tests/engine/test_reference.py: the native kernel for decode rows, capped
SDPA for prompt chunks): torch's gathered pages with and without the fused
kernels, the dense decode path of emulated graphs, and Triton's kernels in
its interpreter (tests/engine/test_attention_choice.py). The kernels alone:
tests/engine/test_attention_kernel.py and test_triton_kernels.py."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from engine.models.config import load_model_config
from engine.presets import ensure_preset

from .reference import assert_greedy_matches, prompts

PRESET = "tiny-gemma2"
CASES: dict[str, dict[str, Any]] = {
    "torch": dict(attention="torch", page_size=4),
    "chunked": dict(attention="torch", max_num_batched_tokens=16),
    "graphs-dense-decode": dict(cuda_graphs="emulate", page_size=4),
}


def _greedy_matches(llm) -> None:  # type: ignore[no-untyped-def]
    # The cap moves this model's logits by up to 0.33, its greedy choice at
    # only a few positions: the log-probabilities show it.
    assert_greedy_matches(llm, PRESET, prompts(4), 12)


def test_the_caps_and_windows_read_as_transformers_reads_them(make_llm) -> None:
    llm = make_llm(PRESET)
    mc = llm.engine.model_config
    assert (mc.attn_logit_softcapping, mc.final_logit_softcapping) == (2.0, 30.0)
    assert mc.sliding_windows == (16, 0)  # the first of each two layers slides
    assert llm.engine.attention.softcap == 2.0


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(make_llm, case: str) -> None:
    llm = make_llm(PRESET, **CASES[case])
    _greedy_matches(llm)
    if case == "graphs-dense-decode":
        assert llm.engine.graphs is not None and sum(llm.engine.graphs.replays.values()) > 0


def test_greedy_matches_transformers_with_torch_ops(make_llm, monkeypatch) -> None:
    monkeypatch.setenv("STENCILD_NO_KERNELS", "1")
    llm = make_llm(PRESET)
    assert llm.engine.model.ops is None and llm.engine.attention.name == "torch"
    _greedy_matches(llm)


@pytest.mark.parametrize(("family", "caps"), [("gemma2", (50.0, 30.0)), ("gemma3", (None, None))])
def test_a_config_without_caps_takes_transformers_defaults(tmp_path, family: str, caps: tuple) -> None:
    import transformers

    d = tmp_path / family
    shutil.copytree(ensure_preset(f"tiny-{family}"), d)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cfg.pop(key, None)
    (d / "config.json").write_text(json.dumps(cfg))
    hf = getattr(transformers, cfg["architectures"][0]).config_class.from_dict(cfg)
    assert (hf.attn_logit_softcapping, hf.final_logit_softcapping) == caps
    mc = load_model_config(d)
    assert (mc.attn_logit_softcapping, mc.final_logit_softcapping) == caps
