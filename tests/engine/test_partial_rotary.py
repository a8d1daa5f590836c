"""Phi-4-mini's and Phi-3.5-mini's rotations: a partial one (only the first
3/4 of each head turns) and longrope (each pair's wavelength stretched by its
own factor, short ones within the pretraining length, long ones past it, and
cos/sin scaled by an attention factor), served token for token as
transformers runs them on every path that applies the rotation: the CPU
extension's kernel, torch's complex multiply, Triton's rotate-in-write in its
interpreter, and emulated decode graphs.

The pretraining length here is 32 positions. transformers picks the factors
per forward pass by the longest position in it; we pick them once for the
context served (as vLLM does), so the two agree when the context and every
sequence are within 32 positions, or when every prompt is longer than 32."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton's kernels run on a CPU in its interpreter, chosen when they are first
# imported (as tests/engine/test_triton_kernels.py does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.config import CheckpointError, RopeConfig, load_model_config  # noqa: E402
from engine.models.rope import interleave_permutation, rotation_table  # noqa: E402
from engine.presets import ensure_preset  # noqa: E402

from .reference import assert_engine_matches, greedy_argmax, prompts, variant_checkpoint  # noqa: E402

ORIGINAL = 32
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 20.0]
# tiny-phi3's heads are 16 wide: 12 dims (6 pairs) turn, 4 do not. As in
# Phi-3.5-mini's and Phi-4-mini's configs, the pretraining length is named
# outside the block.
PHI4_MINI_LIKE: dict[str, Any] = {
    "partial_rotary_factor": 0.75, "max_position_embeddings": 512, "original_max_position_embeddings": ORIGINAL,
    "sliding_window": None, "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
}
NEW_TOKENS = 8
LONG_PROMPTS = [p for p in prompts(4) if len(p) > ORIGINAL]  # 60 and 33 tokens

CASES: dict[str, dict[str, Any]] = {
    "cpu-kernel": dict(page_size=4),
    "torch": dict(attention="torch"),
    "graphs-emulate": dict(cuda_graphs="emulate", page_size=4),
}


@pytest.fixture(scope="module")
def phi(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return variant_checkpoint("tiny-phi3", PHI4_MINI_LIKE, tmp_path_factory.mktemp("phi"))


@pytest.fixture(scope="module")
def expected(phi) -> list[list[int]]:
    return [list(greedy_argmax(phi[1], tuple(p), NEW_TOKENS)) for p in LONG_PROMPTS]


def _greedy(llm: LLM, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(batch, params)]


def test_the_config_reads_as_transformers_reads_it(phi) -> None:
    mc = load_model_config(phi[0])
    assert mc.rotary_dim == 12
    assert mc.rope.rope_type == "longrope"
    assert (mc.rope.short_factor, mc.rope.long_factor) == (tuple(SHORT), tuple(LONG))
    assert mc.rope.original_max_position_embeddings == ORIGINAL
    assert mc.max_position_embeddings == 512
    # The factor is the ratio of the two lengths, and scales cos and sin.
    assert mc.rope.magnitude == pytest.approx(math.sqrt(1 + math.log(16) / math.log(ORIGINAL)))


def test_logits_match_transformers_past_the_pretraining_length(phi) -> None:
    # A 60-token prompt in chunks of 20 and 33, then decode tokens: long factors throughout.
    assert_engine_matches(*phi)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_past_the_pretraining_length(phi, expected, case: str) -> None:
    llm = LLM(str(phi[0]), kv_cache_gib=0.05, **CASES[case])
    try:
        assert _greedy(llm, LONG_PROMPTS) == expected
    finally:
        llm.close()


def test_greedy_matches_transformers_with_torch_ops(phi, expected, monkeypatch) -> None:
    # No fused kernels: the rotation is the complex multiply of models/rope.py.
    monkeypatch.setenv("STENCILD_NO_KERNELS", "1")
    llm = LLM(str(phi[0]), kv_cache_gib=0.05)
    try:
        assert llm.engine.model.ops is None
        assert _greedy(llm, LONG_PROMPTS) == expected
    finally:
        llm.close()


def test_greedy_matches_transformers_in_triton_kernels(phi, expected) -> None:
    pytest.importorskip("triton")
    llm = LLM(str(phi[0]), kv_cache_gib=0.05, attention="triton", page_size=4)
    try:
        assert llm.engine.attention.rotates_in_write
        assert _greedy(llm, LONG_PROMPTS[1:], 4) == [expected[1][:4]]
    finally:
        llm.close()


def test_a_context_within_the_pretraining_length_turns_by_the_short_factors(phi) -> None:
    short = [p[:20] for p in prompts(3)]
    want = [list(greedy_argmax(phi[1], tuple(p), 10)) for p in short]
    llm = LLM(str(phi[0]), kv_cache_gib=0.05, max_model_len=ORIGINAL)
    try:
        assert _greedy(llm, short, 10) == want
    finally:
        llm.close()


def test_the_unturned_dims_are_rotated_by_exactly_one() -> None:
    rope = RopeConfig(theta=1e4, rope_type="longrope", factor=16.0, original_max_position_embeddings=ORIGINAL,
                      short_factor=tuple(SHORT), long_factor=tuple(LONG))
    table = rotation_table(rope, 16, 64, rotary_dim=12)
    assert table.shape == (64, 8)
    assert torch.equal(table[:, 6:], torch.ones(64, 2, dtype=torch.complex64))
    torch.testing.assert_close(table[:, :6].abs(), torch.full((64, 6), rope.magnitude))
    # The rotated pairs interleave within the first 12 dims; the rest stay put.
    assert interleave_permutation(16, 12).tolist() == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11, 12, 13, 14, 15]


def _edited(tmp_path: Path, source: Path, **edits: Any) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(source, d)
    cfg = {**json.loads((d / "config.json").read_text()), **edits}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_phi3s_older_names_and_forms_read_as_transformers_reads_them(tmp_path, phi) -> None:
    from transformers import AutoConfig

    want = load_model_config(phi[0]).rope
    # A block that names another pretraining length than the top level: the top level wins.
    block = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 64}
    d = _edited(tmp_path / "other-length", phi[0], rope_scaling=block, rope_parameters=None)
    assert AutoConfig.from_pretrained(d).rope_parameters["original_max_position_embeddings"] == ORIGINAL
    assert load_model_config(d).rope == want
    # "su", as the first Phi-3 configs said (transformers 5 then wants the
    # pretraining length inside the block too).
    block = {**block, "type": "su", "original_max_position_embeddings": ORIGINAL}
    d = _edited(tmp_path / "su", phi[0], rope_scaling=block, rope_parameters=None)
    assert AutoConfig.from_pretrained(d).rope_parameters["rope_type"] == "longrope"
    assert load_model_config(d).rope == want


@pytest.mark.parametrize(("edits", "message"), [
    # Each factor list covers the 6 turning pairs, not the head's 8.
    (dict(partial_rotary_factor=0.75, rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                    "long_factor": [1.0] * 8}), "short_factor must list 6"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}), "long_factor"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [-2]}),
     "long_factor"),
    # 16 x 0.6875 = 11 dims: not a whole number of pairs.
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.6875}), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 1.5}), "partial_rotary_factor"),
], ids=["factors-for-the-whole-head", "no-long-factors", "a-negative-factor", "odd-dims", "above-one"])
def test_a_malformed_rotation_is_refused_by_name(tmp_path, edits: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_model_config(_edited(tmp_path, ensure_preset("tiny-phi3"), **edits))
