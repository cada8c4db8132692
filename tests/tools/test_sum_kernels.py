"""tools/sum_kernels.py's candidate one-shot kernel in the Triton interpreter (CPU): one rank's
side of a two-rank sum, its peer simulated in memory (the peer's rows already in its slot, its
flag already raised), over three calls: the slots alternate, the flags count, the sum is
exact. The GPU timing is the probe's point; this checks its arithmetic and its barrier's
indexing."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")


def test_one_rank_of_two_sums_with_a_simulated_peer():
    from tools.sum_kernels import _one_shot_kernel

    n, slot_numel, grid = 5000, 8192, 4  # 5,000: not a multiple of the block
    slots = [torch.zeros(2 * slot_numel), torch.zeros(2 * slot_numel)]
    flags = [torch.zeros(grid * 2, dtype=torch.int64), torch.zeros(grid * 2, dtype=torch.int64)]
    counts = torch.zeros(grid, dtype=torch.int64)
    slot_ptrs = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    for call in (1, 2, 3):
        x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
        slot = (call % 2) * slot_numel
        slots[1][slot:slot + n] = y  # the peer's rows of this call, in the slot it alternates to
        flags[0][1::2] = call  # the peer's flag of this call, raised on this rank's pad
        out = torch.empty_like(x)
        _one_shot_kernel[(grid,)](x, out, slot_ptrs, flag_ptrs, counts, n, slot_numel,
                                  RANK=0, WORLD=2, WORLD_P2=2, BLOCK=1024, SCOPE="sys")
        assert torch.equal(out, x + y)
        assert torch.equal(slots[0][slot:slot + n], x)  # this rank's rows, where the peer reads them
        assert flags[1].tolist() == [call, 0] * grid  # this rank's flag raised on the peer's pad
        assert counts.tolist() == [call] * grid
