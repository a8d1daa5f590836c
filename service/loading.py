"""Loading the served models: the generation engine, the speech engine, the
embedding model, warm-up.

Runs on a loader thread (never the event loop). Model tensors are built and
warmed up on one device thread: the generation engine's own, which a separate
speech engine and the embedding model share; a server without a generation
model gives the first model it builds a device thread of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine import EngineCore, SamplingParams
from service.api.embeddings import EmbeddingOptions, EmbeddingRuntime
from service.api.speech import SpeechOptions

log = logging.getLogger(__name__)

GRAMMAR_WARMUP_CHOICES = ("yes", "no")


def warm_up(engine: EngineCore, grammar: bool = False) -> None:
    """Run short requests through the engine so first calls pay no start-up cost.

    With `grammar`, also start the grammar compiler's worker process (1-3 s)
    and run one constrained request, so the first constrained call does not
    wait for either.
    """
    tok = engine.tokenizer
    matcher = None
    if grammar:
        from grammar import GrammarSpec

        matcher = engine.structured.compile(GrammarSpec.choice(GRAMMAR_WARMUP_CHOICES))
    prompts = ["Hello", "Warm-up request with a somewhat longer prompt."]
    for i, text in enumerate(prompts + (["Yes or no?"] if grammar else [])):
        ids = tok.encode(text)[: engine.max_model_len - 3]
        ctx = engine.requests.make_context(ids, SamplingParams(temperature=0.0, max_new_tokens=2),
                                  request_id=f"stencild-warmup-{i}",
                                  matcher=matcher if i == len(prompts) else None)
        engine.add_request(ctx)
    while engine.has_work():
        engine.step()


def warm_up_speech(engine: EngineCore) -> None:
    """Speak a few frames, in one-frame chunks, so the first Synthesize pays no
    start-up cost in the speech LM or the audio decoder."""
    ctx = engine.requests.make_speech_context("Warm-up.", SamplingParams(temperature=0.0),
                                     request_id="stencild-warmup-speech", chunk_frames=1,
                                     max_audio_seconds=0.5)
    engine.add_request(ctx)
    while engine.has_work():
        engine.step()


@dataclass
class LoadedModels:
    """What a server serves; any model may be absent (not all).

    `speech` is a separate speech engine; None when there is none or when the
    generation engine serves speech itself.
    """

    engine: EngineCore | None
    embeddings: EmbeddingRuntime | None
    speech: EngineCore | None = None

    def close(self) -> None:
        # The others may use the generation engine's device thread: close them first.
        if self.embeddings is not None:
            self.embeddings.close()
        if self.speech is not None:
            self.speech.close()
        if self.engine is not None:
            self.engine.close()


def load_speech(engine: EngineCore | None, speech: SpeechOptions, warmup: bool) -> EngineCore | None:
    """Build (and warm up) a separate speech engine on `engine`'s device thread,
    or check that `engine` serves speech itself (shared). Returns the separate one."""
    if speech.engine_factory is None:
        if engine is None or not engine.serves_speech:
            raise ValueError("the generation model serves no speech (it needs a speech codec)")
        if warmup:
            warm_up_speech(engine)
        return None
    speech_engine = speech.engine_factory(engine.executor if engine is not None else None)
    try:
        if not speech_engine.serves_speech:
            raise ValueError(f"{speech.model_name} serves no speech (it needs a speech codec)")
        if warmup:
            warm_up_speech(speech_engine)
    except BaseException:
        speech_engine.close()
        raise
    log.info("speech model ready: %s (%d Hz)", speech.model_name,
             speech_engine.audio.decoder_sample_rate if speech_engine.audio else 0)
    return speech_engine


def load_models(engine_factory: Callable[[], EngineCore] | None, embedding: EmbeddingOptions | None,
                warmup: bool = True, warmup_grammar: bool = True,
                engine_alive: Callable[[], bool] | None = None,
                speech: SpeechOptions | None = None) -> LoadedModels:
    """Build (and warm up) the generation engine, the speech engine, then the embedding model.

    `engine_alive` tells the embedding runtime whether the engine, whose device
    thread it borrows, still runs.
    """
    engine = engine_factory() if engine_factory is not None else None
    speech_engine = None
    try:
        if engine is not None and warmup:
            warm_up(engine, grammar=warmup_grammar)
        if speech is not None:
            speech_engine = load_speech(engine, speech, warmup)
        # The first engine built owns the device thread the embedding model borrows.
        owner = engine or speech_engine
        runtime = None
        if embedding is not None:
            runtime = EmbeddingRuntime.load(embedding, owner.executor if owner is not None else None,
                                            alive=engine_alive if owner is not None else None,
                                            warmup=warmup)
            log.info("embedding model ready: %s (dimension %d, max %d tokens)", embedding.model_name,
                     runtime.pipeline.dimension, runtime.pipeline.max_length)
    except BaseException:
        if speech_engine is not None:
            speech_engine.close()
        if engine is not None:
            engine.close()
        raise
    return LoadedModels(engine, runtime, speech_engine)
