"""The decode-graph path (engine/graphs.py), replayed eagerly on CPU.

`cuda_graphs="emulate"` runs decode steps through the graphs' static buffers,
bucket choice, padding rows on a dummy page and in-place refresh, calling
what a graph would have captured. Its tokens must equal the plain path's
across bucket boundaries, batches that shrink, preemption, prefix-cache hits
and aborts mid-batch (make_llm checks that no page leaks)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine import graphs as graphs_module
from engine import pipeline as pipeline_module
from engine.attention import DenseDecodeAttention, SeqSpan, TorchAttention
from engine.attention import paged as paged_module
from engine.context import TextContext
from engine.graphs import graph_buckets
from engine.kv_cache import KVCacheInputs
from engine.scheduler import LONG_FORCED_RUN, Scheduler
from engine.staging import Staging
from grammar import GrammarSpec

from .reference import prompts
from .test_structured import PERSON

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 8000, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def _pair(make_llm, **kwargs) -> tuple[LLM, LLM]:
    kwargs.setdefault("kv_cache_gib", 0.05)
    return make_llm("tiny-llama", cuda_graphs="emulate", **kwargs), make_llm("tiny-llama", **kwargs)


def test_buckets() -> None:
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]


@pytest.mark.parametrize("overlap", [True, False])
def test_tokens_equal_the_plain_path_across_buckets(make_llm, overlap: bool) -> None:
    graphs, plain = _pair(make_llm, max_num_seqs=20, overlap=overlap)
    # Lengths vary so the batch shrinks through the buckets as requests finish.
    batch = _prompts(17)
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_new_tokens=4 + i, ignore_eos=True)
              for i in range(len(batch))]
    for size in (1, 3, 9, 17):
        got = graphs.generate(batch[:size], params[:size])
        want = plain.generate(batch[:size], params[:size])
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert graphs.engine.graphs is not None
    used = set(graphs.engine.graphs.replays)
    assert {1, 2, 4, 8, 16, 20} <= used, used
    assert plain.engine.graphs is None


def test_dense_attention_graphs_stop_at_the_batch_its_width_allows(make_llm, monkeypatch, caplog) -> None:
    # Dense decode attention reads the whole static width every step: graphs
    # only up to DENSE_GRAPH_SLOTS slots a step, larger batches eager (the
    # same tokens), and none where even one row is wider.
    caplog.set_level(logging.INFO, logger="engine")
    probe = make_llm(attention="torch", cuda_graphs="emulate", max_num_seqs=8, kv_cache_gib=0.05)
    width = probe.engine.max_model_len
    assert probe.engine.graphs is not None and probe.engine.graphs.buckets == [1, 2, 4, 8]
    monkeypatch.setattr(graphs_module, "DENSE_GRAPH_SLOTS", 2 * width + 1)
    graphs = make_llm(attention="torch", cuda_graphs="emulate", max_num_seqs=8, kv_cache_gib=0.05)
    assert graphs.engine.graphs is not None and graphs.engine.graphs.buckets == [1, 2]
    assert "decode graphs over dense attention up to batch 2 only" in caplog.text
    plain = make_llm(attention="torch", cuda_graphs="off", max_num_seqs=8, kv_cache_gib=0.05)
    batch = _prompts(5)
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    for size in (2, 5):
        got = graphs.generate(batch[:size], params)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain.generate(batch[:size], params)]
    assert set(graphs.engine.graphs.replays) == {2}
    monkeypatch.setattr(graphs_module, "DENSE_GRAPH_SLOTS", width - 1)
    assert make_llm(attention="torch", cuda_graphs="emulate", kv_cache_gib=0.05).engine.graphs is None


def _decoding(prompt_len: int, forced: int) -> TextContext:
    """A context past its prompt: its last sampled token, then `forced` forced tokens."""
    ctx = TextContext(tokens=np.arange(5, 5 + prompt_len), max_length=prompt_len + 64)
    ctx.update(7)
    for token in range(forced):
        ctx.jump_ahead(100 + token)
    return ctx


def test_forced_runs_are_cut_to_one_token_where_that_makes_a_graph_step() -> None:
    decode, run = _decoding(4, 0), _decoding(4, 3)
    Scheduler._shape_for_graphs([decode, run])
    assert (decode.active_length, run.active_length) == (1, 1)
    # A prompt chunk in the step makes it eager anyway: runs stay whole.
    prefill, run = TextContext(tokens=np.arange(5, 15), max_length=40), _decoding(4, 3)
    Scheduler._shape_for_graphs([prefill, run])
    assert (prefill.active_length, run.active_length) == (10, 4)
    # Alone in its step, a short run goes a token a step, a long one in one pass.
    short, long_ = _decoding(4, LONG_FORCED_RUN - 2), _decoding(4, LONG_FORCED_RUN)
    Scheduler._shape_for_graphs([short])
    Scheduler._shape_for_graphs([long_])
    assert (short.active_length, long_.active_length) == (1, LONG_FORCED_RUN + 1)
    # Generated tokens recomputed (a preemption, past the prompt) make the step
    # eager: they stay whole (cut, they took a step a token), and so do runs beside them.
    recompute, run = _decoding(4, 0), _decoding(4, 3)
    for token in (8, 9, 10):
        recompute.update(token)
    recompute.recompute_from(5)
    Scheduler._shape_for_graphs([recompute, run])
    assert (recompute.active_length, run.active_length) == (3, 4)


def test_a_preempted_request_recomputes_in_chunks_with_graphs(make_llm) -> None:
    llm = make_llm("tiny-llama", cuda_graphs="emulate", overlap=False, max_num_batched_tokens=32,
                   enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    a, b = (eng.make_context(p, params) for p in prompts(2))
    eng.add_request(a)
    eng.add_request(b)
    while a.num_generated < 100:
        eng.step()
    eng.scheduler._preempt(a)  # as schedule() does when pages run out
    steps = 0
    while a.start_idx < a.end_idx - 1:
        eng.step()
        steps += 1
    assert steps <= -(-a.end_idx // 31) + 1  # chunks of the budget, not a token a step
    while eng.has_work():
        eng.step()


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_batches_replay_graphs_with_forced_tokens(make_llm, monkeypatch, overlap: bool) -> None:
    """With decode graphs, forced tokens are fed a token per step (a row in a
    forced run samples nothing until its run ends), so every step without a
    prompt chunk replays a graph; and constrained requests are scheduled ahead
    of their last token (overlap). The tokens equal the plain path's, which
    computes each forced run in one multi-token pass."""
    steps: list[tuple[bool, tuple[int, ...], int]] = []
    real = pipeline_module.run_step

    def spy(inputs, *args, **kwargs):
        steps.append((inputs.graph, tuple(s.q_end - s.q_start for s in inputs.spans), len(inputs.sampled)))
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(pipeline_module, "run_step", spy)
    graphs, plain = _pair(make_llm, overlap=overlap, grammar_backend="xgrammar")
    assert graphs.engine.scheduler.config.speculative_constrained
    assert not plain.engine.scheduler.config.speculative_constrained
    schema = GrammarSpec.json_schema(json.dumps(PERSON))
    params = SamplingParams(temperature=0, max_new_tokens=40)
    batch = _prompts(5, seed=3)
    got = graphs.generate(batch, params, constraint=schema)
    graph_steps = list(steps)
    steps.clear()
    want = plain.generate(batch, params, constraint=schema)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert all(json.loads(o.text) for o in got)
    assert sum(o.forced_tokens for o in got) > len(batch)
    multi = [s for s in graph_steps if max(s[1]) > 1]
    assert len(multi) <= len(batch), multi  # prompt chunks only
    assert all(graph for graph, q_lens, _ in graph_steps if max(q_lens) == 1)
    assert any(graph and sampled < len(q_lens) for graph, q_lens, sampled in graph_steps), \
        "no graph step fed a forced token"
    # The plain path computes forced runs in multi-token passes.
    assert sum(1 for s in steps if max(s[1]) > 1) > len(batch)
    # Alone, a request's short forced runs go a token per step too: graph
    # steps in which no row samples.
    steps.clear()
    lone = graphs.generate(batch[:1], params, constraint=schema)
    assert [o.token_ids for o in lone] == [o.token_ids for o in plain.generate(batch[:1], params, constraint=schema)]
    assert any(graph and sampled == 0 for graph, _, sampled in steps), "no graph step without a sampled row"


def test_preemption_and_prefix_cache_hits(make_llm) -> None:
    mc = make_llm("tiny-llama", kv_cache_gib=0.01).engine.model_config
    per_page = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4  # fp32, 16 tokens a page
    graphs, plain = _pair(make_llm, max_num_seqs=8, kv_cache_gib=24 * per_page / 2**30)
    batch = prompts(8)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    got, want = graphs.generate(batch, params), plain.generate(batch, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert graphs.engine.scheduler.num_preemptions > 0
    again = graphs.generate(batch[:3], params)
    assert any(r.cached_prompt_tokens > 0 for r in again)
    assert [r.token_ids for r in again] == [r.token_ids for r in want[:3]]


def test_aborts_mid_batch(make_llm) -> None:
    graphs, plain = _pair(make_llm, max_num_seqs=8)
    batch = _prompts(6, seed=3)

    def run(llm: LLM) -> tuple[dict[str, list[int]], dict[str, str | None]]:
        eng = llm.engine
        contexts = [eng.make_context(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(batch)]
        for ctx in contexts:
            eng.add_request(ctx)
        tokens: dict[str, list[int]] = {c.request_id: [] for c in contexts}
        ends: dict[str, str | None] = {}
        for step in range(40):
            if step == 4:
                assert eng.abort("r1")
            if step == 6:
                assert eng.abort("r4")
            for out in eng.step():
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    ends[out.request_id] = out.finish_reason
            if not eng.has_work():
                break
        return tokens, ends

    assert graphs.engine.graphs is not None
    (got, got_ends), (want, want_ends) = run(graphs), run(plain)
    for rid in ("r0", "r2", "r3", "r5"):
        assert got[rid] == want[rid] and len(got[rid]) == GREEDY.max_new_tokens
    # The aborted ones ended there, with the tokens they had.
    for rid in ("r1", "r4"):
        assert got_ends[rid] == want_ends[rid] == "cancelled"
        assert len(got[rid]) < (GREEDY.max_new_tokens or 0) and got[rid] == want[rid][:len(got[rid])]


def test_padded_rows_write_to_the_dummy_page_only(make_llm, monkeypatch) -> None:
    llm = make_llm("tiny-llama", cuda_graphs="emulate", kv_cache_gib=0.05)
    eng = llm.engine
    assert eng.graphs is not None
    assert eng.kv_manager.kv_blocks.shape[0] == eng.allocator.num_pages + 1
    assert eng.graphs.dummy_page == eng.allocator.num_pages
    given: list[int] = []
    allocate = eng.allocator.allocate

    def recording(n: int) -> list[int]:
        pages = allocate(n)
        given.extend(pages)
        return pages

    monkeypatch.setattr(eng.allocator, "allocate", recording)
    with torch.inference_mode():
        eng.kv_manager.kv_blocks[eng.graphs.dummy_page].zero_()  # the warm-up wrote there already
    dummy = eng.kv_manager.kv_blocks[eng.graphs.dummy_page].clone()
    llm.generate(_prompts(3), SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert eng.graphs.replays[4] > 0, "three requests run in the bucket of four: one padded row"
    assert given and max(given) < eng.graphs.dummy_page, "no request is given the dummy page"
    assert not torch.equal(dummy, eng.kv_manager.kv_blocks[eng.graphs.dummy_page]), "the padded row wrote there"


@pytest.mark.parametrize("chunk_slots", [None, 1, 3])
def test_dense_decode_attention_matches_the_reference(monkeypatch, chunk_slots: int | None) -> None:
    # Every slot no sequence has written holds NaN: the dense kernel gathers
    # whole pages (the dummy page's, a last page's tail, a freed page's old
    # keys), and a NaN there must not reach a row through its mask. Over the
    # context in one chunk, and in chunks of 1 and 3 slots (its running softmax).
    torch.manual_seed(0)
    if chunk_slots is not None:  # bytes of float32 keys a slot: 3 sequences x 2 heads x 16
        monkeypatch.setattr(paged_module, "CHUNK_BYTES", chunk_slots * 3 * 2 * 16 * 4)
    layers, page_size, kv_heads, heads, dim = 2, 4, 2, 4, 16
    blocks = torch.full((12, 2, layers, page_size, kv_heads, dim), float("nan"))
    table = np.array([[3, 7, 1, 0], [5, 0, 0, 0], [2, 9, 4, 11]], dtype=np.int32)
    cached = (9, 2, 15)
    for row, n in enumerate(cached):
        for pos in range(n):  # the step writes position n
            blocks[table[row, pos // page_size], :, :, pos % page_size] = torch.randn(2, layers, kv_heads, dim)
    spans = [SeqSpan(i, i, i + 1, n) for i, n in enumerate(cached)]
    kv = KVCacheInputs(blocks, torch.tensor([9, 2, 15], dtype=torch.int32), torch.from_numpy(table),
                       torch.tensor([[1, 16]], dtype=torch.int32))
    q, k, v = torch.randn(3, heads, dim), torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    staging = Staging(torch.device("cpu"))
    ref_blocks = blocks.clone()
    dense = DenseDecodeAttention(heads, dim, staging)
    reference = TorchAttention(heads, dim, staging)
    out = dense(q, k, v, 1, dense.plan(spans, table, kv))
    kv_ref = KVCacheInputs(ref_blocks, kv.cache_lengths, kv.lookup_table, kv.max_lengths)
    expected = reference(q, k, v, 1, reference.plan(spans, table, kv_ref))
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blocks, ref_blocks, equal_nan=True)  # the same keys and values were written
    with pytest.raises(ValueError, match="decode steps only"):
        dense.plan([SeqSpan(0, 0, 2, 0)], table[:1], kv)


@pytest.mark.parametrize("setting, device, mode", [
    ("auto", "cuda", "capture"), ("auto", "cpu", None), ("off", "cuda", None),
    ("emulate", "cpu", "emulate"), ("emulate", "cuda", "emulate"),
])
def test_graphs_mode_captures_only_on_cuda_unless_told(setting: str, device: str, mode: str | None) -> None:
    assert graphs_module.graphs_mode(setting, torch.device(device)) == mode
