"""BlockTableArray (a worker's persistent block tables) against padding the lists afresh."""

import random

import numpy as np

from pipeserve.runtime.worker.batch import BlockTableArray


def padded(tables: list[list[int]]) -> np.ndarray:
    """The reference: each table padded with 0 to the longest (at least one column)."""
    width = max([len(t) for t in tables] + [1])
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64).reshape(len(tables), width)


def test_rows_follow_growth_replacements_and_frees():
    rng = random.Random(0)
    array = BlockTableArray()
    tables: dict[str, list[int]] = {}
    replaced: set[str] = set()  # new or restarted since their last step: sent in full
    next_id = 0
    for _ in range(300):
        # Requests come and go; each step some tables grow, some restart with new blocks.
        if len(tables) < 40 and rng.random() < 0.5:
            rid = f"r{next_id}"
            next_id += 1
            tables[rid] = [rng.randrange(1000) for _ in range(rng.randint(1, 5))]
            replaced.add(rid)
        if tables and rng.random() < 0.2:
            rid = rng.choice(sorted(tables))
            del tables[rid]
            replaced.discard(rid)
            array.free(rid)
        for rid, table in tables.items():
            if rng.random() < 0.2:
                table.extend(rng.randrange(1000) for _ in range(rng.randint(1, 3)))
            elif rng.random() < 0.05:  # preempted and readmitted: a new table, maybe as long
                tables[rid] = [rng.randrange(1000) for _ in range(rng.randint(1, len(table) + 1))]
                replaced.add(rid)
        step = [rid for rid in tables if rng.random() < 0.8]
        rng.shuffle(step)
        got = array.gather(step, [list(tables[r]) for r in step], [r in replaced for r in step])
        replaced -= set(step)
        np.testing.assert_array_equal(got, padded([tables[r] for r in step]))


def test_a_freed_row_is_reused_clean():
    array = BlockTableArray()
    array.gather(["a", "b"], [[1, 2, 3, 4], [5]], [True, True])
    array.free("a")
    np.testing.assert_array_equal(array.gather(["c", "b"], [[7], [5]], [True, False]), [[7], [5]])
    np.testing.assert_array_equal(array.gather(["b"], [[5, 6, 8, 9, 10]], [False]), [[5, 6, 8, 9, 10]])


def test_an_empty_step_has_one_column():
    assert BlockTableArray().gather([], [], []).shape == (0, 1)
