"""Structural tags: free text with structured pieces inside named tags.

The format vLLM and xgrammar accept, in two spellings:

- legacy (vLLM's `structural_tag`, SGLang's): `{"type": "structural_tag",
  "structures": [{"begin": "<function=f>", "schema": {...}, "end":
  "</function>"}, ...], "triggers": ["<function="]}` - any text, until a
  trigger starts one of the structures (its `begin` starts with the trigger),
  whose content is a JSON value the schema accepts, then its `end`; then any
  text again. `type` may be left out.
- xgrammar's (0.2 on): `{"type": "structural_tag", "format": {...}}`, a tree of
  formats (`const_string`, `json_schema`, `regex`, `grammar`, `any_text`,
  `sequence`, `or`, `tag`, `triggered_tags`, `tags_with_separator`,
  `optional`, `plus`, `star`, `repeat`, `token`, ...; see xgrammar's
  `structural_tag.py`).

`normalize` checks the shape (cheap, at the edge) and returns the xgrammar
spelling, which both backends read: xgrammar compiles any format; llguidance
(`to_lark`) gets what its structural tags express, triggered tags whose
contents are JSON schemas (the legacy spelling, or its equivalent in the new
one), and refuses the rest so that `auto` stays with xgrammar.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .errors import GrammarError

LABEL = "structural tag"


def _error(message: str) -> GrammarError:
    return GrammarError(f"cannot compile {LABEL}: {message}")


def parse(source: str) -> dict[str, Any]:
    """The structural tag as a JSON object, its shape checked; GrammarError otherwise."""
    try:
        tag = json.loads(source)
    except (ValueError, RecursionError) as e:
        raise _error(f"not valid JSON: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(tag, dict):
        raise _error("must be a JSON object")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise _error(f'"type" must be "structural_tag", got {tag.get("type")!r}')
    if "format" in tag:
        if not isinstance(tag["format"], dict) or "type" not in tag["format"]:
            raise _error('"format" must be an object with a "type"')
        return tag
    if "structures" not in tag:
        raise _error('give "format" (xgrammar\'s structural tag) or "structures" and "triggers" (vLLM\'s)')
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise _error('"structures" must be a non-empty list')
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _error('"triggers" must be a non-empty list of non-empty strings')
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not isinstance(item.get("begin"), str) \
                or not isinstance(item.get("end"), str) or "schema" not in item:
            raise _error(f"structures[{i}] needs a string begin and end and a schema")
        if not isinstance(item["schema"], dict | bool):
            raise _error(f"structures[{i}].schema must be a JSON schema (an object or a boolean)")
        if not any(item["begin"].startswith(t) for t in triggers):
            raise _error(f"structures[{i}].begin {item['begin']!r} starts with none of the triggers")
    return tag


def normalize(source: str) -> dict[str, Any]:
    """The structural tag in xgrammar's spelling (`{"type", "format"}`)."""
    tag = parse(source)
    if "format" in tag:
        fmt = tag["format"]
    else:
        fmt = {"type": "triggered_tags", "triggers": list(tag["triggers"]),
               "tags": [{"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": s["schema"]}}
                        for s in tag["structures"]]}
    _check_tag_list(fmt)
    return {"type": "structural_tag", "format": fmt}


def map_schemas(node: Any, fn: Callable[[Any], Any]) -> Any:
    """`node` (a normalized structural tag or a part of one) with `fn` applied
    to the schema of every JSON-schema content, wherever in the format tree."""
    if isinstance(node, list):
        return [map_schemas(v, fn) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {**node, "json_schema": fn(node["json_schema"])}
    return {k: map_schemas(v, fn) for k, v in node.items()}


def _check_tag_list(fmt: Any) -> None:
    """GrammarError for a list of tags the libraries would read apart: one
    trigger the prefix of another (xgrammar refuses it; in llguidance the
    shorter always fires first, so the other tags are never reached) or
    inside another, triggers that are not a list of strings, or two
    tags with one begin (which tag's schema a text follows is then unknown:
    the output's check reads the first's)."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("tags"), list):
        return
    raw = fmt.get("triggers", [])
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        # llguidance would take a string's characters for the triggers.
        raise _error("triggers must be a list of strings")
    triggers = [t for t in raw if t]
    for i, a in enumerate(triggers):
        for j, b in enumerate(triggers):
            if i != j and b.startswith(a):
                raise _error(f"trigger {a!r} is the start of trigger {b!r}: give each tag one trigger")
            if i != j and a in b:
                # The libraries read it apart: llguidance fires the inner one
                # (free text, then that tag), xgrammar the outer.
                raise _error(f"trigger {a!r} is inside trigger {b!r}: give each tag one trigger")
    begins = [t.get("begin") for t in fmt["tags"] if isinstance(t, dict) and isinstance(t.get("begin"), str)]
    repeated = next((b for i, b in enumerate(begins) if b in begins[:i]), None)
    if repeated is not None:
        raise _error(f"two tags begin {repeated!r}: give each tag a begin of its own")


def to_lark(tag: dict[str, Any]) -> str:
    """llguidance's grammar for a normalized structural tag: triggered tags,
    or tags with a separator (what tool calls make), with string begins and
    ends and JSON-schema contents (GrammarError for anything else: xgrammar
    compiles it)."""
    import llguidance

    fmt = tag["format"]
    kind = fmt.get("type")
    if kind == "tags_with_separator":
        return _separated_lark(fmt)
    if kind != "triggered_tags":
        raise _error(f"llguidance takes triggered tags or tags with a separator only, not {kind!r} (use xgrammar)")
    for option in ("at_least_one", "stop_after_first"):
        if fmt.get(option):
            raise _error(f"llguidance cannot enforce {option} on triggered tags (use xgrammar)")
    if fmt.get("excludes"):
        raise _error("llguidance cannot enforce excludes (use xgrammar)")
    triggers = fmt.get("triggers") or []
    items = []
    for i, (begin, schema, end) in enumerate(_json_tags(fmt)):
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise _error(f"tags[{i}].begin {begin!r} starts with none of the triggers")
        items.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    # Triggers are matched as text: special tokens never appear as text here.
    return llguidance.StructTag.to_grammar(items, assume_special=False)


def _separated_lark(fmt: dict[str, Any]) -> str:
    """Only tags, `separator` between them, as xgrammar reads
    `tags_with_separator`: at least one with `at_least_one`, at most one
    with `stop_after_first`."""
    separator = fmt.get("separator", "")
    if not isinstance(separator, str):
        raise _error("the separator must be a string")
    rules = [f"tag_{i}: {json.dumps(begin)} %json {json.dumps(schema)} {json.dumps(end)}"
             for i, (begin, schema, end) in enumerate(_json_tags(fmt))]
    names = [f"tag_{i}" for i in range(len(rules))]
    one = names[0] if len(names) == 1 else "(" + " | ".join(names) + ")"
    sep = f"{json.dumps(separator)} " if separator else ""
    many = one if fmt.get("stop_after_first") else f"{one} ({sep}{one})*"
    body = many if fmt.get("at_least_one") else f"({many})?"
    return "\n".join(["%llguidance {}", f"start: {body}", *rules]) + "\n"


def _json_tags(fmt: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(begin, schema, end) of each tag of a tag list whose contents llguidance
    takes: string begins and ends, JSON-schema contents (the schema carries
    its whitespace bound as llguidance reads it)."""
    items = []
    for i, item in enumerate(fmt.get("tags") or []):
        content = item.get("content") or {}
        begin, end = item.get("begin"), item.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise _error(f"tags[{i}]: llguidance takes string begins and ends only (use xgrammar)")
        if content.get("type") != "json_schema" or content.get("style", "json") != "json" \
                or content.get("any_order") or content.get("excludes"):
            raise _error(f"tags[{i}]: llguidance takes JSON-schema contents only (use xgrammar)")
        schema = content.get("json_schema")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise _error(f"tags[{i}]: the schema must be an object (or true)")
        if content.get("max_whitespace_cnt") is not None:
            n = int(content["max_whitespace_cnt"])
            schema = {**schema, "x-guidance": {"whitespace_flexible": True,
                                               "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{n}}}"}}
        items.append((begin, schema, end))
    if not items:
        raise _error("no tags")
    return items
