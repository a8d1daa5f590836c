"""What the compiler does with a JSON spec before any library sees it.

`plan_for(spec)` normalizes the schema (`schema_normalize`), derives each
library's view of it and the keywords that view leaves unenforced
(`schema_keywords`): `prepare_views`, run in a compile worker process with
process isolation (a large schema takes the better part of a second of pure
Python, which in the server would hold the GIL the engine thread needs); then
builds the output validator (`validation`, `with_validator`) in the server,
which keeps it. Once per spec: the plan is cached like a compiled grammar,
and every artifact compiled from it carries its unenforced keywords and
validator.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from . import structural_tag
from .errors import GrammarError
from .schema_keywords import backend_view
from .schema_normalize import Unresolved, normalize_schema, strict_defaults
from .schema_store import SchemaStore
from .spec import GrammarSpec
from .validation import SchemaValidator
from .watch_plan import WatchPlan

log = logging.getLogger(__name__)

# Schemas larger than this get their validator built on first use (see
# SchemaValidator.lazy).
LAZY_VALIDATOR_CHARS = 64 * 1024


@dataclass(frozen=True)
class SchemaPlan:
    """A JSON spec prepared for compiling.

    views: per backend, the spec that library compiles (normalized, without
        the keywords it cannot enforce).
    unenforced: per backend, the schema keywords it leaves to the validator.
    validator: the full schema's validator; None when it cannot read the schema
        (`validator_error` says why), and outputs are then not checked.
    watch: where each node of the (normalized) schema applies, for the value
        checks of resampling requests (engine/resample.py); None for json_object.
    """

    views: dict[str, GrammarSpec]
    unenforced: dict[str, tuple[str, ...]]
    validator: SchemaValidator | None
    validator_error: str | None = None
    watch: WatchPlan | None = None

    def order(self, preferred: tuple[str, ...]) -> tuple[str, ...]:
        """`preferred` re-ordered so the backend leaving fewer keywords
        unenforced comes first (ties keep the preferred order)."""
        return tuple(sorted(preferred, key=lambda b: (len(self.unenforced.get(b, ())),
                                                      preferred.index(b))))

    @property
    def size_bytes(self) -> int:
        return sum(v.source_size for v in self.views.values()) + 4096


def plan_for(spec: GrammarSpec, backends: tuple[str, ...],
             store: SchemaStore | None = None) -> SchemaPlan | None:
    """The plan of a json_schema / json_object spec (None for other kinds);
    `store` has the documents its `$ref`s may name by URI.

    Raises GrammarError when the schema cannot be normalized (a `$ref` that
    points nowhere, too large once expanded).
    """
    prepared = prepare_views(spec, backends, store)
    if prepared is None:
        return None
    return with_validator(spec, *prepared, store=store)


def with_validator(spec: GrammarSpec, views: dict[str, GrammarSpec],
                   unenforced: dict[str, tuple[str, ...]],
                   watch: WatchPlan | None, store: SchemaStore | None = None) -> SchemaPlan:
    """The plan of `spec` from its prepared views, with the full schema's validator."""
    if spec.kind == "json_schema" and spec.source_size > LAZY_VALIDATOR_CHARS:
        validator = SchemaValidator.lazy(str(spec.source), store)
        return SchemaPlan(views, unenforced, validator, watch=watch)
    schema: Any = {"type": "object"} if spec.kind == "json_object" else json.loads(str(spec.source))
    try:
        return SchemaPlan(views, unenforced, SchemaValidator(schema, store), watch=watch)
    except ValueError as e:
        return SchemaPlan(views, unenforced, None, str(e), watch=watch)


def prepare_views(spec: GrammarSpec, backends: tuple[str, ...], store: SchemaStore | None = None
                  ) -> tuple[dict[str, GrammarSpec], dict[str, tuple[str, ...]], WatchPlan | None] | None:
    """Each backend's view of a JSON spec, the keywords it leaves unenforced
    and the plan of resampling requests' value checks (None for other kinds). Pure Python over the whole schema: the
    compiler runs it in a compile worker, away from the server's GIL."""
    if spec.kind == "json_object":
        schema: Any = {"type": "object"}
    elif spec.kind == "json_schema":
        assert isinstance(spec.source, str)
        try:
            schema = json.loads(spec.source)  # large ones were not parsed at the edge
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"JSON schema is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("JSON schema must be a JSON object or a boolean")
    else:
        return None
    normalized = normalized_schema(_closed(schema) if spec.options.closed_objects else schema, store)
    views: dict[str, GrammarSpec] = {}
    unenforced: dict[str, tuple[str, ...]] = {}
    try:
        for backend in backends:
            view, missing = backend_view(normalized, backend)
            unenforced[backend] = missing
            if spec.kind == "json_object":
                views[backend] = spec
            else:
                views[backend] = GrammarSpec("json_schema", json.dumps(view, ensure_ascii=False),
                                             spec.options)
        watch = WatchPlan.for_schema(normalized, schema) if spec.kind == "json_schema" else None
    except (RecursionError, MemoryError):
        raise _too_deep() from None
    return views, unenforced, watch


def normalized_schema(schema: Any, store: SchemaStore | None = None) -> Any:
    """`schema` normalized (`schema_normalize`); as written when it names a
    document `store` lacks, or the normalizer fails on it. GrammarError when
    it cannot be compiled at all (a `$ref` to nowhere, too large or deep)."""
    try:
        return normalize_schema(schema, store)
    except GrammarError:
        raise
    except Unresolved:
        return schema
    except (RecursionError, MemoryError):
        raise _too_deep() from None
    except Exception:  # a normalizer bug on an odd schema: the libraries get it as written
        log.exception("could not normalize a JSON schema; compiling it as written")
        return schema


def tag_view(spec: GrammarSpec, backend: str, store: SchemaStore | None = None,
             unenforced: set[str] | None = None) -> GrammarSpec:
    """A structural tag as `backend` compiles it: each JSON-schema content
    normalized and cut to the library's view as a JSON-schema spec's is, so
    the grammar enforces what the tag's value checks (tag_watch.TagPlan)
    take as enforced; the keywords cut go into `unenforced` when given. Run
    where the compile runs (a worker, with isolation)."""
    assert spec.kind == "structural_tag" and isinstance(spec.source, str)

    def view(schema: Any) -> Any:
        if spec.options.closed_objects:
            schema = _closed(schema)
        cut, left_out = backend_view(normalized_schema(schema, store), backend)
        if unenforced is not None:
            unenforced.update(left_out)
        return cut

    tag = structural_tag.map_schemas(structural_tag.normalize(spec.source), view)
    return GrammarSpec("structural_tag", json.dumps(tag, ensure_ascii=False), spec.options)


def _closed(schema: Any) -> Any:
    try:
        return strict_defaults(schema)
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> GrammarError:
    return GrammarError("JSON schema is too deeply nested to compile", reason="too_large")
