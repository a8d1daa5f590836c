"""What the engine records for the service's metrics: stage times, prefix-cache
counters, step stats and its load (plain numbers; the engine imports nothing of them)."""

from __future__ import annotations

from engine import EngineConfig, EngineCore, SamplingParams
from engine.presets import ensure_preset

PROMPT = list(range(5, 45))  # 40 tokens: two full 16-token pages can be reused


def _run(engine: EngineCore, n: int = 1) -> tuple[list, list]:
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    ctxs = [engine.make_context(PROMPT, params) for _ in range(n)]
    for ctx in ctxs:
        engine.add_request(ctx)
    assert engine.load().waiting == n
    steps = []
    while engine.has_work():
        engine.step()
        steps.append(engine.last_step)
    return ctxs, steps


def test_stage_times_counters_and_load() -> None:
    engine = EngineCore(EngineConfig(model=str(ensure_preset("tiny-llama")), kv_cache_gib=0.05))
    try:
        [first], steps = _run(engine)
        t = first.times
        assert t.arrival is not None and t.scheduled is not None
        assert t.first_token is not None and t.finished is not None
        assert t.arrival <= t.scheduled <= t.first_token <= t.finished
        assert steps[0].batch_size == 1 and steps[0].num_tokens == len(PROMPT)
        assert all(s.seconds > 0 and s.mask_seconds is None for s in steps)
        assert engine.scheduler.prefix_cache_queries == len(PROMPT)
        assert engine.scheduler.prefix_cache_hits == 0
        [second], _ = _run(engine)
        assert second.num_cached_prompt_tokens == 32
        assert engine.scheduler.prefix_cache_queries == 2 * len(PROMPT)
        assert engine.scheduler.prefix_cache_hits == 32
        load = engine.load()
        assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
        assert load.kv_usage == 0.0 and load.kv_pages_total == engine.allocator.num_pages
    finally:
        engine.close()
