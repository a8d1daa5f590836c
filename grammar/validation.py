"""Checking a finished output against the whole JSON schema.

The grammar enforces what its library can (see `schema_keywords`); a real
validator (jsonschema-rs) checks everything else once the output is complete.
A `SchemaValidator` is built once per schema, when the schema's grammar is
compiled, and cached with it; validating one output then costs microseconds
for typical schemas (BENCHMARKS.md has figures per schema size).

The validator sees the schema as the client wrote it, not the normalized form
the libraries compile, so a normalization mistake can never hide a violation.
It runs offline: a `$ref` to another document is read from the schema store
(`schema_store`), never fetched.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import jsonschema_rs

from .json_values import parse_instance
from .schema_store import SchemaStore

# Messages quote the instance; keep what goes into a status or a log short.
_MAX_MESSAGE_CHARS = 300


def validator_options(store: SchemaStore | None) -> dict[str, Any]:
    """jsonschema-rs options that resolve other documents from `store` only."""
    return {"retriever": store.retrieve} if store is not None else {"offline": True}


@dataclass(frozen=True)
class ValidationResult:
    """The outcome of validating one output.

    valid: the output is JSON and the schema accepts it.
    instance_path: JSON pointer to the first failing value ("" for the root).
    keyword: the schema keyword that failed (empty when the output is not JSON).
    message: one line, for humans.
    """

    valid: bool
    instance_path: str = ""
    keyword: str = ""
    message: str = ""
    checked: bool = True  # False: the validator could not read the schema (`message` says why)
    parsed: bool = True  # False: the output is not JSON


VALID = ValidationResult(True)


class OutputValidator(Protocol):
    """What gives a finished output its verdict: `SchemaValidator` for JSON
    kinds, `output_check.OutputCheck` for regex, choice and grammar kinds."""

    @property
    def built(self) -> bool: ...

    def prepare(self) -> None: ...

    def validate_text(self, text: str) -> ValidationResult: ...


class SchemaValidator:
    """A compiled validator for one schema (thread-safe; shared by requests).

    Raises ValueError when the validator cannot read the schema (the grammar
    compiler then reports outputs as not checked rather than failing them).
    A `lazy` one (`SchemaValidator.lazy(source)`, for large schemas) is built
    on its first use instead: building holds the GIL for a while (hundreds of
    milliseconds for a schema of several hundred KB), which a constraint that
    never completes (a slow-to-compile "bomb") should not cost the server;
    its failure to read the schema is then a result with `checked` False.
    """

    def __init__(self, schema: Any, store: SchemaStore | None = None) -> None:
        self._source: str | None = None
        self._store = store
        self._lock = threading.Lock()
        self._failed: str | None = None
        self._validator = self._build(schema, store)

    @classmethod
    def lazy(cls, source: str, store: SchemaStore | None = None) -> SchemaValidator:
        """A validator of the schema in `source`, built when first used."""
        self = cls.__new__(cls)
        self._source, self._store, self._lock, self._validator = source, store, threading.Lock(), None
        self._failed = None
        return self

    @property
    def built(self) -> bool:
        """Whether using it costs no build any more (built, or found unreadable)."""
        return self._validator is not None or self._failed is not None

    def prepare(self) -> None:
        """Build a lazy validator now (slow for a large schema: not on the
        event loop or the engine thread); a schema it cannot read is remembered."""
        with contextlib.suppress(ValueError):  # remembered; validate() reports it
            self._ready()

    @staticmethod
    def _build(schema: Any, store: SchemaStore | None) -> Any:
        try:
            return jsonschema_rs.validator_for(schema, **validator_options(store))
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as e:
            raise ValueError(f"the validator cannot read this schema: {_short(str(e))}") from None

    def _ready(self) -> Any:
        if self._validator is None:
            with self._lock:
                if self._failed is not None:
                    raise ValueError(self._failed)  # built once, found unreadable
                if self._validator is None:
                    assert self._source is not None
                    try:
                        self._validator = self._build(json.loads(self._source), self._store)
                    except ValueError as e:
                        self._failed = str(e)
                        raise
        return self._validator

    def validate_text(self, text: str) -> ValidationResult:
        """Parse `text` as JSON and validate it; never raises."""
        try:
            instance = parse_instance(text)
        except (ValueError, RecursionError) as e:
            return ValidationResult(False, "", "", f"output is not JSON: {_short(str(e))}", parsed=False)
        return self.validate(instance)

    def validate(self, instance: Any) -> ValidationResult:
        """Validate a parsed instance: VALID or the first error; never raises."""
        try:
            validator = self._ready()
        except ValueError as e:
            return ValidationResult(False, "", "", str(e), checked=False)
        try:
            error = next(iter(validator.iter_errors(instance)), None)
        except Exception as e:  # noqa: BLE001 - a validator fault must not fail the request
            # Not a verdict: the validator could not read the value (a lone
            # surrogate escape, "\ud800", valid JSON it refuses), so NOT_CHECKED
            # and nothing resampled or refused for it.
            return ValidationResult(False, "", "", f"validator failed: {_short(str(e))}", checked=False)
        if error is None:
            return VALID
        keyword = next((str(p) for p in reversed(error.schema_path) if isinstance(p, str)), "")
        path = "".join("/" + str(p).replace("~", "~0").replace("/", "~1")
                       for p in error.instance_path)
        return ValidationResult(False, path, keyword, _short(error.message))


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_MESSAGE_CHARS else line[: _MAX_MESSAGE_CHARS - 1] + "…"


@functools.lru_cache(maxsize=4096)
def readable_pattern(pattern: str) -> bool:
    """Whether the validator reads `pattern` as a regex (ECMA-262, as a
    schema's `pattern` is read)."""
    try:
        jsonschema_rs.validator_for({"type": "string", "pattern": pattern})
    except (jsonschema_rs.ValidationError, ValueError):
        return False
    return True
