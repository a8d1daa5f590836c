"""Checking a finished regex, choice or grammar output against its spec.

JSON outputs get a verdict from a JSON Schema validator (validation.py). The
other kinds get one here, from a matcher of the spec's own semantics, fed the
output's text byte by byte, whichever library generated it:

- regex: llguidance, whose regex parser is the Rust `regex` crate's, the
  syntax the API promises (xgrammar's own parser reads some of it otherwise);
- choice: the output is one of the strings, exactly;
- Lark: llguidance (its native format); EBNF: xgrammar (its native format);
- structural tag: xgrammar, which reads every format of it. A tag that names
  tokens (`token`, `token_triggered_tags`, ...) cannot be read over bytes: its
  outputs are NOT_CHECKED, with that reason. A whole output that matches is
  then checked tag by tag: each JSON content against its full schema
  (jsonschema-rs: the keywords the grammar leaves out too), the contents
  found as the value checks of resampling requests find them
  (tag_segments.py), so both read the same text.

Each matcher reads a vocabulary of the 256 bytes, not the model's tokens, so
the verdict does not depend on how the output was tokenized. A checker is
built once per spec, on first use (milliseconds; the service builds it off
the event loop), shared by requests, and never raises: a spec its library
cannot read gives a result with `checked` False.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from functools import lru_cache

import llguidance
import xgrammar as xgr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from . import structural_tag
from ._xgr import build_grammar
from .errors import clean_message
from .schema_plan import tag_view
from .schema_store import SchemaStore
from .spec import GrammarSpec
from .tag_segments import TagShape, contents, shapes_of
from .validation import VALID, SchemaValidator, ValidationResult

_MAX_MESSAGE_CHARS = 200
# The byte vocabularies' stop token.
_STOP = 256


def _byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


@lru_cache(maxsize=1)
def _llg_bytes() -> llguidance.LLTokenizer:
    """llguidance's tokenizer over one token per byte (id = the byte) and a stop token."""
    vocab = {ch: b for b, ch in _byte_level_alphabet().items()}
    vocab["<|stop|>"] = _STOP
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|stop|>"])
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=_STOP + 1, eos_token=[_STOP])


@lru_cache(maxsize=1)
def _xgr_compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<|stop|>"], xgr.VocabType.RAW,
                             stop_token_ids=[_STOP])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _where(text: str, accepted_bytes: int) -> str:
    """Where a match of `text` stopped, in characters."""
    return f"character {len(text.encode('utf-8')[:accepted_bytes].decode('utf-8', 'ignore'))}"


class OutputCheck:
    """A verdict on finished outputs of one regex, choice or grammar spec
    (thread-safe; the same interface as `SchemaValidator`)."""

    def __init__(self, spec: GrammarSpec, store: SchemaStore | None = None):
        if spec.kind not in ("regex", "choice", "ebnf", "lark", "structural_tag"):
            raise ValueError(f"no output check for {spec.kind}")
        self.spec = spec
        self.store = store  # where a tag's schemas find the documents they name, as compiled
        self._lock = threading.Lock()
        self._check: Callable[[str], ValidationResult] | None = None
        self._failed: str | None = None

    @property
    def built(self) -> bool:
        """Whether using it costs no build any more."""
        return self._check is not None or self._failed is not None

    def prepare(self) -> None:
        """Build the matcher now (milliseconds: not on the event loop)."""
        with self._lock:
            if self.built:
                return
            try:
                self._check = self._build()
            except Exception as e:  # noqa: BLE001 - a spec the checker cannot read is not checked
                self._failed = f"the output checker cannot read this {self.spec.kind}: {clean_message(str(e))}"

    def _build(self) -> Callable[[str], ValidationResult]:
        spec = self.spec
        if spec.kind == "choice":
            assert isinstance(spec.source, tuple)
            choices = frozenset(spec.source)
            return lambda text: VALID if text in choices else ValidationResult(
                False, message="the output is not one of the choices")
        if spec.kind == "ebnf":
            assert isinstance(spec.source, str)
            compiled = _xgr_compiler().compile_grammar(spec.source, root_rule_name="root")
            return lambda text: self._xgr_verdict(compiled, text)
        if spec.kind == "structural_tag":
            assert isinstance(spec.source, str)
            # The grammar xgrammar generates with (each content's schema cut to
            # what it enforces, opened out of its strict mode, bounded strings
            # taking escapes): a tag read straight from the source refused
            # answers that grammar wrote (an extra key, "Zürich" under a
            # maxLength). What the cut left out the content checks below see.
            left_out: set[str] = set()
            view = tag_view(spec, "xgrammar", self.store, unenforced=left_out)
            try:
                tag_grammar = build_grammar(view)
            except xgr.exception.InvalidStructuralTagError as e:
                if "tokenizer_info" in str(e):
                    raise ValueError("it names tokens, which a check over the output's bytes cannot "
                                     "read") from None
                raise
            tag_compiled = _xgr_compiler().compile_grammar(tag_grammar)
            shapes = shapes_of(structural_tag.normalize(spec.source))
            validators = _content_validators(shapes or ())
            # Contents the scanner cannot find (sequences, empty ends, ...):
            # the grammar's verdict holds only if it enforces their whole schemas.
            unseen = None if shapes is not None or not left_out else ValidationResult(
                True, checked=False, message="the contents of this structural tag cannot be located to "
                f"check {', '.join(sorted(left_out))}, which its grammar leaves out")

            def verdict(text: str) -> ValidationResult:
                result = self._xgr_verdict(tag_compiled, text)
                if not result.valid:
                    return result
                if shapes is None:
                    return unseen or result
                return _contents_verdict(shapes, validators, text)
            return verdict
        assert isinstance(spec.source, str)
        grammar = (llguidance.LLMatcher.grammar_from_regex(spec.source) if spec.kind == "regex"
                   else llguidance.LLMatcher.grammar_from_lark(spec.source))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, _llg_bytes())
        if is_error:
            raise ValueError(messages[0] if messages else "invalid grammar")
        return lambda text: self._llg_verdict(grammar, text)

    def _llg_verdict(self, grammar: str, text: str) -> ValidationResult:
        matcher = llguidance.LLMatcher(_llg_bytes(), grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        data = list(text.encode("utf-8"))
        accepted = matcher.try_consume_tokens(data)
        if accepted == len(data) and matcher.is_accepting():
            return VALID
        return self._invalid(text, accepted, accepted == len(data))

    def _xgr_verdict(self, compiled: xgr.CompiledGrammar, text: str) -> ValidationResult:
        matcher = xgr.GrammarMatcher(compiled)
        data = text.encode("utf-8")
        accepted = 0
        for accepted, byte in enumerate(data):  # noqa: B007 - the count is read after the loop
            if not matcher.accept_token(byte):
                return self._invalid(text, accepted, False)
        if matcher.accept_token(_STOP):
            return VALID
        return self._invalid(text, len(data), True)

    def _invalid(self, text: str, accepted_bytes: int, whole: bool) -> ValidationResult:
        what = {"regex": "the regex", "ebnf": "the grammar", "lark": "the grammar",
                "structural_tag": "the structural tag"}[self.spec.kind]
        if whole:
            return ValidationResult(False, message=f"the output is an unfinished match of {what}")
        return ValidationResult(False, message=f"the output leaves {what} at {_where(text, accepted_bytes)}")

    def validate_text(self, text: str) -> ValidationResult:
        """The output's verdict; never raises."""
        if not self.built:
            self.prepare()
        if self._check is None:
            return ValidationResult(False, message=self._failed or "not checked", checked=False)
        try:
            return self._check(text)
        except Exception as e:  # noqa: BLE001 - a checker fault must not fail the request
            return ValidationResult(False, message=f"output check failed: {_short(str(e))}", checked=False)


def _content_validators(shapes: tuple[TagShape, ...]) -> dict[int, SchemaValidator]:
    """Tag index -> the validator of its JSON content's schema (tags whose
    schema it cannot read are left out: the grammar's verdict stands)."""
    validators = {}
    for i, shape in enumerate(shapes):
        schema = {} if shape.schema is True else shape.schema
        if shape.json and isinstance(schema, dict) and schema:
            try:
                validators[i] = SchemaValidator(schema)
            except ValueError:
                continue
    return validators


def _contents_verdict(shapes: tuple[TagShape, ...], validators: dict[int, SchemaValidator],
                      text: str) -> ValidationResult:
    """The first tag content of `text` that breaks its schema, or VALID."""
    for tag, content in contents(shapes, text):
        validator = validators.get(tag)
        if validator is None:
            continue
        result = validator.validate_text(content)
        if result.checked and not result.valid:
            begin = shapes[tag].begin.decode("utf-8", "replace")
            return dataclasses.replace(result, message=f"the content of tag {begin!r}: {result.message}")
    return VALID


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_MESSAGE_CHARS else line[: _MAX_MESSAGE_CHARS - 1] + "…"
