"""kernels/push_sum in the Triton interpreter: one rank's side of a two- and a three-rank sum,
the peers simulated in memory (their rows already pushed into this rank's slots, their flags
already raised), over three calls: this rank's rows land in every peer's region for it, in the
slot the call alternates to; its flags count the calls; the sum is the reference's, bit for
bit. The peers' side runs on two GPUs in tests/mp/test_symmetric_allreduce.py."""

from __future__ import annotations

import os

import pytest
import torch

from pipeserve.kernels.reference import push_sum_reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 1)])
def test_one_rank_sums_with_simulated_peers(world, rank):
    from pipeserve.kernels.push_sum import push_sum

    n, slot_numel, grid = 7000, 8192, 3  # 7,000: three strides of the grid (3 × 1,024), the last one partial
    slots = [torch.zeros(2 * world * slot_numel) for _ in range(world)]
    flags = [torch.zeros(grid * world, dtype=torch.int64) for _ in range(world)]
    counts = torch.zeros(grid, dtype=torch.int64)
    slot_ptrs = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    g = torch.Generator().manual_seed(7 * world + rank)
    for call in (1, 2, 3):
        parts = [torch.randn(n, generator=g) for _ in range(world)]
        slot = (call % 2) * world * slot_numel
        for peer in range(world):
            if peer != rank:  # the peer's push of its rows into this rank's region for it
                slots[rank][slot + peer * slot_numel:slot + peer * slot_numel + n] = parts[peer]
                flags[rank][peer::world] = call
        out = torch.empty(n)
        push_sum(parts[rank], out, rank=rank, world=world, slot_ptrs=slot_ptrs, flag_ptrs=flag_ptrs,
                 counts=counts, slot_numel=slot_numel)
        assert torch.equal(out, push_sum_reference(parts))
        for peer in range(world):
            if peer != rank:
                region = slot + rank * slot_numel
                assert torch.equal(slots[peer][region:region + n], parts[rank])
                assert flags[peer][rank::world].tolist() == [call] * grid
        assert counts.tolist() == [call] * grid
