"""Warm-up: short requests through a fresh engine, so first calls pay no start-up cost.

Run by whoever built the engine, on the thread that will drive it: the
server's loader thread, or an engine process before it reports ready.
"""

from __future__ import annotations

import gc

from grammar import GrammarSpec

from .engine import EngineCore
from .sampling_params import SamplingParams

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
        matcher = engine.structured.compile(GrammarSpec.choice(GRAMMAR_WARMUP_CHOICES))
    prompts = ["Hello", "Warm-up request with a somewhat longer prompt."]
    for i, text in enumerate(prompts + (["Yes or no?"] if grammar else [])):
        # Fitted to any context the engine takes (2 tokens and up).
        ids = tok.encode(text)[: max(1, engine.max_model_len - 2)]
        new_tokens = min(2, engine.max_model_len - len(ids))
        ctx = engine.requests.make_context(ids, SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
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


def freeze_heap() -> int:
    """Collect once, then keep every object alive now out of the garbage
    collector's reach (`gc.freeze`), as vLLM does after start-up; returns how
    many were frozen. For a process about to serve: a full collection walks
    every tracked object, and a loaded engine's libraries make ~250k of them,
    ~0.2 s on a 2-core box with every thread of the process waiting (each
    stream, the engine's step). Frozen objects are still freed when nothing
    refers to them; only a cycle among them would stay."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Undo `freeze_heap`, for a process about to exit: the interpreter's
    exit collects what is left, and xgrammar's bindings report as leaked
    (on stderr) what it could not."""
    gc.unfreeze()
