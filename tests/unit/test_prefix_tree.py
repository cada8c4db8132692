"""Global prefix grouping: the block-level prefix tree, groups and their schedule order."""

import pytest

from pipeserve.scheduler.prefix_tree import PrefixGroup, group_by_prefix, schedule_order

BS = 4
SYS_A = [1] * 8  # two full blocks
SYS_B = [2] * 8


def test_groups_follow_the_shared_full_blocks():
    prompts = [
        SYS_A + [10, 11, 12],  # 0
        SYS_B + [20],  # 1
        [3, 3, 3],  # 2: no full block: alone
        SYS_A + [13, 14],  # 3
        SYS_B + [21, 22, 23, 24, 25],  # 4
        SYS_A + [10, 11, 12, 99, 5],  # 5: shares a third block with 0? no: 0 has only 2 usable
    ]
    groups = group_by_prefix(prompts, [1] * 6, block_size=BS)
    assert [g.indices for g in groups] == [[0, 3, 5], [1, 4], [2]]
    assert [g.num_shared_blocks for g in groups] == [2, 2, 0]
    assert [g.num_decode_tokens for g in groups] == [3, 2, 1]


def test_depth_first_order_keeps_deeper_sharing_adjacent():
    doc1, doc2 = [5] * 4, [6] * 4
    prompts = [
        SYS_A + doc1 + [1, 2],  # 0
        SYS_A + doc2 + [1, 2],  # 1
        SYS_A + doc1 + [3, 4],  # 2
        SYS_A + doc2 + [3, 4],  # 3
        SYS_A + [7],  # 4: ends on the shared blocks
    ]
    (group,) = group_by_prefix(prompts, [1, 1, 1, 1, 1], block_size=BS)
    assert group.num_shared_blocks == 2
    order = group.indices
    assert order[0] == 4 and {tuple(order[1:3]), tuple(order[3:])} == {(0, 2), (1, 3)}


def test_heavier_decode_subtree_first():
    doc1, doc2 = [5] * 4, [6] * 4
    prompts = [SYS_A + doc1 + [1], SYS_A + doc2 + [1], SYS_A + doc2 + [2]]
    (group,) = group_by_prefix(prompts, [10, 4, 4], block_size=BS)
    assert group.indices == [0, 1, 2]
    (group,) = group_by_prefix(prompts, [1, 4, 4], block_size=BS)
    assert group.indices == [1, 2, 0]


def test_schedule_order_puts_decode_heavy_groups_first_and_keeps_them_whole():
    groups = [PrefixGroup([0, 2], 2, 10), PrefixGroup([1], 0, 50), PrefixGroup([3, 4], 1, 10)]
    assert schedule_order(groups) == [1, 0, 2, 3, 4]  # ties keep first appearance


def test_order_is_a_permutation_on_a_mixed_batch():
    prompts = [[i % 3] * (4 + i % 9) + [i] * (i % 5) for i in range(60)]
    order = schedule_order(group_by_prefix(prompts, [1 + i % 7 for i in range(60)], block_size=BS))
    assert sorted(order) == list(range(60))


def test_very_deep_prompts_do_not_recurse():
    prompts = [[1] * 5000 + [2], [1] * 5000 + [3]]
    (group,) = group_by_prefix(prompts, [1, 1], block_size=1)
    assert group.num_shared_blocks == 5000 and sorted(group.indices) == [0, 1]


def test_validation():
    with pytest.raises(ValueError):
        group_by_prefix([[1, 2]], [], block_size=BS)
    with pytest.raises(ValueError):
        group_by_prefix([[1, 2]], [1], block_size=0)
