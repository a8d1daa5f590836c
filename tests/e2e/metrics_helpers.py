"""Scraping a test server's /metrics over real HTTP and reading values out of it."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from service.address import host_port

from .helpers import TIMEOUT, ServerHandle, reachable

Labels = dict[str, str]


class Scrape:
    """One scrape of `/metrics`: every sample, by name and labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples: list[tuple[str, Labels, float]] = []
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), s.value))

    def get(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels` (0 if none)."""
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

    def labels_of(self, name: str) -> list[Labels]:
        return [lab for n, lab, _ in self.samples if n == name]


def metrics_url(handle: ServerHandle) -> str:
    port = handle.server.telemetry.metrics_port
    assert port, "this server serves no metrics"
    return f"http://{host_port(reachable(handle.server.config.telemetry.metrics_host), port)}/metrics"


def scrape(handle: ServerHandle) -> Scrape:
    with urllib.request.urlopen(metrics_url(handle), timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return Scrape(resp.read().decode())


def wait_for(handle: ServerHandle, check: Callable[[Scrape], bool], timeout: float = TIMEOUT) -> Scrape:
    """Scrape until `check` holds (AssertionError with the last scrape if it never does)."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(handle)
        if check(s):
            return s
        assert time.monotonic() < deadline, "the metrics never reached the expected values"
        time.sleep(0.02)
