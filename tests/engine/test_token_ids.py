"""Checking token ids: converted a slice at a time (the GIL changes hands
between slices), with each slice's kind checked, so an id of the wrong kind
anywhere is refused as if the list were converted whole."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from engine.errors import InvalidRequest
from engine.requests import ID_SLICE, check_token_ids
from service.gen.stencil.v1 import generate_pb2 as pb

N = 2 * ID_SLICE + 17  # three slices, the last a short one


def _ids() -> list[int]:
    return [i % 1000 for i in range(N)]


@pytest.mark.parametrize("form", [list, tuple, np.asarray, iter, collections.deque,
                                  lambda ids: pb.DetokenizeRequest(token_ids=ids).token_ids])
def test_every_form_gives_the_same_array(form) -> None:
    got = check_token_ids(form(_ids()), 1000, "ids")
    assert got.dtype == np.int64 and got.tolist() == _ids()


@pytest.mark.parametrize(("bad", "says"), [(2.5, "float64"), ("7", "<U"), (2**70, "integers")])
@pytest.mark.parametrize("where", [0, ID_SLICE, N - 1])
def test_an_id_of_the_wrong_kind_in_any_slice_is_refused(bad, says, where) -> None:
    ids: list[object] = list(_ids())
    ids[where] = bad
    with pytest.raises(InvalidRequest, match="integers") as err:
        check_token_ids(ids, 1000, "ids")  # type: ignore[arg-type]
    assert says in err.value.description and err.value.field == "ids"


def test_an_id_outside_the_vocabulary_is_named_by_its_index_across_slices() -> None:
    ids = _ids()
    ids[ID_SLICE + 3] = 1000
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as err:
        check_token_ids(ids, 1000, "ids")
    assert err.value.index == ID_SLICE + 3
    # One past 2^63 in a slice of its own reads as a uint64 there: refused as
    # what it is, not as the negative id it wraps to.
    for past in ([*_ids(), 2**63 + 5], [np.uint64(2**63 + 1)]):
        with pytest.raises(InvalidRequest, match=r"integers in \[0, 2\^63\)"):
            check_token_ids(past, 1000, "ids")  # type: ignore[arg-type]


def test_empty_ids_give_an_empty_array() -> None:
    empties: list[Any] = [[], (), np.zeros(0, np.int64)]
    for empty in empties:
        got = check_token_ids(empty, 10, "ids")
        assert got.dtype == np.int64 and got.size == 0


def test_no_conversion_takes_more_than_a_slice(monkeypatch) -> None:
    # What the slices are for: one C call over millions of ids held the GIL
    # (and every stream's event loop) ~0.15 s.
    sizes: list[int] = []
    real = np.asarray

    def asarray(obj, *args, **kwargs):
        sizes.append(len(obj))
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(np, "asarray", asarray)
    check_token_ids(pb.DetokenizeRequest(token_ids=_ids()).token_ids, 1000, "ids")
    assert sizes and max(sizes) <= ID_SLICE
