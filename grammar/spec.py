"""What a request asks its output to look like: `GrammarSpec` and its options.

A spec is a frozen, hashable value, so the compiler can use it directly as a
cache key. It is validated when built: a malformed spec never reaches a
compiler.

JSON whitespace. Peers let a JSON grammar accept any run of whitespace between
tokens, and weak models exploit that: a random-weight model under vLLM's JSON
schema mode printed `{"name"` followed by 70 spaces until max_tokens. The
default here is therefore `compact` (no whitespace at all, separators `,` and
`:` - exactly what `json.dumps(x, separators=(",", ":"))` prints), because it

- makes a whitespace runaway impossible rather than merely bounded;
- maximises forced tokens: after `{` the next key, its quotes and the colon are
  the only possible bytes, so they are jump-ahead output the model never has to
  produce (with any whitespace allowed, nothing after `{` is forced);
- is the shortest encoding, so the fewest decode steps;
- gives byte-for-byte deterministic output for a given value.

A model trained to write `": "` is simply steered to `":"`; the JSON value is
the same. Two opt-in styles remain, both bounded:

- `flexible`: any JSON whitespace between tokens, each run at most
  `max_whitespace` characters (default 4), so `{"a": 1}` and `{ "a" : 1 }` work;
- `pretty`: indented output, separators `,` and `: `. xgrammar enforces the
  `json.dumps(x, indent=N)` layout for the structure the schema declares and
  lays free-form sub-values out on one line; llguidance cannot count
  indentation, so it allows one optional newline plus at most `16 * indent`
  spaces at each whitespace position. Both accept `json.dumps(x, indent=N)` of
  values whose structure the schema declares.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import structural_tag
from .errors import GrammarError
from .regex_syntax import largest_count, stacked_repetition

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "lark", "structural_tag")
# The grammar libraries, in the default order of `auto`.
BACKENDS = ("xgrammar", "llguidance")
JSON_KINDS = frozenset({"json_schema", "json_object"})
WHITESPACE_STYLES = ("compact", "flexible", "pretty")

# A hard cap applied before any parsing, so even building a spec from a huge
# payload stays cheap. The compiler enforces its own, usually lower, limit.
MAX_SPEC_SOURCE_CHARS = 8 * 1024 * 1024
_DEFAULT_MAX_WHITESPACE = 4
_DEFAULT_INDENT = 2


# How error messages name each kind of spec.
KIND_LABELS = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "ebnf": "EBNF grammar",
    "lark": "Lark grammar",
    "structural_tag": "structural tag",
}


@dataclass(frozen=True)
class GrammarOptions:
    """How JSON output is laid out (ignored, and normalised away, for other kinds).

    whitespace: "compact" (default), "flexible" or "pretty" - see the module
    docstring for why compact is the default.
    max_whitespace: longest whitespace run under "flexible" (1..64).
    indent: spaces per level under "pretty" (1..8).
    closed_objects: read schemas as vLLM does (xgrammar's strict mode): an
    object that names its properties admits no others, an array of
    `prefixItems` no more items, unless the schema says otherwise
    (`schema_normalize.strict_defaults`). Also for a structural tag's schemas,
    the one option that kind keeps.
    """

    whitespace: str = "compact"
    max_whitespace: int = _DEFAULT_MAX_WHITESPACE
    indent: int = _DEFAULT_INDENT
    closed_objects: bool = False

    def __post_init__(self) -> None:
        if self.whitespace not in WHITESPACE_STYLES:
            raise GrammarError(
                f"unknown whitespace style {self.whitespace!r}; "
                f"choose one of {', '.join(WHITESPACE_STYLES)}"
            )
        if not isinstance(self.closed_objects, bool):
            raise GrammarError(f"closed_objects must be a bool, got {self.closed_objects!r}")
        for name, lo, hi in (("max_whitespace", 1, 64), ("indent", 1, 8)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise GrammarError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        # Fields a style does not use are reset, so equal layouts hash equal.
        if self.whitespace != "flexible":
            object.__setattr__(self, "max_whitespace", _DEFAULT_MAX_WHITESPACE)
        if self.whitespace != "pretty":
            object.__setattr__(self, "indent", _DEFAULT_INDENT)


Source = str | tuple[str, ...] | None


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on generated text; frozen and hashable (a cache key).

    kind and source:
      - "json_schema": source is the schema as JSON text (an object or a boolean);
      - "json_object": any JSON object; source must be None;
      - "regex": a regular expression the whole output must match;
      - "choice": a non-empty list of strings; the output is exactly one of them;
      - "ebnf": a grammar in xgrammar's EBNF (GBNF) syntax, root rule `root`;
      - "lark": a grammar in llguidance's Lark syntax, start rule `start`;
      - "structural_tag": free text with structured pieces in tags, as JSON
        text in vLLM's or xgrammar's format (structural_tag.py).
    options: `GrammarOptions`; only JSON kinds use them.

    Raises GrammarError when the kind is unknown, the source has the wrong type
    or is empty, or a JSON schema is not valid JSON.
    """

    kind: str
    source: Source = None
    options: GrammarOptions = field(default_factory=GrammarOptions)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(
                f"unknown grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}"
            )
        if not isinstance(self.options, GrammarOptions):
            raise GrammarError("options must be a GrammarOptions")
        if self.kind not in JSON_KINDS and self.options != GrammarOptions():
            kept = self.options.closed_objects if self.kind == "structural_tag" else False
            object.__setattr__(self, "options", GrammarOptions(closed_objects=kept))
        object.__setattr__(self, "source", _checked_source(self.kind, self.source))

    # Convenience constructors, so callers need not remember source conventions.
    @classmethod
    def json_schema(
        cls, schema: str | Mapping[str, Any] | bool, options: GrammarOptions | None = None
    ) -> GrammarSpec:
        """A JSON-schema spec from schema text or an already-parsed schema."""
        if not isinstance(schema, str):
            try:
                schema = json.dumps(schema, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise GrammarError(f"JSON schema is not serialisable: {e}") from None
        return cls("json_schema", schema, options or GrammarOptions())

    @classmethod
    def json_object(cls, options: GrammarOptions | None = None) -> GrammarSpec:
        """Any JSON object."""
        return cls("json_object", None, options or GrammarOptions())

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> GrammarSpec:
        return cls("choice", tuple(choices) if not isinstance(choices, str) else choices)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    @classmethod
    def structural_tag(cls, tag: str | Mapping[str, Any]) -> GrammarSpec:
        """A structural tag from its JSON text or an already-parsed object."""
        if not isinstance(tag, str):
            try:
                tag = json.dumps(tag, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise GrammarError(f"structural tag is not serialisable: {e}") from None
            except RecursionError:
                raise GrammarError("structural tag is nested too deeply") from None
        return cls("structural_tag", tag)

    @property
    def source_size(self) -> int:
        """Size of the source in UTF-8 bytes (what the compiler's limit counts)."""
        if self.source is None:
            return 0
        if isinstance(self.source, str):
            return len(self.source.encode("utf-8", "surrogatepass"))
        return sum(len(c.encode("utf-8", "surrogatepass")) + 1 for c in self.source)

    def __repr__(self) -> str:
        src = repr(self.source)
        if len(src) > 80:
            src = src[:77] + "..."
        return f"GrammarSpec(kind={self.kind!r}, source={src}, options={self.options!r})"


def _checked_source(kind: str, source: Any) -> Source:
    if kind == "json_object":
        if source not in (None, ""):
            raise GrammarError("json_object takes no source")
        return None
    if kind == "choice":
        if isinstance(source, str) or not isinstance(source, tuple | list):
            raise GrammarError("choice source must be a list of strings")
        choices = tuple(source)
        if not choices:
            raise GrammarError("choice list is empty")
        if not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice list must contain only strings")
        if sum(len(c) for c in choices) > MAX_SPEC_SOURCE_CHARS:
            raise GrammarError("choice list is too large")
        return choices
    if not isinstance(source, str):
        raise GrammarError(f"{kind} source must be a string, got {type(source).__name__}")
    # A regex of spaces alone matches them; any other kind of blank source is empty.
    if not (source if kind == "regex" else source.strip()):
        raise GrammarError(f"{kind} source is empty")
    if len(source) > MAX_SPEC_SOURCE_CHARS:
        raise GrammarError(f"{kind} source is too large ({len(source)} characters)")
    if kind == "regex":
        problem = stacked_repetition(source) or _huge_repetition(source)
        if problem:
            raise GrammarError(f"cannot compile regex: {problem}")
    if kind == "structural_tag":
        structural_tag.parse(source)  # its shape, here; its contents where it compiles
    if kind == "json_schema":
        if len(source) > EDGE_PARSE_CHARS:
            # Parsed where it is planned, in the compile worker: a parse here
            # holds the server's GIL (~0.1 s for 700 KB) on the request path.
            if source.lstrip()[:1] not in ("{", "t", "f"):
                raise GrammarError("JSON schema must be a JSON object or a boolean")
            return source
        try:
            schema = json.loads(source)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"JSON schema is not valid JSON: {_short(e)}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("JSON schema must be a JSON object or a boolean")
    return source


# Larger JSON schemas are checked to be JSON when planned (schema_plan), not here.
EDGE_PARSE_CHARS = 64 * 1024


# The largest count a counted repetition may have. Regex engines refuse the
# like by size (Rust's regex crate, which llguidance follows, by the size of the
# compiled automaton): `a{1000000}` compiled in xgrammar but made llguidance's
# lexer give up on its first token, and no context holds such an output anyway.
MAX_REPETITION = 100_000


def _huge_repetition(pattern: str) -> str | None:
    """A counted repetition above MAX_REPETITION, if any."""
    count = largest_count(pattern)
    if count > MAX_REPETITION:
        return f"repetition count {count} is above the limit of {MAX_REPETITION}"
    return None


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
