"""Text embeddings: a BERT-family encoder over unpadded batches, pooling, batching.

`EmbeddingPipeline.embed` runs one request; `EmbeddingBatcher` merges requests
from many concurrent callers into shared forward passes.
"""

from .batcher import BatcherClosed, BatcherOverloaded, EmbeddingBatcher
from .checkpoint import EmbeddingModelSpec, EncoderConfig, default_model_path, load_embedding_spec
from .pipeline import EmbeddingConfig, EmbeddingPipeline, EmbedRequest

__all__ = [
    "BatcherClosed",
    "BatcherOverloaded",
    "EmbedRequest",
    "EmbeddingBatcher",
    "EmbeddingConfig",
    "EmbeddingModelSpec",
    "EmbeddingPipeline",
    "EncoderConfig",
    "default_model_path",
    "load_embedding_spec",
]
