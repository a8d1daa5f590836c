"""vLLM's gRPC engine protocol (`vllm.grpc.engine.VllmEngine`), as routers such
as SMG and llm-d drive it: its servicer, proto conversions, server info and the
prefix cache's KV events."""
