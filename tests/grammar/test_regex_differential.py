"""Regex answers of each backend, checked by the Rust `regex` crate.

Patterns use every construct of the Rust regex syntax. Each backend either
refuses a pattern (xgrammar refuses what its own parser reads differently,
grammar/regex_syntax.py) or generates answers by random walks through its
masks: the engine's path (fill a bitmask, pick an allowed token, accept it).
Every answer that ends with a stop token must be a whole match for the regex
crate (`regex_rs`, its Python binding) and get a VALID verdict from the
output check; a pattern no string matches is refused by both.
"""

from __future__ import annotations

import random

import pytest
from regex_rs import Regex

from grammar import GrammarError, GrammarSpec
from grammar.output_check import OutputCheck

from .conftest import BACKENDS, STOP_IDS, allowed

# One or more patterns per construct of the Rust regex syntax.
FEATURES = {
    "literals and escapes": [r"ab\.c\*", r"\x41\u0042\t", r"\x{43}\u{44}", r"[\[\]\-]{2}", r"\\d"],
    "dot": [r"caf.", r"(?s)a.b"],
    "perl classes": [r"\d{3}", r"\w{2}", r"\s\S", r"\D{2}", r"\W{2}", r"[\d\s]{3}", r"[^\d]{2}", r"[^\w]{2}"],
    "unicode classes": [r"\pL{2}", r"\p{Greek}{2}", r"\PL", r"[\p{Han}a]{2}"],
    "classes": [r"[a-c]{3}", r"[^a]{2}", r"[-a]{2}", r"[]a]{2}", r"[^]a]{2}", r"[\^a]{2}", r"[é-ö]{2}"],
    "nested classes and set operations": [r"[a-z[0-9]]{3}", r"[a-z&&[^aeiou]]{4}", r"[a-z--[aeiou]]{3}",
                                          r"[a-g~~c-j]{3}"],
    "ascii classes": [r"[[:alpha:]]{3}", r"[[:digit:]]{2}", r"[[:^alpha:]]{2}", r"[^[:alpha:]]{2}"],
    "repetitions": [r"a{2,4}", r"(ab){2}", r"a+?b", r"a{2,4}?", r"x{0}y", r"(a*)*b"],
    "groups and alternation": [r"(?:ab|cd){2}", r"(?<n>x)y", r"(?P<n>x)y", r"a|b|", r"(a|)b"],
    "flags": [r"(?i)abc", r"(?i:ab)c", r"(?x) a b c ", r"(?U)a+b"],
    "anchors": [r"^ab$", r"\Aab\z", r"a^b"],
    "no string matches": [r"[^\x00-\x{10FFFF}]", r"a[^\x00-\x{10FFFF}]"],
}
PATTERNS = [p for group in FEATURES.values() for p in group]
WALKS = 8
MAX_TOKENS = 24


def _walk(matcher, compiler, rng: random.Random) -> list[int] | None:
    """A random answer of `matcher`'s grammar; None if it did not end in MAX_TOKENS."""
    bitmask = compiler.allocate_bitmask(1)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        matcher.fill_bitmask(bitmask, 0)
        choices = sorted(allowed(bitmask))
        stops = [t for t in choices if t in STOP_IDS]
        # End about half the times the grammar allows it, so answers vary in length.
        token = stops[0] if stops and (len(stops) == len(choices) or rng.random() < 0.5) \
            else rng.choice([t for t in choices if t not in STOP_IDS])
        assert matcher.accept_token(token)
        if token in STOP_IDS:
            return out
        out.append(token)
    return None


def _rust_matches(pattern: str, text: str) -> bool | None:
    """Whether the regex crate matches all of `text` (None: the crate refuses the pattern)."""
    try:
        regex = Regex(r"\A(?:" + pattern + r")\z")
    except Exception:  # noqa: BLE001 - its parse error
        return None
    return regex.find(text, None) is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_answer_matches_the_regex(compiler, tokenizer, backend: str) -> None:
    rng = random.Random(7)
    compiled = 0
    for pattern in PATTERNS:
        spec = GrammarSpec.regex(pattern)
        try:
            compiler.compile(spec, backend=backend)
        except GrammarError:
            continue  # refused: no answer can break it
        compiled += 1
        check = OutputCheck(spec)
        for _ in range(WALKS):
            ids = _walk(compiler.compile(spec, backend=backend), compiler, rng)
            if ids is None:
                continue
            text = tokenizer.decode(ids)
            assert _rust_matches(pattern, text), f"{backend} answered {text!r} to {pattern!r}"
            assert check.validate_text(text).valid, (pattern, text)
    assert compiled >= 20, "most patterns compile"


@pytest.mark.parametrize("pattern", FEATURES["no string matches"])
@pytest.mark.parametrize("backend", ["llguidance", None])
def test_a_regex_no_string_matches_is_refused_without_fallback(compiler, backend, pattern) -> None:
    """A verdict on the spec, not a library's limit: auto does not fall back
    to xgrammar (which refuses the braced escape anyway)."""
    with pytest.raises(GrammarError, match="accepts no string") as err:
        compiler.compile(GrammarSpec.regex(pattern), backend=backend)
    assert err.value.final


@pytest.mark.parametrize("pattern", FEATURES["nested classes and set operations"]
                         + FEATURES["ascii classes"] + [r"[\p{Han}a]{2}", r"\Aab\z", r"\x{43}", r"[^]a]"])
def test_xgrammar_refuses_what_it_reads_otherwise(compiler, pattern: str) -> None:
    with pytest.raises(GrammarError, match="differently from the Rust regex syntax"):
        compiler.compile(GrammarSpec.regex(pattern), backend="xgrammar")
    # auto reads it with llguidance.
    assert compiler.compile(GrammarSpec.regex(pattern)).backend == "llguidance"


def test_the_output_check_reads_rust_semantics() -> None:
    compared = eligible = 0
    for pattern in PATTERNS:
        check = OutputCheck(GrammarSpec.regex(pattern))
        for text in ("abc", "ab", "a", "bcdf", "l]]]]", "\u4e00a", "AB", "caf\n", "aab", "\u03b1\u03b2", ""):
            expected = _rust_matches(pattern, text)
            if expected is None:
                continue  # the crate refuses the pattern
            eligible += 1
            result = check.validate_text(text)
            if not result.checked:
                continue  # a pattern the checker cannot read (an anchor mid-pattern), said so
            assert result.valid == expected, (pattern, text, result)
            compared += 1
    # Most of what the crate reads, the check reads too: verdicts were compared.
    assert compared >= 0.8 * eligible, (compared, eligible)
