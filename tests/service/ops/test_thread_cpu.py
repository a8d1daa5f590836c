"""ThreadCpuCollector: per-thread CPU time, each thread once, ended threads left out."""

from __future__ import annotations

import threading

from service.ops.metrics import ThreadCpuCollector, thread_cpu_seconds


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_threads_are_counted_once_and_ended_ones_are_left_out() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,))
    busy.start()
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    collector = ThreadCpuCollector()
    collector.add("event_loop", threading.current_thread())
    collector.add("engine_0", busy)
    collector.add("device_1", busy)  # shared with engine_0: counted once
    collector.add("engine_0", done)  # a label already taken
    collector.add("gone", done)
    collector.add("none", None)
    try:
        stop.wait(0.05)
        [family] = collector.collect()
        values = {s.labels["thread"]: s.value for s in family.samples}
    finally:
        stop.set()
        busy.join()
    assert set(values) == {"event_loop", "engine_0"}
    assert values["engine_0"] > 0
    assert thread_cpu_seconds(done) is None
    assert thread_cpu_seconds(threading.Thread(target=lambda: None)) is None  # never started
