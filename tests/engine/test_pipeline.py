"""The pipeline's public interface (MAX's TokenGenerator): `next_token(batch,
num_steps)` runs one step over the contexts it is given, `release(context)`
frees what it holds for one. Driven here without the scheduler."""

from __future__ import annotations

from engine import SamplingParams

from .reference import hf_greedy, prompts


def test_next_token_and_release_without_a_scheduler(make_llm):
    llm = make_llm("tiny-llama", overlap=False)
    eng, pipe = llm.engine, llm.engine.pipeline
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    batch = {}
    for i, prompt in enumerate(prompts(3)):
        ctx = eng.make_context(prompt, params, request_id=f"r{i}")
        eng.postprocessor.track(ctx)
        eng.kv_manager.claim(ctx, use_prefix_cache=False)
        batch[ctx.request_id] = ctx
    tokens: dict[str, list[int]] = {rid: [] for rid in batch}
    for _ in range(3):
        for ctx in batch.values():
            ctx.set_chunk(ctx.end_idx - ctx.start_idx)  # the whole prompt, then one token
            assert eng.kv_manager.reserve(ctx, ctx.active_idx)
        outputs = pipe.next_token(batch, num_steps=1)
        assert set(outputs) == set(batch)
        for rid, out in outputs.items():
            tokens[rid] += out.token_ids
    for i, (rid, ctx) in enumerate(batch.items()):
        assert tokens[rid] == hf_greedy("tiny-llama", prompts(3)[i], 3)
        assert eng.kv_manager.num_pages_held(rid) > 0 and ctx.buffer_row is not None
        pipe.release(ctx)
        assert eng.kv_manager.num_pages_held(rid) == 0 and ctx.buffer_row is None
    assert eng.allocator.num_used == 0
