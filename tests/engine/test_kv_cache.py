"""Paged KV cache: allocator, prefix cache, page accounting, preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.context import TextContext
from engine.kv_cache import KVCacheManager, OutOfPages, PageAllocator, chain_hash
from engine.presets import ensure_preset

from .reference import GREEDY, hf_greedy, prompts


def test_allocator_refcounts_and_free_list():
    a = PageAllocator(4, page_size=2)
    pages = a.allocate(3)
    assert a.num_free == 1 and a.num_used == 3
    a.retain(pages[0])
    a.release(pages[0])
    assert a.refcount[pages[0]] == 1
    for p in pages:
        a.release(p)
    assert a.num_free == 4 and a.num_used == 0
    with pytest.raises(OutOfPages):
        a.allocate(5)
    with pytest.raises(AssertionError):
        a.release(pages[0])
    a.check_consistency()


def test_prefix_cache_compares_tokens_and_evicts_lru():
    a = PageAllocator(3, page_size=2)
    p0, p1, p2 = a.allocate(3)
    h0 = chain_hash(None, (1, 2))
    a.publish(p0, h0, (1, 2))
    a.publish(p1, chain_hash(h0, (3, 4)), (3, 4))
    assert a.lookup(h0, (1, 2)) == p0
    # Same hash, other tokens: a collision must not be served.
    assert a.lookup(h0, (9, 9)) is None
    for p in (p1, p0, p2):  # p1 becomes the least recently released cached page
        a.release(p)
    assert a.num_free == 3 and a.num_cached == 2
    a.allocate(1)  # the unpublished free page goes first
    assert a.num_cached == 2
    a.allocate(1)  # then the LRU cached page (p1) is evicted
    assert a.lookup(h0, (1, 2)) == p0 and a.evictions == 1
    a.check_consistency()


def _ctx(tokens, rid="r") -> TextContext:
    return TextContext(tokens=np.array(tokens), max_length=64, request_id=rid)


def test_manager_claims_cached_pages_but_computes_the_last_token():
    a = PageAllocator(16, page_size=4)
    m = KVCacheManager(torch.zeros(16, 2, 1, 4, 1, 2), a)
    first = _ctx(list(range(1, 13)), "a")  # 12 tokens = 3 full pages
    assert m.claim(first) == 0
    assert m.reserve(first, 12)
    first.update(99)  # all 12 computed
    m.commit(first, 8)  # as of a step that had computed 8 of them: 2 pages
    assert first.committed_idx == 8 and a.num_cached == 2
    m.commit(first, 12)
    assert first.committed_idx == 12 and a.num_cached == 3
    m.release(first)
    again = _ctx(list(range(1, 13)), "b")
    # Only 2 of the 3 cached pages: the last prompt token must be recomputed.
    assert m.claim(again) == 8 and again.start_idx == 8
    longer = _ctx(list(range(1, 15)), "c")
    assert m.claim(longer) == 12
    other = _ctx([1, 2, 3, 5, 5, 6, 7, 8, 1], "d")
    assert m.claim(other) == 0
    for c in (again, longer, other):
        m.release(c)
    a.check_consistency()
    assert a.num_used == 0


def test_placeholders_are_never_published():
    a = PageAllocator(8, page_size=2)
    m = KVCacheManager(torch.zeros(8, 2, 1, 2, 1, 2), a)
    c = _ctx([1, 2, 3], "a")
    m.claim(c)
    m.reserve(c, 4)
    c.update_with_future_token()  # token at index 3 is not known yet
    c.set_chunk(1)
    c.update_with_future_token()  # and index 3 has been computed
    m.commit(c, 4)
    assert c.committed_idx == 2  # page [2, 3] holds a placeholder
    c.realize_future_token(7)
    c.realize_future_token(8)
    m.commit(c, 4)
    assert c.committed_idx == 4
    m.release(c)


def test_pages_freed_after_finish_and_abort(make_llm):
    llm = make_llm("tiny-llama")
    eng = llm.engine
    batch = prompts(8)
    for p in batch:
        eng.add_request(eng.make_context(p, GREEDY))
    for _ in range(5):
        eng.step()
    assert eng.allocator.num_used > 0
    victims = [c.request_id for c in eng.scheduler.running[::2]]
    for rid in victims:
        assert eng.abort(rid)
    finals = {}
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert all(finals[r] == "cancelled" for r in victims)
    assert sum(r == "length" for r in finals.values()) == 8 - len(victims)
    eng.allocator.check_consistency()
    assert eng.allocator.num_used == 0  # make_llm re-checks every page after the test


def test_preemption_under_a_tiny_cache_keeps_greedy_output(make_llm):
    # 12 pages of 16 tokens for 8 requests of up to 92 tokens: they cannot all fit.
    per_page = 2 * 2 * 16 * 2 * 16 * 4  # layers, kv, page, kv_heads, head_dim, fp32
    llm = make_llm("tiny-llama", kv_cache_gib=12 * per_page / 2**30, max_model_len=192)
    assert llm.engine.allocator.num_pages == 12
    batch = prompts(8)
    results = llm.generate(batch, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, res in zip(batch, results, strict=True):
        assert res.token_ids == hf_greedy("tiny-llama", prompt)
    # Distinct prompts: a preempted request finding its own pages again is no cache hit (as vLLM counts).
    assert [r.cached_prompt_tokens for r in results] == [0] * 8
    assert llm.engine.scheduler.prefix_cache_hits == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_takes_the_newest_running_request_and_puts_it_first_in_line(make_llm, overlap):
    # First come, first served under memory pressure too: the oldest keeps its
    # pages (its progress), the newest gives them up and goes back ahead of the
    # requests that never ran.
    per_page = 2 * 2 * 16 * 2 * 16 * 4
    llm = make_llm("tiny-llama", kv_cache_gib=5 * per_page / 2**30, max_num_seqs=2, overlap=overlap)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    first, second, third = (eng.make_context(list(range(5 + i, 25 + i)), params) for i in range(3))
    for ctx in (first, second, third):
        eng.add_request(ctx)
    steps = 0
    while eng.scheduler.num_preemptions == 0:
        assert eng.has_work() and steps < 200
        eng.step()
        steps += 1
    sched = eng.scheduler
    assert first in sched.running and second not in sched.running
    assert list(sched.waiting)[:2] == [second, third]
    while eng.has_work():  # and all three still finish
        eng.step()
    assert all(c.is_done for c in (first, second, third))


def test_request_larger_than_the_cache_fails_cleanly(make_llm):
    per_page = 2 * 2 * 16 * 2 * 16 * 4
    llm = make_llm("tiny-llama", kv_cache_gib=4 * per_page / 2**30)
    assert llm.engine.max_model_len == 64  # the context is capped to what the cache holds
    out = llm.generate([list(range(5, 60))], SamplingParams(temperature=0, max_new_tokens=9))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 9


def test_a_context_asked_for_past_what_the_cache_holds_is_refused_at_start_up():
    # It was capped with a log line (vLLM refuses): a prompt that fitted the
    # context asked for was then refused at request time.
    per_page = 2 * 2 * 16 * 2 * 16 * 4
    with pytest.raises(ValueError, match=r"max_model_len=96 is longer than the KV cache holds \(64 tokens\); "
                                         "raise kv_cache_gib"):
        LLM(str(ensure_preset("tiny-llama")), kv_cache_gib=4 * per_page / 2**30, max_model_len=96)


def test_request_that_can_never_fit_ends_with_an_error(make_llm):
    per_page = 2 * 2 * 16 * 2 * 16 * 4
    llm = make_llm("tiny-llama", kv_cache_gib=4 * per_page / 2**30)
    eng = llm.engine
    # Bypass make_context's length check to hand the scheduler an impossible request.
    big = eng.make_context(list(range(5, 60)), SamplingParams(temperature=0, max_new_tokens=9))
    big.tokens[:200] = 7
    big.end_idx = big.active_idx = big.prompt_len = 80
    eng.add_request(big)
    outs = eng.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "error"
    assert "does not fit" in (outs[0].error or "")
    assert not eng.has_work()


def _published(pages: int) -> tuple[PageAllocator, KVCacheManager, TextContext, list[int]]:
    """A 6-page pool of 4-token pages and a request whose first `pages` pages
    are computed and published (one token more written); their tokens."""
    a = PageAllocator(6, page_size=4)
    m = KVCacheManager(torch.zeros(6, 2, 1, 4, 1, 2), a)
    ctx = _ctx([1, 2, 3])
    m.claim(ctx)
    for tok in range(10, 10 + 4 * pages - 2):
        assert m.reserve(ctx, ctx.end_idx + 1)
        ctx.update(tok)
    m.commit(ctx, 4 * pages)
    return a, m, ctx, ctx.tokens[:4 * pages].tolist()


def _take(m: KVCacheManager, pages: int) -> None:
    """Another request takes `pages` pages (the free ones first, then cached ones)."""
    other = _ctx([99] * 4, "o")
    m.claim(other)
    assert m.reserve(other, 4 * pages)


def test_truncate_gives_back_published_pages_tail_first():
    # Head first, eviction took a parent before its children: they stayed
    # published (and announced stored) though no claim could reach them.
    a, m, ctx, known = _published(4)
    ctx.rollback(11)  # back into page 1, as a resample does: pages 1-3 go
    m.truncate(ctx)
    assert m.num_pages_held("r") == 1 and a.num_cached == 4
    _take(m, 3)  # the 2 free pages, then one cached page evicted
    assert a.num_cached == 3
    assert m.claim(_ctx(known + [5], "p")) == 12  # pages 0-2 still reachable: the tail went


def test_release_gives_back_published_pages_tail_first():
    # The same for a finished request: head first, eviction took its first
    # page and left the rest cached but unreachable, a lost prefix hit.
    a, m, ctx, known = _published(3)
    m.release(ctx)
    assert m.num_pages_held("r") == 0 and a.num_cached == 3
    _take(m, 4)  # the 3 free pages, then one cached page evicted
    assert a.num_cached == 2
    assert m.claim(_ctx(known + [5], "p")) == 8  # pages 0-1 still reachable: the tail went


def test_truncate_after_a_rollback_never_rewrites_a_published_page():
    a = PageAllocator(16, page_size=4)
    m = KVCacheManager(torch.zeros(16, 2, 1, 4, 1, 2), a)
    ctx = _ctx([1, 2, 3])
    m.claim(ctx)
    for tok in range(10, 20):  # 13 tokens, the first 12 computed: 3 full pages published
        assert m.reserve(ctx, ctx.end_idx + 1)
        ctx.update(tok)
    m.commit(ctx, 12)
    assert a.num_cached == 3 and m.num_pages_held("r") == 4
    published = a.num_cached
    # Back to 6 tokens: position 5 is recomputed, and it lies in page 1 (published).
    ctx.rollback(7)
    assert ctx.start_idx == 5
    m.truncate(ctx)
    assert ctx.start_idx == 4 and ctx.active_idx == ctx.end_idx == 6  # page 1 is recomputed afresh
    assert m.num_pages_held("r") == 1
    assert a.num_cached == published  # the cached pages stay findable, untouched
    assert m.reserve(ctx, 6) and m.num_pages_held("r") == 2
    # A rollback inside the unpublished tail keeps the page it lands in.
    ctx.update(50)
    ctx.update(51)  # 8 tokens, 7 computed
    m.reserve(ctx, 8)
    ctx.rollback(1)
    m.truncate(ctx)
    assert ctx.start_idx == 6 and m.num_pages_held("r") == 2
    m.release(ctx)
    a.check_consistency()
    assert a.num_used == 0
