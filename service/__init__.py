"""stencild's gRPC edge.

`server` assembles the grpc.aio server from: the stencil.v1 API (`api/`),
vLLM's engine protocol (`vllm_protocol/`), operations (`ops/`: metrics, logs,
tracing, health, watchdog, reflection) and security (`security/`: API keys,
TLS), over a core both protocols share (`engine_loop`: the engine thread and
admission; `structured`: constraints compiled off the loop; `errors`;
`interceptors`). `cli/` is the `stencild` command. docs/architecture.md has
the map and the layering tests/test_architecture.py checks.
"""
