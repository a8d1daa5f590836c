"""Prometheus metrics: vLLM's names for what vLLM also measures, `stencil_` for the rest.

Each server has a `CollectorRegistry` of its own (prometheus_client's default
registry is global: two servers in one process, as in the tests, would share
it), served over HTTP by `MetricsServer` (`GET /metrics`, prometheus_client's
exposition). Counters and histograms are updated as requests, RPCs and steps
end (service/ops/telemetry.py); the engine gauges and the engine's own counters
are read when Prometheus scrapes (`EngineCollector`), from the plain numbers
the engine keeps (`EngineCore.load()`, the scheduler's counters), so the
engine thread never does any metrics work for them.

Names, types, label sets and buckets of the `vllm:` series follow vLLM's V1
Prometheus logger (vllm/v1/metrics/loggers.py), so the llm-d / Gateway API
Inference Extension endpoint picker and dashboards built for vLLM read them
unchanged; docs/operations.md lists where they differ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.address import bare_host

if TYPE_CHECKING:
    from engine import EngineCore

log = logging.getLogger(__name__)

# vLLM labels every engine series with the served model and the engine index.
ENGINE_LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Ours: grammar compiles run from a cache hit (microseconds) to the timeout (10 s).
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0)
MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EMBED_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Our finish reasons (engine GenerationStatus values) as vLLM's FinishReason strings.
VLLM_FINISH_REASONS = {
    "eos": "stop", "stop_token": "stop", "stop_string": "stop",
    "length": "length", "context_length": "length",
    "cancelled": "abort", "error": "error",
}


@dataclass(frozen=True)
class EngineSource:
    """An engine whose gauges are read at scrape time, and its label values."""

    engine: EngineCore
    model_name: str
    index: str
    # Requests bound for the engine that wait outside it (for their grammar's
    # compile): vLLM counts those among its waiting requests.
    waiting_outside: Callable[[], int] = lambda: 0

    @property
    def labels(self) -> list[str]:
        return [self.model_name, self.index]


class EngineCollector(Collector):
    """The engine gauges and engine-owned counters, read at scrape time.

    Reads only plain numbers the engine thread writes (list lengths, ints);
    each is exact, and together they may be one step apart.
    """

    def __init__(self) -> None:
        self._sources: list[EngineSource] = []
        self._lock = threading.Lock()

    def add(self, source: EngineSource) -> None:
        with self._lock:
            self._sources.append(source)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources)
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Number of requests in model execution batches.",
                                    labels=ENGINE_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Number of requests waiting to be processed.", labels=ENGINE_LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage.", labels=ENGINE_LABELS)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=(*ENGINE_LABELS, "block_size", "num_gpu_blocks",
                                         "enable_prefix_caching"))
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.",
                                      labels=ENGINE_LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.",
                                   labels=ENGINE_LABELS)
        preemptions = CounterMetricFamily("vllm:num_preemptions",
                                          "Cumulative number of preemption from the engine.",
                                          labels=ENGINE_LABELS)
        for src in sources:
            engine = src.engine
            load = engine.load()
            running.add_metric(src.labels, load.running)
            waiting.add_metric(src.labels, load.waiting + src.waiting_outside())
            usage.add_metric(src.labels, load.kv_usage)
            cfg = engine.config
            info.add_metric([*src.labels, str(cfg.page_size), str(load.kv_pages_total),
                             str(cfg.enable_prefix_caching)], 1.0)
            queries.add_metric(src.labels, load.prefix_cache_queries)
            hits.add_metric(src.labels, load.prefix_cache_hits)
            preemptions.add_metric(src.labels, load.num_preemptions)
        yield from (running, waiting, usage, info, queries, hits, preemptions)


def thread_cpu_seconds(thread: threading.Thread) -> float | None:
    """CPU seconds `thread` has used (None where the platform cannot say, or
    once the thread has ended)."""
    ident = thread.ident
    # An ended thread's id may name another thread by now (or nothing).
    if ident is None or not thread.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except OSError:  # it ended just now
        return None


class ThreadCpuCollector(Collector):
    """CPU seconds of the server's own threads (the event loop, each engine
    thread and its device thread), read at scrape time: a thread near one CPU
    second a second is saturated, and with the GIL the event loop's and the
    engine's time add up. Labelled by role (`event_loop`, `engine_0`,
    `device_0`, ...); a thread two roles share is counted once, under the first.
    The engine and device threads of an engine process are not this process's:
    their seconds come as readings (`add_reading`), as of the process's latest
    step, and `engine_link_0` is the thread here that reads its pipe."""

    def __init__(self) -> None:
        self._threads: list[tuple[str, threading.Thread]] = []
        self._readings: dict[str, Callable[[], float | None]] = {}
        self._lock = threading.Lock()

    def add(self, label: str, thread: threading.Thread | None) -> None:
        with self._lock:
            if thread is not None and label not in self._readings \
                    and all(t is not thread and name != label for name, t in self._threads):
                self._threads.append((label, thread))

    def add_reading(self, label: str, read: Callable[[], float | None]) -> None:
        """Export `read()` (CPU seconds of a thread elsewhere; None: unknown) as `label`'s."""
        with self._lock:
            if label not in self._readings and all(name != label for name, _ in self._threads):
                self._readings[label] = read

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            threads = list(self._threads)
            readings = list(self._readings.items())
        family = CounterMetricFamily("stencil_thread_cpu_seconds",
                                     "CPU seconds used by each of the server's threads.", labels=("thread",))
        for label, thread in threads:
            seconds = thread_cpu_seconds(thread)
            if seconds is not None:
                family.add_metric([label], seconds)
        for label, read in readings:
            seconds = read()
            if seconds is not None:
                family.add_metric([label], seconds)
        yield family


class ServerMetrics:
    """Every metric of one server, in its own registry (see the module docstring).

    Counter names are given without `_total`: prometheus_client appends it, so
    `vllm:prompt_tokens` is exposed as `vllm:prompt_tokens_total`, as vLLM's is.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        e = ENGINE_LABELS
        # -- vLLM's --------------------------------------------------------------
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         e, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       (*e, "finished_reason"), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", e, registry=r,
                              buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", e, registry=r,
                             buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", e, registry=r,
                             buckets=REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", e,
                                    registry=r, buckets=REQUEST_LATENCY_BUCKETS)
        # -- structured output ---------------------------------------------------
        self.compile_seconds = Histogram(
            "stencil_grammar_compile_seconds",
            "Seconds a request waited for its constraint to compile (cache misses that compiled).",
            ("backend", "kind"), registry=r, buckets=COMPILE_BUCKETS)
        self.compile_failures = Counter(
            "stencil_grammar_compile_failures",
            "Constraints that could not be compiled, by reason (invalid, timeout, too_large, crashed); "
            "not those refused because no compile worker was free.",
            ("kind", "reason"), registry=r)
        self.compile_timeouts = Counter(
            "stencil_grammar_compile_timeouts",
            "Constraints whose compile ran past --grammar-timeout (also counted as failures).",
            ("kind",), registry=r)
        self.compile_cache_hits = Counter(
            "stencil_grammar_compile_cache_hits",
            "Constraints answered by the compile cache (a compiled grammar or a cached failure).",
            ("kind",), registry=r)
        self.constrained_requests = Counter(
            "stencil_constrained_requests", "Constrained requests that reached the engine.",
            ("kind", "backend"), registry=r)
        self.forced_tokens = Counter(
            "stencil_grammar_forced_tokens", "Output tokens the grammar forced (no model choice).",
            ("kind", "backend"), registry=r)
        self.passes_saved = Counter(
            "stencil_grammar_forward_passes_saved",
            "Forced tokens appended without a forward pass of their own (jump-ahead).",
            ("kind", "backend"), registry=r)
        self.schema_validations = Counter(
            "stencil_schema_validations",
            "Finished JSON outputs checked against their whole schema, by result "
            "(valid, invalid, not_checked).", ("result",), registry=r)
        self.schema_retries = Counter(
            "stencil_schema_retries",
            "JSON values rolled back and resampled because they broke a schema keyword "
            "the grammar does not enforce.", ("kind", "backend"), registry=r)
        self.mask_seconds = Histogram(
            "stencil_grammar_mask_seconds",
            "Seconds spent filling a step's grammar bitmask (steps with constrained requests).", e,
            registry=r, buckets=MASK_BUCKETS)
        # -- embeddings and speech -------------------------------------------------
        self.embed_requests = Counter("stencil_embed_requests", "Embed calls answered.", ("model_name",),
                                      registry=r)
        self.embed_inputs = Counter("stencil_embed_inputs", "Texts embedded.", ("model_name",), registry=r)
        self.embed_latency = Histogram("stencil_embed_latency_seconds", "Seconds to answer an Embed call.",
                                       ("model_name",), registry=r, buckets=EMBED_BUCKETS)
        self.speech_requests = Counter("stencil_speech_requests", "Speech requests finished in the engine.",
                                       (*e, "finished_reason"), registry=r)
        self.audio_seconds = Counter("stencil_speech_audio_seconds", "Seconds of audio synthesized.", e,
                                     registry=r)
        self.ttfa = Histogram("stencil_speech_time_to_first_audio_seconds",
                              "Seconds from a Synthesize call to its first audio.", e, registry=r,
                              buckets=TTFT_BUCKETS)
        # -- the server --------------------------------------------------------------
        self.rpcs = Counter("stencil_rpcs", "RPCs handled, by method and status code.",
                            ("method", "code"), registry=r)
        self.refusals = Counter("stencil_admission_refusals",
                                "Calls refused with RESOURCE_EXHAUSTED, by the limit that refused them.",
                                ("reason",), registry=r)
        self.step_seconds = Histogram("stencil_engine_step_seconds", "Seconds per engine step.", e,
                                      registry=r, buckets=STEP_BUCKETS)
        self.batch_size = Histogram("stencil_engine_batch_size", "Requests per engine step.", e,
                                    registry=r, buckets=BATCH_BUCKETS)
        self.engines = EngineCollector()
        r.register(self.engines)
        self.threads = ThreadCpuCollector()
        r.register(self.threads)
        # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux).
        ProcessCollector(registry=r)


class MetricsServer:
    """`GET /metrics` over HTTP (prometheus_client's WSGI server, on threads of its own)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and serve (port 0 picks a free one); OSError if it cannot bind."""
        httpd, thread = start_http_server(self.requested_port, bare_host(self.host), self.registry)
        self._httpd, self._thread = httpd, thread
        self.port = int(httpd.server_port)
        return self.port

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
