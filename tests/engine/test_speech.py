"""Speech requests on the engine: streamed audio, scheduling with text, cleanup."""

from __future__ import annotations

import json
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequest
from engine.presets import ensure_preset
from engine.speech import CODES_PER_FRAME, SpeechUnavailable
from engine.speech.codec import DecodeWindow, SpeechCodec

from .reference import hf_greedy  # noqa: F401  (keeps the reference models importable)

# Streaming decodes each chunk with 3 frames of context on both sides; the
# decoder's receptive field is about +-3 frames, so streamed samples equal
# one-shot decoding up to float rounding. Bound: 1e-5 absolute on samples in
# [-1, 1] (-100 dBFS, far below audibility); measured ~7e-7.
STREAM_BOUND = 1e-5


@pytest.fixture
def speech_llm(make_llm):
    def build(codec: str = "tiny-codec", **kwargs) -> LLM:
        return make_llm("demo-speech", speech_codec=str(ensure_preset(codec)), **kwargs)

    return build


def stream(llm: LLM, text: str, **kwargs):
    """Run one speech request, returning (chunks, step index of each chunk, ctx)."""
    eng = llm.engine
    ctx = eng.make_speech_context(text, **kwargs)
    eng.add_request(ctx)
    chunks, steps, step = [], [], 0
    last_step = None
    while eng.has_work():
        for out in eng.step():
            if out.audio is not None:
                chunks.append(out.audio)
                steps.append(step)
            if out.finished:
                last_step = step
        step += 1
    return chunks, steps, last_step, ctx


@pytest.mark.parametrize("codec", ["tiny-codec", "demo-codec"])
def test_streamed_audio_equals_one_shot_decoding(speech_llm, codec):
    llm = speech_llm(codec)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, repetition_penalty=1.1)
    chunks, steps, last_step, ctx = stream(llm, "Streaming speech should be seamless.", params=params,
                                           chunk_frames=3, max_audio_seconds=1.5)
    codes = ctx.speech_codes()
    # 1.5 s holds 17 whole frames of 2048 samples (1.45 s; never more than asked),
    # streamed in chunks of 3 frames (the end is
    # drained at once when generation stops).
    assert len(codes) == 17 and len(chunks) >= 4
    one_shot = llm.engine.audio.codec.decode_all(codes)
    streamed = np.concatenate(chunks)
    assert streamed.shape == one_shot.shape == (17 * 2048,)
    assert np.abs(streamed - one_shot).max() < STREAM_BOUND
    # The first chunk is ready long before the request ends.
    assert steps[0] < last_step / 2


@pytest.mark.parametrize("codec", ["tiny-codec", "demo-codec"])
def test_windows_decoded_as_one_batch_equal_windows_decoded_alone(codec):
    # A GPU batches windows of one length; each row's noise is indexed from its own start.
    dec = SpeechCodec(ensure_preset(codec), torch.device("cpu"))
    codes = np.random.default_rng(0).integers(0, dec.codebook_size, size=(24, CODES_PER_FRAME))
    windows = [DecodeWindow(codes[s:s + n], s, s + 1, s + n - 1) for s, n in ((0, 8), (9, 8), (4, 5), (15, 8))]
    alone = dec.decode(windows)
    dec.batch_windows = True
    batched = dec.decode(windows)
    assert [len(a) for a in batched] == [len(a) for a in alone] == [6 * dec.samples_per_frame] * 2 + \
        [3 * dec.samples_per_frame] + [6 * dec.samples_per_frame]
    assert max(float(np.abs(a - b).max()) for a, b in zip(alone, batched, strict=True)) < STREAM_BOUND
    assert not np.allclose(alone[0], alone[1])  # other starts: other noise, other audio


def test_the_device_thread_decodes_audio_only_when_a_chunk_is_ready(speech_llm, monkeypatch):
    """Steps that complete no chunk (most of them) make no call on the device
    thread for audio: on CUDA such a call queues behind the next step's launch."""
    llm = speech_llm()
    eng = llm.engine
    drains = []
    drain = eng.audio.drain
    def counted(contexts):  # type: ignore[no-untyped-def]
        drains.append(drain(contexts))
        return drains[-1]

    monkeypatch.setattr(eng.audio, "drain", counted)
    chunks, steps, last_step, _ = stream(llm, "Only ready chunks cost a trip.", chunk_frames=2,
                                         max_audio_seconds=1.0)
    assert len(chunks) >= 3 and last_step > 3 * len(chunks)
    # One call per step that made audio, each with audio to give.
    assert len(drains) == len(set(steps)) and all(drains)


def test_a_decode_failing_mid_drain_loses_no_audio(speech_llm, monkeypatch):
    """A drain decodes several chunks; when one fails after others were decoded,
    the request by request retry decodes those frames again: the stream has no
    gap (it used to skip the frames decoded before the failure)."""
    llm = speech_llm()
    audio = llm.engine.audio
    decode, drain = audio.codec.decode, audio.drain
    calls = {"in_drain": 0, "failed": False}

    def flaky_decode(windows):  # type: ignore[no-untyped-def]
        calls["in_drain"] += 1
        if calls["in_drain"] == 2 and not calls["failed"]:
            calls["failed"] = True
            raise RuntimeError("injected decode failure")
        return decode(windows)

    def counted_drain(contexts):  # type: ignore[no-untyped-def]
        calls["in_drain"] = 0
        return drain(contexts)

    monkeypatch.setattr(audio.codec, "decode", flaky_decode)
    monkeypatch.setattr(audio, "drain", counted_drain)
    chunks, _, _, ctx = stream(llm, "A gap in the audio.", params=SamplingParams(temperature=0.7, seed=3),
                               chunk_frames=1, max_audio_seconds=1.0)
    assert calls["failed"]
    assert ctx.status.finish_reason == "length"
    streamed = np.concatenate(chunks)
    assert streamed.shape == (len(ctx.speech_codes()) * 2048,)
    one_shot = audio.codec.decode_all(ctx.speech_codes())
    assert np.abs(streamed - one_shot).max() < STREAM_BOUND


def test_tokens_follow_the_codebook_layout(speech_llm):
    llm = speech_llm()
    out = llm.synthesize("Every position in its own codebook.", max_audio_seconds=1.0)[0]
    layout = llm.engine.speech_layout
    assert len(out.token_ids) % CODES_PER_FRAME == 0
    for i, tok in enumerate(out.token_ids):
        lo, hi = layout.token_range(i)
        assert lo <= tok < hi
    assert out.finish_reason == "length" and len(out.audio) == len(out.token_ids) // 7 * 2048


def test_speech_and_text_share_the_engine(speech_llm):
    """Text requests batched with speech requests on one KV cache get the same
    greedy tokens as when they run alone."""
    llm = speech_llm()
    eng = llm.engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 8000, size=n).tolist() for n in (5, 40, 17)]
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, greedy)]
    ids = []
    for text in ("one voice", "a second, longer voice line"):
        ctx = eng.make_speech_context(text, max_audio_seconds=1.0)
        eng.add_request(ctx)
        ids.append(ctx.request_id)
    mixed = llm.generate(prompts, greedy)
    assert [o.token_ids for o in mixed] == alone
    while eng.has_work():
        eng.step()


def test_cancelling_speech_frees_pages(speech_llm):
    llm = speech_llm()
    eng = llm.engine
    ctx = eng.make_speech_context("cancel me soon", max_audio_seconds=5.0)
    eng.add_request(ctx)
    for _ in range(10):
        eng.step()
    assert eng.allocator.num_used > 0
    eng.abort(ctx.request_id)
    finals = [o for _ in range(3) for o in eng.step() if o.finished]
    assert finals and finals[0].finish_reason == "cancelled" and finals[0].audio is None
    while eng.has_work():
        eng.step()
    assert eng.allocator.num_used == 0


def test_preempted_speech_gives_the_same_audio(speech_llm, make_llm):
    per_page = 2 * 6 * 16 * 2 * 48 * 4  # kv, layers, page, kv heads, head dim, fp32
    small = speech_llm(kv_cache_gib=14 * per_page / 2**30, max_model_len=200)
    big = speech_llm()
    params = SamplingParams(temperature=0.7, seed=1)  # a seed whose lines outgrow the small cache
    texts = ["first line", "second line here", "third"]
    a = small.synthesize(texts, params, max_audio_seconds=1.0)
    assert small.engine.scheduler.num_preemptions > 0
    b = big.synthesize(texts, params, max_audio_seconds=1.0)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert np.abs(x.audio - y.audio).max() < STREAM_BOUND


def test_a_chunk_is_ready_once_its_frames_and_their_look_ahead_are_there(speech_llm):
    llm = speech_llm()
    eng = llm.engine
    ctx = eng.make_speech_context("ready when whole", chunk_frames=2)
    codes = np.arange(5 * CODES_PER_FRAME) % eng.speech_layout.codebook_size
    tokens = eng.speech_layout.codes_to_tokens(codes).tolist()
    for token in tokens[:-1]:
        ctx.update(token)
    assert ctx.next_speech_tokens(lookahead=3) is None  # the fifth frame is not whole
    ctx.update(tokens[-1])
    window = ctx.next_speech_tokens(lookahead=3)  # 2 frames + 3 of look-ahead: no waiting for a sixth
    assert window is not None and (window.keep_start, window.keep_end) == (0, 2)


def test_voice_prompt_and_bad_requests(speech_llm, make_llm):
    llm = speech_llm()
    eng = llm.engine
    codes = list(range(14))
    ctx = eng.make_speech_context("clone this voice", audio_prompt_codes=codes,
                                  audio_prompt_transcription="reference words")
    assert eng.speech_layout.codes_to_tokens(np.array(codes)).tolist()[0] in ctx.prompt_tokens.tolist()
    size = eng.speech_layout.codebook_size
    cases: dict[str, dict[str, Any]] = {"input": dict(text=""), "audio_prompt_tokens": dict(text="x", audio_prompt_codes=[1, 2, 3]),
             "chunk_frames": dict(text="x", chunk_frames=0)}
    # Each range's last value is in it, the next one is not.
    eng.make_speech_context("x", chunk_frames=64)
    eng.make_speech_context("x", audio_prompt_codes=[0] * 6 + [size - 1])
    cases |= {"chunk_frames ": dict(text="x", chunk_frames=65),
              "audio_prompt_tokens ": dict(text="x", audio_prompt_codes=[0] * 6 + [size])}
    for field, kwargs in cases.items():
        with pytest.raises(InvalidRequest) as err:
            eng.make_speech_context(**kwargs)
        assert err.value.field == field.strip()
    with pytest.raises(InvalidRequest, match="at most"):
        eng.make_speech_context("x" * 5000)
    text_only = make_llm("tiny-llama")
    with pytest.raises(SpeechUnavailable):
        text_only.engine.make_speech_context("hello")


@pytest.mark.parametrize("change", [{"vq_strides": [8, 4, 2, 1]}, {"codebook_size": 1024}, {"hop": 2},
                                    {"weights": "other shape"}])
def test_a_codec_the_layout_cannot_drive_is_refused_at_load(tmp_path, change):
    """A SNAC with four codebooks (the 32/44 kHz models), one with fewer codes
    a codebook than the model writes, or a config SNAC does not take: each used
    to load and then fail every request inside the decoder (or, for the first
    two, would index out of range on a GPU). So do weights of another shape."""
    from engine.models.config import CheckpointError
    from engine.speech.codec import SNAC_24KHZ, write_random_codec

    small = {**SNAC_24KHZ, "decoder_dim": 64, "encoder_dim": 16}
    if "hop" in change or "weights" in change:
        codec = write_random_codec(tmp_path / "codec", config=small)
        config = {**small, "decoder_dim": 32} if "weights" in change else {**small, **change}
        (codec / "config.json").write_text(json.dumps(config))
    else:
        codec = write_random_codec(tmp_path / "codec", config={**small, **change})
    with pytest.raises(CheckpointError):
        LLM(ensure_preset("demo-speech"), speech_codec=str(codec))


@pytest.mark.parametrize("change", [{"end_of_speech": 10**7}, {"start_of_ai": "audio"}, {"voice": 1}])
def test_a_speech_layout_with_markers_outside_the_text_tokens_is_refused(tmp_path, change):
    """A marker outside the vocabulary or among the audio tokens, and a key
    the layout does not have, are checkpoint errors, not a crash mid-request."""
    from engine.models.config import CheckpointError
    from engine.speech.layout import SPEECH_CONFIG

    model = tmp_path / "model"
    shutil.copytree(ensure_preset("demo-speech"), model)
    layout = json.loads((model / SPEECH_CONFIG).read_text())
    if change.get("start_of_ai") == "audio":
        change = {"start_of_ai": layout["audio_token_offset"] + 3}
    (model / SPEECH_CONFIG).write_text(json.dumps({**layout, **change}))
    with pytest.raises(CheckpointError, match="not a speech model"):
        LLM(model, speech_codec=str(ensure_preset("tiny-codec")))


def test_max_new_tokens_only_shortens_the_audio(speech_llm):
    """The offline API's max_new_tokens bounds the audio inside
    max_audio_seconds (it used to replace it, past the 300 s cap too), and one
    under a frame is refused rather than raised to a frame."""
    eng = speech_llm().engine
    # 0.5 s holds 5 whole frames of 2048 samples at 24 kHz.
    ctx = eng.make_speech_context("bounded", SamplingParams(max_new_tokens=7 * 40), max_audio_seconds=0.5)
    assert ctx.sampling_params.max_new_tokens == 5 * 7
    ctx = eng.make_speech_context("bounded", SamplingParams(max_new_tokens=7 * 2 + 3), max_audio_seconds=0.5)
    assert ctx.sampling_params.max_new_tokens == 2 * 7
    with pytest.raises(InvalidRequest) as err:
        eng.make_speech_context("tiny", SamplingParams(max_new_tokens=3))
    assert err.value.field == "max_new_tokens"


def test_a_voice_prompt_may_be_an_array_of_frames(speech_llm):
    """`ctx.speech_codes()` ([F, 7]) goes back in as a voice prompt (an array's
    truth value used to raise)."""
    eng = speech_llm().engine
    codes = np.arange(14).reshape(2, 7)
    from_array = eng.make_speech_context("clone", audio_prompt_codes=codes)
    from_list = eng.make_speech_context("clone", audio_prompt_codes=codes.reshape(-1).tolist())
    assert from_array.prompt_tokens.tolist() == from_list.prompt_tokens.tolist()


def test_two_engines_share_one_device_thread(make_llm):
    text = make_llm("tiny-llama")
    speech = make_llm("demo-speech", speech_codec=str(ensure_preset("tiny-codec")), executor=text.engine.executor)
    assert speech.engine.executor is text.engine.executor
    out = speech.synthesize("shared thread", max_audio_seconds=0.5)[0]
    assert len(out.audio) > 0
    assert len(text.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4))[0].token_ids) == 4
    speech.close()  # does not stop the shared thread
    assert len(text.generate([[5, 6]], SamplingParams(temperature=0, max_new_tokens=2))[0].token_ids) == 2


def test_prompt_overflow_names_the_voice_prompt(speech_llm):
    llm = speech_llm(max_model_len=120)
    eng = llm.engine
    with pytest.raises(InvalidRequest) as err:
        eng.make_speech_context("short text", audio_prompt_codes=list(range(7)) * 15)
    assert err.value.field == "audio_prompt_tokens"
    # One frame of codes fits; its transcription does not (it named the codes).
    with pytest.raises(InvalidRequest) as err:
        eng.make_speech_context("short text", audio_prompt_codes=list(range(7)),
                                audio_prompt_transcription="word " * 150)
    assert err.value.field == "audio_prompt_transcription"
    with pytest.raises(InvalidRequest) as err:
        eng.make_speech_context("word " * 150)
    assert err.value.field == "input"
    with pytest.raises(InvalidRequest) as err:
        eng.make_speech_context("hi", SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.field == "logit_bias"


def test_executor_refuses_work_after_close():
    import torch

    from engine.executor import StepExecutor

    ex = StepExecutor(torch.device("cpu"))
    assert ex.call(lambda: 7) == 7
    ex.close()
    with pytest.raises(RuntimeError, match="stopped"):
        ex.submit(lambda: 1).result(timeout=5)
    ex.close()  # twice is fine


def test_a_bad_text_in_a_batch_leaves_nothing_queued(speech_llm) -> None:
    # The texts were added one by one: the good ones before the bad one stayed
    # queued, and ran unseen inside the next call.
    llm = speech_llm()
    with pytest.raises(InvalidRequest):
        llm.synthesize(["fine", ""], max_audio_seconds=0.5)
    assert not llm.engine.has_work() and llm.engine.allocator.num_used == 0
    # One request_id for two texts: the second was refused as a duplicate, the first left queued.
    with pytest.raises(InvalidRequest, match="request_id"):
        llm.synthesize(["one", "two"], max_audio_seconds=0.5, request_id="x")
    assert not llm.engine.has_work() and llm.engine.allocator.num_used == 0
    assert llm.synthesize("three", max_audio_seconds=0.5, request_id="x")[0].request_id == "x"


def test_a_failed_speech_request_is_raised_as_generate_does(speech_llm) -> None:
    # It came back silently: finish_reason "error", no audio, no message.
    from engine import RequestFailed

    llm = speech_llm()

    def broken_drain(contexts):  # type: ignore[no-untyped-def]
        raise RuntimeError("codec fault")

    llm.engine.audio.drain = broken_drain  # type: ignore[method-assign,union-attr]
    with pytest.raises(RequestFailed) as failed:
        llm.synthesize(["Hello there."], max_audio_seconds=0.5)
    [out] = failed.value.outputs
    assert out.finish_reason == "error" and out.error and "audio" in out.error
