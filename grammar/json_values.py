"""Equality of JSON values as JSON Schema defines it.

`1` equals `1.0`, `true` is not `1`, objects ignore key order. Python's own
`==` gets the second wrong (`True == 1`), so schema rewriting and output
checks compare `canonical` forms instead.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def _finite(text: str) -> float:
    value = float(text)
    if value == 0.0 and any(digit in "123456789" for digit in text.lower().partition("e")[0]):
        # Below a double's smallest: read as its nearest non-zero one, signed
        # (as 0 it would equal 0 and be an integer, which it is not).
        return math.copysign(_SMALLEST, value)
    return max(-sys.float_info.max, min(sys.float_info.max, value))


_SMALLEST = 5e-324  # the least positive (subnormal) double

# An instance's numbers past a double's range are read as its largest value:
# Python reads them as infinity, which is no JSON value (a validator sees
# null); those too small for a double, as its smallest (Python reads 0.0).
INSTANCE_DECODER = json.JSONDecoder(parse_float=_finite)


def parse_instance(text: str) -> Any:
    """A model's JSON output as a value to validate (ValueError if it is not JSON)."""
    return INSTANCE_DECODER.decode(text)


def canonical(value: Any) -> Any:
    """A hashable form of a JSON value under JSON Schema equality (RecursionError
    for values nested past Python's recursion limit)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)  # 1 == 1.0, with equal hashes
    if isinstance(value, str):
        return ("s", value)
    if value is None:
        return ("z",)
    if isinstance(value, list):
        return ("a", tuple(canonical(v) for v in value))
    return ("o", frozenset((k, canonical(v)) for k, v in value.items()))


def same(a: Any, b: Any) -> bool:
    """Whether two JSON values are equal under JSON Schema (False when too deep to tell)."""
    try:
        return bool(canonical(a) == canonical(b))
    except RecursionError:
        return False
