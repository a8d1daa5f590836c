"""Server assembly: the grpc.aio server, model loading, health, reflection, drain.

Lifecycle: `start()` binds the port and serves health (NOT_SERVING) and
reflection at once, then loads and warms up the models off the event loop
(service/loading.py) and turns SERVING: the generation model
(stencil.v1.Generation), the speech model (stencil.v1.Speech) and the
embedding model (stencil.v1.Embeddings), any of which may be absent.
`drain()` turns NOT_SERVING, refuses new calls with UNAVAILABLE, lets
Generate and Synthesize streams and Embed calls in flight finish for up to the
grace period, then aborts the rest (their streams end UNAVAILABLE) and stops.

An engine thread that dies (a failure no single request explains: requests
that break a step are ended one by one, see EngineCore.step) takes the whole
server down: everything turns NOT_SERVING at once, its calls end INTERNAL, the
others are cut short, new calls are refused (UNAVAILABLE) for FAILURE_HOLD_S
before the port closes, and `serve` returns EXIT_ENGINE_FAILED so the process
exits non-zero and its supervisor (Kubernetes, systemd) starts a fresh one.
The engine is not restarted in-process: whatever broke it (the device, the KV
cache, a native library) cannot be trusted, and a restart loop inside one
process would hide the fault from the orchestrator that can fix it. A
watchdog (service/ops/watchdog.py) reports an engine that hangs without failing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine import EngineCore
from engine.warmup import freeze_heap, thaw_heap
from service.address import host_port
from service.api.embeddings import SERVICE_NAME as EMBEDDINGS_SERVICE
from service.api.embeddings import EmbeddingOptions, EmbeddingSlot, EmbeddingsServicer
from service.api.generation import SERVICE_NAME, GenerationServicer, ServingState
from service.api.speech import SERVICE_NAME as SPEECH_SERVICE
from service.api.speech import SpeechOptions, SpeechServicer, SpeechSlot
from service.engine_loop import AdmissionLimits, EngineLoop
from service.engine_proc import ProcessLink, RemoteEngine
from service.gen.stencil.v1 import embed_pb2_grpc, speech_pb2_grpc
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.gen.vllm import vllm_engine_pb2_grpc
from service.interceptors import UnparsableRequests
from service.loading import LoadedModels, load_models
from service.ops.health import OVERALL_HEALTH, HealthState
from service.ops.reflection import enable_reflection
from service.ops.telemetry import Telemetry, TelemetryConfig
from service.ops.watchdog import Watchdog, Watched
from service.security.auth import ApiKey, ApiKeyAuth, load_keys
from service.security.tls import ServerTLS, TLSConfig
from service.structured import ConstraintCompiler
from service.vllm_protocol.kv_events import KvEventHub
from service.vllm_protocol.servicer import ROUTER_METHODS, VllmEngineServicer
from service.vllm_protocol.servicer import SERVICE_NAME as VLLM_SERVICE

log = logging.getLogger(__name__)

SERVER_VERSION = "0.1.0"
HEALTH_SERVICE = "grpc.health.v1.Health"
SHUTDOWN_MESSAGE = "the server is shutting down"
# Process exit codes of `serve`: a model that could not load, an engine that died.
EXIT_LOAD_FAILED = 1
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE
# After an engine failure the port stays open this long, refusing new calls
# with UNAVAILABLE, before the server stops: a client that sends its next call
# as the failure happens gets a clear, retryable status instead of a call that
# gRPC cancels while the server closes (CANCELLED), or a refused connection.
FAILURE_HOLD_S = 1.0
# grpc channel arguments are C ints: a larger value fails deep in grpc.
GRPC_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class KeepalivePolicy:
    """How the server treats pings and long-lived connections (seconds).

    grpc's defaults refuse a client ping more often than every 5 minutes
    without data: a client (or mesh sidecar) pinging every 10 s on an idle
    stream got a too-many-pings GOAWAY after about 40 s, which grpc-js reports
    as RESOURCE_EXHAUSTED. Here client pings are welcome down to
    `min_ping_interval_s`; the server pings idle connections every
    `ping_interval_s` (dropping one that does not answer in `ping_timeout_s`);
    and a connection older than `max_connection_age_s` is asked to go away
    (GOAWAY), its calls given `max_connection_age_grace_s` to finish, so that
    clients reconnect and a load balancer can spread them again (0: never).
    """

    min_ping_interval_s: float = 5.0
    ping_interval_s: float = 60.0
    ping_timeout_s: float = 20.0
    max_connection_age_s: float = 1800.0
    max_connection_age_grace_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("min_ping_interval_s", "ping_interval_s", "ping_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not (self.max_connection_age_s >= 0 and self.max_connection_age_grace_s >= 0):
            raise ValueError("max_connection_age_s and its grace must be >= 0")
        longest = GRPC_INT_MAX / 1000
        for name in ("min_ping_interval_s", "ping_interval_s", "ping_timeout_s", "max_connection_age_s",
                     "max_connection_age_grace_s"):
            if getattr(self, name) > longest:
                raise ValueError(f"{name} must be at most {longest:.0f} s (grpc counts milliseconds "
                                 "in a C int)")

    def options(self) -> list[tuple[str, int]]:
        """grpc server channel arguments."""
        def ms(seconds: float) -> int:  # rounded up: 0.0001 s is not 0 (which means off or never)
            return math.ceil(seconds * 1000)

        options = [
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.keepalive_time_ms", ms(self.ping_interval_s)),
            ("grpc.keepalive_timeout_ms", ms(self.ping_timeout_s)),
            # The server's own keepalive pings carry no data: allow them all.
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if self.max_connection_age_s:
            options += [("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                        ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s))]
        return options


@dataclass(frozen=True)
class ServerConfig:
    """Network and lifecycle settings (the engine's are in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    grace_period_s: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    keepalive: KeepalivePolicy = field(default_factory=KeepalivePolicy)
    warmup: bool = True
    # Start the grammar compiler's worker during warm-up (else on first use).
    warmup_grammar: bool = True
    # Seconds an engine with work may go without completing a step before its
    # services report NOT_SERVING (0: no watchdog).
    watchdog_timeout_s: float = 60.0
    # Validate finished JSON outputs against the full schema (service/api/schema_check.py).
    validate_output: bool = True
    resample: bool = True  # Constraint.resample's default
    # TLS on the main port (None: plaintext).
    tls: TLSConfig | None = None
    # A second, plaintext port serving only grpc.health.v1, for probes that
    # cannot speak TLS (kubelet's gRPC probes); 0: none.
    health_port: int = 0
    health_host: str = "127.0.0.1"
    # With keys, every RPC but health (and reflection, if public) needs one (see auth.py).
    api_keys: tuple[ApiKey, ...] = ()
    # The file api_keys were read from: SIGHUP reads it again (None: the keys are fixed).
    api_key_file: Path | None = None
    public_reflection: bool = False
    # Metrics endpoint and trace export (service/ops/telemetry.py); none by default.
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    # Also serve vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine), so
    # routers that drive vLLM fleets (SMG, llm-d) can route to this server.
    vllm_protocol: bool = True
    # Messages a second all Generate streams may send together; past it each
    # stream's tokens go out in fewer messages (service/engine_loop.py). 0: one
    # message per engine step per stream.
    stream_messages_per_s: float = 4000.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.grace_period_s < math.inf:
            raise ValueError("grace_period_s must be >= 0 and finite")
        if not self.stream_messages_per_s >= 0:
            raise ValueError("stream_messages_per_s must be >= 0")
        if not 1024 <= self.max_message_bytes <= GRPC_INT_MAX:
            raise ValueError(f"max_message_bytes must be in [1024, {GRPC_INT_MAX}]")
        if not self.watchdog_timeout_s >= 0:
            raise ValueError("watchdog_timeout_s must be >= 0 (0 turns the watchdog off)")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in [0, 65535], got {self.health_port}")


class StencilServer:
    """The gRPC server around a generation engine, a speech model and/or an embedding model.

    `engine_factory` None serves no generation model; `embedding` None serves
    no embedding model (Embed answers FAILED_PRECONDITION); `speech` None
    serves no speech model (Synthesize answers FAILED_PRECONDITION). Use from
    a running event loop.
    """

    def __init__(self, engine_factory: Callable[[], EngineCore] | None, model_name: str,
                 config: ServerConfig | None = None, embedding: EmbeddingOptions | None = None,
                 speech: SpeechOptions | None = None):
        if engine_factory is None and embedding is None and speech is None:
            raise ValueError("a server needs a generation, speech or embedding model")
        if speech is not None and speech.shared and engine_factory is None:
            raise ValueError("a shared speech model needs the generation engine that serves it")
        self.config = config or ServerConfig()
        self._engine_factory = engine_factory
        self.state = ServingState(model_name, SERVER_VERSION, serves_generation=engine_factory is not None,
                                  max_message_bytes=self.config.max_message_bytes)
        self.state.validate_output = self.config.validate_output
        self.embedding = EmbeddingSlot(embedding)
        self.speech = SpeechSlot(speech)
        self.health = HealthState([SERVICE_NAME, EMBEDDINGS_SERVICE, SPEECH_SERVICE]
                                  + ([VLLM_SERVICE] if self.config.vllm_protocol else []))
        self.kv_events = KvEventHub()
        self.telemetry = Telemetry(self.config.telemetry)
        self.telemetry.embedding_model = embedding.model_name if embedding is not None else ""
        self.models: LoadedModels | None = None
        self.port: int | None = None
        self.load_error: BaseException | None = None
        # Why an engine died (the server then shuts down; see the module docstring).
        self.engine_failure: BaseException | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self._tls = ServerTLS(self.config.tls) if self.config.tls is not None else None
        self._auth: ApiKeyAuth | None = None  # with API keys, from start()
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._force = asyncio.Event()
        self._draining: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None  # polls until the server stops

    @property
    def engine_loop(self) -> EngineLoop | None:
        return self.state.engine_loop

    async def start(self) -> int:
        """Bind and serve (NOT_SERVING); load the model in the background. Returns the port."""
        max_bytes = self.config.max_message_bytes
        # An interceptor earlier in the list wraps the handlers of the later
        # ones: every call is counted and logged (refused ones too), then the
        # key is checked, then the request parsed.
        interceptors: list[grpc.aio.ServerInterceptor] = [self.telemetry.interceptor, UnparsableRequests()]
        if self.config.api_keys:
            self._auth = ApiKeyAuth(list(self.config.api_keys), self.config.public_reflection, ROUTER_METHODS)
            interceptors.insert(1, self._auth)
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            # Never share a port with another server by accident.
            ("grpc.so_reuseport", 0),
            *self.config.keepalive.options(),
        ])
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.state), server)
        embed_pb2_grpc.add_EmbeddingsServicer_to_server(EmbeddingsServicer(self.state, self.embedding),
                                                        server)
        speech_pb2_grpc.add_SpeechServicer_to_server(SpeechServicer(self.state, self.speech), server)
        services = [SERVICE_NAME, EMBEDDINGS_SERVICE, SPEECH_SERVICE, HEALTH_SERVICE]
        if self.config.vllm_protocol:
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
                VllmEngineServicer(self.state, self.embedding, self.kv_events, self.health), server)
            services.append(VLLM_SERVICE)
        self.health.add_to_server(server)
        await self.health.not_serving()
        enable_reflection(services, server)
        port = _bind(server, self.config.host, self.config.port,
                     self._tls.credentials if self._tls is not None else None)
        await server.start()
        try:
            await self._start_side_ports()
        except OSError:
            # Nothing may keep listening after a failed start: the caller
            # gets the error and has no server to stop.
            await server.stop(None)
            if self._health_server is not None:
                await self._health_server.stop(None)
                self._health_server = None
            raise
        self._server, self.port = server, port
        self._spawn(self._load())
        return port

    async def _start_side_ports(self) -> None:
        """The plaintext health port and the metrics endpoint, if asked for."""
        if self.config.health_port:
            health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            self.health.add_to_server(health_server)
            self.health_port = _bind(health_server, self.config.health_host, self.config.health_port, None)
            await health_server.start()
            self._health_server = health_server
        try:
            self.telemetry.start()
        except OSError as exc:
            address = host_port(self.config.telemetry.metrics_host, self.config.telemetry.metrics_port or 0)
            raise OSError(f"cannot serve metrics on {address}: {exc}") from None

    def reload_tls(self) -> bool:
        """Re-read the TLS files (SIGHUP): new connections use them, open ones carry on."""
        return self._tls.reload() if self._tls is not None else False

    def reload_keys(self) -> bool:
        """Re-read the API key file (SIGHUP): new calls are checked against
        its keys, calls in flight carry on. False, and the current keys kept,
        if there is no file or it holds no usable key."""
        path = self.config.api_key_file
        if self._auth is None or path is None:
            return False
        try:
            keys = load_keys(path, None)
        except (OSError, ValueError) as err:
            log.error("API key reload failed, keeping the current keys: %s", err)
            return False
        self._auth.replace_keys(keys)
        log.info("API keys reloaded from %s: %d keys", path, len(keys))
        return True

    def reload(self) -> None:
        """SIGHUP: read again what can be read again (TLS files, the API key file)."""
        reloadable = self._tls is not None or (self._auth is not None and self.config.api_key_file is not None)
        if not reloadable:
            log.info("SIGHUP: nothing to reload (no TLS, no API key file); SIGTERM drains and stops")
            return
        self.reload_tls()
        self.reload_keys()

    def _spawn(self, coro) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _build_models(self) -> LoadedModels:
        cfg = self.config
        return load_models(self._engine_factory, self.embedding.options, warmup=cfg.warmup,
                           warmup_grammar=cfg.warmup_grammar, engine_alive=self._engine_alive,
                           speech=self.speech.options)

    def _engine_alive(self) -> bool:
        """Whether the engine that owns the device thread (the first built) still runs."""
        loops = self.state.engine_loops
        return not loops or loops[0].alive

    async def _load(self) -> None:
        # A daemon thread, not the default executor: a shutdown during loading
        # must not wait for the model to finish loading.
        done: concurrent.futures.Future[LoadedModels] = concurrent.futures.Future()

        def build() -> None:
            # Marked running first: a stop while loading then cannot cancel it
            # under the answer (the awaiting task is what gets cancelled).
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(self._build_models())
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=build, name="stencild-load", daemon=True).start()
        try:
            models = await asyncio.wrap_future(done)
        except Exception as exc:
            # Bad checkpoints and options are user errors: no traceback for those.
            log.error("could not load the model: %s", exc,
                      exc_info=not isinstance(exc, ValueError | OSError))
            self.load_error = exc
            self._ready.set()
            return
        if self.state.draining:  # shut down while loading: nobody will use them
            await asyncio.to_thread(models.close)
            self._ready.set()
            return
        self.models = models
        engine = models.engine
        if engine is not None:
            cfg = self.config
            constraints = ConstraintCompiler(engine.structured, cfg.admission.max_pending_requests,
                                             warm=cfg.warmup and cfg.warmup_grammar, resample=cfg.resample)
            link = ProcessLink(engine) if isinstance(engine, RemoteEngine) else None
            observer = self.telemetry.observer(engine, self.state.model_name,
                                               waiting_outside=lambda: constraints.waiting)
            loop = EngineLoop(engine, cfg.admission, on_failure=self._on_engine_failure, observer=observer,
                              stream_messages_per_s=cfg.stream_messages_per_s, link=link)
            loop.start()
            self._watch_threads(loop, 0)
            self.state.constraints = constraints
            self.state.engine_loop = loop
            if self.config.vllm_protocol:
                # Numbering starts with the engine, before anyone subscribes.
                await self.kv_events.attach(loop)
            log.info("ready: %s (%s, %s)", self.state.model_name, engine.model_config.architecture,
                     engine.config.torch_device)
        self._start_speech(models)
        self.embedding.runtime = models.embeddings
        served = [name for name, on in ((SERVICE_NAME, engine is not None),
                                        (VLLM_SERVICE, engine is not None and self.config.vllm_protocol),
                                        (EMBEDDINGS_SERVICE, models.embeddings is not None),
                                        (SPEECH_SERVICE, self.speech.loop is not None)) if on]
        await self.health.serving(served)
        if self.config.watchdog_timeout_s > 0:
            watchdog = Watchdog(self.config.watchdog_timeout_s, self._watched, self.health,
                                lambda: self.state.draining)
            self._watchdog = self._spawn(watchdog.run())
        self._ready.set()

    def _watched(self) -> list[Watched]:
        """Each engine loop with the health services that stop with it."""
        out = []
        shared_speech = self.speech.loop is not None and self.speech.loop is self.state.engine_loop
        if self.state.engine_loop is not None:
            out.append(Watched(self.state.engine_loop, (OVERALL_HEALTH, SERVICE_NAME)
                               + ((VLLM_SERVICE,) if self.config.vllm_protocol else ())
                               + ((SPEECH_SERVICE,) if shared_speech else ())))
        if self.state.speech_loop is not None:
            out.append(Watched(self.state.speech_loop, (SPEECH_SERVICE,)))
        if self.embedding.runtime is not None:
            # On an embeddings-only server it is the server.
            alone = (OVERALL_HEALTH,) if self.state.engine_loop is None else ()
            out.append(Watched(self.embedding.runtime, (*alone, EMBEDDINGS_SERVICE)))
        return out

    def _start_speech(self, models: LoadedModels) -> None:
        """Give the speech servicer its loop: the generation engine's when it serves
        speech itself, else a loop of the separate speech engine's own."""
        if self.speech.options is None:
            return
        if models.speech is None:
            self.speech.loop = self.state.engine_loop
            return
        loop = EngineLoop(models.speech, self.config.admission, on_failure=self._on_engine_failure,
                          observer=self.telemetry.observer(models.speech, self.speech.options.model_name, 1),
                          stream_messages_per_s=self.config.stream_messages_per_s)
        loop.start()
        self._watch_threads(loop, 1)
        self.state.speech_loop = self.speech.loop = loop
        if self.state.engine_loop is not None:
            loop.peers, self.state.engine_loop.peers = (self.state.engine_loop,), (loop,)
        # It runs on the generation engine's device thread, which dies with that engine.
        self.speech.alive = lambda: loop.alive and self._engine_alive()

    def _watch_threads(self, loop: EngineLoop, index: int) -> None:
        """Export the CPU time of the event loop and of `loop`'s engine and device threads."""
        self.telemetry.watch_thread("event_loop", threading.current_thread())
        engine_thread, device_thread = loop.threads
        engine = loop.engine
        if isinstance(engine, RemoteEngine):
            # An engine process's threads are its own: their seconds come with
            # its steps; here, the thread that reads its pipe.
            self.telemetry.watch_thread(f"engine_link_{index}", engine_thread)
            self.telemetry.watch_cpu(f"engine_{index}", lambda: engine.thread_cpu.engine)
            self.telemetry.watch_cpu(f"device_{index}", lambda: engine.thread_cpu.device)
            return
        self.telemetry.watch_thread(f"engine_{index}", engine_thread)
        self.telemetry.watch_thread(f"device_{index}", device_thread)

    def _on_engine_failure(self, exc: BaseException) -> None:
        """An engine thread died: NOT_SERVING now, then shut down (see the module docstring)."""
        if self.engine_failure is None:
            self.engine_failure = exc
            log.critical("an engine failed (%s: %s); the server stops so that it can be restarted",
                         type(exc).__name__, exc)
        self._spawn(self.health.shut_down())
        self.drain(0.0, hold_s=FAILURE_HOLD_S)

    async def wait_ready(self) -> bool:
        """Wait until the models are loaded (True) or failed to load (False)."""
        await self._ready.wait()
        return self.load_error is None and self.models is not None

    def drain(self, grace_period_s: float | None = None, hold_s: float = 0.0) -> asyncio.Task[None]:
        """Start a graceful shutdown (idempotent); a second call with grace 0 hurries it.

        `hold_s`: once the calls in flight are over, keep the port open that
        long, refusing new calls with UNAVAILABLE, before stopping."""
        if self._draining is None:
            grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
            self._draining = asyncio.get_running_loop().create_task(self._drain(grace, hold_s))
        elif grace_period_s == 0:
            self._force.set()
        return self._draining

    async def _drain(self, grace: float, hold_s: float) -> None:
        state = self.state
        state.draining = True
        log.info("draining: %d calls in flight, grace period %.1fs",
                 state.calls_in_flight, grace)
        await self.health.shut_down()
        idle = asyncio.ensure_future(state.wait_idle())
        force = asyncio.ensure_future(self._force.wait())
        await asyncio.wait([idle, force], timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        loops = state.engine_loops
        if not idle.done() and loops:
            n = sum(loop.abort_all(SHUTDOWN_MESSAGE) for loop in loops)
            log.info("grace period over: aborting %d requests", n)
            # The aborted streams end within one engine step; bounded anyway.
            await asyncio.wait([idle], timeout=10.0)
        idle.cancel()
        if hold_s > 0 and not force.done():
            await asyncio.wait([force], timeout=hold_s)
        force.cancel()
        if self._server is not None:
            # Only unary calls and health watches can remain: give them a moment.
            await self._server.stop(grace=1.0)
        if self._health_server is not None:
            await self._health_server.stop(grace=1.0)
        runtime = self.embedding.runtime
        if runtime is not None:
            # Before the engine stops: it may share the engine's device thread.
            await asyncio.to_thread(runtime.close)
        # The speech engine first: it may run on the generation engine's device thread.
        for loop in reversed(loops):
            await loop.stop()
        if self._watchdog is not None:  # it kept polling, and the engines alive, after a stop
            self._watchdog.cancel()
        # Last: a scrape during the drain still sees the server.
        await asyncio.to_thread(self.telemetry.close)
        log.info("stopped")
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain with no grace period and wait until stopped."""
        await self.drain(0.0)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on host:port (TLS with `credentials`); the port bound."""
    address = host_port(host, port)
    try:
        bound = server.add_secure_port(address, credentials) if credentials is not None \
            else server.add_insecure_port(address)
    except RuntimeError:  # grpc's way of saying the port is taken or the host is wrong
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind {address} (port in use, or no such address)")
    return bound


async def serve(engine_factory: Callable[[], EngineCore] | None, model_name: str,
                config: ServerConfig, embedding: EmbeddingOptions | None = None,
                speech: SpeechOptions | None = None) -> int:
    """Run a server until SIGTERM/SIGINT (graceful) or a second signal (at once).

    Returns a process exit code: 0 after a drain, EXIT_LOAD_FAILED (1) if a
    model failed to load, EXIT_ENGINE_FAILED (70) if an engine died.
    """
    server = StencilServer(engine_factory, model_name, config, embedding, speech)
    port = await server.start()
    log.info("listening on %s (health NOT_SERVING until the model is loaded)", host_port(config.host, port))
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if server._draining is None:
            log.info("%s: draining (send it again to stop at once)", signal.Signals(signum).name)
            server.drain()
        else:
            server.drain(0.0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    # SIGHUP reloads what can be reloaded (the TLS files, the API key file).
    # With neither there is nothing, but its default action would end the
    # server on the spot, streams cut and nothing drained (a closed terminal,
    # an operator's habitual `kill -HUP`): it is logged and ignored, as the
    # engine process ignores it.
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    ready = asyncio.ensure_future(server.wait_ready())
    stopped = asyncio.ensure_future(server.wait_stopped())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and server.load_error is not None:
        await server.stop()
        return EXIT_LOAD_FAILED
    if ready.done():
        log.info("start-up heap frozen: %d objects the garbage collector will not walk", freeze_heap())
    try:
        await stopped
    finally:
        ready.cancel()
        thaw_heap()
    return EXIT_ENGINE_FAILED if server.engine_failure is not None else 0
