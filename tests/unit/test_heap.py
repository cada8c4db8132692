"""runtime/heap: the start-up heap frozen out of full collections, and the collections timed."""

from __future__ import annotations

import gc

from pipeserve.runtime.heap import CollectionPauses, freeze_start_up_heap


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)  # only the cycle collector frees it


def test_collections_are_counted_per_generation_until_closed():
    pauses = CollectionPauses()
    try:
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
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
