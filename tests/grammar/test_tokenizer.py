"""TokenizerData and the backends' tokenizer objects built from it (`PerTokenizer`)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from grammar import TokenizerData, _llg, _worker, _xgr
from grammar.tokenizer import PerTokenizer

from .conftest import MODEL_VOCAB, STOP_IDS


def _data(tokenizer) -> TokenizerData:
    return TokenizerData(tokenizer, MODEL_VOCAB, STOP_IDS)


def test_backend_tokenizers_are_built_once_per_tokenizer_data(tokenizer) -> None:
    a, b = _data(tokenizer), _data(tokenizer)
    assert _xgr.tokenizer_info(a) is _xgr.tokenizer_info(a)
    assert _xgr.tokenizer_info(a) is not _xgr.tokenizer_info(b)
    assert _llg.ll_tokenizer(a) is _llg.ll_tokenizer(a)
    assert _llg.ll_tokenizer(a) is not _llg.ll_tokenizer(b)
    assert _xgr.vocab_index(a) is _xgr.vocab_index(a)
    assert _xgr.tokenizer_info(a).vocab_size == MODEL_VOCAB
    assert _llg.ll_tokenizer(a).vocab_size == MODEL_VOCAB


def test_per_tokenizer_builds_once_under_contention(tokenizer) -> None:
    calls: list[int] = []

    def build(data: TokenizerData) -> object:
        calls.append(1)
        time.sleep(0.05)  # long enough for every thread to arrive meanwhile
        return object()

    cache: PerTokenizer[object] = PerTokenizer(build)
    data = _data(tokenizer)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(data))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_per_tokenizer_does_not_hold_up_other_tokenizers(tokenizer) -> None:
    slow, fast = _data(tokenizer), _data(tokenizer)
    release = threading.Event()

    def build(data: TokenizerData) -> str:
        if data is slow:
            release.wait(5)
        return "value"

    cache: PerTokenizer[str] = PerTokenizer(build)
    t = threading.Thread(target=cache.get, args=(slow,))
    t.start()
    try:
        start = time.monotonic()
        assert cache.get(fast) == "value"
        assert time.monotonic() - start < 1.0
    finally:
        release.set()
        t.join()


class _Box:
    def __init__(self, value: object) -> None:
        self.value = value


def test_per_tokenizer_entries_go_with_their_tokenizer_data(tokenizer) -> None:
    cache: PerTokenizer[_Box] = PerTokenizer(lambda data: _Box(data.vocab_size))
    data = _data(tokenizer)
    value = weakref.ref(cache.get(data))
    ref = weakref.ref(data)
    assert value() is not None and len(cache._slots) == 1
    del data
    gc.collect()
    assert ref() is None and value() is None
    assert len(cache._slots) == 0


def test_worker_init_carries_what_the_worker_rebuilds(tokenizer) -> None:
    data = _data(tokenizer)
    init = _worker.process_init(data, 123)
    assert init["tokenizer_json"] == data.tokenizer_json
    assert init["vocab_size"] == MODEL_VOCAB
    assert init["eos_token_ids"] == list(STOP_IDS)
    assert init["memory_limit_bytes"] == 123
    info = _xgr.tokenizer_info_from_json(init["xgr_info_json"])
    assert info.vocab_size == MODEL_VOCAB
    assert list(info.stop_token_ids) == list(STOP_IDS)


def test_vocab_index_finds_extensions(tokenizer) -> None:
    data = _data(tokenizer)
    vocab = _xgr.vocab_index(data)
    quote = data.encode('"')
    assert len(quote) == 1
    longer = vocab.extensions(quote[0])
    assert longer.size > 0
    assert all(vocab.token_bytes(int(t)).startswith(b'"') for t in longer)
    assert all(len(vocab.token_bytes(int(t))) > 1 for t in longer)
    for stop in STOP_IDS:
        assert vocab.token_bytes(stop) == b"" and vocab.extensions(stop).size == 0
    assert _xgr.token_bytes(data, quote[0]) == b'"'
