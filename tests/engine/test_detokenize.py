"""Property tests: a response's streamed text is what its tokens add to the prompt's text.

For prompt ids P and generated ids G the rule (engine/tokenizer.py) is
`decode(P + G)` without the characters `decode(P)` accounts for: after the
longest common prefix of the two. Texts mix several scripts and emoji; each
piece is tokenized either whole or one byte per token, so splits fall at the
prompt's end, inside characters, inside the response and across stop strings.
Two tokenizers: the demo model's byte-level BPE, and a SentencePiece-style one
(byte fallback, `\u2581` for spaces, a stripped leading space) built here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from engine.context import GenerationStatus, TextContext
from engine.output import OutputStream
from engine.presets import ensure_preset
from engine.sampling_params import SamplingParams
from engine.tokenizer import REPLACEMENT, IncrementalDecoder, Tokenizer, skipped_ids

PIECES = ["A user record: ", "caf\u00e9", " na\u00efve", "\u65e5\u672c\u8a9e", " \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
          " \u0420\u0443\u0441\u0441\u043a\u0438\u0439", " \u0639\u0631\u0628\u064a", " \ud55c\uad6d\uc5b4", " \U0001f600",
          "\U0001f469\u200d\U0001f469\u200d\U0001f467", "\U0001f389!", " {\"a\": 1}", "\n", " \u20ac5", "END", " ok"]
STOPS = ["END", "\u00e9", "\U0001f389", "\u672c\u8a9e", "\n"]
EXAMPLES = int(os.environ.get("STENCILD_PROPERTY_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


class _Backend:
    """Just what IncrementalDecoder and OutputStream read of a Tokenizer."""

    def __init__(self, backend: RustTokenizer):
        self.backend = backend
        self.skipped_ids = skipped_ids(backend)

    def stream(self, prefix: list[int], skip_special_tokens: bool) -> IncrementalDecoder:
        return IncrementalDecoder(self, prefix, skip_special_tokens)  # type: ignore[arg-type]


def _sentencepiece_like() -> tuple[_Backend, dict[int, int]]:
    """A Llama-2-style tokenizer: characters of ASCII words, every other
    character by its UTF-8 bytes (<0xNN> tokens), spaces as U+2581."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "\u2581abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:{}\"!,.":
        vocab.setdefault(ch, len(vocab))
    tok = RustTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    byte_ids = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    return _Backend(tok), byte_ids


def _byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _byte_level() -> tuple[_Backend, dict[int, int]]:
    hf = Tokenizer(ensure_preset("demo")).hf
    byte_ids = {b: hf.convert_tokens_to_ids(c) for b, c in _byte_level_alphabet().items()}
    assert hf.decode([byte_ids[0xC3], byte_ids[0xA9]]) == "\u00e9"
    return _Backend(hf.backend_tokenizer), byte_ids


TOKENIZERS = {"byte-level": _byte_level, "sentencepiece-like": _sentencepiece_like}
SPECIAL = {"byte-level": 3, "sentencepiece-like": 2}  # <|im_end|>, </s>
_made: dict[str, tuple[_Backend, dict[int, int]]] = {}


def tokenizer(name: str) -> tuple[_Backend, dict[int, int]]:
    if name not in _made:
        _made[name] = TOKENIZERS[name]()
    return _made[name]


@st.composite
def token_texts(draw: st.DrawFn, name: str) -> list[int]:
    """Ids of a random text: each piece tokenized whole or one byte per token."""
    tok, byte_ids = tokenizer(name)
    special = SPECIAL[name]
    ids: list[int] = []
    for piece in draw(st.lists(st.sampled_from(PIECES), min_size=2, max_size=8)):
        if draw(st.booleans()):
            ids += tok.backend.encode(piece, add_special_tokens=False).ids
        else:
            ids += [byte_ids[b] for b in piece.encode("utf-8")]
        # Runs of special tokens (skipped or not) between pieces: a decode
        # window of only skipped ones made a SentencePiece decoder drop the
        # space of the next word.
        if draw(st.integers(0, 3)) == 0:
            ids += [special] * draw(st.integers(1, 6))
    return ids


def expected_text(tok: _Backend, prompt: list[int], generated: list[int], skip: bool = True) -> str:
    """The rule, from whole decodes: `decode(P + G)` past the prompt's text,
    which is its text up to its last whole character, plus the U+FFFD of the
    bytes dangling after it unless a generated byte completed them."""
    def decode(ids: list[int]) -> str:
        return tok.backend.decode(ids, skip_special_tokens=skip)

    whole, before = decode(prompt + generated), decode(prompt)
    if whole.startswith(before):
        return whole[len(before):]
    cut = len(prompt)
    while cut > 0 and decode(prompt[:cut]).endswith(REPLACEMENT):
        cut -= 1
    clean = decode(prompt[:cut])
    assert whole.startswith(clean), (whole, clean)
    return whole[len(clean):]


def streamed(tok: _Backend, prompt: list[int], generated: list[int], skip: bool = True) -> list[str]:
    decoder = IncrementalDecoder(tok, prompt, skip)  # type: ignore[arg-type]
    return [decoder.step(t) for t in generated] + [decoder.flush()]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_streamed_text_is_what_the_response_adds(name: str) -> None:
    @SETTINGS
    @given(ids=token_texts(name), cut=st.floats(0.05, 0.95), skip=st.booleans())
    def check(ids: list[int], cut: float, skip: bool) -> None:
        tok, _ = tokenizer(name)
        k = min(max(1, int(len(ids) * cut)), len(ids) - 1)
        prompt, generated = ids[:k], ids[k:]
        pieces = streamed(tok, prompt, generated, skip)
        assert "".join(pieces) == expected_text(tok, prompt, generated, skip)
        # A character is never sent in halves: only the last piece may end in
        # U+FFFD (bytes nothing completed), unless the text has a stray byte.
        whole = tok.backend.decode(prompt + generated, skip_special_tokens=skip)
        if REPLACEMENT not in whole:
            assert not any(REPLACEMENT in p for p in pieces)

    check()


def test_a_window_of_skipped_special_tokens_keeps_the_next_words_space() -> None:
    """Prompt "hello" and four </s>, then "world": the decode window held only
    the skipped </s>, so the decoder stripped the space of ▁world as the first
    visible token ("world", not " world"); the same where the window slides
    onto a run of them inside a response."""
    tok, _ = tokenizer("sentencepiece-like")
    eos = SPECIAL["sentencepiece-like"]
    enc = lambda s: tok.backend.encode(s, add_special_tokens=False).ids  # noqa: E731
    for prompt, generated in ((enc("hello") + [eos] * 4, enc("world")),
                              (enc("hello"), enc("a" * 25) + [eos] * 4 + enc("world"))):
        assert "".join(streamed(tok, prompt, generated)) == expected_text(tok, prompt, generated)
    # However long the run: a window stopped growing at 64 tokens, all </s>.
    for run in (4, 63, 64, 200):
        assert "".join(streamed(tok, enc("hello") + [eos] * run, enc("world"))) == " world", run


def _run_stream(tok: _Backend, prompt: list[int], generated: list[int], params: SamplingParams,
                eos: int | None = None) -> tuple[str, TextContext]:
    """Feed `generated` to an OutputStream a token per step, as the postprocess does."""
    ctx = TextContext(tokens=np.asarray(prompt), max_length=len(prompt) + len(generated) + 1, sampling_params=params)
    stream = OutputStream(ctx, tok)  # type: ignore[arg-type]
    text = ""
    for i, t in enumerate(generated):
        ctx.update(t)
        if eos is not None and t == eos:
            ctx.finish(GenerationStatus.END_OF_SEQUENCE)
        elif i == len(generated) - 1:
            ctx.finish(GenerationStatus.MAXIMUM_LENGTH)
        match = stream.decode()
        if match is not None:
            ctx.rollback(ctx.num_generated - match.keep_tokens)
            ctx.end_at_stop_string()
        text += stream.delta().text
        if ctx.is_done:
            break
    return text, ctx


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_stop_strings_match_the_response_text_only(name: str) -> None:
    @SETTINGS
    @given(ids=token_texts(name), cut=st.floats(0.05, 0.95), stop=st.sampled_from(STOPS),
           include=st.booleans())
    def check(ids: list[int], cut: float, stop: str, include: bool) -> None:
        tok, _ = tokenizer(name)
        k = min(max(1, int(len(ids) * cut)), len(ids) - 1)
        prompt, generated = ids[:k], ids[k:]
        params = SamplingParams(stop=(stop,), include_stop_str_in_output=include)
        text, ctx = _run_stream(tok, prompt, generated, params)
        response = expected_text(tok, prompt, generated)
        at = response.find(stop)
        if at < 0:
            assert text == response
            assert ctx.status is GenerationStatus.MAXIMUM_LENGTH
        else:
            assert text == response[:at + len(stop) if include else at]
            assert ctx.status is GenerationStatus.STOP_STRING
            # The tokens kept are those up to the one that completed the stop.
            kept = ctx.generated_tokens.tolist()
            assert stop in "".join(streamed(tok, prompt, kept)[:-1])
            assert stop not in "".join(streamed(tok, prompt, kept[:-1])[:-1])

    check()


def test_demo_prompt_ending_inside_a_character() -> None:
    """The issue's case: "A user record: caf" + the byte 0xC3 (the start of é)."""
    tok, byte_ids = tokenizer("byte-level")
    prompt = tok.backend.encode("A user record: caf", add_special_tokens=False).ids + [byte_ids[0xC3]]
    brace = tok.backend.encode("{", add_special_tokens=False).ids
    assert "".join(streamed(tok, prompt, brace)) == "{"
    # A generated byte that completes the character makes it the response's.
    assert "".join(streamed(tok, prompt, [byte_ids[0xA9]] + brace)) == "\u00e9{"
    # Never completed: the prompt's U+FFFD stays the prompt's.
    assert "".join(streamed(tok, prompt, [byte_ids[0xC3]] + brace)) == REPLACEMENT + "{"


def test_prompt_token_with_whole_characters_before_dangling_bytes() -> None:
    """The prompt's last token holds a whole character (a space) and the first
    bytes of an emoji; a generated byte that does not complete the emoji, then
    ASCII: the space and the emoji's U+FFFD stay the prompt's."""
    tok, byte_ids = tokenizer("byte-level")
    prompt = tok.backend.encode("caf\u00e9", add_special_tokens=False).ids + \
        tok.backend.encode(" \U0001f600", add_special_tokens=False).ids[:1]
    assert tok.backend.decode(prompt).endswith(" " + REPLACEMENT)
    ok = tok.backend.encode("ok", add_special_tokens=False).ids
    generated = [byte_ids[0x98]] + ok
    assert "".join(streamed(tok, prompt, generated)) == expected_text(tok, prompt, generated) == "ok"


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_and_answer_join_to_the_response_text(parser: str) -> None:
    """With a reasoning parser the streamed text splits into the thought and
    the answer at the end marker: the two, with the marker's text between
    them (and a `<think>` the model wrote first before them), are the whole
    response text, wherever the marker falls among split characters."""
    from engine.presets import END_THINK_ID, THINK_ID
    from engine.reasoning import ReasoningParser

    tok = Tokenizer(ensure_preset("tiny-reasoning"))  # the demo vocabulary plus the markers
    reasoning = ReasoningParser.load(parser, tok.hf.get_vocab())

    @SETTINGS
    @given(ids=token_texts("byte-level"), cut=st.floats(0.05, 0.95), at=st.floats(0.0, 1.0),
           opened=st.booleans(), writes_start=st.booleans(), closes=st.booleans(), skip=st.booleans())
    def check(ids: list[int], cut: float, at: float, opened: bool, writes_start: bool, closes: bool,
              skip: bool) -> None:
        k = min(max(1, int(len(ids) * cut)), len(ids) - 1)
        prompt, generated = ids[:k] + ([THINK_ID] if opened else []), ids[k:]
        m = int(len(generated) * at)
        if closes:
            generated = generated[:m] + [END_THINK_ID] + generated[m:]
        if writes_start:
            generated = [THINK_ID] + generated
        ctx = TextContext(tokens=np.asarray(prompt), max_length=len(prompt) + len(generated) + 1,
                          sampling_params=SamplingParams(skip_special_tokens=skip))
        ctx.gate = reasoning.gate(prompt)
        stream = OutputStream(ctx, tok)
        thought = answer = ""
        for i, t in enumerate(generated):
            ctx.update(t)
            ctx.gate.observe(ctx.tokens, ctx.num_final_tokens)
            if i == len(generated) - 1:
                ctx.finish(GenerationStatus.MAXIMUM_LENGTH)
            assert stream.decode() is None
            delta = stream.delta()
            thought, answer = thought + delta.reasoning, answer + delta.text
        whole = expected_text(tok, prompt, generated, skip)  # type: ignore[arg-type]
        gate = ctx.gate
        if gate.thought_start is None:  # no thought (qwen3: the first token was not `<think>`)
            assert (thought, answer) == ("", whole)
            return
        start = "<think>" if gate.start_marker is not None else ""
        if gate.thought_end is None:
            assert start + thought == whole and answer == ""
        else:
            assert start + thought + "</think>" + answer == whole
        assert delta.thought == gate.outcome(ctx.forced_positions)
        assert delta.reasoning_tokens == gate.reasoning_tokens(ctx.num_final_tokens)

    check()
