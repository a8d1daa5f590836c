"""xgrammar backend: spec -> CompiledGrammar, and its matcher.

xgrammar compiles eagerly (it precomputes token masks per parser state), which
is what makes its masks fast and its compiles slow on large schemas; the
compile runs in a worker process (see `_pool`), and the result crosses back as
`CompiledGrammar.serialize_json()`, rebuilt here against the parent's
`TokenizerInfo` (xgrammar 0.2.8 checks the tokenizer metadata matches).
That TokenizerInfo is built here, once per `TokenizerData` (`tokenizer_info`),
and sent to the workers as JSON (`tokenizer_info_json`).

Three xgrammar 0.2.8 behaviours are corrected here: special tokens are read as
literal text (the TokenizerInfo is built from `TokenizerData.encoded_vocab`,
where they have none), compact JSON keeps ", " inside
free-form values (`_compact_fixup`), and references it cannot resolve are
silently treated as "any value" (refused by `_unsupported_reference`).
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xgrammar as xgr

from . import structural_tag
from .errors import GrammarError, accepts_nothing, clean_message
from .matcher import Matcher
from .productive import RECURSIVE_KINDS, check_completable
from .regex_syntax import rust_syntax_error, xgrammar_misreads, xgrammar_pattern
from .schema_normalize import map_subschemas
from .spec import KIND_LABELS
from .tokenizer import PerTokenizer
from .xgr_classes import scalar_classes

if TYPE_CHECKING:
    from .spec import GrammarSpec
    from .tokenizer import TokenizerData

BACKEND = "xgrammar"
# Enough characters of a forced string for one token (tokens are far shorter).
_MAX_CHARS_PER_TOKEN = 64


def _build_tokenizer_info(data: TokenizerData) -> xgr.TokenizerInfo:
    """TokenizerInfo whose special tokens (other than stop tokens) have no text."""
    # Let xgrammar detect the vocabulary encoding (byte-level, byte-fallback,
    # prefix space) from the tokenizer, then rebuild the table without specials.
    detected = xgr.TokenizerInfo.from_huggingface(
        data.hf_tokenizer, vocab_size=data.vocab_size, stop_token_ids=list(data.eos_token_ids)
    )
    return xgr.TokenizerInfo(
        data.encoded_vocab,
        detected.vocab_type,
        vocab_size=data.vocab_size,
        stop_token_ids=list(data.eos_token_ids),
        add_prefix_space=detected.add_prefix_space,
    )


_INFOS: PerTokenizer[xgr.TokenizerInfo] = PerTokenizer(_build_tokenizer_info)


def tokenizer_info(data: TokenizerData) -> xgr.TokenizerInfo:
    """xgrammar's TokenizerInfo for `data`, built on first use and then shared."""
    return _INFOS.get(data)


def tokenizer_info_json(data: TokenizerData) -> str:
    """`tokenizer_info(data)` in the form a compile worker process receives it."""
    return tokenizer_info(data).serialize_json()


def tokenizer_info_from_json(text: str) -> xgr.TokenizerInfo:
    """The worker's side of `tokenizer_info_json`."""
    return xgr.TokenizerInfo.deserialize_json(text)


class VocabIndex:
    """The vocabulary as raw bytes, sorted, to find the tokens that extend a token.

    `XGrammarMatcher.forced_tokens` uses it to decide whether a forced
    string's last token could merge with what the model writes next (then it
    is held back). xgrammar already knows how to turn byte-level / byte-fallback
    vocabularies back into raw bytes, so its decoded vocabulary is the source.
    """

    def __init__(self, data: TokenizerData) -> None:
        table = list(tokenizer_info(data).decoded_vocab)
        for i in data.eos_token_ids:
            table[i] = b""  # stop tokens have no text
        order = sorted(range(len(table)), key=table.__getitem__)
        self._keys = [table[i] for i in order]
        self._ids = np.asarray(order, dtype=np.int64)
        self._table = table

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of `token_id` (b"" for stop and special tokens)."""
        return self._table[token_id]

    def extensions(self, token_id: int) -> np.ndarray:
        """Ids of tokens whose bytes strictly extend those of `token_id`."""
        prefix = self._table[token_id]
        if not prefix:
            return self._ids[:0]
        lo = bisect.bisect_right(self._keys, prefix)
        end = _prefix_end(prefix)
        hi = bisect.bisect_left(self._keys, end, lo) if end else len(self._keys)
        return self._ids[lo:hi]


def _prefix_end(prefix: bytes) -> bytes:
    """Smallest byte string greater than every string starting with `prefix` (b"" if none)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b""
    p[-1] += 1
    return bytes(p)


# Built only when a forced string first needs the hold-back check.
_VOCABS: PerTokenizer[VocabIndex] = PerTokenizer(VocabIndex)


def vocab_index(data: TokenizerData) -> VocabIndex:
    """The `VocabIndex` of `data`, built on first use and then shared."""
    return _VOCABS.get(data)


def token_bytes(data: TokenizerData, token_id: int) -> bytes:
    """The raw bytes of `token_id` as xgrammar decodes them (b"" for stop/special tokens)."""
    return vocab_index(data).token_bytes(token_id)


def extensions(data: TokenizerData, token_id: int) -> np.ndarray:
    """Ids of tokens whose bytes strictly extend those of `token_id`."""
    return vocab_index(data).extensions(token_id)


def _whitespace_kwargs(spec: GrammarSpec) -> dict[str, Any]:
    opts = spec.options
    if opts.whitespace == "flexible":
        return {"any_whitespace": True, "max_whitespace_cnt": opts.max_whitespace}
    if opts.whitespace == "pretty":
        return {"any_whitespace": False, "indent": opts.indent, "separators": (",", ": ")}
    return {"any_whitespace": False, "separators": (",", ":")}


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable() and ch != "\x7f":
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def choice_ebnf(choices: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in dict.fromkeys(choices))


# xgrammar 0.2.8 writes the item separator of free-form arrays/objects (values
# the schema leaves open) as ", " even when asked for (",", ":"), so compact
# output such as `{"a":[1,2]}` would be rejected there. Those rules are fixed up
# in the grammar text before compiling.
_FREE_FORM_RULE = re.compile(r"^(basic_array_items|basic_object_properties)(_\d+)? ::=")


def _compact_fixup(ebnf: str) -> str:
    """The grammar text with compact free-form separators."""
    lines = ebnf.splitlines()
    for i, line in enumerate(lines):
        if _FREE_FORM_RULE.match(line) and '", "' in line:
            lines[i] = line.replace('", "', '","')
    return "\n".join(lines) + "\n"


# xgrammar 0.2.8 writes the characters of length-bounded strings as
# [^"\\\r\n]: raw control characters (U+0000-U+001F) get into the string,
# which is not JSON, and no escape does, so a valid value holding a quote, a
# backslash or a newline (`x\"y` under maxLength 5) was refused. Each such
# character becomes what JSON allows unescaped, or one escape (a character
# counts once either way). A `\u` escape of a UTF-16 surrogate is left out:
# two of them make one character, which the count would take for two.
_BOUNDED_CHARS = '[^\\"\\\\\\r\\n]'
_BOUNDED_CHAR = '(([^\\0-\\x1f\\"\\\\\\r\\n]) | ("\\\\" stencil_bounded_escape))'
_BOUNDED_ESCAPE = (
    'stencil_bounded_escape ::= ([\\"\\\\/bfnrt] | ("u" (([0-9a-cA-CeEfF] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
    ' | ([dD] [0-7] [0-9a-fA-F] [0-9a-fA-F]))))\n'
)


def _string_fixup(ebnf: str) -> str:
    if _BOUNDED_CHARS not in ebnf:
        return ebnf
    return ebnf.replace(_BOUNDED_CHARS, _BOUNDED_CHAR).rstrip("\n") + "\n" + _BOUNDED_ESCAPE


# xgrammar resolves only JSON-pointer references within the document; any other
# reference (remote URL, `$id`-relative, `#anchor`, `$dynamicRef`) it silently
# treats as "any value", which would fail open. Those schemas are refused here,
# so `auto` can try llguidance, which resolves anchors and `$id`s or says no.
_LOCAL_POINTER = re.compile(r"^#(/.*)?$")
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _unsupported_reference(node: Any) -> str | None:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if key in ("$dynamicRef", "$recursiveRef"):
                    return f"{key} is not supported"
                if key == "$ref" and isinstance(value, str) and not _LOCAL_POINTER.match(value):
                    return f"only local $ref (like #/$defs/name) is supported, got {value[:80]!r}"
                if key not in _DATA_KEYWORDS:
                    stack.append(value)
    return None


# xgrammar prints U+0001-U+00FF as `\xHH` but reads a `\x` escape with every
# hex digit after it: "é1" printed as `\xe91` came back as U+0E91, so a
# constraint holding "réaction" or "année" refused it (and allowed the wrong
# character). Printed grammars are re-read with those escapes made `\u00HH`,
# which both sides read as four digits. (An escape is matched with what
# follows its backslash, so an escaped backslash before an `x` stays.)
_ESCAPE = re.compile(r"\\(x([0-9a-fA-F]{2})|.)", re.DOTALL)


def _fixed_width_escapes(ebnf: str) -> str:
    return _ESCAPE.sub(lambda m: f"\\u00{m.group(2)}" if m.group(2) else m.group(0), ebnf)


def _reparse(ebnf: str) -> xgr.Grammar:
    """Grammar text xgrammar printed (and we rewrote) read back, its character
    classes narrowed to Unicode scalar values (xgr_classes.py)."""
    return xgr.Grammar.from_ebnf(scalar_classes(_fixed_width_escapes(ebnf)))


def _json_grammar(schema: str, spec: GrammarSpec) -> xgr.Grammar:
    problem = _unsupported_reference(json.loads(schema))
    if problem:
        raise GrammarError(f"cannot compile JSON schema: {problem}", backend=BACKEND)
    kwargs = _whitespace_kwargs(spec)
    text = _string_fixup(str(xgr.Grammar.from_json_schema(schema, strict_mode=False, **kwargs)))
    if spec.options.whitespace == "compact":
        text = _compact_fixup(text)
    return _reparse(text)


def _scalar(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with its character classes narrowed to Unicode scalar values (xgr_classes.py)."""
    return _reparse(str(grammar))


# A Lark grammar's items, for `xgrammar_lark_misread`: a string literal, a
# comment, a regex literal, or any other run of text.
_LARK_ITEM = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|//[^\n]*|/(?:[^/\\\n]|\\.)+/[imsux]*|[^"/]+|.', re.S)


def xgrammar_lark_misread(grammar: str) -> str | None:
    """What of a Lark grammar xgrammar reads otherwise than llguidance (whose
    Lark the docs and the verdict follow) so that its outputs break it, or
    None: `%ignore`, whose text xgrammar lets trail the last token. (xgrammar
    also has no lexer, so a terminal that could run on into what follows it
    is not matched greedily there; the verdict tells such an output apart.)"""
    rest = "".join(item.group() for item in _LARK_ITEM.finditer(grammar)
                   if not item.group().startswith(('"', "//", "/")) or item.group() == "/")
    if re.search(r"^[ \t]*%ignore\b", rest, re.M):
        return "%ignore (its text may trail the last token)"
    return None


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """`spec` as an xgrammar Grammar (converted, not compiled); library errors raise."""
    if spec.kind == "json_schema":
        assert isinstance(spec.source, str)
        return _json_grammar(spec.source, spec)
    if spec.kind == "json_object":
        return _json_grammar('{"type": "object"}', spec)
    if spec.kind == "regex":
        assert isinstance(spec.source, str)
        refused = rust_syntax_error(spec.source)
        if refused is not None:  # not a regex of the documented syntax: no backend may read it its own way
            raise GrammarError(f"cannot compile regex: {clean_message(refused, keep_positions=False)}",
                               backend=BACKEND, final=True)
        misread = xgrammar_misreads(spec.source)
        if misread is not None:
            raise GrammarError(f"cannot compile regex: xgrammar reads {misread} differently from the "
                               "Rust regex syntax; use llguidance", backend=BACKEND)
        return _scalar(xgr.Grammar.from_regex(xgrammar_pattern(spec.source)))
    if spec.kind == "choice":
        assert isinstance(spec.source, tuple)
        return xgr.Grammar.from_ebnf(choice_ebnf(spec.source))
    if spec.kind == "ebnf":
        assert isinstance(spec.source, str)
        return _scalar(xgr.Grammar.from_ebnf(spec.source, root_rule_name="root"))
    if spec.kind == "lark":
        assert isinstance(spec.source, str)
        misread = xgrammar_lark_misread(spec.source)
        if misread is not None:
            raise GrammarError(f"cannot compile Lark grammar: xgrammar reads {misread} otherwise than "
                               "llguidance's Lark; use llguidance", backend=BACKEND)
        return _scalar(xgr.Grammar.from_lark(spec.source))
    if spec.kind == "structural_tag":
        assert isinstance(spec.source, str)
        # Formats naming tokens need the vocabulary: compile_native compiles those.
        # Its schemas' bounded strings as a JSON schema's (`_string_fixup`).
        return _reparse(_string_fixup(str(xgr.Grammar.from_structural_tag(_tag_json(spec.source)))))
    raise GrammarError(f"{spec.kind} is not supported by xgrammar", backend=BACKEND)


def _tag_json(source: str) -> str:
    """A structural tag as xgrammar compiles it, its JSON-schema contents read
    as JSON Schema reads them: xgrammar's structural tags compile schemas in
    its strict mode, where an object allows only the properties it lists and
    an array nothing past its prefixItems (valid tool arguments with an
    optional extra key were refused). A content with a reference xgrammar
    would read as any value is refused, as in a JSON-schema spec."""
    tag = structural_tag.normalize(source)
    problems: list[str] = []

    def opened(schema: Any) -> Any:
        problem = _unsupported_reference(schema)
        if problem:
            problems.append(problem)
        return _open_schema(schema)

    tag = structural_tag.map_schemas(tag, opened)
    if problems:
        raise GrammarError(f"cannot compile structural tag: {problems[0]}", backend=BACKEND)
    return json.dumps(tag)


def _open_schema(schema: Any) -> Any:
    """`schema` with JSON Schema's defaults spelled out where strict mode would differ."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, _open_schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = True
    if isinstance(out.get("prefixItems"), list) and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = True
    return out


def compile_native(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """Compile `spec`; library errors become a clean GrammarError.

    A grammar with a rule that can never be completed is refused before it is
    compiled: xgrammar's jump-forward search would follow it for ever.
    """
    try:
        try:
            grammar = build_grammar(spec)
        except xgr.exception.InvalidStructuralTagError as e:
            if "tokenizer_info" not in str(e):
                raise
            # A structural tag that names tokens: compiled with the vocabulary.
            compiled = compiler.compile_structural_tag(_tag_json(str(spec.source)))
        else:
            if spec.kind in RECURSIVE_KINDS:
                check_completable(str(grammar), KIND_LABELS[spec.kind], BACKEND, dead_ends=True)
            compiled = compiler.compile_grammar(grammar)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        if "bad_alloc" in str(e):
            raise GrammarError(
                "grammar is too large", reason="too_large", backend=BACKEND
            ) from None
        # EBNF is xgrammar's dialect: what its parser refuses is no EBNF, and
        # another library's laxer reader must not make something of it.
        final = spec.kind == "ebnf" and any(w in str(e) for w in ("EBNF parser error", "EBNF lexer error"))
        raise GrammarError(
            f"cannot compile {KIND_LABELS[spec.kind]}: {clean_message(str(e))}", backend=BACKEND, final=final
        ) from None
    except MemoryError:
        raise GrammarError("grammar is too large", reason="too_large", backend=BACKEND) from None
    _check_first_mask(compiled, spec)
    return compiled


def _check_first_mask(compiled: xgr.CompiledGrammar, spec: GrammarSpec) -> None:
    """Refuse a grammar under which no token, not even a stop token, may come first."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    if not bool(mask.any()):
        raise accepts_nothing(KIND_LABELS[spec.kind], BACKEND)


def new_compiler(info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    # Caching is ours (bounded LRU in the parent); xgrammar's cache is unbounded
    # by default and would grow without limit in a long-lived worker.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def load(payload: dict[str, Any], data: TokenizerData) -> tuple[xgr.CompiledGrammar, int]:
    """Rebuild a CompiledGrammar sent by a worker; returns it and its size in bytes."""
    compiled = xgr.CompiledGrammar.deserialize_json(payload["json"], tokenizer_info(data))
    # The estimate leaves out the per-rule automata; the text's length does not.
    return compiled, max(int(compiled.memory_size_bytes), len(payload["json"]))


def direct_target(bitmask: torch.Tensor) -> Any | None:
    """`bitmask` as xgrammar's native handle takes it without a conversion per
    call (a tvm_ffi tensor over the same memory); None where this xgrammar has
    no tvm_ffi (the public call is used then)."""
    try:
        import tvm_ffi

        return tvm_ffi.from_dlpack(bitmask)
    except Exception:  # noqa: BLE001 - an older xgrammar
        return None


class XGrammarMatcher(Matcher):
    """Matcher over an xgrammar CompiledGrammar."""

    backend = BACKEND

    def __init__(self, spec: GrammarSpec, tokenizer: TokenizerData, compiled: Any) -> None:
        super().__init__(spec, tokenizer)
        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=list(tokenizer.eos_token_ids))
        # xgrammar's Python methods only forward to this native handle.
        self._h: Any = getattr(self._m, "_handle", self._m)
        # fill_direct(target, row, False): fill row `row` of a bitmask given as
        # `direct_target` made it, straight into native code (no Python frame,
        # no per-call tensor conversion: about half the library's own call).
        # It raises once the matcher is terminated (the library refuses; the
        # caller then uses `fill_bitmask`, which writes the stop-only row): not
        # checked first, as that costs a native call on every step.
        self.fill_direct: Callable[[Any, int, bool], Any] = self._h.fill_next_token_bitmask
        self._scratch: torch.Tensor | None = None
        self._vocab: VocabIndex | None = None  # looked up once, on first hold-back check

    @property
    def native(self) -> Any:
        return self._m

    def batch_native(self) -> Any | None:
        return None if self._h.is_terminated() else self._m

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)  # numpy / 0-d tensor ids too
        if not self._valid_id(token_id) or self._m.is_terminated():
            return False
        if self._m.accept_token(token_id):  # rejection leaves the state untouched
            self._num_accepted += 1
            return True
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self._m.is_terminated():
            self._fill_eos_only(bitmask, row)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self, max_tokens: int | None = None) -> list[int]:
        if self._m.is_terminated():
            return []
        try:
            text = self._m.find_jump_forward_string()
        except UnicodeDecodeError:
            # The forced bytes end inside a character ("é" | "è" share its
            # first byte): the binding cannot return them. Nothing is forced;
            # the mask lets the model write the character.
            return []
        if not text:
            return []
        if max_tokens is not None:
            # A forced string can be megabytes (`a{1000000}`); tokenize only
            # what can be used. A cut may split a token: the hold-back below
            # keeps a last token that could still grow.
            text = text[: max(1, max_tokens) * _MAX_CHARS_PER_TOKEN]
        tokens = self._tok.encode_after(text)
        if max_tokens is not None:
            tokens = tokens[: max_tokens + 1]
        n = 0
        for tok in tokens:
            if not self._m.accept_token(tok):
                break
            n += 1
        keep = n
        try:
            if n and n == len(tokens):
                # The whole forced string was consumed; its last token may be a
                # prefix of a longer token the model could produce next (e.g. `"`
                # of `":"` vs `""`), and then the canonical tokenization of the
                # final text would not contain it. Hold it back in that case.
                self._m.rollback(1)
                n -= 1
                if self._extendable(tokens[n]):
                    keep = n
        finally:
            if n:
                self._m.rollback(n)
        return tokens[: keep if max_tokens is None else min(keep, max_tokens)]

    def _extendable(self, token_id: int) -> bool:
        if self._vocab is None:
            self._vocab = vocab_index(self._tok)
        longer = self._vocab.extensions(token_id)
        if longer.size == 0:
            return False
        if self._scratch is None:
            self._scratch = torch.empty((1, self._tok.bitmask_words), dtype=torch.int32)
        self._m.fill_next_token_bitmask(self._scratch, 0)
        words = self._scratch[0].numpy().view(np.uint32)
        bits = (words[longer >> 5] >> (longer & 31).astype(np.uint32)) & 1
        return bool(bits.any())

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def can_terminate(self) -> bool:
        return bool(self._m.is_terminated() or self._m.is_completed())

    def error(self) -> str | None:
        return None  # rejected tokens never change xgrammar's state

    def reset(self) -> None:
        self._m.reset()
        self._num_accepted = 0

    def _rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
