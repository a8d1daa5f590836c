"""bench/pyspy.py reads py-spy's raw output per thread (what bench/gpu.py
--profile-server writes to its log)."""

from __future__ import annotations

from bench import pyspy

RAW = """\
thread (11): stencild-engine;_bootstrap (threading.py:1012);step (engine/engine.py:292);wait (threading.py:327) 30
thread (11): stencild-engine;_bootstrap (threading.py:1012);step (engine/engine.py:292);decode (engine/output.py:149) 10
thread (11): stencild-engine;_bootstrap (threading.py:1012);send (selector_events.py:139) 5
thread (11): stencild-engine;_bootstrap (threading.py:1012);get (queue.py:171) 15
thread (7): MainThread;run (runners.py:118);Generate (service/api/generation.py:198) 12
not a stack line
"""


def test_parse_counts_samples_per_thread_and_frame():
    threads = pyspy.parse(RAW)
    engine = threads["thread (11): stencild-engine"]
    assert engine.samples == 60
    assert engine.own["wait (threading.py:327)"] == 30
    assert engine.inclusive["step (engine.py:292)"] == 40
    assert engine.inclusive["_bootstrap (threading.py:1012)"] == 60
    assert threads["thread (7): MainThread"].samples == 12


def test_summary_puts_the_busiest_thread_first_and_skips_frames_on_nearly_every_stack():
    lines = pyspy.summary(RAW, top=2)
    assert lines[0] == "thread (11): stencild-engine: 60 samples"
    assert "    own     30  wait (threading.py:327)" in lines
    assert "    in      40  step (engine.py:292)" in lines
    assert not any("_bootstrap" in line for line in lines)
    assert lines.index("thread (7): MainThread: 12 samples") > 0
