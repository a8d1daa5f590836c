"""vLLM's gRPC engine protocol <-> our engine: checks, SamplingParams, messages.

`vllm.grpc.engine.GenerateRequest` is validated here with the same rules as
`stencil.v1` (service/api/convert.py, service/structured.py), and its failures name
the field by its path in *that* proto (`sampling_params.top_p`,
`tokenized.input_ids[3]`). Unset and zero values take the defaults the proto
and vLLM document: temperature unset -> 1.0, top_p 0 -> 1.0, top_k 0 -> no cut,
repetition_penalty 0 -> 1.0, n 0 -> 1, max_tokens unset (or past the context) -> up to the context.

Responses follow vLLM's servicer: stream chunks carry the new token ids only
(the router detokenizes), `completion_tokens` is the chunk's own count, and the
closing `complete` repeats the last delta in streaming mode (the router
accumulates the chunks) or carries every output token otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine import EngineCore, GenerationStatus, InvalidRequest, RequestOutput, SamplingParams
from engine.context import TokenLogprobs
from engine.reasoning import ReasoningOptions
from engine.requests import RequestSpec
from engine.sampling_params import MAX_LOGPROBS
from grammar import GrammarError, GrammarOptions, GrammarSpec
from service.errors import Reason, ServiceError, invalid_argument
from service.gen.vllm import vllm_engine_pb2 as vpb
from service.structured import ConstraintSpec

# Engine parameter name -> path of the vLLM proto field it came from.
FIELD_PATHS: dict[str, str] = {
    **{name: f"sampling_params.{name}" for name in (
        "temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "seed", "logit_bias", "stop", "stop_token_ids", "ignore_eos",
        "include_stop_str_in_output", "logprobs", "prompt_logprobs", "skip_special_tokens")},
    "max_new_tokens": "sampling_params.max_tokens",
    "min_new_tokens": "sampling_params.min_tokens",
    "request_id": "request_id",
}
# Most sequences one request may ask for (n).
MAX_N = 16


@dataclass(frozen=True)
class VllmPrepared:
    """A checked vLLM Generate request: one spec per sequence (n of them, seeds
    apart), the output options and the constraint, if any."""

    specs: tuple[RequestSpec, ...]
    logprobs: int | None
    prompt_logprobs: int | None
    constraint: ConstraintSpec | None
    prompt_tokens: int
    # grammar_from_first_token: the constraint starts at the first token
    # whatever reasoning parser runs (the gateway's grammar covers the thought).
    reasoning: ReasoningOptions | None = None
    # The tokenizer's EOS: vLLM ends on the model's other EOS ids (its
    # generation_config's) as stop tokens, matched by id; on this one, unmatched.
    tokenizer_eos: int | None = None


def _path(err: InvalidRequest, input_field: str) -> str:
    if err.field == "prompt":
        return input_field if err.index is None else f"{input_field}[{err.index}]"
    path = FIELD_PATHS.get(err.field, f"sampling_params.{err.field}")
    if err.index is not None and err.field == "stop_token_ids":
        path += f"[{err.index}]"
    return path


def sampling_params(p: vpb.SamplingParams) -> SamplingParams:
    """Our SamplingParams from vLLM's, with the proto's defaults for unset/zero fields."""
    kwargs: dict[str, object] = {
        "temperature": p.temperature if p.HasField("temperature") else 1.0,
        "top_p": p.top_p if p.top_p != 0.0 else 1.0,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "min_p": p.min_p,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
        "min_new_tokens": p.min_tokens,
        "ignore_eos": p.ignore_eos,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "skip_special_tokens": p.skip_special_tokens,
        "stop": p.stop,
        "stop_token_ids": p.stop_token_ids,  # SamplingParams bounds its length, then copies it
    }
    if p.HasField("max_tokens"):
        kwargs["max_new_tokens"] = p.max_tokens
    if p.HasField("seed") and p.seed != -1:  # -1: no seed, as vLLM reads it (a fixed seed repeated its draws)
        kwargs["seed"] = p.seed % (1 << 63)  # a signed int32 here, as vLLM takes any integer
    if p.logit_bias:
        kwargs["logit_bias"] = p.logit_bias  # SamplingParams bounds its size, then copies it
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name):
            value = getattr(p, name)
            if value == -1 or value > MAX_LOGPROBS:
                # vLLM's -1 means the whole vocabulary; we return at most 20.
                raise invalid_argument(f"sampling_params.{name}", f"must be in [0, {MAX_LOGPROBS}], got {value}")
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except InvalidRequest as err:
        raise invalid_argument(_path(err, "input"), err.description) from None


def _reads_as_lark(grammar: str) -> bool:
    """vLLM's rule for its `grammar` field: Lark unless a line (comments
    aside) defines a rule with `::=` (EBNF/GBNF). SMG forwards a client's
    grammar there as it came."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.splitlines())
    return not any("::=" in line for line in lines)


_AS_VLLM = GrammarOptions(closed_objects=True)


def constraint_spec(p: vpb.SamplingParams) -> ConstraintSpec | None:
    """The request's constraint through our grammar path (None when unconstrained).

    JSON is compact (no whitespace at all), as stencil.v1's default: the output
    is valid JSON a weak model cannot pad with runs of spaces. Schemas, a
    structural tag's too, are read as vLLM reads them (`closed_objects`: an
    object that names its properties admits no others): a router builds them
    for vLLM, as SMG's required tool calls, whose objects say nothing of other
    properties, so a weak model wrote keys of its own until max_tokens. `grammar` is an
    xgrammar EBNF (GBNF) grammar, or a Lark one as vLLM tells them apart. `structural_tag` is vLLM's JSON text (the
    legacy `structures` + `triggers` or xgrammar's `format`; SMG sends the
    latter for forced tool calls).
    """
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    field = "sampling_params.choice.choices" if kind == "choice" else f"sampling_params.{kind}"
    try:
        if kind == "json_schema":
            spec = GrammarSpec.json_schema(p.json_schema, _AS_VLLM)
        elif kind == "json_object":
            if not p.json_object:
                raise invalid_argument(field, "must be true (leave the constraint unset for free text)")
            spec = GrammarSpec.json_object()
        elif kind == "regex":
            spec = GrammarSpec("regex", p.regex)
        elif kind == "grammar":
            spec = GrammarSpec("lark" if _reads_as_lark(p.grammar) else "ebnf", p.grammar)
        elif kind == "choice":
            spec = GrammarSpec.choice(list(p.choice.choices))
        else:
            spec = GrammarSpec("structural_tag", p.structural_tag, _AS_VLLM)
    except GrammarError as err:
        raise invalid_argument(field, str(err), Reason.GRAMMAR_INVALID) from None
    return ConstraintSpec(spec, None, field)


def _prompt(req: vpb.GenerateRequest, engine: EngineCore) -> tuple[Sequence[int], str]:
    which = req.WhichOneof("input")
    if which == "tokenized":
        # The field itself: the check converts it a slice at a time (a list of
        # millions of ids in one call held the GIL, and the event loop, ~0.2 s).
        ids = req.tokenized.input_ids
        if not ids:
            raise invalid_argument("tokenized.input_ids", "the prompt is empty")
        return ids, "tokenized.input_ids"
    if which == "text":
        if not req.text:
            raise invalid_argument("text", "the prompt is empty")
        # Truncated to its end, a prompt of any length may fit.
        context = None if req.sampling_params.HasField("truncate_prompt_tokens") else engine.max_model_len
        try:
            return engine.tokenizer.encode(req.text, add_special_tokens=True, context=context), "text"
        except InvalidRequest as err:
            raise invalid_request(err, "text") from None
    raise invalid_argument("input", "set one of tokenized or text")


def _refuse_unsupported(req: vpb.GenerateRequest) -> None:
    """Fields for features this server does not have: an error, never ignored."""
    if req.HasField("mm_inputs") or len(req.extra_mm_inputs) or req.HasField("media_refs"):
        field = "mm_inputs" if req.HasField("mm_inputs") else (
            "extra_mm_inputs" if len(req.extra_mm_inputs) else "media_refs")
        raise invalid_argument(field, "this server serves a text-only model")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        field = "kv_transfer_params" if req.HasField("kv_transfer_params") else "kv_transfer_params_json"
        raise invalid_argument(field, "prefill/decode disaggregation is not supported by this server")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise invalid_argument("data_parallel_rank", "this server has one data-parallel rank (0)")


# Between a request's id and its sequence's number: not a character a client's
# id may hold (check_request_id), so sequence 1 of "job" is never the client
# request "job/1" (an Abort of one would stop the other).
_SEQUENCE_SEPARATOR = "\u00b7"


def sequence_id(request_id: str, i: int) -> str:
    """The engine's id of sequence `i` (> 0) of an n > 1 request."""
    return f"{request_id}{_SEQUENCE_SEPARATOR}{i}"


def prepare_generate(req: vpb.GenerateRequest, engine: EngineCore, request_id: str) -> VllmPrepared:
    """Check a vLLM Generate request against the engine (no engine state touched).

    `request_id` is the checked, scoped id; sequence i > 0 of an n > 1 request
    runs as `sequence_id(request_id, i)` with seed + i (so n seeded samples differ).
    """
    _refuse_unsupported(req)
    p = req.sampling_params
    n = p.n or 1
    if n > MAX_N:
        raise invalid_argument("sampling_params.n", f"must be in [1, {MAX_N}], got {n}")
    params = sampling_params(p)
    if n > 1 and params.greedy:
        # As vLLM: n greedy samples would be one answer n times.
        raise invalid_argument("sampling_params.n", f"must be 1 with greedy sampling (temperature 0), got {n}")
    constraint = constraint_spec(p)
    ids, input_field = _prompt(req, engine)
    cut = 0  # prompt tokens truncation dropped from the front
    if p.HasField("truncate_prompt_tokens"):
        keep = p.truncate_prompt_tokens
        if keep == -1:
            keep = engine.max_model_len - 1
        if not 1 <= keep <= engine.max_model_len:  # as vLLM, a value past the context is refused
            raise invalid_argument("sampling_params.truncate_prompt_tokens",
                                   f"must be -1 (the model's maximum) or in [1, {engine.max_model_len}], "
                                   f"got {keep}")
        cut = max(0, len(ids) - keep)
        ids = ids[cut:]  # vLLM keeps the end of the prompt
    room = engine.max_model_len - len(ids)
    if params.max_new_tokens is not None and 0 < room < params.max_new_tokens:
        # As vLLM's engine: the answer ends at the context ("length"), not refused.
        params = dataclasses.replace(params, max_new_tokens=room)
    specs = []
    try:
        first = engine.requests.check(ids, params, request_id)
        specs.append(first)
        for i in range(1, n):
            specs.append(RequestSpec(first.prompt, first.params, sequence_id(request_id, i), first.max_length,
                                     (first.seed + i) % (1 << 63)))
    except InvalidRequest as err:
        if err.field == "prompt" and err.index is not None:
            err.index += cut  # named where the client sent it
        raise invalid_request(err, input_field) from None
    reasoning = ReasoningOptions(after_thought=False) if p.grammar_from_first_token else None
    return VllmPrepared(tuple(specs), params.logprobs, params.prompt_logprobs, constraint, len(first.prompt),
                        reasoning, engine.tokenizer.eos_token_id)


def invalid_request(err: InvalidRequest, input_field: str) -> ServiceError:
    return invalid_argument(_path(err, input_field), err.description)


# -- responses ----------------------------------------------------------------
def finish_reason(final: RequestOutput) -> str:
    """vLLM's finish reason: "stop" (EOS, a stop string or token), "length", "abort"."""
    status = final.status
    if status in (GenerationStatus.MAXIMUM_LENGTH, GenerationStatus.CONTEXT_LENGTH):
        return "length"
    if status is GenerationStatus.CANCELLED:
        return "abort"
    if status is GenerationStatus.ERROR:
        return "error"
    return "stop"


def _top(lp: TokenLogprobs) -> vpb.TopLogProbs:
    return vpb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])


def output_logprobs(items: Sequence[TokenLogprobs], top: int | None) -> vpb.OutputLogProbs | None:
    if top is None or not items:
        return None
    out = vpb.OutputLogProbs(token_logprobs=[lp.logprob for lp in items],
                             token_ids=[lp.token_id for lp in items])
    if top:
        out.top_logprobs.extend(_top(lp) for lp in items)
    return out


def input_logprobs(items: Sequence[TokenLogprobs | None], prompt: Sequence[int],
                   top: int | None) -> vpb.InputLogProbs | None:
    """Prompt log-probabilities; the first prompt token has none (an unset value)."""
    if top is None or not items:
        return None
    out = vpb.InputLogProbs(token_ids=[int(t) for t in prompt])
    for lp in items:
        entry = vpb.InputTokenLogProb()
        if lp is not None:
            entry.value = lp.logprob
        out.token_logprobs.append(entry)
        if top:  # as vLLM: none at all for prompt_logprobs 0 (not one empty entry a token)
            out.top_logprobs.append(_top(lp) if lp is not None else vpb.TopLogProbs())
    return out


@dataclass
class SequenceState:
    """What one of a request's n sequences has produced so far (event loop only)."""

    index: int
    prompt: Sequence[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs | None]
    sent_prompt_logprobs: bool = False
    cached_tokens: int = 0

    @classmethod
    def start(cls, index: int, prompt: Sequence[int]) -> SequenceState:
        return cls(index, prompt, [], [], [])

    def add(self, outputs: Sequence[RequestOutput]) -> tuple[list[int], list[TokenLogprobs]]:
        """Record a delivery; returns its new token ids and their log-probabilities."""
        new_ids: list[int] = []
        new_lps: list[TokenLogprobs] = []
        for o in outputs:
            new_ids += o.token_ids
            new_lps += o.logprobs
            if o.prompt_logprobs:
                self.prompt_logprobs += o.prompt_logprobs
            self.cached_tokens = max(self.cached_tokens, o.cached_prompt_tokens)
        self.token_ids += new_ids
        self.logprobs += new_lps
        return new_ids, new_lps


def chunk(state: SequenceState, new_ids: list[int], new_lps: list[TokenLogprobs],
          prepared: VllmPrepared, final: bool) -> vpb.GenerateResponse | None:
    """A stream chunk for the delivery (None when it carries nothing new)."""
    in_lps = None
    if not state.sent_prompt_logprobs and prepared.prompt_logprobs is not None and (
            len(state.prompt_logprobs) >= len(state.prompt) or final):
        in_lps = input_logprobs(state.prompt_logprobs, state.prompt, prepared.prompt_logprobs)
        state.sent_prompt_logprobs = True
    if not new_ids and in_lps is None:
        return None
    msg = vpb.GenerateStreamChunk(token_ids=new_ids, prompt_tokens=prepared.prompt_tokens,
                                  completion_tokens=len(new_ids), cached_tokens=state.cached_tokens,
                                  index=state.index)
    out_lps = output_logprobs(new_lps, prepared.logprobs)
    if out_lps is not None:
        msg.output_logprobs.CopyFrom(out_lps)
    if in_lps is not None:
        msg.input_logprobs.CopyFrom(in_lps)
    return vpb.GenerateResponse(chunk=msg)


def complete(state: SequenceState, final: RequestOutput, prepared: VllmPrepared, stream: bool,
             last_ids: list[int], last_lps: list[TokenLogprobs]) -> vpb.GenerateResponse:
    """The closing message of one sequence: every output token, or (streaming)
    the last delta again, as vLLM's servicer sends it."""
    ids, lps = (last_ids, last_lps) if stream else (state.token_ids, state.logprobs)
    msg = vpb.GenerateComplete(output_ids=ids, finish_reason=finish_reason(final),
                               prompt_tokens=prepared.prompt_tokens,
                               completion_tokens=len(state.token_ids) if not stream else len(ids),
                               cached_tokens=state.cached_tokens, index=state.index)
    out_lps = output_logprobs(lps, prepared.logprobs)
    if out_lps is not None:
        msg.output_logprobs.CopyFrom(out_lps)
    in_lps = input_logprobs(state.prompt_logprobs, state.prompt, prepared.prompt_logprobs)
    if in_lps is not None:
        msg.input_logprobs.CopyFrom(in_lps)
    if isinstance(final.stop_reason, str):
        msg.matched_stop_str = final.stop_reason
    elif isinstance(final.stop_reason, int):
        msg.matched_token_id = final.stop_reason
    elif final.status is GenerationStatus.END_OF_SEQUENCE and state.token_ids \
            and state.token_ids[-1] != prepared.tokenizer_eos:
        msg.matched_token_id = state.token_ids[-1]  # another EOS of the model's: a stop token to vLLM
    return vpb.GenerateResponse(complete=msg)
