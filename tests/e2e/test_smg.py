"""Two `stencild serve` workers behind an unmodified Shepherd Model Gateway (`smg`,
from PyPI), driven with the `openai` client through the router's HTTP API.

The router speaks vLLM's gRPC engine protocol to the workers
(vllm.grpc.engine.VllmEngine): it tokenizes with the demo model's tokenizer,
applies the chat template, forwards the structured-output constraints it knows
and detokenizes the tokens the workers stream back.

A reasoning model behind the router (the tiny-reasoning preset, whose chat
template opens the assistant turn inside `<think>`): the worker runs
`--reasoning-parser deepseek_r1` and tells the router so (GetServerInfo), the
router's own parser splits the thought from the answer, and the answer follows
the schema while the thought was free. (This SMG version forwards no
structural tag: it sends forced tool calls as JSON schemas, and refuses a
`structural_tag` response_format.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.presets import ensure_preset

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0


def _smg_command() -> list[str] | None:
    try:
        import smg  # noqa: F401
    except ImportError:
        return None
    script = Path(sys.executable).parent / "smg"
    found = str(script) if script.exists() else shutil.which("smg")
    return [found] if found else [sys.executable, "-m", "smg"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A child process whose output is collected on a thread."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in list(self.log)):
                return
            assert self.proc.poll() is None, "exited:\n" + "".join(self.log[-50:])
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in:\n" + "".join(self.log[-50:]))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Worker(Process):
    """`stencild serve` on the demo model, with its own metrics port."""

    def __init__(self, *extra: str) -> None:
        self.port, self.metrics_port = _free_port(), _free_port()
        super().__init__([sys.executable, "-m", "service.cli", "serve", "--port", str(self.port),
                          "--metrics-port", str(self.metrics_port), "--kv-cache-gib", "0.1",
                          "--no-embedding-model", "--no-speech-model", "--grace-period", "1", *extra])

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on this worker's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def _start_fleet(workers: list[Worker], model: str, *router_args: str) -> Iterator[tuple[list[Worker], str]]:
    smg = _smg_command()
    if smg is None:
        for w in workers:
            w.stop()
        pytest.skip("smg (the Shepherd Model Gateway) is not installed: `make setup` installs it")
    router = None
    try:
        for w in workers:
            w.wait_for(r"service.server: ready: ")
        port = _free_port()
        router = Process([*smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                          "--worker-urls", *[f"grpc://127.0.0.1:{w.port}" for w in workers],
                          "--tokenizer-path", str(ensure_preset(model)), "--policy", "round_robin",
                          "--prometheus-port", str(_free_port()), "--log-level", "info",
                          "--health-check-interval-secs", "1", *router_args])
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        # Ready when a completion goes through (the model is listed before its
        # workers are registered).
        probe = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(
                    f"{base}/v1/completions", probe, {"Content-Type": "application/json"}), timeout=30).read()
                break
            except OSError:
                pass
            assert router.proc.poll() is None, "smg exited:\n" + "".join(router.log[-50:])
            assert time.monotonic() < deadline, "the router never served a completion:\n" + "".join(
                re.sub(r"\x1b\[[0-9;]*m", "", line)[-300:] for line in router.log[-8:])
            time.sleep(0.3)
        yield workers, f"{base}/v1"
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[Worker], str]]:
    if _smg_command() is None:
        pytest.skip("smg (the Shepherd Model Gateway) is not installed: `make setup` installs it")
    ensure_preset("demo")
    yield from _start_fleet([Worker(), Worker()], "demo")


@pytest.fixture(scope="module")
def reasoning_fleet() -> Iterator[tuple[list[Worker], str]]:
    """One tiny-reasoning worker (deepseek_r1, thoughts of at most 8 tokens:
    its random weights would rarely close one) behind SMG's deepseek_r1 parser."""
    if _smg_command() is None:
        pytest.skip("smg (the Shepherd Model Gateway) is not installed: `make setup` installs it")
    ensure_preset("tiny-reasoning")
    worker = Worker("--preset", "tiny-reasoning", "--reasoning-parser", "deepseek_r1", "--max-thinking-tokens", "8")
    yield from _start_fleet([worker], "tiny-reasoning", "--reasoning-parser", "deepseek_r1",
                            "--tool-call-parser", "qwen")


@pytest.fixture(scope="module")
def client(fleet):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=fleet[1], api_key="unused", timeout=60, max_retries=0)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _request_lines(workers: list[Worker], since: list[int], count: int, timeout: float = 10.0) -> list[dict[str, str]]:
    """The `stencild.requests` lines of routed Generate calls the workers logged
    after `since` (their log lengths), once there are `count` (a call's line
    is written as it ends on the worker, just after the router saw it end)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [dict(pair.split("=", 1) for pair in line.split("stencild.requests: ", 1)[1].split()
                      if "=" in pair)
                 for w, start in zip(workers, since, strict=True) for line in w.log[start:]
                 if " INFO stencild.requests: " in line and " service=VllmEngine method=Generate " in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


@pytest.mark.slow
def test_chat_and_completions_stream_and_not(fleet, client) -> None:  # type: ignore[no-untyped-def]
    workers, _ = fleet
    before = [w.metric("vllm:request_success_total") for w in workers]
    since = [len(w.log) for w in workers]
    chat = client.chat.completions.create(model="demo", messages=_chat("Hello"), max_tokens=8)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 8
    assert chat.usage.prompt_tokens > 0
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="demo", messages=_chat("Hello"), max_tokens=8, stream=True) if c.choices]
    assert "".join(parts)
    done = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=8)
    assert done.choices[0].text and done.usage.completion_tokens <= 8
    streamed = [c.choices[0].text for c in client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=8, stream=True) if c.choices]
    assert "".join(streamed)
    # Round robin: both workers served some of these four requests.
    after = [w.metric("vllm:request_success_total") for w in workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    # Each routed call left its line at INFO on the worker that ran it.
    lines = _request_lines(workers, since, 4)
    assert len(lines) == 4, lines
    assert all(line["status"] == "OK" and int(line["completion_tokens"]) <= 8 for line in lines), lines
    # The request id is the router's, the one its response carries.
    [mine] = [line for line in lines if line["request_id"] == chat.id]
    assert int(mine["prompt_tokens"]) == chat.usage.prompt_tokens
    assert int(mine["completion_tokens"]) == chat.usage.completion_tokens


@pytest.mark.slow
def test_structured_output_through_the_router(client) -> None:  # type: ignore[no-untyped-def]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    out = client.chat.completions.create(
        model="demo", messages=_chat("A user record"), max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # json_object: any object. The demo model's random weights write an
    # unbounded key string until max_tokens, so the object is checked as far
    # as it goes: the grammar forced its opening, and a finished one parses.
    obj = client.chat.completions.create(model="demo", messages=_chat("Some JSON"), max_tokens=30,
                                         response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    # The router forwards vLLM's regex (and EBNF grammar); a choice list goes as a regex.
    code = client.completions.create(model="demo", prompt="Code:", max_tokens=16,
                                     extra_body={"regex": "[A-Z]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", code.choices[0].text)
    pick = client.chat.completions.create(model="demo", messages=_chat("yes or no?"), max_tokens=8,
                                          extra_body={"regex": "(yes|no)"})
    assert pick.choices[0].message.content in ("yes", "no")
    grammar = client.completions.create(model="demo", prompt="Pick:", max_tokens=8,
                                        extra_body={"ebnf": 'root ::= "red" | "green"'})
    assert grammar.choices[0].text in ("red", "green")


def _wait_idle(worker: Worker, timeout: float = 30.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        state = (worker.metric("vllm:num_requests_running"), worker.metric("vllm:kv_cache_usage_perc"))
        if state == (0.0, 0.0) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


@pytest.mark.slow
def test_closing_the_stream_ends_the_request_on_the_worker(fleet, client) -> None:  # type: ignore[no-untyped-def]
    workers, _ = fleet
    assert [_wait_idle(w) for w in workers] == [(0.0, 0.0)] * 2
    stream = client.completions.create(model="demo", prompt="Tell me everything", max_tokens=1500, stream=True,
                                       extra_body={"min_tokens": 1500, "ignore_eos": True})
    for got, _ in enumerate(stream, 1):
        if got == 3:
            break
    busy = [w.metric("vllm:num_requests_running") for w in workers]
    assert sum(busy) == 1, "one worker runs the request while the stream is open"
    stream.close()
    # The router cancels the gRPC call; the worker aborts the request and frees its pages.
    assert [_wait_idle(w) for w in workers] == [(0.0, 0.0)] * 2


@pytest.mark.slow
def test_a_killed_worker_leaves_the_router_serving(fleet, client) -> None:  # type: ignore[no-untyped-def]
    workers, _ = fleet
    survivor, victim = workers
    victim.stop(signal.SIGKILL)
    before = survivor.metric("vllm:request_success_total")
    for i in range(4):
        out = client.completions.create(model="demo", prompt=f"Request {i}", max_tokens=4)
        assert out.choices[0].text is not None
    assert survivor.metric("vllm:request_success_total") >= before + 4


ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.slow
def test_a_reasoning_model_thinks_then_answers_through_the_router(reasoning_fleet) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    workers, base = reasoning_fleet
    client: Any = OpenAI(base_url=base, api_key="unused", timeout=60, max_retries=0)  # its replies carry extra fields
    since = [len(w.log) for w in workers]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    out = client.chat.completions.create(model="tiny-reasoning", messages=_chat("Yes or no?"), max_tokens=60,
                                         temperature=0, response_format=fmt)
    message = out.choices[0].message
    thought = (message.model_extra or {}).get("reasoning_content")
    # The thought was free (8 tokens of random text, then its end forced); the
    # answer after it follows the schema.
    assert thought and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert out.usage.completion_tokens_details.reasoning_tokens == 8
    [line] = _request_lines(workers, since, 1)
    assert line["constraint"] == "json_schema" and line["finish_reason"] == "eos"
    # Streamed: the thought's deltas, then the answer's.
    parts: dict[str, str] = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model="tiny-reasoning", messages=_chat("Yes or no?"),
                                                max_tokens=60, temperature=0, response_format=fmt, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert parts["reasoning_content"] == thought
    assert json.loads(parts["content"]) == json.loads(message.content)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
        "additionalProperties": False}


def test_required_tool_calls_through_the_router_end_in_calls(reasoning_fleet) -> None:  # type: ignore[no-untyped-def]
    # The router sends required calls as an array schema whose objects name
    # their properties and say nothing of others, built for vLLM's reading
    # (no others). Read as JSON Schema reads it, the random model wrote keys
    # of its own until max_tokens: no call in 6 seeds of 6.
    from openai import OpenAI

    _, base = reasoning_fleet
    client: Any = OpenAI(base_url=base, api_key="unused", timeout=60, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time", "description": "time", "parameters": TIME}}]
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for seed in range(3):
        out = client.chat.completions.create(model="tiny-reasoning", messages=_chat("Weather in Paris?"),
                                             max_tokens=200, temperature=1, seed=seed, tools=tools,
                                             tool_choice="required")
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
