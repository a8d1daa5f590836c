"""llguidance backend: spec -> grammar text, and its matcher.

llguidance compiles lazily. Turning a spec into its internal grammar and
building an `LLMatcher` is cheap (about a millisecond for typical schemas); the
lexer's automaton is built on demand while masks are computed, and every mask
step is bounded by fuel limits (`LLParserLimits`), so no single step can run
away. The worker process therefore only has to prove that a spec converts,
validates and yields a first mask within the time limit; it returns the grammar
text, and the parent builds one template `LLMatcher` from it, which every
request then copies (`deep_copy` costs well under a microsecond, a fresh
matcher about half a millisecond). The parent's `LLTokenizer` is built here,
once per `TokenizerData` (`ll_tokenizer`); a worker rebuilds its own from the
tokenizer JSON (`build_tokenizer`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from . import structural_tag
from .bitmask import check_bitmask
from .errors import GrammarError, accepts_nothing, clean_message
from .matcher import Matcher
from .productive import RECURSES
from .spec import KIND_LABELS
from .tokenizer import PerTokenizer

if TYPE_CHECKING:
    from .spec import GrammarSpec
    from .tokenizer import TokenizerData

BACKEND = "llguidance"


def build_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...] | list[int]
) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(_added_tokens_as_text(tokenizer_json), n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids))


def _added_tokens_as_text(tokenizer_json: str) -> str:
    """The tokenizer with its non-special added tokens (Qwen's `<tool_call>`,
    `<think>`, ...) as ordinary vocabulary entries. llguidance reads every added
    token as special: its masks allowed one where its text fits, and consuming
    it then failed, ending the request. As vocabulary its text is just text
    (xgrammar's reading); its masks keep to canonical tokenizations, so the
    model spells such a text out there, which it then accepts."""
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab")
    added = data.get("added_tokens") or []
    # Printable ASCII reads the same in a byte-level or SentencePiece vocabulary.
    plain = [t for t in added if not t.get("special", False)
             and t.get("content") and all("!" <= ch <= "~" for ch in t["content"])]
    if not isinstance(vocab, dict) or not plain:
        return tokenizer_json  # a list vocabulary (Unigram), or nothing to move
    for t in plain:
        vocab.setdefault(t["content"], t["id"])
    moved = {t["id"] for t in plain}
    data["added_tokens"] = [t for t in added if t["id"] not in moved]
    return json.dumps(data)


_TOKENIZERS: PerTokenizer[llguidance.LLTokenizer] = PerTokenizer(
    lambda data: build_tokenizer(data.tokenizer_json, data.vocab_size, data.eos_token_ids)
)


def ll_tokenizer(data: TokenizerData) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `data`, built on first use and then shared."""
    return _TOKENIZERS.get(data)


# The Earley parser refuses a row with more items than this. Its default (2000)
# is below realistic grammars (a Lark rule of 5000 alternatives needs 5001) and,
# worse, llguidance enforces it when consuming a token but not when computing the
# mask, so a token the mask allowed was then rejected. `step_max_items` (50000
# by default) bounds the work of each step anyway, so the row limit matches it.
MAX_ITEMS_IN_ROW = 50_000


def limits() -> llguidance.LLParserLimits:
    # verbose_errors=False keeps parser state and grammar dumps out of messages.
    return llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=MAX_ITEMS_IN_ROW)


# The characters the Rust regex syntax (llguidance's) treats as meta; escaping
# any other character is an error there.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of `choices`.

    A choice list is a regular language: as one regex it is a single lexeme,
    which llguidance's lexer handles at any size, where a Lark rule with one
    alternative per choice puts every choice into one parser row.
    """
    return "|".join(
        "".join("\\" + ch if ch in _REGEX_META else ch for ch in choice)
        for choice in dict.fromkeys(choices)
    )


def _json_options(spec: GrammarSpec) -> dict[str, Any]:
    opts = spec.options
    base: dict[str, Any] = {"lenient": False}  # fail, never silently ignore, a keyword
    if opts.whitespace == "flexible":
        pattern = rf"[\x20\x0A\x0D\x09]{{0,{opts.max_whitespace}}}"
        return base | {"whitespace_flexible": True, "whitespace_pattern": pattern}
    if opts.whitespace == "pretty":
        pattern = rf"(\n {{0,{16 * opts.indent}}})?"
        return base | {
            "whitespace_flexible": True,
            "whitespace_pattern": pattern,
            "item_separator": ",",
            "key_separator": ": ",
        }
    return base | {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec` (not yet validated)."""
    try:
        if spec.kind == "json_schema":
            assert isinstance(spec.source, str)
            source = spec.source
            if source.strip() in ("true", "false"):
                # Layout options only attach to object schemas; `true` is `{}`.
                if source.strip() == "false":
                    raise GrammarError(
                        "cannot compile JSON schema: schema false accepts no value", backend=BACKEND
                    )
                source = "{}"
            return llguidance.LLMatcher.grammar_from_json_schema(
                source,
                overrides=_json_options(spec),  # type: ignore[arg-type]
            )
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}',
                overrides=_json_options(spec),  # type: ignore[arg-type]
            )
        if spec.kind == "regex":
            assert isinstance(spec.source, str)
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            assert isinstance(spec.source, tuple)
            return llguidance.LLMatcher.grammar_from_regex(choice_regex(spec.source))
        if spec.kind == "ebnf":
            assert isinstance(spec.source, str)
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.source))
        if spec.kind == "lark":
            assert isinstance(spec.source, str)
            return llguidance.LLMatcher.grammar_from_lark(spec.source)
        if spec.kind == "structural_tag":
            assert isinstance(spec.source, str)
            try:
                lark = structural_tag.to_lark(structural_tag.normalize(spec.source))
            except GrammarError as e:
                raise GrammarError(str(e), reason=e.reason, backend=BACKEND) from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
    except GrammarError:
        raise
    except Exception as e:  # the GBNF converter raises plain Exceptions
        raise _error(spec, str(e)) from None
    raise GrammarError(f"{spec.kind} is not supported by llguidance", backend=BACKEND)


def _error(spec: GrammarSpec, raw: str) -> GrammarError:
    if "NoExtensionBias" in raw:  # llguidance's word for a start rule that never ends
        # (A regex's start rule is the regex itself, which has no recursion.)
        return accepts_nothing(KIND_LABELS[spec.kind], BACKEND,
                               "" if spec.kind in ("regex", "choice") else RECURSES)
    msg = clean_message(raw, keep_positions=spec.kind in ("lark", "ebnf"))
    lowered = msg.lower()
    limit_hit = any(word in lowered for word in ("too large", "too complex", "too many"))
    reason = "too_large" if limit_hit else "invalid"
    # A regex the Rust syntax refuses is refused by every backend (xgrammar's
    # parser would read `\Q.\E` its own way): no fallback.
    final = spec.kind == "regex" and "regex parse error" in raw
    return GrammarError(
        f"cannot compile {KIND_LABELS[spec.kind]}: {msg}", reason=reason, backend=BACKEND, final=final
    )


# A Lark token reference: `<[128010]>`, `<[128000-128255]>`, `<[^1,2]>`.
_TOKEN_REF = re.compile(r"<\[\^?([0-9,\s-]+)\]>")


@dataclass(frozen=True)
class TokenFacts:
    """What a grammar's token references are checked against: the ids the
    tokenizer has (the model's vocabulary may be wider: padding), and the
    stop tokens by id and by name."""

    size: int
    stop_ids: frozenset[int]
    stop_names: tuple[str, ...]

    @classmethod
    def read(cls, tokenizer_json: str, eos_token_ids: tuple[int, ...] | list[int]) -> TokenFacts:
        data = json.loads(tokenizer_json)
        vocab = data.get("model", {}).get("vocab")
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab or ()) - 1]
        added = data.get("added_tokens") or []
        ids += [t["id"] for t in added]
        names = tuple(t["content"] for t in added if t["id"] in eos_token_ids and t.get("content", "").startswith("<"))
        return cls(max(ids, default=-1) + 1, frozenset(eos_token_ids), names)


def check_token_refs(spec: GrammarSpec, grammar: str, facts: TokenFacts) -> None:
    """Refuse a Lark token reference llguidance cannot keep its word on: an id
    past the tokenizer (the model's padding ids have no text; its mask would
    allow them), or a stop token (its mask allows it where the grammar names
    it, and then consuming it is the end, refused before the grammar is done)."""
    def refuse(what: str) -> GrammarError:
        return GrammarError(f"cannot compile {KIND_LABELS[spec.kind]}: {what}", backend=BACKEND, final=True)

    for ref in _TOKEN_REF.finditer(grammar):
        for n in map(int, re.findall(r"[0-9]+", ref.group(1))):
            if n >= facts.size:
                raise refuse(f"token id {n} is past the tokenizer's {facts.size} tokens")
            if n in facts.stop_ids:
                raise refuse(f"token id {n} is a stop token: the output ends where the grammar allows it")
    for name in facts.stop_names:
        if re.search(r'(?<!["\w])' + re.escape(name) + r'(?!["\w])', grammar):
            raise refuse(f"{name} is a stop token: the output ends where the grammar allows it")


def check(tokenizer: llguidance.LLTokenizer, spec: GrammarSpec, grammar: str) -> None:
    """Validate `grammar` fully: build a matcher and compute its first mask."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=limits()
    )
    if is_error:
        raise _error(spec, messages[0] if messages else "invalid grammar")
    matcher = new_template(tokenizer, spec, grammar)
    mask = matcher.compute_bitmask()  # forces the initial lexer/parser work
    if matcher.is_error():
        raise _error(spec, matcher.get_error())
    if not any(mask):  # not even a stop token may come first
        raise accepts_nothing(KIND_LABELS[spec.kind], BACKEND)
    # Some grammars pass every check above and then fail on their first token
    # (`a{1000000}`: "too many expressions constructed" in the lexer). Consume
    # one token the mask allows, so those fail here, where `auto` can still
    # fall back to xgrammar, and not in the middle of a request.
    probe = _first_token(matcher, mask)
    if probe is not None and matcher.try_consume_tokens([probe]) != 1 and matcher.is_error():
        raise _error(spec, matcher.get_error())


def _first_token(matcher: llguidance.LLMatcher, mask: bytes) -> int | None:
    """A token the grammar allows first: a forced one, else the lowest allowed id."""
    forced = matcher.compute_ff_tokens()
    if forced:
        return int(forced[0])
    for i, byte in enumerate(mask):
        if byte:
            return 8 * i + (byte & -byte).bit_length() - 1
    return None


def new_template(
    tokenizer: llguidance.LLTokenizer, spec: GrammarSpec, grammar: str
) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise _error(spec, matcher.get_error())
    return matcher


class LLGuidanceMatcher(Matcher):
    """Matcher over a copy of a template `LLMatcher`.

    llguidance enters a permanent error state when fed a token it rejects, so
    tokens are offered with `try_consume_tokens`, which leaves the state alone
    on rejection. Stop tokens are handled here rather than consumed by the
    library (which does not record them for rollback): one is accepted exactly
    when the parser is in an accepting state.
    """

    backend = BACKEND

    def __init__(self, spec: GrammarSpec, tokenizer: TokenizerData, template: Any) -> None:
        super().__init__(spec, tokenizer)
        self._template = template
        self._m = template.deep_copy()
        self._eos = False
        self._eos_ids = frozenset(tokenizer.eos_token_ids)
        self._row_bytes = tokenizer.bitmask_words * 4

    @property
    def native(self) -> Any:
        return self._m

    def batch_native(self) -> Any | None:
        return None if self._eos or self._m.is_error() else self._m

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)  # numpy / 0-d tensor ids too
        if self._eos or not self._valid_id(token_id) or self._m.is_error():
            return False
        if token_id in self._eos_ids:
            if not self._m.is_accepting():
                return False
            self._eos = True
        elif self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self._eos or self._m.is_error():
            self._fill_eos_only(bitmask, row)
            return
        check_bitmask(bitmask, self._tok.bitmask_words)
        target = bitmask[row]
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), self._row_bytes)

    def forced_tokens(self, max_tokens: int | None = None) -> list[int]:
        if self._eos or self._m.is_error():
            return []
        # llguidance already withholds a final token that could still merge
        # with what follows, so these are canonical tokens.
        return list(self._m.compute_ff_tokens()[:max_tokens])

    def rejection_reason(self, token_id: int) -> str | None:
        # try_consume_tokens refuses without saying why; a throwaway copy that
        # consumes the token for real records the parser's reason (a limit,
        # for instance) as its error.
        probe = self._m.deep_copy()
        if not probe.is_error() and not probe.consume_token(int(token_id)) and probe.is_error():
            return clean_message(probe.get_error(), keep_positions=False)
        return None

    def is_terminated(self) -> bool:
        return self._eos

    def can_terminate(self) -> bool:
        return self._eos or (not self._m.is_error() and bool(self._m.is_accepting()))

    def error(self) -> str | None:
        if self._m.is_error():
            return clean_message(self._m.get_error(), keep_positions=False)
        return None

    def reset(self) -> None:
        # A fresh copy also clears a (sticky) error state, which reset() would not.
        self._m = self._template.deep_copy()
        self._eos = False
        self._num_accepted = 0

    def _rollback(self, num_tokens: int) -> None:
        if self._eos:
            self._eos = False
            num_tokens -= 1
        if num_tokens:
            self._m.rollback(num_tokens)
