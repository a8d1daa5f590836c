"""A scanner of the Rust `regex` syntax, for the checks made before a regex compiles.

Regex constraints use the Rust `regex` crate's syntax, which llguidance parses
with the crate's own parser. xgrammar has a parser of its own that reads part
of that syntax differently, and where it does, the answers it generates break
the regex (`[[:alpha:]]{3}` gave "l]]]"). `xgrammar_misreads` names the first
such construct in a pattern, so the xgrammar backend refuses it instead. It
was found by generating from each backend and checking every answer with the
regex crate (tests/grammar/test_regex_differential.py); what xgrammar reads
the same way (ASCII-only `\\d`, `\\w`, `\\s` are narrower, never wider) stays.

The scan is shallow: it tells items apart (escapes, classes, groups,
repetitions) without building a full syntax tree. Whether the Rust syntax takes
a pattern at all is the crate's own parser's word (`rust_syntax_error`, through
llguidance): a pattern it refuses is refused whatever the backend, never read
by xgrammar's parser in some way of its own (`\\Q.\\E` as "Q, any, E").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import llguidance

# A counted repetition: {n}, {n,}, {n,m} (a `{` not followed by this is a literal).
_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# Escapes with a braced argument (\x{1F600}, \u{43}, \p{Greek}) or a fixed-width one.
_BRACED = re.compile(r"\\[xuUpP]\{[^}]*\}")
_FIXED = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[pP][A-Za-z])")


@dataclass
class Item:
    """One top-level item of a pattern: kind is escape, class, repeat, open,
    close, alt, anchor or char; `text` is its source, `pos` where it starts."""

    kind: str
    text: str
    pos: int
    counts: tuple[int, ...] = ()  # a counted repetition's numbers
    # A class's contents, for the misread checks.
    negated: bool = False
    nested: bool = False  # a class inside it (POSIX [:alpha:] or [a-z[0-9]])
    set_operator: str = ""  # &&, -- or ~~
    leading_bracket: bool = False  # a literal ] first ([]a], [^]a])
    escapes: list[str] = field(default_factory=list)


def _escape_at(pattern: str, i: int) -> int:
    """The end of the escape starting at pattern[i] (a backslash)."""
    for form in (_BRACED, _FIXED):
        m = form.match(pattern, i)
        if m is not None:
            return m.end()
    return min(i + 2, len(pattern))


def _class_at(pattern: str, i: int) -> tuple[Item, int]:
    """The class starting at pattern[i] ("["), and where it ends."""
    item = Item("class", "", i)
    j = i + 1
    if pattern.startswith("^", j):
        item.negated = True
        j += 1
    if pattern.startswith("]", j):
        item.leading_bracket = True
        j += 1
    n = len(pattern)
    while j < n and pattern[j] != "]":
        c = pattern[j]
        if c == "\\":
            end = _escape_at(pattern, j)
            item.escapes.append(pattern[j:end])
            j = end
        elif c == "[":
            item.nested = True
            inner, j = _class_at(pattern, j)
            item.escapes += inner.escapes
            item.set_operator = item.set_operator or inner.set_operator
        elif pattern.startswith(("&&", "--", "~~"), j):
            item.set_operator = item.set_operator or pattern[j:j + 2]
            j += 2
        else:
            j += 1
    end = min(j + 1, n)
    item.text = pattern[i:end]
    return item, end


def scan(pattern: str) -> Iterator[Item]:
    """The pattern's top-level items, in order."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            end = _escape_at(pattern, i)
            yield Item("escape", pattern[i:end], i)
            i = end
        elif c == "[":
            item, i = _class_at(pattern, i)
            yield item
        elif c in "*+?":
            yield Item("repeat", c, i)
            i += 1
        elif c == "{" and (m := _COUNTED.match(pattern, i)) is not None:
            counts = tuple(int(g) for g in m.groups() if g)
            yield Item("repeat", m.group(), i, counts=counts)
            i = m.end()
        elif c == "(":
            m = re.match(r"\(\?(?:P?<[^>]*>|[a-zA-Z-]*:?)?", pattern[i:]) if pattern.startswith("(?", i) else None
            text = m.group() if m is not None else "("
            yield Item("open", text, i)
            i += len(text)
        elif c in ")|^$":
            yield Item({")": "close", "|": "alt"}.get(c, "anchor"), c, i)
            i += 1
        else:
            yield Item("char", c, i)
            i += 1


def stacked_repetition(pattern: str) -> str | None:
    """A repetition applied straight to another (`a**`, `a+*`, `a{2}{3}`), if any.

    xgrammar refuses these and llguidance reads them as a nested repetition, so
    the same regex would mean different things per backend; both are refused.
    A `?` right after a repetition is its lazy form, which matches the same
    strings, and is allowed (`a+?`). Group the inner one to nest: `(a*)*`.
    """
    after_repetition, lazy_seen = False, False
    for item in scan(pattern):
        if item.kind != "repeat":
            after_repetition = False
            continue
        if after_repetition:
            if item.text == "?" and not lazy_seen:
                lazy_seen = True
                continue
            end = item.pos + len(item.text)
            return (f"two repetition operators in a row at position {item.pos} "
                    f"({pattern[max(0, item.pos - 8):end]!r}); group the inner one, as in (a*)*")
        after_repetition, lazy_seen = True, False
    return None


def xgrammar_pattern(pattern: str) -> str:
    """`pattern` as xgrammar should read it: each `.` outside a class becomes
    `[^\\n]` (xgrammar's `.` also matches a newline, the Rust syntax's does not)."""
    return "".join(r"[^\n]" if item.kind == "char" and item.text == "." else pattern[item.pos:end]
                   for item, end in _with_ends(pattern))


# A JSON-schema pattern is ECMA-262, whose `.` also leaves out \r, U+2028 and
# U+2029, and whose `\s` is another set than the Rust syntax's (U+FEFF in,
# U+0085 out). Written out, both libraries read them as the validator does.
_ECMA_DOT = r"[^\n\r\u2028\u2029]"
_ECMA_SPACES = r"\t\n\x0B\x0C\r \xA0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFEFF"


def ecma_pattern(pattern: str) -> str:
    r"""A JSON-schema `pattern` with ECMA-262's `.`, `\s` and `\S` written out as
    classes (inside a class, `\s` as its members), so that a library reading
    the Rust syntax admits no character the validator refuses (`.` took
    "\r", `\s` took U+0085). `\S` inside a class has no such spelling and
    stays (`json_pattern_misread` reports it)."""
    out = []
    for item, end in _with_ends(pattern):
        text = pattern[item.pos:end]
        if item.kind == "char" and text == ".":
            text = _ECMA_DOT
        elif item.kind == "escape" and text in ("\\s", "\\S"):
            text = ("[^" if text == "\\S" else "[") + _ECMA_SPACES + "]"
        elif item.kind == "class" and "\\s" in item.escapes:
            text = _class_spaces(text)
        out.append(text)
    return "".join(out)


def _class_spaces(text: str) -> str:
    r"""A class's source with each `\s` in it replaced by ECMA's spaces."""
    out, j = [], 0
    while j < len(text):
        if text[j] == "\\":
            end = _escape_at(text, j)
            out.append(_ECMA_SPACES if text[j:end] == "\\s" else text[j:end])
            j = end
        else:
            out.append(text[j])
            j += 1
    return "".join(out)


def _with_ends(pattern: str) -> Iterator[tuple[Item, int]]:
    items = list(scan(pattern))
    for k, item in enumerate(items):
        yield item, items[k + 1].pos if k + 1 < len(items) else len(pattern)


def largest_count(pattern: str) -> int:
    """The largest count of a counted repetition in the pattern (0 if none)."""
    return max((c for item in scan(pattern) if item.kind == "repeat" for c in item.counts), default=0)


# Escapes xgrammar reads differently: Unicode classes (\p{Greek}: refused
# outside a class, misread inside one), the negated Perl classes (ASCII in
# xgrammar, so wider than the Rust crate's Unicode ones), text anchors and
# word boundaries (read as the letters A, z, b, B).
_MISREAD_ESCAPES = {"p": "a Unicode class (\\p)", "P": "a Unicode class (\\P)",
                    "D": "\\D (ASCII in xgrammar, so it allows Unicode digits)",
                    "W": "\\W (ASCII in xgrammar, so it allows Unicode letters)",
                    "S": "\\S (ASCII in xgrammar, so it allows Unicode spaces)",
                    "A": "the \\A anchor", "z": "the \\z anchor", "b": "a word boundary (\\b)",
                    "B": "a word boundary (\\B)"}
# Inside a negated class the positive Perl classes widen the same way.
_NEGATED_CLASS_ESCAPES = {"d": "\\d inside a negated class", "w": "\\w inside a negated class",
                          "s": "\\s inside a negated class"}


def _escape_problem(escape: str, negated_class: bool) -> str | None:
    letter = escape[1:2]
    if escape.startswith(("\\x{", "\\u{", "\\U{")):
        return f"the braced escape {escape}"
    if letter in _MISREAD_ESCAPES:
        return _MISREAD_ESCAPES[letter]
    if negated_class and letter in _NEGATED_CLASS_ESCAPES:
        return _NEGATED_CLASS_ESCAPES[letter]
    return None


def xgrammar_misreads(pattern: str) -> str | None:
    """The first construct of `pattern` that xgrammar reads differently from
    the Rust regex syntax (so its answers could break the regex), or None."""
    items = list(scan(pattern))
    for k, item in enumerate(items):
        if item.kind == "escape":
            problem = _escape_problem(item.text, False)
        elif item.kind == "class":
            problem = ("a class inside a class ([[:alpha:]], [a-z[0-9]])" if item.nested
                       else f"the class operator {item.set_operator}" if item.set_operator
                       else "a ] first in a class" if item.leading_bracket
                       else "an escaped ^ in a class" if "\\^" in item.escapes
                       else next((p for e in item.escapes if (p := _escape_problem(e, item.negated))), None))
        elif item.kind == "open" and item.text.startswith("(?") and item.text != "(?:" \
                and not item.text.startswith("(?<"):
            problem = f"the group flags {item.text}"
        elif item.kind == "anchor" and ((item.text == "^" and k > 0)
                                        or (item.text == "$" and k < len(items) - 1)):
            problem = f"{item.text} inside the pattern"
        else:
            problem = None
        if problem is not None:
            return f"{problem} at position {item.pos}"
    return None


def _xgrammar_unanchored(pattern: str) -> str | None:
    """xgrammar matches a JSON-schema pattern against the whole string; the
    validator searches for it anywhere (`@` allows "a@b.com", `^https://` any
    URL). They agree only on a pattern anchored at both ends with no
    top-level alternative (`^a|b$` is "starts with a, or ends with b")."""
    items = list(scan(pattern))
    depth = 0
    for item in items:
        depth += (item.kind == "open") - (item.kind == "close")
        if item.kind == "alt" and depth == 0:
            return f"a top-level | at position {item.pos} (xgrammar matches the whole string)"
    if not items or (items[0].kind, items[0].text) != ("anchor", "^") \
            or (items[-1].kind, items[-1].text) != ("anchor", "$"):
        return "a pattern not anchored by ^ and $ (xgrammar matches the whole string; JSON Schema searches)"
    return None


# Characters a JSON string holds only escaped: the quote, the backslash and
# the controls. Where a JSON-schema pattern names one as a literal (`"`,
# `\\`, `\n`, or a class of nothing else: `["]`, `[\t-\r]`), xgrammar puts it
# into the string raw, which is not JSON (`^"[a-z]+"$` gave `""ab""`), and
# refuses its escaped spelling, which is. (From a class with other
# characters, a negated class or a `.`, xgrammar leaves them out: narrower,
# never wider.)
_SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}


def _needs_json_escape(code: int | None) -> bool:
    return code is not None and (code < 0x20 or code in (0x22, 0x5C))


def _literal_code(text: str) -> int | None:
    """The code point a literal (a character or a one-character escape)
    stands for; None for a class escape or an assertion (`\\d`, `\\b`)."""
    if not text.startswith("\\"):
        return ord(text) if len(text) == 1 else None
    letter, rest = text[1:2], text[2:].strip("{}")
    if letter in ("x", "u", "U") and rest:
        try:
            return int(rest, 16)
        except ValueError:
            return None
    if letter in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[letter]
    return ord(letter) if letter and not letter.isalnum() else None


def _class_spans(item: Item) -> list[tuple[int, int]] | None:
    r"""The (first, last) code points of each item of a positive class (a
    literal or a range); None where an item is neither (`\d`, `[:alpha:]`)."""
    if item.negated or item.nested or item.set_operator:
        return None
    body = item.text[1:-1]
    parts: list[str] = []
    j = 0
    while j < len(body):
        end = _escape_at(body, j) if body[j] == "\\" else j + 1
        parts.append(body[j:end])
        j = end
    spans: list[tuple[int, int]] = []
    k = 0
    while k < len(parts):
        lo = hi = _literal_code(parts[k])
        if k + 2 < len(parts) and parts[k + 1] == "-":
            hi = _literal_code(parts[k + 2])
            k += 3
        else:
            k += 1
        if lo is None or hi is None:
            return None
        spans.append((lo, hi))
    return spans


def _only_escaped(lo: int, hi: int) -> bool:
    """Whether every character from `lo` to `hi` needs a JSON escape."""
    return hi < 0x20 or (lo == hi and _needs_json_escape(lo))


def _xgrammar_raw_json_char(pattern: str) -> str | None:
    for item in scan(pattern):
        if item.kind in ("char", "escape") and _needs_json_escape(_literal_code(item.text)):
            return f"{item.text!r} at position {item.pos}, which xgrammar writes into the JSON string unescaped"
        spans = _class_spans(item) if item.kind == "class" else None
        if spans and all(_only_escaped(lo, hi) for lo, hi in spans):
            return f"the class {item.text} at position {item.pos}, which xgrammar writes unescaped"
    return None


def json_pattern_misread(pattern: str, backend: str) -> str | None:
    """The first construct of a JSON-schema `pattern` (ECMA-262, as the
    validator reads it) that `backend` would read otherwise, or None:
    xgrammar's misreads of the Rust syntax, and any pattern it would match
    against the whole string that the validator searches; for llguidance a class inside a
    class or a set operator (`[[:alpha:]]`, `[a-z&&[^a]]`: Rust classes,
    literal characters in ECMA) and look-around, which it refuses."""
    if backend == "xgrammar":
        return xgrammar_misreads(pattern) or _xgrammar_unanchored(pattern) or _xgrammar_raw_json_char(pattern)
    for item in scan(pattern):
        if item.kind == "class" and (item.nested or item.set_operator):
            return f"a class inside a class or a set operator at position {item.pos}"
        if item.kind == "class" and "\\S" in item.escapes:
            return f"\\S inside a class at position {item.pos} (ECMA's \\S is another set)"
        if item.kind == "open" and pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), item.pos):
            return f"a look-around at position {item.pos}"
        if item.kind == "escape" and item.text in ("\\b", "\\B"):
            return f"a word boundary at position {item.pos} (llguidance has none)"
    return None


def rust_syntax_error(pattern: str) -> str | None:
    """The Rust regex crate's parse error for `pattern`, or None if it parses
    (llguidance's own regex parser, without a tokenizer: ~1 ms)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_regex(pattern), None)
    return "; ".join(messages) if is_error else None
