"""Loading the served models: the generation engine, the speech engine, the
embedding model, warm-up.

Runs on a loader thread (never the event loop). Model tensors are built and
warmed up on one device thread: the generation engine's own, which a separate
speech engine and the embedding model share; a server without a generation
model gives the first model it builds a device thread of its own, and so does
one whose generation engine runs in an engine process (service/engine_proc:
that process warms its engine up itself).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine import EngineCore
from engine.executor import StepExecutor
from engine.warmup import GRAMMAR_WARMUP_CHOICES, warm_up, warm_up_speech
from grammar import GrammarSpec
from service.api.embeddings import EmbeddingOptions, EmbeddingRuntime
from service.api.speech import SpeechOptions
from service.engine_proc import RemoteEngine

log = logging.getLogger(__name__)

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
    speech_engine = speech.engine_factory(device_thread(engine))
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


def device_thread(engine: EngineCore | None) -> StepExecutor | None:
    """The device thread other models share: an in-process engine's (None for
    none, or for an engine in a process of its own)."""
    if engine is None or isinstance(engine, RemoteEngine):
        return None
    return engine.executor


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
        if isinstance(engine, RemoteEngine):
            if warmup and warmup_grammar:  # the process warmed its own compiler; this one checks requests
                engine.structured.compile(GrammarSpec.choice(GRAMMAR_WARMUP_CHOICES))
        elif engine is not None and warmup:
            warm_up(engine, grammar=warmup_grammar)
        if speech is not None:
            speech_engine = load_speech(engine, speech, warmup)
        # The first engine built here owns the device thread the embedding model borrows.
        device = device_thread(engine) or device_thread(speech_engine)
        runtime = None
        if embedding is not None:
            runtime = EmbeddingRuntime.load(embedding, device, alive=engine_alive if device is not None else None,
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
