"""Client flags copied into request messages, with the flag named when one does not fit.

Protobuf refuses a value out of its field's range (a negative --seed, a
--dimensions past uint32) with a bare ValueError; the client commands turn it
into `stencild: --seed: ...` and exit code 2, as argparse does for a bad flag.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class BadFlag(ValueError):
    """A flag whose value the request cannot take."""

    def __init__(self, flag: str, err: Exception):
        super().__init__(f"{flag}: {err}")


def set_flags(args: argparse.Namespace, fields: list[tuple[str, Any, str]]) -> None:
    """Copy each set `--flag` of `args` into its (message, field); BadFlag names the first misfit."""
    for flag, message, field in fields:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            try:
                setattr(message, field, value)
            except (ValueError, TypeError) as err:
                raise BadFlag(flag, err) from None


def refuse(err: BadFlag) -> int:
    """Report a bad flag as argparse would: on stderr, exit code 2."""
    print(f"stencild: {err}", file=sys.stderr)
    return 2
