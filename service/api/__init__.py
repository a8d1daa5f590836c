"""The stencil.v1 API: the Generation, Embeddings and Speech servicers and the
conversions between their protos and the engine's objects."""
