"""After start-up a serving process freezes its heap: the garbage collector's
full walks then skip the libraries' objects (~0.2 s a walk, every thread
waiting), and what is frozen is still freed by reference counting."""

from __future__ import annotations

import gc
import weakref

from engine.warmup import freeze_heap


class _Thing:
    pass


def test_freeze_heap_takes_what_is_alive_out_of_the_collectors_walks() -> None:
    kept = _Thing()
    cycle = _Thing()
    cycle.me = cycle  # type: ignore[attr-defined]
    gone = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_heap()
        # It collected first: a cycle that was garbage is not frozen for good.
        assert gone() is None
        # At most what it returned: threads earlier tests left (a server's,
        # an executor's) may free a frozen object meanwhile, as they should.
        assert frozen >= gc.get_freeze_count() > 1000
        assert all(len(gc.get_objects(generation)) < frozen for generation in range(3))
        # A frozen object nothing refers to is still freed.
        ref = weakref.ref(kept)
        del kept
        assert ref() is None
    finally:
        gc.unfreeze()
