"""bench/gpu.py's parts run end to end on a CPU, so that a GPU session (rare,
and 30 minutes long) does not discover a broken benchmark: a tiny Llama
checkpoint written as the GPU shapes are, stencild offline in its default mode
(every batch, the JSON schema, sampling with penalties, the step phases), the batch-1 profile
(bench/gpu_profile.py, here ops by CPU time), the grammar mask's two paths
(bench/mask_apply.py), transformers' eager and
static-cache modes, `stencild serve` with the engine in a thread and in a
process of its own, then the tables, the targets and the JSON.

The CUDA calls the benchmark makes around its runs (synchronize, empty_cache,
memory_allocated) are no-ops here; everything else is the benchmark's code."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import torch

from bench import gpu

TINY = gpu.ModelShape("tiny-llama-gpu-bench", "tiny (CPU smoke test)", hidden=64, intermediate=128, layers=2,
                      heads=4, kv_heads=2, vocab=8192, max_positions=256, rope_theta=10000.0)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)


def test_every_part_of_the_gpu_benchmark_runs_and_reports(on_cpu, tmp_path, monkeypatch):
    # transformers' compiled mode (reduce-overhead: CUDA graphs) is for the GPU only.
    modes = gpu._transformers_modes
    monkeypatch.setattr(gpu, "_transformers_modes", lambda: (modes()[0][:2], modes()[1]))
    args = gpu.parse_args(["--batches", "1", "4", "--new-tokens", "6", "--repeat", "1", "--prompt-len", "12",
                           "--grpc-concurrency", "4", "--kv-cache-gib", "0.05", "--default-mode-only",
                           "--profile-kernels",
                           "--out-dir", str(tmp_path / "models"), "--results-dir", str(tmp_path / "results")])
    report = gpu.Report(tmp_path / "results" / "gpu-test.log")
    model_dir = gpu.write_checkpoint(TINY, args.out_dir)
    assert gpu.write_checkpoint(TINY, args.out_dir) == model_dir  # reused
    per_step = gpu.bytes_per_decode_step(gpu.tensor_bytes(model_dir))
    bound = 1e9 / per_step
    info: dict = {}
    saves: list[int] = []
    figures = gpu.run_stencild("1.1b", model_dir, args, bound, report, info, lambda so_far: saves.append(len(so_far)))
    assert saves == [4]  # after each configuration: the JSON survives a run killed in the next
    assert [(f.mode, f.batch) for f in figures] == [
        (gpu.DEFAULT_MODE, 1), (gpu.DEFAULT_MODE, 4), (gpu.DEFAULT_MODE + ", JSON schema", 4),
        (gpu.DEFAULT_MODE + gpu.SAMPLED_MODE, 4)]
    # One run that fails costs its own figure only, not its configuration's others.
    real_batch = gpu._stencild_batch

    def failing_batch(llm, key, mode, batch, *rest):  # noqa: ANN001
        if mode.endswith(gpu.SAMPLED_MODE):
            raise RuntimeError("injected")
        return real_batch(llm, key, mode, batch, *rest)

    with monkeypatch.context() as m:
        m.setattr(gpu, "_stencild_batch", failing_batch)
        kept = gpu.run_stencild("1.1b", model_dir, args, bound, report, {})
    assert [f.mode for f in kept] == [f.mode for f in figures[:3]]
    assert "failed: RuntimeError: injected" in report.log_path.read_text()
    assert all(f.tok_s > 0 and f.extra["tokens"] == f.batch * args.new_tokens for f in figures)
    schema = figures[2]
    # A decode step's time leaves the prefill out (it was counted in and made the GPU look idler).
    for fig in figures[:2] + figures[3:4]:
        assert fig.extra["prefill_ms"] > 0
        assert fig.extra["step_ms"] == pytest.approx(
            gpu.decode_step_ms(min(fig.seconds), fig.extra["prefill_ms"] / 1000, args.new_tokens))
    assert "step_ms" not in schema.extra
    assert "decode step" in report.log_path.read_text()
    assert "x greedy's tok/s" in gpu.figure_notes(figures[3], figures)
    assert schema.extra["phases_summary"] and schema.extra["forced_tokens"] > 0
    assert set(info) >= {"attention", "pointwise_kernels", "graphs", "gemv", "grammar_mask_threads"}

    lines = gpu.profile_kernels("1.1b", model_dir, report)  # on a CPU: ops by CPU time
    assert lines[0].startswith(f"{model_dir.name}, batch 1: ") and len(lines) > 3

    hf = gpu.run_transformers("1.1b", model_dir, [1], args, bound, report)
    assert [f.mode for f in hf] == ["eager (dynamic cache)", "static cache"]
    figures += hf
    # A server profile that fails leaves the gRPC figure standing.
    def failing_profile(*_a, **_k):  # noqa: ANN002, ANN003
        raise RuntimeError("py-spy broke")

    monkeypatch.setattr(gpu, "profile_grpc", failing_profile)
    args.profile_server = True
    for engine_process in (False, True):
        served = gpu.run_grpc("1.1b", model_dir, args, bound, report, engine_process)
        assert served is not None and served.extra["tokens"] == 4 * args.new_tokens
        assert served.extra["server_steps"] >= args.new_tokens
        figures.append(served)

    results: dict = {"models": {"1.1b": info}}
    gpu.summarize(figures, args, report, results, "test")
    log = report.log_path.read_text()
    assert "| target | figure | verdict |" in log
    saved = json.loads((args.results_dir / "gpu-test.json").read_text())
    goals = {g["target"]: g for g in saved["targets"]}
    grpc_goal = goals["gRPC at concurrency 4 >= 90 % of offline (1.1b)"]
    assert grpc_goal["met"] is not None and "engine process" in log
    assert goals["JSON schema at batch 4 no slower per request than no schema (1.1b)"]["met"] is not None
    assert goals["8B batch 1 >= 70 % of the bandwidth bound"]["met"] is None  # not run here
    assert len(saved["figures"]) == len(figures)
    assert "--profile-server failed: RuntimeError: py-spy broke" in log


def test_the_mixture_of_experts_shape_is_written_served_and_bounded_by_its_active_experts(on_cpu, tmp_path):
    from engine import LLM, SamplingParams

    shape = gpu.ModelShape("tiny-mixtral-gpu-bench", "tiny MoE (CPU smoke test)", hidden=64, intermediate=96,
                           layers=2, heads=4, kv_heads=2, vocab=8192, max_positions=256, rope_theta=10000.0,
                           experts=4, experts_per_token=2)
    model_dir = gpu.write_checkpoint(shape, tmp_path)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    sizes = gpu.tensor_bytes(model_dir)
    experts = sum(size for name, size in sizes.items() if ".experts." in name)
    assert experts == 2 * 2 * 4 * 3 * 64 * 96  # bf16, 2 layers, 4 experts of three 64 x 96 matrices
    assert gpu.bytes_per_decode_step(sizes) - gpu.bytes_per_decode_step(sizes, 0.5) == experts // 2
    llm = LLM(str(model_dir), kv_cache_gib=0.02, dtype="float32")
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4 and llm.engine.model.sparse_mlps()
    finally:
        llm.close()
    assert gpu.SHAPES["moe"].experts and "moe" not in gpu.parse_args([]).models


def test_a_decode_step_is_the_run_less_its_prefill_over_the_steps_after_it():
    # The H200's 8B at batch 64: 1.117 s for 128 tokens a request, of which ~145 ms of prefill.
    assert gpu.decode_step_ms(1.117, 0.145, 128) == pytest.approx(1000 * 0.972 / 127)
    assert gpu.decode_step_ms(1.117, 0.0, 128) > 1000 * 1.117 / 128  # over the 127 steps after the first token
    assert gpu.decode_step_ms(0.1, 0.2, 1) == 0.0  # a noisy prefill longer than the run, one token: no negative step


def test_parts_past_the_budget_are_skipped_and_said_so(tmp_path):
    # A GPU session's commands run under a time limit: past --budget-s a part is
    # not started, so the run still reaches its tables and JSON.
    ran: list[str] = []

    def part(name: str, result: int) -> Callable[[], int]:
        def run() -> int:
            ran.append(name)
            return result
        return run

    report = gpu.Report(tmp_path / "gpu-budget.log", budget_s=60)
    assert gpu.guarded(report, "[1.1b] first part", part("first", 1)) == 1
    report.deadline = 0.0  # the budget is spent
    assert gpu.guarded(report, "[1.1b] second part", part("second", 2)) is None
    assert ran == ["first"]
    assert "[1.1b] second part skipped: past the --budget-s deadline" in report.log_path.read_text()
    assert gpu.parse_args(["--budget-s", "540"]).budget_s == 540
    # pytest tests/cuda is stopped at the deadline, not waited for.
    report.deadline = time.monotonic()
    tests = gpu.run_tests(report)
    assert tests["returncode"] is None and tests["summary"].startswith("stopped after")
    assert gpu.parse_args([]).tests_budget_s == 240


def test_py_spy_is_found_where_pip_install_target_puts_it(tmp_path, monkeypatch):
    # On the lent GPU machine the wheels go in with `pip install --target DIR`
    # and DIR is on PYTHONPATH: py-spy is then DIR/bin/py-spy, beside no
    # Python and on no PATH.
    from bench import pyspy

    exe = tmp_path / "site" / "bin" / "py-spy"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setattr(pyspy.sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(pyspy.sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path / "site")])
    assert pyspy.available() == str(exe)


def test_the_grammar_mask_part_compares_the_two_paths(on_cpu, tmp_path):
    report = gpu.Report(tmp_path / "gpu-test.log")
    rows = gpu.grammar_mask(report, vocabs=(300,), batch=4)
    assert [r["mask"] for r in rows] == ["json", "random"]
    assert all(r["before_ms"] > 0 and r["now_ms"] > 0 for r in rows)
    assert "grammar mask, batch 4 over 300 tokens (json mask)" in (tmp_path / "gpu-test.log").read_text()


def test_a_server_that_exits_at_start_up_is_reported_at_once_with_its_lines():
    from bench._server import ServerProcess

    start = time.monotonic()
    with pytest.raises(SystemExit, match="(?s)exited with status 2.*--no-such-flag"):
        ServerProcess(["--no-such-flag"])
    assert time.monotonic() - start < 60  # not the whole start-up wait
    assert not ServerProcess.live


def test_a_part_running_far_past_the_budget_is_cut_short_with_the_tables_written(tmp_path):
    from bench._server import ServerProcess

    report = gpu.Report(tmp_path / "gpu-stop.log", budget_s=0.0)
    written: list[bool] = []
    exits: list[int] = []
    server = ServerProcess(["--preset", "tiny-llama", "--no-embedding-model", "--no-speech-model"])
    stop = gpu.HardStop(report, 0.0, lambda: written.append(True), exit=exits.append)
    stop.run()  # what the thread does at its time
    assert written == [True] and exits == [3]
    assert server.proc.wait(30) is not None and not ServerProcess.live
    assert "hard stop" in report.log_path.read_text()
    assert gpu.parse_args([]).overrun_s == 75
