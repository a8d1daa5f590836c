"""Generate, Tokenize, Detokenize and GetModelInfo on a real server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.presets import IM_END_ID
from service.gen.stencil.v1 import generate_pb2 as pb

from .helpers import TIMEOUT, ServerHandle, generate, greedy

Finish = pb.GenerateComplete.FinishReason


def test_streaming_text(stub) -> None:
    req = greedy("The quick brown fox", max_new_tokens=12)
    req.stopping.ignore_eos = True
    text, ids, done, chunks = generate(stub, req)
    assert len(chunks) >= 2, "tokens are streamed as they are produced"
    assert len(ids) == 12
    assert done.finish_reason == Finish.LENGTH
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens == len(stub.Tokenize(pb.TokenizeRequest(text="The quick brown fox")).token_ids)
    assert text == stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text


def test_request_id_is_echoed_or_assigned(stub) -> None:
    call = stub.Generate(greedy("hi", max_new_tokens=2, request_id="my-id-1"), timeout=TIMEOUT)
    msgs = list(call)
    assert {m.request_id for m in msgs} == {"my-id-1"}
    assert dict(call.initial_metadata())["x-request-id"] == "my-id-1"
    msgs = list(stub.Generate(greedy("hi", max_new_tokens=2), timeout=TIMEOUT))
    assigned = {m.request_id for m in msgs}
    assert len(assigned) == 1 and assigned.pop()


def test_greedy_is_deterministic_and_token_ids_round_trip(stub) -> None:
    text, ids, _, _ = generate(stub, greedy("Once upon a time", max_new_tokens=10))
    prompt = list(stub.Tokenize(pb.TokenizeRequest(text="Once upon a time")).token_ids)
    req = greedy(max_new_tokens=10)
    req.token_ids.ids.extend(prompt)
    text2, ids2, done, _ = generate(stub, req)
    assert (text2, ids2) == (text, ids)
    assert done.usage.prompt_tokens == len(prompt)


def test_chat_messages(stub) -> None:
    req = greedy(max_new_tokens=8)
    req.chat.messages.add(role="system", content="You are terse.")
    req.chat.messages.add(role="user", content="Say hello.")
    _, ids, done, _ = generate(stub, req)
    tok = pb.TokenizeRequest()
    tok.chat.CopyFrom(req.chat)
    rendered = list(stub.Tokenize(tok).token_ids)
    assert done.usage.prompt_tokens == len(rendered)
    assert IM_END_ID in rendered, "the chat template was applied"
    assert 1 <= len(ids) <= 8


def test_tokenize_detokenize_round_trip(stub) -> None:
    text = "Héllo, wörld! 123 <tags> and\nnew lines"
    resp = stub.Tokenize(pb.TokenizeRequest(text=text, return_offsets=True))
    assert len(resp.offsets) == len(resp.token_ids) > 3
    back = stub.Detokenize(pb.DetokenizeRequest(token_ids=resp.token_ids))
    assert back.text == text
    # Offsets walk through the text in order (a character split over two
    # byte-level tokens is covered by both).
    spans = [(o.start, o.end) for o in resp.offsets]
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(spans, spans[1:], strict=False))
    # Special tokens are dropped from the text unless asked for.
    chat = pb.TokenizeRequest()
    chat.chat.messages.add(role="user", content="hi")
    ids = stub.Tokenize(chat).token_ids
    assert "<|im_start|>" not in stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text
    raw = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=False)).text
    assert raw.count("<|im_start|>") == 2 and "<|im_end|>" in raw


def test_model_info(server: ServerHandle) -> None:
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    engine = server.engine
    assert info.model == "tiny-llama"
    assert info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == engine.vocab_size == 8192
    assert info.max_model_len == engine.max_model_len
    assert set(info.eos_token_ids) == set(engine.eos_token_ids)
    assert info.has_chat_template
    assert info.device == "cpu" and info.dtype == "float32"
    assert info.kv_cache_pages == engine.allocator.num_pages
    assert info.max_logprobs == 20 and info.max_stop_strings == 16
    mc = engine.model_config
    assert mc.num_kv_heads < mc.num_heads  # grouped-query attention tells the two apart
    assert (info.num_layers, info.hidden_size, info.num_attention_heads, info.num_kv_heads) == \
        (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads)
    assert (info.page_size, info.max_num_seqs) == (engine.config.page_size, engine.config.max_num_seqs)


def test_stop_string_and_stop_token(stub) -> None:
    req = greedy("The quick brown fox", max_new_tokens=24)
    req.stopping.ignore_eos = True
    full, ids, _, _ = generate(stub, req)
    # A stop string taken from the greedy output itself must end the stream there.
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), "the output has text to stop on"
    req.stopping.stop.append(stop)
    text, _, done, _ = generate(stub, req)
    assert done.finish_reason == Finish.STOP_STRING
    assert done.stop_string == stop
    assert text == full[:full.index(stop)]

    req = greedy("The quick brown fox", max_new_tokens=24)
    req.stopping.ignore_eos = True
    req.stopping.stop_token_ids.append(ids[5])
    _, ids2, done, _ = generate(stub, req)
    assert done.finish_reason == Finish.STOP_TOKEN
    assert done.stop_token_id == ids[5]
    assert ids2 == ids[:ids.index(ids[5]) + 1]


def test_logprobs_and_response_options(stub) -> None:
    req = greedy("Logprobs please", max_new_tokens=4)
    req.response.logprobs = 3
    req.response.prompt_logprobs = 2
    _, ids, done, chunks = generate(stub, req)
    lps = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        assert lp.top[0].token_id == lp.token_id, "greedy picks the most likely token"
    prompt_lps = [lp for c in chunks for lp in c.prompt_logprobs]
    assert len(prompt_lps) == done.usage.prompt_tokens - 1
    assert len(chunks[0].prompt_logprobs) == len(prompt_lps), "prompt logprobs come in the first chunk"

    req = greedy("No ids please", max_new_tokens=4)
    req.response.return_token_ids = False
    text, ids, done, _ = generate(stub, req)
    assert ids == [] and done.usage.completion_tokens == 4


def test_seeded_sampling_is_reproducible(stub) -> None:
    req = pb.GenerateRequest(text="Random but seeded")
    req.sampling.temperature = 1.0
    req.sampling.top_p = 0.9
    req.sampling.seed = 1234
    req.stopping.max_new_tokens = 8
    req.stopping.ignore_eos = True
    first = generate(stub, req)[1]
    assert generate(stub, req)[1] == first
    # ... and the seed is what decides: other seeds draw other tokens.
    others = set()
    for seed in (1, 2, 3):
        req.sampling.seed = seed
        others.add(tuple(generate(stub, req)[1]))
    assert others - {tuple(first)}


@pytest.mark.slow
def test_32_concurrent_streams_match_their_solo_runs(server: ServerHandle) -> None:
    stub = server.stub
    reqs = []
    for i in range(32):
        req = greedy(f"Request number {i}: " + "word " * (i % 7), max_new_tokens=12)
        req.stopping.ignore_eos = True
        reqs.append(req)
    alone = [generate(stub, r)[:2] for r in reqs]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda r: generate(stub, r, timeout=120.0)[:2], reqs))
    assert together == alone
