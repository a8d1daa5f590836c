"""Proto <-> engine: validate a request at the edge, build the engine's objects,
and turn per-step engine outputs back into stream messages.

Validation errors name the offending field by its path in the request
(`sampling.top_p`, `token_ids.ids[3]`, `chat.messages[0].role`), as
google.rpc.BadRequest field violations do.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import EngineCore, InvalidRequest, RequestOutput, SamplingParams
from engine.context import TokenLogprobs
from engine.reasoning import ReasoningOptions
from engine.requests import RequestSpec, check_token_ids
from engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, default_length
from engine.tokenizer import Tokenizer, token_spans
from service.api.constraints import ToolsSpec, constraint_spec, tools_spec
from service.errors import (
    Reason,
    ServiceError,
    failed_precondition,
    invalid_argument,
    response_too_large,
)
from service.gen.stencil.v1 import generate_pb2 as pb
from service.ops.request_log import MAX_REQUEST_ID_LENGTH, valid_request_id
from service.structured import ConstraintSpec

_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty", "seed")
_STOPPING = ("max_new_tokens", "min_new_tokens", "ignore_eos", "include_stop_str_in_output")
_RESPONSE = ("logprobs", "prompt_logprobs", "skip_special_tokens")

# Engine parameter name -> path of the proto field it came from.
FIELD_PATHS: dict[str, str] = {
    **{name: f"sampling.{name}" for name in (*_SAMPLING, "logit_bias")},
    **{name: f"stopping.{name}" for name in (*_STOPPING, "stop", "stop_token_ids")},
    **{name: f"response.{name}" for name in _RESPONSE},
    "request_id": "request_id",
}

Finish = pb.GenerateComplete.FinishReason


def finish_reason(output: RequestOutput) -> pb.GenerateComplete.FinishReason:
    """The proto's finish reason of a final output: the enum value named like the
    engine's status value (eos -> EOS, length -> LENGTH, ...)."""
    try:
        return Finish.Value(output.status.value.upper())
    except ValueError:  # "error": failed requests end with a status code instead
        return Finish.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True)
class OutputOptions:
    """What each stream message carries besides text."""

    return_token_ids: bool = True
    logprobs: bool = False
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class PreparedRequest:
    """A checked Generate request: the engine builds its context from `spec`
    once its constraint (if any) is compiled."""

    spec: RequestSpec
    options: OutputOptions
    constraint: ConstraintSpec | None = None
    reasoning: ReasoningOptions | None = None
    tools: ToolsSpec | None = None

    @property
    def request_id(self) -> str:
        assert self.spec.request_id is not None
        return self.spec.request_id


# -- requests -----------------------------------------------------------------
# Ids one Abort may name: a router aborts a call's few; millions in one message
# kept the event loop busy for seconds (every stream and probe waited).
MAX_ABORT_IDS = 4096


def check_abort_ids(ids: Sequence[str]) -> None:
    """INVALID_ARGUMENT for an Abort naming more ids than one may."""
    if len(ids) > MAX_ABORT_IDS:
        raise invalid_argument("request_ids", f"at most {MAX_ABORT_IDS} ids a call, got {len(ids)}")


def check_request_id(rid: str) -> str:
    """A client's request id, validated; a new one when it is empty.

    Anything `valid_request_id` refuses is refused here rather than failing
    the call when the header is sent.
    """
    if not rid:
        return uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_LENGTH:
        raise invalid_argument("request_id", f"at most {MAX_REQUEST_ID_LENGTH} characters")
    if not valid_request_id(rid):
        raise invalid_argument("request_id", "must be visible ASCII characters (spaces only between "
                                             "them), as it is sent in the x-request-id header")
    return rid


def sampling_kwargs(s: pb.SamplingOptions) -> dict[str, object]:
    """The SamplingParams arguments a SamplingOptions message sets (unset fields left out)."""
    kwargs: dict[str, object] = {name: getattr(s, name) for name in _SAMPLING if s.HasField(name)}
    if s.logit_bias:
        kwargs["logit_bias"] = s.logit_bias  # SamplingParams bounds its size, then copies it
    return kwargs


def sampling_params(req: pb.GenerateRequest, defaults: Mapping[str, float] | None = None) -> SamplingParams:
    """SamplingParams from the request; unset fields take `defaults` (the
    model's, from its generation_config.json), else the engine's defaults."""
    st, r = req.stopping, req.response
    kwargs: dict[str, object] = {**(defaults or {}), **sampling_kwargs(req.sampling)}
    for msg, names in ((st, _STOPPING), (r, _RESPONSE)):
        for name in names:
            if msg.HasField(name):
                kwargs[name] = getattr(msg, name)
    if st.stop:
        kwargs["stop"] = st.stop  # SamplingParams bounds its length, then copies it
    if st.stop_token_ids:
        kwargs["stop_token_ids"] = st.stop_token_ids  # SamplingParams bounds its length, then copies it
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except InvalidRequest as err:
        raise invalid_argument(FIELD_PATHS.get(err.field, err.field), err.description) from None


def invalid_request(err: InvalidRequest, input_field: str = "prompt") -> ServiceError:
    """INVALID_ARGUMENT for an engine's InvalidRequest, its field named by its
    path in the request (the prompt's by `input_field`, with the bad index)."""
    if err.field == "prompt":
        path = input_field if err.index is None else f"{input_field}[{err.index}]"
    else:
        path = FIELD_PATHS.get(err.field, err.field)
    return invalid_argument(path, err.description)


_RENDERER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def template_kwargs(chat: pb.ChatInput, tokenizer: Tokenizer, field: str = "chat") -> dict[str, Any]:
    """ChatInput.template_kwargs as a dict (none of apply_chat_template's own parameters)."""
    if not chat.template_kwargs:
        return {}
    if len(chat.template_kwargs) > MAX_TEMPLATE_KWARGS_CHARS:
        raise invalid_argument(f"{field}.template_kwargs", f"{len(chat.template_kwargs)} characters; at most "
                                                            f"{MAX_TEMPLATE_KWARGS_CHARS} are read")
    try:
        kwargs = json.loads(chat.template_kwargs)
    except (ValueError, RecursionError) as e:
        raise invalid_argument(f"{field}.template_kwargs", f"not JSON: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(kwargs, dict):
        raise invalid_argument(f"{field}.template_kwargs", "must be a JSON object")
    if _deeper_than(kwargs, MAX_TEMPLATE_KWARGS_DEPTH):
        raise invalid_argument(f"{field}.template_kwargs", f"nested deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels")
    # apply_chat_template's own parameters, and the names its renderer passes the template itself.
    own = set(inspect.signature(tokenizer.hf.apply_chat_template).parameters) | _RENDERER_NAMES
    reserved = sorted(set(kwargs) & own)
    if reserved:
        raise invalid_argument(f"{field}.template_kwargs", f"{reserved[0]!r} is not a template variable")
    return kwargs


# Template variables are settings (enable_thinking, a date): a few levels at
# most. transformers walks them recursively before rendering.
MAX_TEMPLATE_KWARGS_DEPTH = 32
# And a few kilobytes: measured before parsing, since parsing, walking and
# rendering 11 MB of them (600k variables) held the GIL, and so every
# stream's event loop, for ~1 s; a document belongs in a message.
MAX_TEMPLATE_KWARGS_CHARS = 1 << 20


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a JSON value nests lists/objects more than `limit` levels (iteratively)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def chat_prompt(chat: pb.ChatInput, tokenizer: Tokenizer, field: str = "chat",
                tools: list[dict[str, Any]] | None = None, context: int | None = None) -> list[int]:
    """Render chat messages (and tools) with the model's template; one far
    longer than a `context` of that many tokens is refused before all of it
    is tokenized."""
    if not tokenizer.has_chat_template:
        raise failed_precondition("the loaded model has no chat template; send text or token_ids",
                                  Reason.NO_CHAT_TEMPLATE)
    if not chat.messages:
        raise invalid_argument(f"{field}.messages", "at least one message is required")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise invalid_argument(f"{field}.messages[{i}].role", "the role is empty")
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    kwargs = template_kwargs(chat, tokenizer, field)
    import jinja2

    try:
        return tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in chat.messages],
                                             add_generation_prompt=add_prompt, tools=tools, template_kwargs=kwargs,
                                             context=context)
    except InvalidRequest as err:  # far too long for the context
        raise invalid_request(err, f"{field}.messages") from None
    except jinja2.TemplateError as err:
        raise invalid_argument(f"{field}.messages", f"the chat template rejected them: {err}") from None
    except RecursionError:  # template variables (or tools) nested past what the renderer walks
        raise invalid_argument(f"{field}.template_kwargs" if kwargs else "tools",
                               "nested too deeply for the chat template") from None
    except TypeError as err:
        if kwargs and "multiple values" in str(err):  # a variable the renderer sets too
            raise invalid_argument(f"{field}.template_kwargs", f"not usable as template variables: {err}") from None
        raise invalid_argument(f"{field}.messages", f"the chat template failed on them: {err}") from None
    except (ValueError, ArithmeticError, LookupError) as err:
        # Python's own errors raised by the template's code on these messages
        # (vLLM answers them 400, as a template's raise_exception).
        raise invalid_argument(f"{field}.messages", f"the chat template failed on them: {err}") from None


def prompt_ids(req: pb.GenerateRequest, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None = None,
               context: int | None = None) -> tuple[Sequence[int], str]:
    """The prompt's token ids and the path of the input field they came from
    (`tools` go to a chat input's template); text far longer than a
    `context` of that many tokens is refused before all of it is tokenized."""
    which = req.WhichOneof("input")
    if which is None:
        raise invalid_argument("input", "set one of text, token_ids or chat")
    if which == "text":
        if not req.text:
            raise invalid_argument("text", "the prompt is empty")
        add = req.add_special_tokens if req.HasField("add_special_tokens") else True
        try:
            return tokenizer.encode(req.text, add_special_tokens=add, context=context), "text"
        except InvalidRequest as err:
            raise invalid_request(err, "text") from None
    if which == "token_ids":
        # The field itself: the check converts it a slice at a time (a list of
        # millions of ids in one call held the GIL, and the event loop, ~0.2 s).
        ids = req.token_ids.ids
        if not ids:
            raise invalid_argument("token_ids.ids", "the prompt is empty")
        return ids, "token_ids.ids"
    return chat_prompt(req.chat, tokenizer, tools=tools, context=context), "chat.messages"


_STARTS = {pb.ReasoningOptions.CONSTRAINT_START_UNSPECIFIED: None,
           pb.ReasoningOptions.CONSTRAINT_START_AFTER_THOUGHT: True,
           pb.ReasoningOptions.CONSTRAINT_START_FIRST_TOKEN: False}


def reasoning_options(req: pb.GenerateRequest, engine: EngineCore) -> ReasoningOptions | None:
    """The request's ReasoningOptions (None: the engine's defaults)."""
    if not req.HasField("reasoning"):
        return None
    r = req.reasoning
    if r.constraint_start not in _STARTS:
        raise invalid_argument("reasoning.constraint_start", f"unknown value {r.constraint_start}")
    after = _STARTS[r.constraint_start]
    if after and engine.reasoning is None:
        raise invalid_argument("reasoning.constraint_start", "this server runs no reasoning parser "
                                                             "(stencild serve --reasoning-parser)")
    after = engine.reasoning is not None and after is not False
    budget = r.max_thinking_tokens if r.HasField("max_thinking_tokens") else None
    if budget is not None and not after:
        raise invalid_argument("reasoning.max_thinking_tokens",
                               "applies to a thought the constraint waits for: a server with a reasoning "
                               "parser and constraint_start AFTER_THOUGHT")
    return ReasoningOptions(after_thought=after, max_thinking_tokens=budget)


def prepare_generate(req: pb.GenerateRequest, engine: EngineCore, request_id: str) -> PreparedRequest:
    """Check a Generate request against the engine's model (no engine state is touched);
    `request_id` is its checked id (`check_request_id`).

    Everything is checked here, before any grammar is compiled, so a request
    that would fail anyway never occupies the compiler.
    """
    params = sampling_params(req, engine.sampling_defaults)
    tools = tools_spec(req)
    constraint: ConstraintSpec | None = tools.constraint if tools is not None else None
    if constraint is None:
        constraint = constraint_spec(req)
    reasoning = reasoning_options(req, engine)
    ids, input_field = prompt_ids(req, engine.tokenizer, tools.template_entries if tools is not None else None,
                                  engine.max_model_len)
    try:
        params = default_length(params, engine.default_max_new_tokens, len(ids), engine.max_model_len)
        spec = engine.requests.check(ids, params, request_id)
    except InvalidRequest as err:
        raise invalid_request(err, input_field) from None
    r = req.response
    options = OutputOptions(
        return_token_ids=r.return_token_ids if r.HasField("return_token_ids") else True,
        logprobs=params.logprobs is not None,
        prompt_logprobs=params.prompt_logprobs is not None,
    )
    return PreparedRequest(spec, options, constraint, reasoning, tools)


# -- responses ----------------------------------------------------------------
def _logprob(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def chunk_response(request_id: str, outputs: Sequence[RequestOutput],
                   options: OutputOptions) -> pb.GenerateResponse | None:
    """One chunk for the outputs of one or more engine steps; None if there is nothing new."""
    text = "".join(o.text for o in outputs)
    reasoning = "".join(o.reasoning for o in outputs)
    chunk = pb.GenerateChunk(text=text, reasoning=reasoning)
    for o in outputs:
        if options.return_token_ids:
            chunk.token_ids.extend(o.token_ids)
        if options.logprobs:
            chunk.logprobs.extend(_logprob(lp) for lp in o.logprobs)
        if options.prompt_logprobs and o.prompt_logprobs:
            chunk.prompt_logprobs.extend(_logprob(lp) for lp in o.prompt_logprobs if lp is not None)
    # Nothing the client asked for is new (tokens whose text is not complete
    # yet, with token ids off): no message.
    if not (text or reasoning or len(chunk.token_ids) or len(chunk.logprobs) or len(chunk.prompt_logprobs)):
        return None
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


Thought = pb.GenerateComplete.Thought
THOUGHTS = {None: Thought.THOUGHT_UNSPECIFIED, "none": Thought.THOUGHT_NONE, "closed": Thought.THOUGHT_CLOSED,
            "forced": Thought.THOUGHT_FORCED, "unfinished": Thought.THOUGHT_UNFINISHED}


def complete_response(request_id: str, final: RequestOutput) -> pb.GenerateResponse:
    """The closing message of a stream, from the request's final output."""
    done = pb.GenerateComplete(
        finish_reason=finish_reason(final),
        usage=pb.Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                       cached_prompt_tokens=final.cached_prompt_tokens,
                       forced_tokens=final.forced_tokens, schema_retries=final.schema_retries,
                       reasoning_tokens=final.reasoning_tokens),
        grammar_backend=final.grammar_backend or "",
        thought=THOUGHTS[final.thought],
    )
    if isinstance(final.stop_reason, str):
        done.stop_string = final.stop_reason
    elif isinstance(final.stop_reason, int):
        done.stop_token_id = final.stop_reason
    return pb.GenerateResponse(request_id=request_id, complete=done)


# -- the other RPCs -----------------------------------------------------------
TOKENIZE_ADVICE = "send less text, or leave out the offsets"
# Ids and offsets become messages a slice at a time: each slice is a short
# hold of the GIL, which a whole long text's (a million offsets: seconds)
# took from the event loop while this ran on a worker thread.
_MESSAGE_SLICE = 16384


def tokenize(req: pb.TokenizeRequest, tokenizer: Tokenizer, max_bytes: int | None = None) -> pb.TokenizeResponse:
    """The text's (or chat's) token ids, with their offsets if asked; an
    answer with offsets over `max_bytes` is refused before it is built."""
    which = req.WhichOneof("input")
    if which is None:
        raise invalid_argument("input", "set one of text or chat")
    if which == "chat":
        if req.return_offsets:
            raise invalid_argument("return_offsets", "offsets are only given for text input")
        return pb.TokenizeResponse(token_ids=chat_prompt(req.chat, tokenizer))
    add = req.add_special_tokens if req.HasField("add_special_tokens") else True
    if not req.return_offsets:
        if req.offsets_in_utf8_bytes:
            raise invalid_argument("offsets_in_utf8_bytes", "applies with return_offsets only")
        return _with_ids(tokenizer.encode(req.text, add_special_tokens=add))
    enc = tokenizer.encoding(req.text, add_special_tokens=add)
    spans = token_spans(enc)
    if req.offsets_in_utf8_bytes:
        spans = utf8_offsets(req.text)[spans]
    ids = enc.ids
    if max_bytes is not None:
        size = _tokenize_answer_bytes(ids, spans)
        if size > max_bytes:
            raise response_too_large("text", size, max_bytes, TOKENIZE_ADVICE)
    response = _with_ids(ids)
    for first in range(0, len(spans), _MESSAGE_SLICE):
        response.offsets.extend(pb.TokenOffset(start=s, end=e)
                                for s, e in spans[first:first + _MESSAGE_SLICE].tolist())
    return response


def _with_ids(ids: list[int]) -> pb.TokenizeResponse:
    """A TokenizeResponse of `ids`, copied in a slice at a time: one copy of
    millions held the GIL (every stream's event loop) ~0.1 s."""
    response = pb.TokenizeResponse()
    for first in range(0, len(ids), _MESSAGE_SLICE):
        response.token_ids.extend(ids[first:first + _MESSAGE_SLICE])
    return response


def _varint_bytes(values: np.ndarray) -> np.ndarray:
    """Bytes of each non-negative value as a protobuf varint."""
    size = np.ones(values.shape, dtype=np.int64)
    for k in range(1, 9):
        size += values >= 1 << (7 * k)
    return size


def _tokenize_answer_bytes(ids: list[int], spans: np.ndarray) -> int:
    """A TokenizeResponse's size from its ids and offsets, without building it
    (the top-level fields' tags and lengths left out: a few bytes)."""
    starts, ends = spans[:, 0], spans[:, 1]
    # A TokenOffset: its tag and length, then each non-zero field's tag and value.
    inner = (starts > 0) * (1 + _varint_bytes(starts)) + (ends > 0) * (1 + _varint_bytes(ends))
    id_bytes = sum(int(_varint_bytes(np.asarray(ids[first:first + _MESSAGE_SLICE], dtype=np.int64)).sum())
                   for first in range(0, len(ids), _MESSAGE_SLICE))
    return id_bytes + int((1 + _varint_bytes(inner) + inner).sum())


def utf8_offsets(text: str) -> np.ndarray:
    """UTF-8 byte offset of every code point index of `text` (one more than its length)."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    sizes = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def detokenize(req: pb.DetokenizeRequest, tokenizer: Tokenizer, vocab_size: int) -> pb.DetokenizeResponse:
    skip = req.skip_special_tokens if req.HasField("skip_special_tokens") else True
    return pb.DetokenizeResponse(text=decode_ids(req.token_ids, tokenizer, vocab_size, "token_ids", skip))


def decode_ids(ids: Sequence[int], tokenizer: Tokenizer, vocab_size: int, field: str,
               skip_special_tokens: bool = True) -> str:
    """The text of a request's token ids, each checked to be in the
    vocabulary (INVALID_ARGUMENT naming `field[i]`)."""
    try:
        checked = check_token_ids(ids, vocab_size, field)
    except InvalidRequest as err:
        raise invalid_argument(f"{field}[{err.index}]", err.description) from None
    return tokenizer.decode(checked, skip_special_tokens=skip_special_tokens)


def model_info(engine: EngineCore, model_name: str, server_version: str) -> pb.GetModelInfoResponse:
    mc, cfg = engine.model_config, engine.config
    return pb.GetModelInfoResponse(
        model=model_name,
        architecture=mc.architecture,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        eos_token_ids=sorted(engine.eos_token_ids),
        has_chat_template=engine.tokenizer.has_chat_template,
        device=str(cfg.torch_device),
        dtype=str(cfg.torch_dtype).removeprefix("torch."),
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        kv_cache_pages=engine.load().kv_pages_total,
        page_size=cfg.page_size,
        max_num_seqs=cfg.max_num_seqs,
        max_logprobs=MAX_LOGPROBS,
        max_stop_strings=MAX_STOP_STRINGS,
        server_version=server_version,
        grammar_backend=cfg.grammar_backend,
        grammar_compile_timeout_s=cfg.grammar_compile_timeout_s,
        reasoning_parser=cfg.reasoning_parser or "",
    )
