"""Value checks inside a structural tag's tags (and so inside tool calls).

A structural tag's JSON contents are compiled from their schemas normalized
and cut to each library's view, as a JSON answer's schema is
(schema_plan.tag_view), and the library leaves the same keywords unenforced
there as in a JSON answer (`schema_keywords`: xgrammar ignores `uniqueItems`, `not`, ...). A
resampling request checks them the same way: `TagPlan` knows, per tag, the
keywords its content's schema leaves to checks, its watch plan and its
validator; `TagWatch` reads the output like a `value_watch.ValueWatch` (same
interface, so engine/resample.py drives either), finds the tags' contents
(tag_segments.py) and runs a `ValueWatch` over each content of a checked tag,
with offsets relative to the content's start, translated back to the
output's. Free text and unchecked tags are never checked, and `stable` holds
back only from the start of a checked value that is open inside a tag.

Violations are handled oldest first, whatever a single read finds: `feed`
reports the oldest one not yet resolved, and a `give_up` (no retries left)
keeps it and every later violation of its tag, so the next violation of
another tag is reported next, and `stable` holds back from it until then (a
step's forced run can close two checked tags at once).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from . import structural_tag
from .schema_keywords import backend_view
from .schema_plan import normalized_schema
from .schema_store import SchemaStore
from .tag_segments import Piece, TagScanner, TagShape, shapes_of
from .validation import SchemaValidator
from .value_watch import ValueWatch, Violation
from .watch_plan import WatchPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TagCheck:
    """What the content of one tag is checked with."""

    plan: WatchPlan
    keywords: tuple[str, ...]  # unenforced by the grammar
    validator: SchemaValidator | None  # the content schema's (None: it cannot read it)

    def watch(self) -> ValueWatch:
        return ValueWatch(self.plan, self.keywords, self.validator)


class TagPlan:
    """The value checks of one structural tag compiled by one backend, built
    on first use (`prepare`: off the event loop and the engine thread)."""

    def __init__(self, source: str, backend: str, store: SchemaStore | None = None):
        self.source = source
        self.backend = backend
        self._store = store
        self._lock = threading.Lock()
        self._built = False
        self._shapes: tuple[TagShape, ...] | None = None
        self._checks: dict[int, TagCheck] = {}

    @property
    def ready(self) -> bool:
        return self._built

    def prepare(self) -> None:
        """Read the tags, normalize their schemas, build the checks' validators."""
        with self._lock:
            if self._built:
                return
            try:
                self._shapes = shapes_of(structural_tag.normalize(self.source))
            except Exception:  # noqa: BLE001 - a tag the compiler read; nothing to check then
                log.debug("a structural tag's value checks could not be read", exc_info=True)
                self._shapes = None
            for i, shape in enumerate(self._shapes or ()):
                check = self._check(shape) if shape.json else None
                if check is not None:
                    self._checks[i] = check
            self._built = True

    def _check(self, shape: TagShape) -> TagCheck | None:
        schema = {} if shape.schema is True else shape.schema
        if not isinstance(schema, dict):
            return None
        try:
            normalized = normalized_schema(schema, self._store)  # as the compile read it (schema_plan.tag_view)
        except Exception:  # noqa: BLE001 - a content the compile refused: nothing to check
            return None
        _, keywords = backend_view(normalized, self.backend)
        plan = WatchPlan.for_schema(normalized, schema)
        if not keywords or plan is None:
            return None
        try:
            validator: SchemaValidator | None = SchemaValidator(schema, self._store)
        except ValueError:
            validator = None
        if validator is None and "uniqueItems" not in keywords:
            return None  # without a validator only duplicates are found
        plan.checks_nodes  # noqa: B018 - builds the node validators now
        return TagCheck(plan, keywords, validator)

    @property
    def shapes(self) -> tuple[TagShape, ...] | None:
        """The tags (None: a format whose contents cannot be found)."""
        self.prepare()
        return self._shapes

    @property
    def checks(self) -> dict[int, TagCheck]:
        """Tag index -> its content's check, for tags with keywords to check."""
        self.prepare()
        return self._checks

    @property
    def resampled_keywords(self) -> tuple[str, ...]:
        """The keywords checked in some tag's content, sorted."""
        return tuple(sorted({k for c in self.checks.values() for k in c.keywords}))

    def watch(self) -> TagWatch | None:
        """A new watch of one output; None when no tag's content is checked."""
        shapes = self.shapes
        if shapes is None or not self.checks:
            return None
        return TagWatch(shapes, self.checks)


@dataclass
class _Open:
    """A checked tag's content being read (or read): its watch and first byte."""

    start: int
    watch: ValueWatch
    closed: bool = False


class TagWatch:
    """Reads one structural tag's output; reports values inside checked tags
    that break their schema (the interface of `ValueWatch`)."""

    def __init__(self, shapes: tuple[TagShape, ...], checks: dict[int, TagCheck]):
        self._shapes = shapes
        self._checks = checks
        self._given_up: set[int] = set()  # content starts whose violation stays
        self._reset()

    def _reset(self) -> None:
        self._scanner = TagScanner(self._shapes)
        self._current: _Open | None = None  # the last checked content opened
        # Violations found and neither rolled back nor given up, oldest first,
        # each with its tag content's start.
        self._unresolved: list[tuple[Violation, int]] = []

    @property
    def size(self) -> int:
        """Bytes read so far."""
        return self._scanner.size

    @property
    def stable(self) -> int:
        """Bytes no check can take back: up to the start of the earliest open
        checked value inside a tag (everything, when none is open)."""
        current = self._current
        stable = self.size if current is None or current.closed else current.start + current.watch.stable
        return min(stable, self._unresolved[0][0].start) if self._unresolved else stable

    def feed(self, data: bytes) -> Violation | None:
        """Read more output; the oldest violation not yet resolved (by a
        rollback, `truncate`, or `give_up`), if any."""
        for piece in self._scanner.feed(data):
            self._read(piece)
        return self._unresolved[0][0] if self._unresolved else None

    def _read(self, piece: Piece) -> None:
        if piece.kind == "open":
            check = self._checks.get(piece.tag)
            self._current = _Open(piece.at, check.watch()) if check is not None else None
            if self._current is not None and piece.at in self._given_up:
                self._current.watch.give_up()
            return
        current = self._current
        if current is None or current.closed:
            return
        if piece.kind == "content":
            self._note(current, current.watch.feed(piece.data))
            return
        current.closed = True  # "close": a bare scalar is checked now
        self._note(current, current.watch.finish())

    def _note(self, current: _Open, found: Violation | None) -> None:
        if found is None:
            return
        at = current.start
        self._unresolved.append((Violation(found.start + at, found.end + at, found.keyword,
                                           None if found.close is None else found.close + at), at))

    def give_up(self) -> None:
        """The oldest violation stays: its tag's content is checked no
        further (later tags are)."""
        if not self._unresolved:
            return
        tag = self._unresolved[0][1]
        self._given_up.add(tag)
        self._unresolved = [u for u in self._unresolved if u[1] != tag]
        if self._current is not None and self._current.start == tag:
            self._current.watch.give_up()

    def finish(self) -> Violation | None:
        """The output ended: the oldest violation not yet resolved, else an
        open content's whole-value violation (the grammar ends tags before a
        stop, so normally none)."""
        current = self._current
        if not self._unresolved and current is not None and not current.closed:
            self._note(current, current.watch.finish())
        return self._unresolved[0][0] if self._unresolved else None

    def truncate(self, size: int) -> None:
        """Forget everything read after byte `size` (the output was rolled back)."""
        kept = self._scanner.text[:size]
        self._given_up = {s for s in self._given_up if s < size}
        self._reset()
        self.feed(kept)

    def segments(self) -> list[tuple[int, int, int | None]]:
        """(tag, content start, content end or None) of every tag read so far."""
        return [(s.tag, s.start, s.end) for s in self._scanner.segments]

