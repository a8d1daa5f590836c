"""Loading the served models: the generation engine, the embedding model, warm-up.

Runs on a loader thread (never the event loop). Model tensors are built and
warmed up on one device thread: the engine's own, which the embedding model
shares; an embedding-only server gets one dedicated device thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine import EngineCore, SamplingParams

from .embeddings import EmbeddingOptions, EmbeddingRuntime

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
        ctx = engine.make_context(ids, SamplingParams(temperature=0.0, max_new_tokens=2),
                                  request_id=f"stencild-warmup-{i}",
                                  matcher=matcher if i == len(prompts) else None)
        engine.add_request(ctx)
    while engine.has_work():
        engine.step()


@dataclass
class LoadedModels:
    """What a server serves: either model may be absent (not both)."""

    engine: EngineCore | None
    embeddings: EmbeddingRuntime | None

    def close(self) -> None:
        # The embedding runtime may use the engine's device thread: close it first.
        if self.embeddings is not None:
            self.embeddings.close()
        if self.engine is not None:
            self.engine.close()


def load_models(engine_factory: Callable[[], EngineCore] | None, embedding: EmbeddingOptions | None,
                warmup: bool = True, warmup_grammar: bool = True,
                engine_alive: Callable[[], bool] | None = None) -> LoadedModels:
    """Build (and warm up) the generation engine, then the embedding model.

    `engine_alive` tells the embedding runtime whether the engine, whose device
    thread it borrows, still runs.
    """
    engine = engine_factory() if engine_factory is not None else None
    try:
        if engine is not None and warmup:
            warm_up(engine, grammar=warmup_grammar)
        runtime = None
        if embedding is not None:
            runtime = EmbeddingRuntime.load(embedding, engine.executor if engine is not None else None,
                                            alive=engine_alive if engine is not None else None,
                                            warmup=warmup)
            log.info("embedding model ready: %s (dimension %d, max %d tokens)", embedding.model_name,
                     runtime.pipeline.dimension, runtime.pipeline.max_length)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    return LoadedModels(engine, runtime)
