"""The engine tokenizes as the checkpoint's tokenizer.json says, whatever
class tokenizer_config.json names: a router tokenizes with that file, and the
two must agree on every id."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers

from engine.presets import ARCHITECTURE_PRESETS, ensure_preset
from engine.tokenizer import Tokenizer, token_spans

TEXTS = ["Hello world", "<s>[INST] What is the capital? [/INST]", " leading space  x",
         "H\u00e9llo 123 \u00fcn\u00ef", "the lazy dog</s>"]


def _llama2_style(out: Path) -> Path:
    """A Llama-2-style checkpoint's tokenizer files: SentencePiece BPE with
    the legacy normalizer (a space marker prepended, spaces replaced), BOS
    added by the post-processor, and the config naming LlamaTokenizer."""
    corpus = ["Hello world, this is a test. [INST] What is the capital? [/INST] Paris."] * 20
    tok = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "legacy": False, "chat_template": "{{ bos_token }}{% for m in messages %}"
                                                "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return out


def _same_as_file(root: Path) -> None:
    raw = RustTokenizer.from_file(str(root / "tokenizer.json"))
    ours = Tokenizer(root)
    for text in TEXTS:
        want = raw.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.encode(text) == raw.encode(text).ids, text


def test_a_llama2_style_tokenizer_encodes_as_its_file(tmp_path):
    root = _llama2_style(tmp_path / "llama2")
    _same_as_file(root)
    # The chat template's "<s>[INST]" keeps the space marker before "[".
    ids = Tokenizer(root).apply_chat_template([{"role": "user", "content": "What is the capital?"}])
    raw = RustTokenizer.from_file(str(root / "tokenizer.json"))
    assert ids == raw.encode("<s>[INST] What is the capital? [/INST]", add_special_tokens=False).ids
    assert (raw.id_to_token(ids[1]) or "").startswith("\u2581")
    assert Tokenizer(root).eos_token_id == raw.token_to_id("</s>")


@pytest.mark.parametrize("preset", ARCHITECTURE_PRESETS)
def test_every_preset_encodes_as_its_file(preset):
    _same_as_file(ensure_preset(preset))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["Hello", " world", "<|im_start|>", "<|im_end|>", "<think>", "\n", " ", "é",
                                 "123", "日本", "\u2581", "<s>"]), max_size=12).map("".join), st.booleans())
def test_encode_gives_transformers_ids(text: str, special: bool) -> None:
    # Tokenizer.encode calls the backend itself (transformers' encode also built
    # masks it drops): the ids must be transformers' own, special tokens or not.
    for tok in _tokenizers():
        assert tok.encode(text, add_special_tokens=special) == list(
            tok.hf.encode(text, add_special_tokens=special)), (tok, text)


@functools.cache
def _tokenizers() -> list[Tokenizer]:
    return [Tokenizer(ensure_preset(name)) for name in ("demo", "tiny-reasoning")]


def _cleanup_variants(tmp: Path) -> list[Tokenizer]:
    """Tokenizers whose decode transformers cleans up or not: the bundled
    WordPiece embedding model as shipped and with its clean-up flag set, and a
    BPE preset with the flag set (transformers 5 skips it for BPE)."""
    import shutil

    from engine.embedding.checkpoint import default_model_path

    out = []
    for name, src in (("minilm", default_model_path()), ("bpe", ensure_preset("demo"))):
        root = tmp / name
        shutil.copytree(src, root)
        config = json.loads((root / "tokenizer_config.json").read_text())
        config["clean_up_tokenization_spaces"] = True
        (root / "tokenizer_config.json").write_text(json.dumps(config))
        out.append(Tokenizer(root))
    return [*_tokenizers(), Tokenizer(default_model_path()), *out]


@functools.cache
def _all_for_decode() -> list[Tokenizer]:
    import tempfile

    return _cleanup_variants(Path(tempfile.mkdtemp(prefix="stencild-decode-")))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=24), st.booleans())
def test_decode_gives_transformers_text(picks: list[int], skip: bool) -> None:
    # Tokenizer.decode calls the backend's batch decode (it releases the GIL)
    # and cleans up spaces as transformers would: the text must be its own.
    for tok in _all_for_decode():
        ids = [p % len(tok) for p in picks]
        assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip), (tok, ids)


def test_decode_leaves_transformers_decode_alone(monkeypatch) -> None:
    # transformers' decode held the GIL ~1 s for 4M ids; where the clean-up is
    # known (all of these), it is not called.
    tokenizers = _all_for_decode()
    assert [tok._cleanup for tok in tokenizers] == [False, False, False, True, False]
    for tok in tokenizers:
        monkeypatch.setattr(tok.hf, "decode", None)
        assert isinstance(tok.decode(tok.encode("Hello . world")), str)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["Hello", " world", "<|im_start|>", "<think>", "\n", " ", "é", "日本", "<s>",
                                 "[CLS]", "a . b", "\u2581"]), max_size=12).map("".join), st.booleans())
def test_token_spans_are_the_encodings_offsets(text: str, special: bool) -> None:
    # Read a token at a time (offsets builds every tuple in one GIL hold); a
    # token the post-processor added has (0, 0) in both.
    for tok in _all_for_decode():
        enc = tok.encoding(text, add_special_tokens=special)
        assert token_spans(enc).tolist() == [list(span) for span in enc.offsets], (tok, text)


def test_encode_without_the_fast_call_gives_the_same_ids(monkeypatch) -> None:
    # The fast batch call keeps no token strings, so a long prompt's encoding
    # is freed at once (a full one's free held the GIL ~0.25 s for 3M
    # tokens); tokenizers before 0.21 lack it and take the full encoding.
    for tok in _all_for_decode():
        assert tok._encode_fast is not None
        fast = [tok.encode(text, special) for text in TEXTS for special in (True, False)]
        monkeypatch.setattr(tok, "encoding", None)  # not called on the fast path
        assert [tok.encode(text, special) for text in TEXTS for special in (True, False)] == fast
        monkeypatch.undo()
        monkeypatch.setattr(tok, "_encode_fast", None)
        assert [tok.encode(text, special) for text in TEXTS for special in (True, False)] == fast
        monkeypatch.undo()


def test_a_prompt_far_longer_than_the_context_is_refused_on_a_part_of_it(monkeypatch) -> None:
    # A text of megabytes was tokenized whole (seconds of a core) only to be
    # refused as longer than the context; a part of it tells.
    from engine.errors import InvalidRequest

    tok = _tokenizers()[0]
    measured: list[int] = []
    ids = tok._ids

    def counted(text: str, special: bool) -> list[int]:
        measured.append(len(text))
        return ids(text, special)

    monkeypatch.setattr(tok, "_ids", counted)
    long = "the cat sat on the mat. " * 200_000  # 4.8 MB
    with pytest.raises(InvalidRequest, match="more than 4096 tokens") as err:
        tok.encode(long, context=2048)
    assert err.value.field == "prompt" and max(measured) < 100_000
    # Short of that, the whole text's ids, as without a context; a chat too.
    text = "the cat sat on the mat. " * 1300  # under the first part measured: not measured
    assert tok.encode(text, context=2048) == tok.encode(text) and len(tok.encode(text)) > 2048
    with pytest.raises(InvalidRequest, match="more than"):
        tok.apply_chat_template([{"role": "user", "content": long}], context=2048)


def test_decode_takes_any_ids_it_took_before() -> None:
    # A list, a tuple, an iterator, a numpy array, a protobuf field: the same text.
    from service.gen.stencil.v1 import generate_pb2 as pb

    tok = _tokenizers()[0]
    ids = tok.encode("Hello world, and more")
    want = tok.decode(ids)
    for form in (tuple(ids), iter(ids), np.asarray(ids), pb.DetokenizeRequest(token_ids=ids).token_ids):
        assert tok.decode(form) == want  # type: ignore[arg-type]
