import pytest

from pipeserve.scheduler import BlockManager
from pipeserve.scheduler.block_manager import OutOfBlocksError


def test_allocate_append_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_blocks_for(0) == 0 and bm.num_blocks_for(4) == 1 and bm.num_blocks_for(5) == 2
    table = bm.allocate("a", 5)
    assert len(table) == 2 and bm.num_free_blocks == 6 and bm.has("a")
    assert bm.append("a", 8) == []  # 8 slots still fit in 2 blocks
    new = bm.append("a", 9)
    assert len(new) == 1 and bm.block_table("a") == table + new
    bm.allocate("b", 1)
    bm.check_invariants()
    bm.free("a")
    assert not bm.has("a") and bm.num_free_blocks == 7
    bm.free("a")  # idempotent
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_block_table_is_a_copy():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.block_table("a").append(99)
    assert len(bm.block_table("a")) == 1


def test_table_snapshot_is_shared_until_the_table_grows():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 2)
    first = bm.table_snapshot("a")
    assert bm.table_snapshot("a") is first and bm.try_append("a", 2)  # no new block: same list
    assert bm.table_snapshot("a") is first
    assert bm.try_append("a", 3)
    grown = bm.table_snapshot("a")
    assert grown == bm.block_table("a") and len(grown) == 2
    assert first == grown[:1]  # a snapshot handed out earlier never changes
    bm.free("a")
    bm.allocate("a", 2)
    assert bm.table_snapshot("a") == bm.block_table("a") and bm.table_snapshot("a") is not first


def test_exhaustion():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 4)
    assert bm.can_allocate(2) and not bm.can_allocate(3)
    assert bm.can_append("a", 6) and not bm.can_append("a", 7)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", 3)
    assert not bm.has("b")  # a failed allocate leaves no table behind
    with pytest.raises(OutOfBlocksError):
        bm.append("a", 7)
    assert bm.num_free_blocks == 1 and len(bm.block_table("a")) == 2


def test_double_allocate_raises():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="already"):
        bm.allocate("a", 1)
    bm.check_invariants()


def test_free_count_invariant_is_checked():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm._free.append(0)  # corrupt: a block both free and owned
    with pytest.raises(AssertionError):
        bm.free("a")


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=2, block_size=1)
    a = bm.allocate("a", 2)
    bm.free("a")
    assert sorted(bm.allocate("b", 2)) == sorted(a)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
