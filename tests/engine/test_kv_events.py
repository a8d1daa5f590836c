"""The prefix cache's events: what a router's KV index is told, and in which order."""

from __future__ import annotations

import subprocess
import sys

from engine import SamplingParams
from engine.kv_cache import (
    CacheCleared,
    PageAllocator,
    PagesRemoved,
    PagesStored,
    chain_hash,
    wire_hash,
)

from ..conftest import REPO_ROOT


def _replay(events: list, state: dict[int, tuple[int | None, tuple[int, ...]]]) -> None:
    """Apply events to a map hash -> (parent, tokens), as a router's index would."""
    for ev in events:
        if isinstance(ev, PagesStored):
            parent = ev.parent
            for h, toks in zip(ev.hashes, ev.tokens, strict=True):
                state[h] = (parent, toks)
                parent = h
        elif isinstance(ev, PagesRemoved):
            for h in ev.hashes:
                del state[h]  # a removal always names a page that was stored
        else:
            assert isinstance(ev, CacheCleared)
            state.clear()


def _published(a: PageAllocator) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    state: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    _replay(a.snapshot(), state)
    return state


def test_chain_hash_is_the_same_in_every_process():
    code = "from engine.kv_cache import chain_hash; print(chain_hash(chain_hash(None, (1, 2)), (3, 4)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=REPO_ROOT).stdout
    assert other == f"{chain_hash(chain_hash(None, (1, 2)), (3, 4))}\n"


def test_chain_hash_is_a_digest_not_pythons_hash():
    # Python's int hash is modulo 2**61 - 1 and its tuple hash unkeyed and
    # linear: chains a client could make collide, poisoning another's prefix.
    parent = chain_hash(None, (1, 2))
    assert chain_hash(parent, (3, 4)) != chain_hash(parent + 2**61 - 1, (3, 4))
    assert chain_hash(None, (1, 2)) != chain_hash(None, (2, 1))
    hashes = [chain_hash(None, (i, j)) for i in range(40) for j in range(40)]
    assert len(set(hashes)) == len(hashes) and all(0 <= h < 2**128 for h in hashes)
    wires = [wire_hash(h) for h in hashes]  # what routers get: non-negative int64
    assert all(0 <= w < 2**63 for w in wires) and len(set(wires)) == len(wires)


def test_events_only_while_listened_to_and_coalesced_by_chain():
    a = PageAllocator(8, page_size=2)
    p = a.allocate(4)
    h0 = chain_hash(None, (1, 2))
    a.publish(p[0], h0, (1, 2))  # nobody listens: nothing recorded
    got: list = []
    snap = a.add_listener(got.extend)
    assert [(s.hashes, s.parent) for s in snap] == [([h0], None)]
    h1 = chain_hash(h0, (3, 4))
    h2 = chain_hash(h1, (5, 6))
    a.publish(p[1], h1, (3, 4), h0)
    a.publish(p[2], h2, (5, 6), h1)
    a.publish(p[3], chain_hash(None, (7, 8)), (7, 8))  # another sequence: a new event
    assert got == []  # nothing until the flush
    a.flush_events()
    assert got == [PagesStored([h1, h2], [(3, 4), (5, 6)], h0),
                   PagesStored([chain_hash(None, (7, 8))], [(7, 8)], None)]
    a.remove_listener(got.extend)
    a.publish(a.allocate(1)[0], chain_hash(None, (9, 9)), (9, 9))
    a.flush_events()
    assert len(got) == 2


def test_replayed_events_always_equal_what_the_cache_holds():
    a = PageAllocator(6, page_size=2)
    state: dict = {}
    _replay(a.add_listener(lambda evs: _replay(evs, state)), state)
    parent = None
    pages = a.allocate(5)
    for i, page in enumerate(pages):
        toks = (i, i)
        h = chain_hash(parent, toks)
        a.publish(page, h, toks, parent)
        parent = h
    a.flush_events()
    assert state == _published(a) and len(state) == 5
    for page in reversed(pages):  # the tail is released first, as a finished request does
        a.release(page)
    a.allocate(3)  # one free page, then two cached ones evicted: the tail of the chain
    a.flush_events()
    assert state == _published(a) and len(state) == 3
    assert all(parent is None or parent in state for parent, _ in state.values()), "no orphan pages"
    # A flush with a page still in use unpublishes it too, in one CacheCleared:
    # after it no later request may find anything computed before it.
    held = a.allocate(1)[0]  # evicts one more cached page (the free list is empty)
    h_held = chain_hash(None, (42, 42))
    a.publish(held, h_held, (42, 42))
    a.flush_events()
    assert state == _published(a) and len(state) == 3
    events: list = []
    a.add_listener(events.extend)
    assert a.clear_cache() == 3
    a.flush_events()
    assert events == [CacheCleared()] and state == {} and a.num_cached == 0
    assert a.lookup(h_held, (42, 42)) is None
    # The holder keeps its page; the page it fills next, chained after the
    # flushed one, is not published (no lookup could reach it) ...
    after = a.allocate(1)[0]
    a.publish(after, chain_hash(h_held, (43, 43)), (43, 43), h_held)
    a.flush_events()
    assert a.num_cached == 0 and state == {}
    # ... and released, both go to the free list, not the cache.
    free = a.num_free
    a.release(after)
    a.release(held)
    assert a.num_cached == 0 and a.num_free == free + 2
    a.check_consistency()


def test_engine_steps_publish_prompt_pages_and_flush_drops_them(make_llm):
    llm = make_llm("tiny-llama", page_size=4)
    engine = llm.engine
    state: dict = {}
    _replay(engine.allocator.add_listener(lambda evs: _replay(evs, state)), state)
    prompt = list(range(3, 3 + 13))  # 3 full pages of 4, and one more token
    llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=2))
    assert state == _published(engine.allocator)
    chain = [chain_hash(None, tuple(prompt[0:4]))]
    chain.append(chain_hash(chain[0], tuple(prompt[4:8])))
    chain.append(chain_hash(chain[1], tuple(prompt[8:12])))
    assert set(chain) <= set(state), "the prompt's full pages are stored under their chain hashes"
    assert state[chain[1]] == (chain[0], tuple(prompt[4:8]))
    held = len(state)
    assert held > 0 and engine.flush_prefix_cache() == held
    assert state == {} and engine.allocator.num_cached == 0


def test_a_flush_while_a_request_runs_leaves_nothing_to_reuse(make_llm):
    # A flush used to keep the pages running requests held published: a
    # request after it reused keys and values computed before it. Now nothing
    # computed before a flush is found again, and the running request is not
    # disturbed (the same tokens as alone).
    llm = make_llm("tiny-llama", page_size=4)
    engine = llm.engine
    prompt = list(range(3, 3 + 13))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    engine.flush_prefix_cache()
    ctx = engine.make_context(prompt, params)
    engine.add_request(ctx)
    generated: list[int] = []
    for _ in range(4):  # the prompt's pages are written and published; it is still running
        generated += [t for out in engine.step() for t in out.token_ids]
    assert engine.allocator.num_cached > 0 and not ctx.is_done
    state: dict = {}
    _replay(engine.allocator.add_listener(lambda evs: _replay(evs, state)), state)
    assert engine.flush_prefix_cache() > 0
    while engine.has_work():
        generated += [t for out in engine.step() for t in out.token_ids]
    assert state == {} and engine.allocator.num_cached == 0, "nothing filled after the flush was published"
    assert generated == alone
    hits = engine.allocator.hits
    llm.generate([prompt], params)
    assert engine.allocator.hits == hits, "a request after the flush reused a page"
    engine.allocator.check_consistency()


def test_a_page_computed_twice_keeps_what_follows_it_reachable():
    # Two requests computed the same first page before either was published:
    # the second copy is a spare. When the first is evicted the spare takes
    # its place, so the second request's next page, chained after that hash,
    # is still found; a router hears of the hash once, and of its removal only
    # when no copy is left.
    a = PageAllocator(4, page_size=2)
    got: list = []
    a.add_listener(got.extend)
    first, copy, after = a.allocate(3)
    h0 = chain_hash(None, (1, 2))
    h1 = chain_hash(h0, (3, 4))
    a.publish(first, h0, (1, 2))
    a.publish(copy, h0, (1, 2))
    a.publish(after, h1, (3, 4), h0)
    for page in (first, copy, after):
        a.release(page)
    a.check_consistency()
    assert a.lookup(h0, (1, 2)) == first
    assert [(s.hashes, s.parent) for s in a.snapshot()] == [([h0], None), ([h1], h0)]
    a.allocate(2)  # the free page, then the oldest cached one: `first`
    a.check_consistency()
    assert a.lookup(h0, (1, 2)) == copy and a.lookup(h1, (3, 4)) == after
    a.flush_events()
    state: dict = {}
    _replay(got, state)
    assert state == _published(a) == {h0: (None, (1, 2)), h1: (h0, (3, 4))}
    a.allocate(2)  # `copy` and `after`: now the hash is gone
    a.check_consistency()
    a.flush_events()
    state = {}
    _replay(got, state)
    assert state == _published(a) == {} and a.lookup(h0, (1, 2)) is None
