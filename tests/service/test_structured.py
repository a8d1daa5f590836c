"""`GenerateRequest.constraint` -> GrammarSpec, and the async compile wrapper, without a server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from typing import Any

import grpc
import pytest

from grammar import GrammarError, GrammarOptions, GrammarSpec
from grammar.compiler import CompileQueueFull
from service.api.constraints import constraint_spec, tools_spec
from service.errors import Reason, ServiceError
from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.request_log import CallRecord, enter_call, exit_call
from service.security.auth import current_key
from service.structured import ConstraintCompiler, ConstraintSpec, caller_tenant

C = pb.Constraint


def _req(**fields: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text="x")
    choices = fields.pop("choice", None)
    req.constraint.CopyFrom(C(**fields))
    if choices is not None:
        req.constraint.choice.SetInParent()
        req.constraint.choice.choices.extend(choices)
    return req


def test_unconstrained_request_has_no_spec() -> None:
    assert constraint_spec(pb.GenerateRequest(text="x")) is None


@pytest.mark.parametrize("fields, spec, field", [
    ({"json_schema": '{"type": "integer"}'}, GrammarSpec.json_schema('{"type": "integer"}'),
     "constraint.json_schema"),
    ({"json_object": True}, GrammarSpec.json_object(), "constraint.json_object"),
    ({"regex": "a+"}, GrammarSpec.regex("a+"), "constraint.regex"),
    ({"choice": ["x", "y"]}, GrammarSpec.choice(["x", "y"]), "constraint.choice.choices"),
    ({"ebnf": 'root ::= "a"'}, GrammarSpec.ebnf('root ::= "a"'), "constraint.ebnf"),
    ({"lark": 'start: "a"'}, GrammarSpec.lark('start: "a"'), "constraint.lark"),
])
def test_each_kind_maps_to_its_spec(fields: dict[str, Any], spec: GrammarSpec, field: str) -> None:
    got = constraint_spec(_req(**fields))
    assert got == ConstraintSpec(spec, None, field)


def test_backend_and_whitespace_options() -> None:
    got = constraint_spec(_req(json_object=True, backend=C.BACKEND_LLGUIDANCE,
                               whitespace=C.WHITESPACE_FLEXIBLE, max_whitespace=2))
    assert got is not None and got.backend == "llguidance"
    assert got.spec.options == GrammarOptions(whitespace="flexible", max_whitespace=2)
    got = constraint_spec(_req(json_schema="{}", whitespace=C.WHITESPACE_PRETTY, indent=4,
                               backend=C.BACKEND_AUTO))
    assert got is not None and got.backend == "auto"
    assert got.spec.options == GrammarOptions(whitespace="pretty", indent=4)
    got = constraint_spec(_req(regex="a", backend=C.BACKEND_XGRAMMAR))
    assert got is not None and got.backend == "xgrammar"


@pytest.mark.parametrize("fields, field", [
    ({}, "constraint.kind"),
    ({"json_object": False}, "constraint.json_object"),
    ({"json_schema": "{oops"}, "constraint.json_schema"),
    ({"json_schema": "[1, 2]"}, "constraint.json_schema"),
    ({"regex": ""}, "constraint.regex"),  # (spaces alone are a regex)
    ({"choice": []}, "constraint.choice.choices"),
    ({"json_object": True, "indent": 2}, "constraint.indent"),
    ({"json_object": True, "whitespace": C.WHITESPACE_FLEXIBLE, "max_whitespace": 65},
     "constraint.max_whitespace"),
    ({"regex": "a", "max_whitespace": 2}, "constraint.max_whitespace"),
    ({"choice": ["a"], "whitespace": C.WHITESPACE_COMPACT}, "constraint.whitespace"),
    ({"regex": "a", "backend": 99}, "constraint.backend"),
])
def test_malformed_constraints_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ServiceError) as info:
        constraint_spec(_req(**fields))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in info.value.violations] == [field]


class FakeStructured:
    """compile_async returning futures the test completes by hand; its compiler
    counts the futures not yet done as pending compiles, and refuses new ones
    beyond the limits it is given, as GrammarCompiler does."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[Any]] = []
        self.tenants: list[str] = []
        self.built_on: list[threading.Thread] = []
        self.closed = False

    @property
    def compiler(self) -> FakeStructured:
        if self.closed:
            raise GrammarError("the grammar compiler is closed", reason="crashed")
        self.built_on.append(threading.current_thread())
        return self

    @property
    def pending_compiles(self) -> int:
        return sum(not f.done() for f in self.futures)

    def compile_async(self, spec: GrammarSpec, backend: str | None = None, tenant: str = "", *,
                      max_pending: int | None = None,
                      max_pending_per_tenant: int | None = None) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        mine = sum(not f.done() for f, t in zip(self.futures, self.tenants, strict=True) if t == tenant)
        if max_pending is not None and self.pending_compiles >= max_pending:
            fut.set_exception(CompileQueueFull(f"{self.pending_compiles} constraints are compiling"))
        elif max_pending_per_tenant is not None and mine >= max_pending_per_tenant:
            fut.set_exception(CompileQueueFull(f"{mine} of this client's constraints are compiling"))
        self.futures.append(fut)
        self.tenants.append(tenant)
        return fut


SPEC = ConstraintSpec(GrammarSpec.regex("a+"), None, "constraint.regex")


def _compiler(fake: FakeStructured, **options: Any) -> ConstraintCompiler:
    """A compiler over the fake, which is a StructuredOutput by duck typing only."""
    return ConstraintCompiler(fake, **options)  # type: ignore[arg-type]


def test_json_inside_tags_and_tool_calls_follows_the_servers_resample_default() -> None:
    # (Constraint.resample itself is for JSON kinds only.) Before, tags and
    # tool calls never resampled over gRPC whatever the server's default.
    schema = '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'
    tagged = pb.GenerateRequest(text="x")
    tagged.constraint.structural_tag = ('{"structures": [{"begin": "<f>", "schema": ' + schema
                                        + ', "end": "</f>"}], "triggers": ["<f>"]}')
    tool = pb.GenerateRequest(text="x")
    tool.tools.add(name="f", parameters=schema)
    tool.tool_choice.mode = pb.ToolChoice.MODE_REQUIRED
    tools = tools_spec(tool)
    assert tools is not None and tools.constraint is not None
    for spec in (constraint_spec(tagged), tools.constraint):
        assert spec is not None and spec.resamples(True) and not spec.resamples(False)
    regex = constraint_spec(pb.GenerateRequest(text="x", constraint=pb.Constraint(regex="a+")))
    assert regex is not None and not regex.resamples(True)


def test_a_tool_choice_naming_a_tool_called_like_a_mode_calls_that_tool() -> None:
    # function_name "none" left the answer free; "required" allowed any tool.
    for name in ("none", "auto", "required"):
        req = pb.GenerateRequest(text="x")
        req.tools.add(name=name, parameters='{"type": "object"}')
        req.tools.add(name="other", parameters='{"type": "object"}')
        req.tool_choice.function_name = name
        tools = tools_spec(req)
        assert tools is not None and tools.constraint is not None
        source = str(tools.constraint.spec.source)
        assert f'\\"name\\": \\"{name}\\"' in source and "other" not in source, name


def test_compile_result_and_errors() -> None:
    async def go() -> None:
        fake = FakeStructured()
        compiler = _compiler(fake, warm=True)
        task = asyncio.ensure_future(compiler.compile(SPEC))
        await asyncio.sleep(0)
        assert compiler.in_flight == 1
        fake.futures[0].set_result("matcher")
        assert await task == "matcher"
        assert compiler.in_flight == 0
        for err, code in ((GrammarError("bad", reason="invalid", backend="xgrammar"),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (GrammarError("timed out", reason="timeout", backend="xgrammar"),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (GrammarError("compile crashed", reason="crashed", backend="llguidance"),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (GrammarError("compiler is closed", reason="crashed"),
                           grpc.StatusCode.UNAVAILABLE)):
            task = asyncio.ensure_future(compiler.compile(SPEC))
            await asyncio.sleep(0)
            fake.futures[-1].set_exception(err)
            with pytest.raises(ServiceError) as info:
                await task
            assert info.value.code == code
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                assert info.value.violations == (("constraint.regex", str(err)),)
        # A cache hit (a done future) returns without waiting.
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result("cached")
        fake.compile_async = lambda *args, **kwargs: done  # type: ignore[method-assign]
        assert await compiler.compile(SPEC) == "cached"

    asyncio.run(go())


@pytest.mark.parametrize("warm", [True, False])
def test_a_compile_after_the_engine_closed_is_unavailable(warm: bool) -> None:
    # The server stopping closes the engine's compiler; a request racing it
    # got the compiler's GrammarError raw (it started a new compiler before).
    async def go() -> None:
        fake = FakeStructured()
        compiler = _compiler(fake, warm=warm)
        fake.closed = True
        assert compiler.in_flight == 0
        with pytest.raises(ServiceError) as info:
            await compiler.compile(SPEC)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert compiler.waiting == 0

    asyncio.run(go())


def test_a_cancelled_wait_cancels_the_compile_and_frees_its_place(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        fake = FakeStructured()
        compiler = _compiler(fake, max_in_flight=1, warm=True)
        task = asyncio.ensure_future(compiler.compile(SPEC))
        await asyncio.sleep(0)
        with pytest.raises(ServiceError) as info:  # the one place is taken
            await compiler.compile(SPEC)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Nobody waits for it any more: the grammar compiler may drop it from its queue.
        assert fake.futures[0].cancelled()
        assert compiler.in_flight == 0
        again = asyncio.ensure_future(compiler.compile(SPEC))
        await asyncio.sleep(0)
        fake.futures[-1].set_result("matcher")
        assert await again == "matcher"

    asyncio.run(go())
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_requests_awaiting_a_compile_are_counted_as_waiting() -> None:
    # vllm:num_requests_waiting counts them (vLLM counts requests waiting for
    # their grammar); before, a server busy compiling showed nothing waiting.
    async def go() -> None:
        fake = FakeStructured()
        compiler = _compiler(fake, warm=True)
        first = asyncio.ensure_future(compiler.compile(SPEC))
        failing = asyncio.ensure_future(compiler.compile(SPEC))
        cancelled = asyncio.ensure_future(compiler.compile(SPEC))
        await asyncio.sleep(0)
        assert compiler.waiting == 3
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        fake.futures[1].set_exception(GrammarError("bad", reason="invalid", backend="xgrammar"))
        with pytest.raises(ServiceError):
            await failing
        assert compiler.waiting == 1
        fake.futures[0].set_result("matcher")
        assert await first == "matcher"
        assert compiler.waiting == 0
        validating = asyncio.ensure_future(compiler.compile_noting_cache(SPEC))  # ValidateConstraint's
        await asyncio.sleep(0)
        assert compiler.waiting == 0  # bound for no engine
        fake.futures[-1].set_result("checked")
        assert await validating == ("checked", False)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result("cached")
        fake.compile_async = lambda *args, **kwargs: done  # type: ignore[method-assign]
        assert await compiler.compile(SPEC) == "cached" and compiler.waiting == 0

    asyncio.run(go())


def test_first_compile_builds_the_compiler_off_the_loop() -> None:
    async def go() -> None:
        fake = FakeStructured()
        compiler = _compiler(fake)  # not warmed up: the first call may build it
        task = asyncio.ensure_future(compiler.compile(SPEC))
        while not fake.futures:
            await asyncio.sleep(0.001)
        fake.futures[0].set_result("first")
        assert await task == "first"
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result("second")
        fake.compile_async = lambda *args, **kwargs: done  # type: ignore[method-assign]
        assert await compiler.compile(SPEC) == "second"
        assert fake.built_on[0] is not threading.current_thread()

    asyncio.run(go())


def test_callers_are_told_apart_by_api_key_else_by_connection() -> None:
    assert caller_tenant() == ""  # outside a call
    token = enter_call(CallRecord("/stencil.v1.Generation/Generate", "r1", "ipv4:10.0.0.7:52114", 0.0))
    try:
        assert caller_tenant() == "peer:ipv4:10.0.0.7:52114"
        key = current_key.set("alice")
        try:
            assert caller_tenant() == "key:alice"
        finally:
            current_key.reset(key)
    finally:
        exit_call(token)


def test_one_caller_holds_at_most_half_the_compile_places() -> None:
    async def go() -> None:
        fake = FakeStructured()
        compiler = _compiler(fake, max_in_flight=4, warm=True)

        async def as_key(name: str) -> Any:
            current_key.set(name)  # this task's context only
            return await compiler.compile(SPEC)

        mine = [asyncio.ensure_future(as_key("a")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(ServiceError) as info:  # a's half is taken
            await asyncio.ensure_future(as_key("a"))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.reason == Reason.COMPILE_QUEUE_FULL
        assert "this client's" in info.value.message and info.value.message.endswith("retry later")
        others = [asyncio.ensure_future(as_key(name)) for name in ("b", "c")]
        await asyncio.sleep(0)
        assert compiler.in_flight == 4
        with pytest.raises(ServiceError) as info:  # every place is taken
            await asyncio.ensure_future(as_key("d"))
        assert info.value.reason == Reason.COMPILE_QUEUE_FULL
        assert fake.tenants[:3] == ["key:a", "key:a", "key:a"]
        for fut in fake.futures:
            if not fut.done():
                fut.set_result("matcher")
        assert await asyncio.gather(*mine, *others) == ["matcher"] * 4

    asyncio.run(go())


def test_tools_reach_the_chat_template_as_an_openai_client_sends_them() -> None:
    # Templates that print a tool as JSON keep its key order: "parameters"
    # came before "description", so the prompt differed from vLLM's for the
    # same request (another layout for the model; no shared prefix-cache pages).
    import json

    from engine.presets import ensure_preset
    from engine.tokenizer import Tokenizer
    from service.api.convert import chat_prompt
    tokenizer = Tokenizer(ensure_preset("tiny-reasoning"))
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="weather?")]),
                             tools=[pb.Tool(name="get_weather", description="Get it", parameters=json.dumps(params)),
                                    pb.Tool(name="now", parameters=json.dumps(params))])
    spec = tools_spec(req)
    assert spec is not None
    ours = chat_prompt(req.chat, tokenizer, tools=spec.template_entries)
    openai = [{"type": "function", "function": {"name": "get_weather", "description": "Get it", "parameters": params}},
              {"type": "function", "function": {"name": "now", "parameters": params}}]
    assert ours == tokenizer.apply_chat_template([{"role": "user", "content": "weather?"}], tools=openai)


@pytest.mark.parametrize("mode", [pb.ToolChoice.MODE_AUTO, pb.ToolChoice.MODE_NONE])
def test_a_second_tool_of_a_name_is_named_where_it_is(mode: int) -> None:
    # The refusal named `tools`, where the docs name tools[i].name.
    req = pb.GenerateRequest(tools=[pb.Tool(name="f"), pb.Tool(name="g"), pb.Tool(name="f")])
    req.tool_choice.mode = mode  # type: ignore[assignment]
    with pytest.raises(ServiceError) as info:
        tools_spec(req)
    assert [f for f, _ in info.value.violations] == ["tools[2].name"]


def test_many_tools_are_checked_for_a_repeated_name_at_once() -> None:
    # Each tool's name was compared with every earlier one: 300k tools (9 MB,
    # under the message limit) held a worker thread for hours, past the
    # call's deadline and the server's shutdown. 30k took ~40 s; now ~1 s.
    req = pb.GenerateRequest(tools=[pb.Tool(name=f"tool_{i}") for i in range(30_000)] + [pb.Tool(name="tool_7")])
    with pytest.raises(ServiceError) as info:
        tools_spec(req)
    assert [f for f, _ in info.value.violations] == ["tools[30000].name"]
