"""How one request samples and when it stops."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

import numpy as np

from .errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Stop token ids are looked up on every generated token (and again for
# min_new_tokens' block): a few dozen is a lot; millions cost every request.
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRING_LENGTH = 256
# Temperatures below this sample greedily (vLLM's rule): dividing logits by a
# tiny temperature overflows them to infinities.
GREEDY_BELOW_TEMPERATURE = 1e-5
# A temperature between that and this is raised to this (vLLM's floor too, so
# a fleet of both samples a request alike): 0.005 would sharpen the
# distribution twice as much as 0.01, which vLLM serves it.
MIN_SAMPLING_TEMPERATURE = 1e-2
# vLLM bounds repetition_penalty only below (> 0); a huge value multiplies
# negative logits to -inf and is no longer a penalty, so it is capped here.
MAX_REPETITION_PENALTY = 10.0
# top_k beyond any vocabulary: an int32 on the wire, as vLLM takes it.
MAX_TOP_K = 2**31 - 1
# One bias per token of the largest vocabularies served (262,144): a longer
# map must name tokens outside the vocabulary, and every entry is checked on
# the event loop (1.4M entries, what a 16 MB message holds, took ~4 s there).
MAX_LOGIT_BIAS = 2**18


class InvalidSamplingParams(InvalidRequest):
    """A sampling or stopping value out of range; `field` names it."""


def _check_integers(name: str, values: Iterable[Any]) -> None:
    """InvalidSamplingParams unless every value is an integer (not a bool)."""
    for value in values:
        if type(value) is int:  # the common case, without the ABC check's cost
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise InvalidSamplingParams(name, f"must be an integer, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping options (MAX's SamplingParams, vLLM's names where they differ).

    temperature 0 (or below 1e-5) means greedy, and one in [1e-5, 0.01) is
    raised to 0.01 (as vLLM does); top_k <= 0 means no top-k cut.
    max_new_tokens None means "until the context is full". Ranges (vLLM's,
    every float finite): temperature >= 0, top_p in (0, 1], min_p in [0, 1],
    frequency and presence penalties in [-2, 2] (negative values encourage
    repetition), repetition_penalty in (0, 10], logit_bias values in [-100, 100]. logprobs=N returns the sampled
    token's log-probability plus the N most likely (N <= 20); prompt_logprobs
    likewise for prompt tokens. Log-probabilities are of the model's raw
    distribution (before penalties, temperature and filtering).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise containers so the object stays immutable and hashable-ish.
        # A lone string is one stop string, as vLLM takes it (a tuple of it
        # would be one stop string per character).
        # None for a collection is "none given", as vLLM reads it. Ids are
        # checked to be integers before they are converted (`int()` truncated 1.5).
        stop = self.stop if self.stop is not None else ()
        if not isinstance(stop, str) and isinstance(stop, Sized) and len(stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParams("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop))
        ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        if isinstance(ids, str | bytes):
            raise InvalidSamplingParams("stop_token_ids", "give a list of token ids")
        if isinstance(ids, Sized) and len(ids) > MAX_STOP_TOKEN_IDS:  # before millions are converted
            raise InvalidSamplingParams("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        _check_integers("stop_token_ids", ids)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSamplingParams("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, "
                                                      f"got {len(self.logit_bias)}")
        bias = dict(self.logit_bias) if self.logit_bias is not None else {}
        _check_integers("logit_bias", bias)
        for v in bias.values():
            if type(v) is float:
                continue
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise InvalidSamplingParams("logit_bias", f"biases must be numbers, got {v!r}")
        object.__setattr__(self, "logit_bias", MappingProxyType({int(k): float(v) for k, v in bias.items()}))
        self._validate()
        if GREEDY_BELOW_TEMPERATURE <= self.temperature < MIN_SAMPLING_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_SAMPLING_TEMPERATURE)

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise InvalidSamplingParams(name, msg)

        # Counts and seeds must be integers: logprobs=1.5 failed inside the
        # sampler (reported as the server's fault), max_new_tokens=2.5 ran 3.
        for name in ("top_k", "min_new_tokens"):
            _check_integers(name, [getattr(self, name)])
        for name in ("seed", "max_new_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_integers(name, [getattr(self, name)])
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                bad(name, f"must be a number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                bad(name, f"must be a finite number, got {value}")
        if not self.temperature >= 0.0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be -1 (disabled), 0 (disabled) or positive up to {MAX_TOP_K}, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not 0 <= tok < 2**31:
                bad("logit_bias", f"token id {tok} is outside [0, 2^31)")
            if not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"bias for token {tok} must be in [-100, 100], got {bias}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            bad("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                bad("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_LENGTH:
                bad("stop", f"stop strings must be at most {MAX_STOP_STRING_LENGTH} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids must be in [0, 2^31)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", f"must be in [0, 2^63), got {self.seed}")

    def __reduce__(self) -> tuple[type[SamplingParams], tuple[object, ...]]:
        # Pickled to an engine in another process: the read-only view of
        # logit_bias cannot be pickled, its dict can (__post_init__ wraps it again).
        values = [getattr(self, f.name) for f in fields(self)]
        values[_LOGIT_BIAS] = dict(self.logit_bias)
        return (SamplingParams, tuple(values))

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, int64; biases, float32), built once: the
        sampler reads it every step, and a request may bias the whole vocabulary."""
        return (np.fromiter(self.logit_bias.keys(), dtype=np.int64, count=len(self.logit_bias)),
                np.fromiter(self.logit_bias.values(), dtype=np.float32, count=len(self.logit_bias)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)


_LOGIT_BIAS = [f.name for f in fields(SamplingParams)].index("logit_bias")


def model_defaults(generation_config: str, values: Mapping[str, float]) -> tuple[dict[str, float], int | None]:
    """What a request that leaves them unset takes: a checkpoint's
    generation_config.json's values (`values`) with --generation-config auto,
    as vLLM's default, each kept only if a request could send it; none with
    "vllm". Returns the sampling values and the default max_new_tokens apart:
    the latter is capped by each prompt's room (`default_length`)."""
    if generation_config == "vllm":
        return {}, None
    kept: dict[str, float] = {}
    for name, value in values.items():
        try:
            SamplingParams(**{name: value})  # type: ignore[arg-type]
        except (InvalidRequest, TypeError):
            continue
        kept[name] = value
    max_new = kept.pop("max_new_tokens", None)
    return kept, None if max_new is None else int(max_new)


def default_length(params: SamplingParams, default: int | None, prompt_len: int,
                   max_model_len: int) -> SamplingParams:
    """`params` with the model's default max_new_tokens when it sets none (as
    vLLM does). A default at or past the room the prompt leaves is no limit of
    the request's: the context's applies (so the output ends CONTEXT_LENGTH, and
    a prompt with no room is refused by its own check)."""
    if default is None or params.max_new_tokens is not None or default >= max_model_len - prompt_len:
        return params
    if params.min_new_tokens > default:
        raise InvalidSamplingParams("min_new_tokens", f"({params.min_new_tokens}) exceeds the model's default "
                                    f"max_new_tokens ({default}, from its generation_config.json); "
                                    "set max_new_tokens")
    return replace(params, max_new_tokens=default)
