"""Checking a request before it runs, once: `check_request` -> `RequestSpec`.

The service (or the offline `LLM`) checks a request first, compiles its
constraint if it has one, then builds its context from the spec: every check
happens here, and the seed is drawn here, so nothing is validated or drawn
twice.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest
from .sampling_params import SamplingParams


def check_token_ids(ids: Iterable[int], vocab_size: int, field: str) -> np.ndarray:
    """`ids` as an int64 array; InvalidRequest (with the index) for one outside
    [0, vocab_size) or not an integer (a float was truncated, b"Hi" read as
    its bytes, 2**70 overflowed with a bare OverflowError)."""
    if isinstance(ids, str | bytes | bytearray):
        raise InvalidRequest(field, f"give token ids as a list of integers, not {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        arr = _integer_ids(ids, field)
    else:
        # Converted in C a slice at a time, each slice's dtype read after (not a
        # Python check per id): the GIL changes hands between slices, where one
        # call for millions of ids held it (and every stream's event loop)
        # ~0.15 s. Any iterable: a list, a protobuf field, a deque, dict keys.
        parts = [_integer_ids(np.asarray(part), field) for part in id_slices(ids)]
        arr = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidRequest(field, f"token id {int(arr[i])} is outside the vocabulary [0, {vocab_size})", index=i)
    return arr


# Ids copied per C call (~2 ms each).
ID_SLICE = 1 << 15


def id_slices(ids: Iterable[int]) -> Iterator[list[int]]:
    """`ids` as lists of at most ID_SLICE: one copy of millions (a
    protobuf field's, say) holds the GIL, and every stream's event loop, for
    ~0.15 s; between slices it changes hands."""
    rest = iter(ids)
    while part := list(itertools.islice(rest, ID_SLICE)):
        yield part


def _integer_ids(arr: np.ndarray, field: str) -> np.ndarray:
    """`arr` as int64, refused unless integers: floats, strings or bools make
    another kind, an id past 2^63 an object array."""
    # A uint64 past 2^63 would wrap below 0 as int64.
    if arr.size and (arr.dtype.kind not in "iu" or arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max):
        raise InvalidRequest(field, "token ids must be integers in [0, 2^63)"
                             + (f", got {arr.dtype}" if arr.dtype.kind not in "Ou" else ""))
    return arr.astype(np.int64, copy=False).reshape(-1)


def check_params_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request's parameters name (stop tokens, logit biases) are in the vocabulary."""
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias), vocab_size, "logit_bias")


@dataclass(frozen=True)
class RequestSpec:
    """A checked generation request: what its context is built from."""

    prompt: np.ndarray
    params: SamplingParams
    request_id: str | None
    max_length: int  # prompt + the most it may generate
    seed: int


def check_request(prompt: Sequence[int] | np.ndarray, params: SamplingParams | None, request_id: str | None,
                  vocab_size: int, max_model_len: int) -> RequestSpec:
    """Check a tokenized prompt and its parameters against the model; InvalidRequest names the field."""
    params = params or SamplingParams()
    ids = check_token_ids(prompt, vocab_size, "prompt")
    if ids.size == 0:
        raise InvalidRequest("prompt", "the prompt is empty")
    if ids.size >= max_model_len:
        raise InvalidRequest("prompt", f"the prompt has {ids.size} tokens; the context holds "
                                       f"{max_model_len} including at least one new token")
    if params.max_new_tokens is not None:
        max_length = ids.size + params.max_new_tokens
        if max_length > max_model_len:
            raise InvalidRequest("max_new_tokens", f"prompt ({ids.size}) + max_new_tokens "
                                 f"({params.max_new_tokens}) exceeds the context length {max_model_len}")
    else:
        max_length = max_model_len
    check_params_token_ids(params, vocab_size)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return RequestSpec(ids, params, request_id, max_length, seed)
