"""Helpers of the benchmarks: bench/pyspy.py reads py-spy's raw output per
thread (what bench/gpu.py --profile-server writes to its log); bench/_server.py
reads a server's engine steps from its metrics endpoint; bench/step_phases.py
breaks an engine's steps down phase by phase; bench/device_emulation.py stands
in for a GPU; bench/mask_apply.py runs (it checks both kernels agree)."""

from __future__ import annotations

import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

import engine.pipeline as pipeline_module
from bench import mask_apply, pyspy
from bench._server import EngineSteps, engine_steps, free_port
from bench.device_emulation import MODELS, install
from bench.step_phases import StepPhases
from engine import SamplingParams
from engine.kernels import cpu_ops
from engine.models.llama import LlamaFamilyModel
from engine.sampler import SamplerOutput
from grammar import GrammarSpec

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


def test_engine_steps_sums_the_step_histograms_of_every_engine():
    registry = CollectorRegistry()
    steps = Histogram("stencil_engine_step_seconds", "", ("model_name",), registry=registry)
    batch = Histogram("stencil_engine_batch_size", "", ("model_name",), registry=registry)
    cpu = Counter("stencil_thread_cpu_seconds", "", ("thread",), registry=registry)
    cpu.labels("event_loop").inc(1.0)
    cpu.labels("engine_0").inc(2.0)
    for model, seconds, size in (("a", 0.002, 64), ("a", 0.004, 32), ("b", 0.010, 1)):
        steps.labels(model).observe(seconds)
        batch.labels(model).observe(size)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        first = engine_steps(port)
        assert (first.steps, round(first.seconds, 6), first.requests) == (3, 0.016, 97)
        assert first.cpu == {"event_loop": 1.0, "engine_0": 2.0}
        steps.labels("a").observe(0.003)
        batch.labels("a").observe(63)
        cpu.labels("event_loop").inc(0.0005)
        cpu.labels("engine_0").inc(0.00125)
        later = engine_steps(port).since(first)
        assert (later.steps, round(later.seconds, 6), later.requests) == (1, 0.003, 63)
        assert later.describe() == ("1 engine steps, 3.00 ms a step, 63.0 requests a step; "
                                    "CPU ms a step: event_loop 0.50, engine_0 1.25")
    finally:
        server.shutdown()
    assert EngineSteps(0, 0, 0).describe() == "no engine steps"


def test_step_phases_time_each_phase_and_put_every_method_back(make_llm):
    llm = make_llm("tiny-llama", kv_cache_gib=0.05)
    pipe, host, jobs = llm.engine.pipeline, SamplerOutput.host, (pipeline_module.run_step, pipeline_module.sample_step)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    regex = GrammarSpec.regex("[a-z]{20,40}")
    with StepPhases(llm) as free:
        llm.generate(["one", "two"], params)
    with StepPhases(llm) as constrained:
        llm.generate(["one", "two"], params, constraint=regex)
    for timer in (free, constrained):
        ms = timer.per_step_ms()
        assert timer.steps >= 6
        assert all(v >= 0 for v in ms.values()), ms
        assert ms["launch"] > 0 and ms["report"] > 0 and ms["advance (work)"] > 0
        busy = sum(ms[k] for k in ("schedule", "launch", "advance (work)", "fill", "report"))
        assert abs(ms["engine thread busy"] - busy) < 1e-9
        assert timer.summary().endswith(f"(ms a step, {timer.steps} steps)")
    assert free.per_step_ms()["fill"] < constrained.per_step_ms()["fill"]
    # Only a constrained step's sampling waits for a mask, as a job of its own.
    assert free.per_step_ms()["device waits for the mask"] == 0
    assert constrained.per_step_ms()["device waits for the mask"] > 0
    assert constrained.per_step_ms()["fill"] > 0
    # Nothing stays wrapped: the instance's methods are the class's again.
    assert "launch" not in vars(pipe) and "schedule" not in vars(llm.engine.scheduler)
    assert SamplerOutput.host is host and (pipeline_module.run_step, pipeline_module.sample_step) == jobs


def test_the_emulated_device_costs_each_forward_pass_its_time_and_is_put_back(make_llm):
    llm = make_llm("tiny-llama", kv_cache_gib=0.05)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    forward, logits = LlamaFamilyModel.forward, LlamaFamilyModel.logits
    to_host, host = SamplerOutput.to_host_async, SamplerOutput.host
    for model in MODELS:
        undo = install(30.0, model)
        try:
            start = time.perf_counter()
            [out] = llm.generate(["a prompt"], params)
            elapsed = time.perf_counter() - start
        finally:
            undo()
        # Six forward passes (the prompt, then five decode steps), each one the
        # device's 30 ms whether slept on the device thread or waited for.
        assert len(out.token_ids) == 6 and elapsed >= 6 * 0.030, (model, elapsed)
        # Zero hidden states give zero logits: the emulated LM head's, uncomputed.
        assert out.token_ids == [0] * 6
    assert (LlamaFamilyModel.forward, LlamaFamilyModel.logits) == (forward, logits)
    assert (SamplerOutput.to_host_async, SamplerOutput.host) == (to_host, host)


@pytest.mark.skipif(cpu_ops() is None, reason="the CPU extension did not build")
def test_the_mask_apply_benchmark_runs_and_its_kernels_agree(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mask_apply.py", "--batch", "3", "--vocab", "40,100",
                                      "--iters", "1", "--repeat", "1"])
    assert mask_apply.main() == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.endswith("x")]) == 6


def test_the_grammar_mask_benchmark_fills_through_the_engines_path(capsys):
    # Its stand-in for a request's context lacked fields StepMasks.fill came to
    # read (min_new_tokens' held-back stops): the documented command crashed.
    from bench import grammar_masks

    assert grammar_masks.main(["--tokenizers", "demo", "--skip-compile", "--iters", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| demo (8192) |")]
    assert {row.split(" | ")[2] for row in rows} == {"xgrammar", "llguidance"}
