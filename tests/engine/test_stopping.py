"""Stopping and streaming text, on a scripted model (deterministic tokens)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.presets import IM_END_ID

from .scripted import chain, scripted

TEXT = "Hello world, this is a test of stop strings"


@pytest.fixture
def script_llm(make_llm):
    """An LLM whose model, after token 5, writes TEXT and then `<|im_end|>`."""

    def build(text: str = TEXT, end: int | None = IM_END_ID, **kwargs):
        probe = make_llm("tiny-llama", **kwargs)  # only for its tokenizer
        ids = probe.tokenizer.encode(text, add_special_tokens=False)
        tokens = [5] + ids + ([end] if end is not None else [])
        llm = make_llm("tiny-llama", wrap_model=scripted(chain(tokens)), **kwargs)
        return llm, ids

    return build


def run(llm, params: SamplingParams, prompt=(9, 5)):
    return llm.generate([list(prompt)], params)[0]


def test_eos_from_generation_config_ends_the_request(script_llm):
    llm, ids = script_llm()
    out = run(llm, SamplingParams(temperature=0))
    # config.json says EOS is <|end_of_text|>; generation_config adds <|im_end|>.
    assert out.finish_reason == "eos"
    assert out.token_ids == ids + [IM_END_ID]
    assert out.text == TEXT  # the special token is not part of the text


def test_ignore_eos_and_max_new_tokens(script_llm):
    llm, ids = script_llm()
    out = run(llm, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=len(ids) + 3))
    assert out.finish_reason == "length" and len(out.token_ids) == len(ids) + 3


def test_stop_token_ids(script_llm):
    llm, ids = script_llm()
    out = run(llm, SamplingParams(temperature=0, stop_token_ids=(ids[3],)))
    assert out.finish_reason == "stop_token" and out.stop_reason == ids[3]
    assert out.token_ids == ids[:4]


def test_an_eos_also_listed_as_a_stop_token_ends_with_eos(script_llm):
    # vLLM checks EOS first: no stop token is reported as matched.
    llm, ids = script_llm()
    out = run(llm, SamplingParams(temperature=0, stop_token_ids=(IM_END_ID,)))
    assert out.finish_reason == "eos" and out.stop_reason is None
    assert out.token_ids == ids + [IM_END_ID]
    # With EOS ignored, the listed id is a stop token like any other.
    out = run(llm, SamplingParams(temperature=0, stop_token_ids=(IM_END_ID,), ignore_eos=True))
    assert out.finish_reason == "stop_token" and out.stop_reason == IM_END_ID


def _boundary_stop(llm, ids) -> tuple[str, int]:
    """A stop string spanning the boundary between two tokens, and where it starts."""
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    for i in range(3, len(pieces) - 1):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            stop = pieces[i][-2:] + pieces[i + 1][:2]
            start = len("".join(pieces[:i])) + len(pieces[i]) - 2
            if TEXT.find(stop) == start:
                return stop, start
    raise AssertionError("no suitable token boundary")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(script_llm, include):
    llm, ids = script_llm()
    stop, start = _boundary_stop(llm, ids)
    out = run(llm, SamplingParams(temperature=0, stop=("never there", stop), include_stop_str_in_output=include))
    assert out.finish_reason == "stop_string" and out.stop_reason == stop
    assert out.text == TEXT[:start + (len(stop) if include else 0)]


def test_two_stop_strings_in_one_token_the_earliest_in_the_text_wins(script_llm):
    # " strings" is one token holding both: the one that starts first ends
    # the text and is reported, whichever the request lists first.
    llm, ids = script_llm()
    assert " strings" in [llm.tokenizer.decode([t]) for t in ids]
    for stop in (("ngs", "str"), ("str", "ngs")):
        out = run(llm, SamplingParams(temperature=0, stop=stop))
        assert out.finish_reason == "stop_string" and out.stop_reason == "str"
        assert out.text == TEXT[:TEXT.index("strings")]


def test_no_stop_string_before_min_new_tokens(script_llm):
    # As vLLM: stop strings count once the output has more than
    # min_new_tokens tokens, and only in the text added since.
    llm, ids = script_llm()
    texts = [llm.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    hello = next(i for i, t in enumerate(texts) if "Hello" in t)  # tokens until each is written
    world = next(i for i, t in enumerate(texts) if "world" in t)
    out = run(llm, SamplingParams(temperature=0, stop=("Hello",), min_new_tokens=hello))
    assert out.finish_reason == "eos" and out.text == TEXT  # its only "Hello" came too early
    # ... whatever longer stop strings share the request: each looks back its own length only.
    out = run(llm, SamplingParams(temperature=0, stop=("Hello", "a much longer stop string"), min_new_tokens=hello))
    assert out.finish_reason == "eos" and out.text == TEXT
    out = run(llm, SamplingParams(temperature=0, stop=("world", "test"), min_new_tokens=world - 1))
    assert out.finish_reason == "stop_string" and out.text == "Hello "
    out = run(llm, SamplingParams(temperature=0, stop=("world", "test"), min_new_tokens=world))
    assert out.finish_reason == "stop_string" and out.text == TEXT[:TEXT.index("test")]


def test_streamed_text_never_includes_a_trimmed_stop(script_llm):
    llm, ids = script_llm()
    stop, start = _boundary_stop(llm, ids)
    eng = llm.engine
    ctx = eng.make_context([9, 5], SamplingParams(temperature=0, stop=(stop,)))
    eng.add_request(ctx)
    pieces = []
    while eng.has_work():
        pieces += [o.text for o in eng.step()]
    assert "".join(pieces) == TEXT[:start]


def test_context_length_and_min_new_tokens(script_llm):
    llm, ids = script_llm(max_model_len=12)
    out = run(llm, SamplingParams(temperature=0))
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    llm2, ids2 = script_llm(text="Hi", end=IM_END_ID)
    # EOS is masked until 4 tokens exist; the scripted model then falls back
    # to the lowest allowed id, so the request runs on.
    out = run(llm2, SamplingParams(temperature=0, min_new_tokens=4, max_new_tokens=6))
    assert out.token_ids[:len(ids2)] == ids2 and IM_END_ID not in out.token_ids[:4]


def test_incremental_text_never_splits_a_character(script_llm):
    text = "naïve 本 🙂 x"  # distinct tokens, several characters split over bytes
    llm, ids = script_llm(text=text)
    eng = llm.engine
    ctx = eng.make_context([9, 5], SamplingParams(temperature=0))
    eng.add_request(ctx)
    pieces = []
    while eng.has_work():
        for o in eng.step():
            assert "\ufffd" not in o.text
            pieces.append(o.text)
    assert "".join(pieces) == text
    assert len(ids) > len(text.split())  # multi-byte characters were split across tokens
