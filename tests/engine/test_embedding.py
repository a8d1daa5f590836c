"""The embedding pipeline against sentence-transformers, and the cross-request batcher."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine import InvalidRequest  # noqa: E402
from engine.embedding import (  # noqa: E402
    BatcherClosed,
    BatcherOverloaded,
    EmbeddingBatcher,
    EmbeddingConfig,
    EmbeddingPipeline,
    default_model_path,
    load_embedding_spec,
)
from engine.embedding.packing import pack  # noqa: E402
from engine.embedding.pipeline import plan_batches  # noqa: E402

from .embedding_checkpoints import make_tiny_bert  # noqa: E402

MIN_COSINE = 0.9999

SHORT = [
    "",
    "a",
    "Hi!",
    "The quick brown fox jumps over the lazy dog.",
    "Straße, Ünïcödé — naïve café; 日本語のテキスト; Привет, мир! 🎉🚀",
    "Embeddings map text to vectors so that similar meanings land close together.",
]


def long_text(pipeline: EmbeddingPipeline, tokens: int) -> str:
    """A text of exactly `tokens` tokens (special tokens included)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    text = " ".join(words[i % 5] for i in range(tokens - 2))
    assert len(pipeline.tokenizer.encode([text])[0]) == tokens
    return text


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def pipeline() -> EmbeddingPipeline:
    return EmbeddingPipeline()


@pytest.fixture(scope="module")
def st_model() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_path()), device="cpu")


@pytest.fixture(scope="module")
def st_unnormalized(st_model: Any) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(modules=[st_model[0], st_model[1]], device="cpu")


@pytest.fixture(scope="module")
def texts(pipeline: EmbeddingPipeline) -> list[str]:
    return [*SHORT, long_text(pipeline, pipeline.max_length - 1), long_text(pipeline, 40),
            long_text(pipeline, pipeline.max_length)]


# -- checkpoint --------------------------------------------------------------------


def test_default_model_is_the_bundled_minilm() -> None:
    root = default_model_path()
    assert (root / "modules.json").is_file() and (root / "model.safetensors").is_file()
    spec = load_embedding_spec(root)
    assert spec.pooling == ("mean",)
    assert spec.normalize and spec.dimension == 384 and spec.max_length == 256
    assert spec.encoder.num_layers == 6 and spec.encoder.hidden_act == "gelu"


# -- correctness against sentence-transformers -------------------------------------


def test_single_inputs_match_sentence_transformers(pipeline: EmbeddingPipeline, st_model: Any,
                                                   texts: list[str]) -> None:
    for text in texts:
        ours, tokens = pipeline.embed([text])
        ref = st_model.encode([text], convert_to_numpy=True)
        assert ours.shape == (1, 384) and ours.dtype == np.float32
        assert tokens == len(pipeline.tokenizer.encode([text])[0])
        assert cosines(ours, ref)[0] >= MIN_COSINE, text[:40]


def test_batch_of_mixed_lengths_matches_sentence_transformers(pipeline: EmbeddingPipeline,
                                                              st_model: Any, texts: list[str]) -> None:
    ours, tokens = pipeline.embed(texts)
    ref = st_model.encode(texts, convert_to_numpy=True)
    assert ours.shape == (len(texts), 384)
    assert cosines(ours, ref).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert tokens == sum(len(t) for t in pipeline.tokenizer.encode(texts))
    # Batching does not change a row: same as embedding each input alone.
    alone = np.concatenate([pipeline.embed([t])[0] for t in texts])
    np.testing.assert_allclose(ours, alone, atol=1e-5)


def test_normalize_off_returns_raw_pooled_vectors(pipeline: EmbeddingPipeline, st_unnormalized: Any,
                                                  texts: list[str]) -> None:
    raw, _ = pipeline.embed(texts, normalize=False)
    ref = st_unnormalized.encode(texts, convert_to_numpy=True)
    assert cosines(raw, ref).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    unit, _ = pipeline.embed(texts)
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("dims", [1, 64, 383, 384])
def test_dimensions_truncate_then_renormalize(pipeline: EmbeddingPipeline, texts: list[str],
                                              dims: int) -> None:
    full, _ = pipeline.embed(texts)
    cut, _ = pipeline.embed(texts, dimensions=dims)
    assert cut.shape == (len(texts), dims)
    expected = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
    raw, _ = pipeline.embed(texts, normalize=False)
    raw_cut, _ = pipeline.embed(texts, normalize=False, dimensions=dims)
    np.testing.assert_allclose(raw_cut, raw[:, :dims], atol=1e-6)


def test_truncate(pipeline: EmbeddingPipeline, st_model: Any) -> None:
    over = long_text(pipeline, pipeline.max_length + 300)
    inputs = ["short one", over, "another"]
    with pytest.raises(InvalidRequest) as err:
        pipeline.embed(inputs)
    assert err.value.field == "inputs[1]"
    assert str(pipeline.max_length) in err.value.description

    ours, tokens = pipeline.embed(inputs, truncate=True)
    # sentence-transformers silently truncates to the same window.
    ref = st_model.encode(inputs, convert_to_numpy=True)
    assert cosines(ours, ref).min() >= MIN_COSINE
    short = pipeline.tokenizer.encode(["short one", "another"])
    assert tokens == pipeline.max_length + sum(len(t) for t in short)
    # An input exactly at the limit needs no truncation.
    pipeline.embed([long_text(pipeline, pipeline.max_length)])


class _Measured:
    """The tokenizer's untruncated copy, noting the longest text it was given."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.longest = 0

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.longest = max(self.longest, *(len(t) for t in texts))
        return self.inner.encode_batch(texts, **kwargs)


def test_a_huge_input_is_tokenized_only_as_far_as_its_window_needs(pipeline: EmbeddingPipeline,
                                                                    monkeypatch) -> None:
    # A few megabytes were tokenized whole (8M tokens: 5 GB and a minute) to
    # be refused, or cut, afterwards.
    tok = pipeline.tokenizer
    huge = "alpha beta, gamma! " * 200_000  # 3.8M characters
    measured = _Measured(tok._whole)
    monkeypatch.setattr(tok, "_whole", measured)
    with pytest.raises(InvalidRequest) as err:
        pipeline.prepare([huge])
    assert err.value.field == "inputs[0]" and str(pipeline.max_length) in err.value.description
    cut = pipeline.prepare(["short", huge], truncate=True).token_ids[1]
    assert measured.longest <= 64 * pipeline.max_length
    monkeypatch.undo()
    assert list(cut) == tok.encode_truncated([huge[:100_000]])[0]  # the whole text's first window


_PIECES = ["word", "the", " ", "  ", "\n", ",", "日本語", "Straße", "naïve", "🎉", "x" * 150, "-", "42", "é"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(_PIECES), min_size=0, max_size=3000), st.booleans())
def test_bounded_tokenizing_agrees_with_whole_texts(pipeline: EmbeddingPipeline, pieces: list[str],
                                                    truncate: bool) -> None:
    # Over random texts, short and long: the same ids as tokenizing the whole
    # text (cut to the window when truncating), and the same verdict on length.
    tok = pipeline.tokenizer
    text = "".join(pieces)
    [bounded] = tok.encode_bounded([text], truncate)
    [whole] = tok.encode([text])
    if truncate:
        assert bounded == tok.encode_truncated([text])[0]
    elif len(whole) <= pipeline.max_length:
        assert bounded == whole
    else:
        assert len(bounded) > pipeline.max_length and bounded[:pipeline.max_length] == whole[:pipeline.max_length]


def test_bounded_tokenizing_never_holds_the_gil_for_a_whole_text(pipeline: EmbeddingPipeline,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A text of megabytes of one word is measured to its end; the tokenizer's
    # single-text `encode` holds the GIL throughout (6-11 s of a stalled event
    # loop for 8 MB), its `encode_batch` lets go of it while it works.
    tok = pipeline.tokenizer

    def holds_the_gil(*args: object, **kwargs: object) -> None:
        raise AssertionError("encode holds the GIL: use encode_batch")

    for backend in (tok._whole, tok._cut):
        monkeypatch.setattr(backend, "encode", holds_the_gil)
    for truncate in (True, False):
        [ids] = tok.encode_bounded(["a" * 300_000], truncate)
        assert ids[0] == tok._whole.token_to_id("[CLS]") and len(ids) == 3  # the one word is [UNK]


def test_truncation_cuts_the_side_the_checkpoint_names(tmp_path: Path) -> None:
    import json
    import shutil

    from sentence_transformers import SentenceTransformer

    d = tmp_path / "left"
    shutil.copytree(default_model_path(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["truncation_side"] = "left"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    left = EmbeddingPipeline(EmbeddingConfig(model=str(d)))
    text = "filler words here " * 200 + "omega " * 150
    ours, _ = left.embed([text], truncate=True)
    ref = SentenceTransformer(str(d), device="cpu").encode([text], convert_to_numpy=True)
    assert cosines(ours, ref)[0] >= MIN_COSINE


@pytest.mark.parametrize("dims", [0, -1, 385, 1.5, True, "8"])
def test_invalid_dimensions(pipeline: EmbeddingPipeline, dims: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        pipeline.embed(["hello"], dimensions=dims)
    assert err.value.field == "dimensions"


def test_accepts_any_iterable_and_integer_type(pipeline: EmbeddingPipeline) -> None:
    ref, _ = pipeline.embed(["x", "y"], dimensions=8)
    got, _ = pipeline.embed((t for t in ("x", "y")), dimensions=np.int64(8))  # type: ignore[arg-type]
    np.testing.assert_array_equal(got, ref)


def test_invalid_inputs(pipeline: EmbeddingPipeline) -> None:
    for bad, field in (([], "inputs"), ("not a list", "inputs"), (["ok", 3], "inputs[1]")):
        with pytest.raises(InvalidRequest) as err:
            pipeline.embed(bad)  # type: ignore[arg-type]
        assert err.value.field == field


def test_bfloat16_is_close(pipeline: EmbeddingPipeline, texts: list[str]) -> None:
    bf16 = EmbeddingPipeline(EmbeddingConfig(dtype="bfloat16"))
    ours, _ = bf16.embed(texts)
    ref, _ = pipeline.embed(texts)
    assert ours.dtype == np.float32
    assert cosines(ours, ref).min() >= 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(pipeline: EmbeddingPipeline, texts: list[str]) -> None:
    gpu = EmbeddingPipeline(EmbeddingConfig(device="cuda", dtype="float32"))
    ours, tokens = gpu.embed(texts)
    ref, ref_tokens = pipeline.embed(texts)
    assert tokens == ref_tokens
    assert cosines(ours, ref).min() >= MIN_COSINE


# -- other checkpoints: pooling modes, activations, the current save format --------


@pytest.mark.parametrize("mode,act", [
    ("cls", "gelu"),
    ("max", "relu"),
    ("lasttoken", "gelu_new"),
    ("weightedmean", "gelu_pytorch_tanh"),
    ("mean_sqrt_len_tokens", "gelu"),
])
def test_tiny_checkpoints_match_sentence_transformers(tmp_path: Path, mode: str, act: str) -> None:
    from sentence_transformers import SentenceTransformer

    root = make_tiny_bert(tmp_path, pooling_mode=mode, hidden_act=act, max_seq_length=24)
    ours = EmbeddingPipeline(EmbeddingConfig(model=str(root)))
    assert ours.spec.pooling == (mode,) and ours.max_length == 24 and not ours.spec.normalize
    ref_model = SentenceTransformer(str(root), device="cpu")
    inputs = [*SHORT, "one two three four five six seven eight nine ten " * 4]
    got, _ = ours.embed(inputs, normalize=False, truncate=True)
    ref = ref_model.encode(inputs, convert_to_numpy=True)
    assert cosines(got, ref).min() >= MIN_COSINE
    np.testing.assert_allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("normalize", [False, True])
def test_vectors_are_normalized_by_default_as_the_checkpoint_says(tmp_path: Path, normalize: bool) -> None:
    # A checkpoint without a Normalize module gave unit vectors all the same,
    # where sentence-transformers and vLLM return them as pooled.
    from sentence_transformers import SentenceTransformer

    root = make_tiny_bert(tmp_path, normalize=normalize)
    ours = EmbeddingPipeline(EmbeddingConfig(model=str(root)))
    got, _ = ours.embed(SHORT, truncate=True)
    ref = SentenceTransformer(str(root), device="cpu").encode(list(SHORT), convert_to_numpy=True)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize
    assert np.allclose(np.linalg.norm(ours.embed(SHORT, normalize=True, truncate=True)[0], axis=1), 1.0, atol=1e-5)


# -- packing -----------------------------------------------------------------------


def test_pack_groups_equal_lengths_and_restores_order() -> None:
    seqs = [[1, 2, 3], [4], [5, 6, 7], [8, 9], [10]]
    batch = pack(seqs, torch.device("cpu"))
    assert [(g.count, g.length) for g in batch.groups] == [(2, 1), (1, 2), (2, 3)]
    assert batch.num_tokens == 10 and batch.num_seqs == 5
    packed = batch.input_ids.tolist()
    for i, seq in enumerate(seqs):
        row = int(batch.restore[i])
        start, length = int(batch.starts[row]), int(batch.lengths[row])
        assert packed[start:start + length] == seq
        assert batch.position_ids[start:start + length].tolist() == list(range(length))


def test_plan_batches_respects_budget() -> None:
    assert [list(r) for r in plan_batches([3, 3, 3, 5, 1], 6)] == [[0, 1], [2], [3, 4]]
    assert [list(r) for r in plan_batches([7], 6)] == [[0]]


# -- batcher -----------------------------------------------------------------------


class GatedPipeline:
    """Wraps a pipeline so that a forward pass waits until the test opens the gate."""

    def __init__(self, inner: EmbeddingPipeline):
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batch_sizes: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(30)
        self.batch_sizes.append(len(sequences))
        return self.inner.forward(sequences)


def expected_rows(pipeline: EmbeddingPipeline, texts: Sequence[str]) -> list[np.ndarray]:
    return [pipeline.embed([t])[0][0] for t in texts]


def test_sixteen_threads_are_batched(pipeline: EmbeddingPipeline) -> None:
    texts = [f"request {i}: " + "word " * (3 * i) for i in range(16)]
    expected = expected_rows(pipeline, texts)
    results: list[Any] = [None] * 16
    start = threading.Barrier(16)

    with EmbeddingBatcher(pipeline) as batcher:
        def call(i: int) -> None:
            start.wait()
            results[i] = batcher.embed_sync([texts[i]], timeout=60)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert batcher.forward_passes < 16
    for i, (vecs, tokens) in enumerate(results):
        assert tokens == len(pipeline.tokenizer.encode([texts[i]])[0])
        np.testing.assert_allclose(vecs[0], expected[i], atol=1e-5)


def test_sixteen_asyncio_tasks_with_mixed_options(pipeline: EmbeddingPipeline) -> None:
    texts = [f"async caller {i} says " + "hello " * i for i in range(16)]
    full = np.stack(expected_rows(pipeline, texts))
    raw, _ = pipeline.embed(texts, normalize=False)
    gated = GatedPipeline(pipeline)
    batcher = EmbeddingBatcher(gated)  # type: ignore[arg-type]

    async def main() -> list[Any]:
        options = [(i % 2 == 0, None if i % 3 else 32) for i in range(16)]  # (normalize, dimensions)
        tasks = [asyncio.ensure_future(batcher.embed([t], normalize=n, dimensions=d))
                 for t, (n, d) in zip(texts, options, strict=True)]
        await asyncio.sleep(0)  # every task has submitted
        gated.gate.set()
        return list(zip(options, await asyncio.gather(*tasks), strict=True))

    try:
        results = asyncio.run(main())
    finally:
        batcher.close()
    # The worker took the first request before the others were queued, at most.
    assert batcher.forward_passes <= 2
    assert sum(gated.batch_sizes) == 16
    for i, ((normalize, dimensions), (vecs, _)) in enumerate(results):
        vec = raw[i] if not normalize else full[i]
        if dimensions:
            vec = vec[:32] / (np.linalg.norm(vec[:32]) if normalize else 1.0)
        np.testing.assert_allclose(vecs[0], vec, atol=1e-5)


def test_async_large_request_tokenizes_off_the_loop(pipeline: EmbeddingPipeline) -> None:
    big = ["lorem ipsum dolor sit amet " * 800, "small"]  # > INLINE_TOKENIZE_CHARS
    with EmbeddingBatcher(pipeline) as batcher:
        vecs, tokens = asyncio.run(batcher.embed(big, truncate=True))
        with pytest.raises(InvalidRequest):
            asyncio.run(batcher.embed(big))
    ref, ref_tokens = pipeline.embed(big, truncate=True)
    assert tokens == ref_tokens
    np.testing.assert_allclose(vecs, ref, atol=1e-5)


def test_an_input_as_long_as_the_batch_budget_is_embedded(pipeline: EmbeddingPipeline) -> None:
    # The smallest budget allowed is the model's length: an input that long
    # must fit a batch of its own (a strict comparison never took it).
    long = "lorem ipsum dolor sit amet " * 800
    with EmbeddingBatcher(pipeline, max_batch_tokens=pipeline.max_length) as batcher:
        vecs, tokens = batcher.embed_sync([long, "small"], truncate=True, timeout=30)
    assert vecs.shape[0] == 2 and tokens > pipeline.max_length


def test_many_short_inputs_tokenize_off_the_loop(pipeline: EmbeddingPipeline) -> None:
    # Each input is a tokenizer call of its own: 2,000 empty strings weigh as
    # much as long text (300k of them held the loop for 3 s), a few do not.
    with EmbeddingBatcher(pipeline) as batcher:
        where: list[bool] = []
        submit = batcher._submit

        def recording(*args: Any, **kwargs: Any) -> Any:
            where.append(threading.current_thread() is threading.main_thread())
            return submit(*args, **kwargs)

        batcher._submit = recording  # type: ignore[method-assign]
        asyncio.run(batcher.embed([""] * 2000))
        asyncio.run(batcher.embed(["a", "b"]))
    assert where == [False, True]  # off the loop's thread, then on it


def test_invalid_request_fails_only_its_caller(pipeline: EmbeddingPipeline) -> None:
    with EmbeddingBatcher(pipeline) as batcher:
        good = batcher.submit(["fine"])
        with pytest.raises(InvalidRequest) as err:
            batcher.submit(["ok", long_text(pipeline, pipeline.max_length + 1)])
        assert err.value.field == "inputs[1]"
        with pytest.raises(InvalidRequest):
            batcher.submit(["ok"], dimensions=1000)
        vecs, _ = good.result(60)
        assert vecs.shape == (1, 384)
        assert batcher.pending_tokens == 0


def test_large_request_spans_several_passes(pipeline: EmbeddingPipeline) -> None:
    texts = [long_text(pipeline, 100 + i) for i in range(7)]  # ~730 tokens, budget 256
    with EmbeddingBatcher(pipeline, max_batch_tokens=256) as batcher:
        small = batcher.submit(["tiny"])
        vecs, tokens = batcher.embed_sync(texts, timeout=60)
        small.result(60)
        assert batcher.forward_passes >= 4
    assert tokens == sum(100 + i for i in range(7))
    np.testing.assert_allclose(vecs, np.stack(expected_rows(pipeline, texts)), atol=1e-5)


def test_cancelled_request_is_skipped(pipeline: EmbeddingPipeline) -> None:
    gated = GatedPipeline(pipeline)
    with EmbeddingBatcher(gated) as batcher:  # type: ignore[arg-type]
        first = batcher.submit(["first"])
        assert gated.entered.wait(30)  # the worker is inside the first pass
        doomed = batcher.submit(["cancel me"])
        assert doomed.cancel()
        gated.gate.set()
        first.result(60)
        last = batcher.submit(["last"])
        last.result(60)
    assert gated.batch_sizes == [1, 1]
    assert batcher.pending_tokens == 0


def test_cancelling_a_started_request_drops_its_remaining_passes(pipeline: EmbeddingPipeline) -> None:
    """A caller that goes away while its request's first pass runs stops the
    rest (its future is running, so cancelling it used to do nothing: all 8
    passes ran for nobody)."""
    gated = GatedPipeline(pipeline)
    texts = [long_text(pipeline, 200)] * 8  # one input a pass at 256 tokens
    batcher = EmbeddingBatcher(gated, max_batch_tokens=256)  # type: ignore[arg-type]

    async def main() -> None:
        task = asyncio.ensure_future(batcher.embed(texts))
        assert await asyncio.to_thread(gated.entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert batcher.pending_tokens == 0  # what had not run is unqueued at once
        gated.gate.set()

    try:
        asyncio.run(main())
        vecs, _ = batcher.embed_sync(["after"], timeout=60)
    finally:
        batcher.close()
    assert gated.batch_sizes == [1, 1]  # the pass in flight, then "after"
    np.testing.assert_allclose(vecs[0], expected_rows(pipeline, ["after"])[0], atol=1e-5)


def test_a_cancel_while_tokenizing_off_the_loop_drops_the_request(pipeline: EmbeddingPipeline) -> None:
    """A large request is tokenized in a helper thread; a cancel that lands
    then used to leave the job queued, embedded for nobody."""
    prepared, release = threading.Event(), threading.Event()

    class SlowPrepare(GatedPipeline):
        def prepare(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
            if len(texts[0]) > 1000:  # the large request, in the helper thread
                prepared.set()
                assert release.wait(30)
            return self.inner.prepare(texts, *args, **kwargs)

    slow = SlowPrepare(pipeline)
    batcher = EmbeddingBatcher(slow)  # type: ignore[arg-type]
    submitted = threading.Event()
    submit = batcher._submit

    def recording(texts: list[str], *args: Any) -> Any:
        try:
            return submit(texts, *args)
        finally:
            if len(texts[0]) > 1000:
                submitted.set()

    batcher._submit = recording  # type: ignore[method-assign, assignment]

    async def main() -> None:
        first = asyncio.ensure_future(batcher.embed(["first"]))
        assert await asyncio.to_thread(slow.entered.wait, 30)  # the worker waits in a pass
        task = asyncio.ensure_future(batcher.embed(["beta " * 4000], truncate=True))  # off the loop
        assert await asyncio.to_thread(prepared.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert await asyncio.to_thread(submitted.wait, 30)  # the thread has queued the job
        for _ in range(100):  # the loop runs the thread's done callback
            await asyncio.sleep(0.01)
            if not batcher._queue:
                break
        assert not batcher._queue and batcher.pending_tokens == 0
        slow.gate.set()
        await first

    try:
        asyncio.run(main())
        batcher.embed_sync(["after"], timeout=60)
    finally:
        batcher.close()
    assert slow.batch_sizes == [1, 1]  # "first" and "after" only


def test_a_request_over_the_pending_limit_is_invalid(pipeline: EmbeddingPipeline) -> None:
    """An idle batcher took a request of any size, so one call could queue
    many times the limit (838k inputs fit in a 16 MB message); now a call
    over the limit is refused, before tokenizing when its input count alone is."""
    gated = GatedPipeline(pipeline)
    gated.gate.set()
    with EmbeddingBatcher(gated, max_pending_tokens=256) as batcher:  # type: ignore[arg-type]
        for inputs in (["hello world"] * 100, [""] * 300):  # 400 tokens; 300 inputs
            with pytest.raises(InvalidRequest) as err:
                batcher.submit(inputs)
            assert err.value.field == "inputs" and "at most 256" in err.value.description
        vecs, tokens = batcher.embed_sync(["hello world"] * 64)  # 256 tokens: just fits
        assert vecs.shape == (64, 384) and tokens == 256
    assert gated.batch_sizes == [64]


def test_close_without_drain_fails_queued_requests(pipeline: EmbeddingPipeline) -> None:
    gated = GatedPipeline(pipeline)
    batcher = EmbeddingBatcher(gated)  # type: ignore[arg-type]
    running = batcher.submit(["running"])
    assert gated.entered.wait(30)
    queued: Future = batcher.submit(["queued"])
    closer = threading.Thread(target=batcher.close, kwargs={"drain": False})
    closer.start()
    with pytest.raises(BatcherClosed):
        queued.result(30)
    gated.gate.set()
    closer.join(30)
    assert running.result(30)[0].shape == (1, 384)  # the pass in flight completes
    with pytest.raises(BatcherClosed):
        batcher.submit(["late"])


def test_pending_token_limit(pipeline: EmbeddingPipeline) -> None:
    gated = GatedPipeline(pipeline)
    with EmbeddingBatcher(gated, max_pending_tokens=256) as batcher:  # type: ignore[arg-type]
        first = batcher.submit(["in flight"])
        assert gated.entered.wait(30)
        queued = batcher.submit([long_text(pipeline, 200)])
        with pytest.raises(BatcherOverloaded):
            batcher.submit([long_text(pipeline, 100)])
        gated.gate.set()
        first.result(60)
        queued.result(60)


class PoisonedPipeline(GatedPipeline):
    """A gated pipeline whose forward pass fails on any batch holding `poison`."""

    def __init__(self, inner: EmbeddingPipeline, poison: int):
        super().__init__(inner)
        self.poison = poison

    def forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        if any(self.poison in s for s in sequences):
            self.entered.set()
            raise RuntimeError("injected fault in the embedding pass")
        return super().forward(sequences)


def test_a_request_that_breaks_a_merged_pass_fails_alone(pipeline: EmbeddingPipeline) -> None:
    texts = ["a cat", "a kitten", "stock prices rose"]
    expected = expected_rows(pipeline, texts)
    poison_text = "xylophone zeppelins"
    others = {t for text in [*texts, "hold the worker", "next request"]
              for t in pipeline.tokenizer.encode([text])[0]}
    poison = next(t for t in pipeline.tokenizer.encode([poison_text])[0] if t not in others)
    gated = PoisonedPipeline(pipeline, poison)
    with EmbeddingBatcher(gated) as batcher:  # type: ignore[arg-type]
        first = batcher.submit(["hold the worker"])
        assert gated.entered.wait(30)  # the worker waits inside its first pass
        calls = [batcher.submit([t]) for t in texts[:2]]
        bad = batcher.submit([poison_text])
        calls.append(batcher.submit([texts[2]]))
        gated.gate.set()  # all four queued: they go into one merged pass, which fails
        first.result(60)
        with pytest.raises(RuntimeError, match="injected fault"):
            bad.result(60)
        for call, want in zip(calls, expected, strict=True):
            np.testing.assert_allclose(call.result(60)[0][0], want, atol=1e-5)
        after, _ = batcher.embed_sync(["next request"], timeout=60)
        assert after.shape == (1, 384)
        assert batcher.pending_tokens == 0
