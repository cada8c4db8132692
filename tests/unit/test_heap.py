"""runtime/heap: the start-up heap frozen out of full collections, and the collections timed."""

from __future__ import annotations

import gc
import weakref

from pipeserve.runtime.heap import CollectionPauses, freeze_start_up_heap, thaw_heap


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)  # only the cycle collector frees it


def test_collections_are_counted_per_generation_until_closed():
    pauses = CollectionPauses()
    try:
        gc.collect(2)
        pauses.restart()
        assert pauses.summary()["gen2"]["n"] == 0
        _cycles(10)
        gc.collect(2)
        gc.collect(0)
        got = pauses.summary()
        assert got["gen2"]["n"] >= 1 and got["gen0"]["n"] >= 1
        assert got["gen2"]["max_ms"] <= got["gen2"]["total_ms"] and got["gen2"]["total_ms"] >= 0
        assert got["frozen"] == gc.get_freeze_count()
    finally:
        pauses.close()
    assert pauses._on_collection not in gc.callbacks
    before = pauses.summary()["gen2"]["n"]
    gc.collect(2)
    assert pauses.summary()["gen2"]["n"] == before  # closed: no longer counting


class _Node:
    pass


def test_freezing_collects_the_garbage_first_and_thawing_returns_the_rest():
    # A cycle dropped before the freeze is collected, not frozen for good; one made after is
    # the collector's as usual; after the thaw the frozen objects are walked again.
    try:
        dropped = _Node()
        dropped.me = dropped
        gone = weakref.ref(dropped)
        del dropped
        frozen = freeze_start_up_heap()
        assert gone() is None and frozen > 0
        later = _Node()
        later.me = later
        made_later = weakref.ref(later)
        del later
        gc.collect()
        assert made_later() is None and gc.get_freeze_count() == frozen
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0


def test_freezing_leaves_full_collections_only_the_new_objects():
    # (this test process's own heap: unfrozen afterwards, so later tests' cycles are collected)
    try:
        frozen = freeze_start_up_heap()
        assert frozen == gc.get_freeze_count() > 1000  # pytest's and torch's objects at least
        kept = [[i] for i in range(50)]
        tracked = len(gc.get_objects(generation=2))
        assert tracked < frozen  # a full collection no longer walks the frozen ones
        del kept
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
