"""tools/sum_kernels.py's candidate two-shot push kernel in the Triton interpreter (CPU): one
rank's side of a two- and a four-rank sum, its peers simulated in memory (their slices already
pushed into this rank's scatter region, their sums into its gather region, both their flags
raised), over three calls: this rank's slices land in the peers' scatter regions, its slice's
sum in their gather regions, in the slot the call alternates to; the output is every slice's
sum in rank order, bit for bit. The GPU timing is the tool's point."""

from __future__ import annotations

import os

import pytest
import torch

from pipeserve.kernels.reference import push_sum_reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")


@pytest.mark.parametrize("world,rank", [(2, 1), (4, 2)])
def test_one_rank_of_a_two_shot_push_with_simulated_peers(world, rank):
    from tools.sum_kernels import _push_two_shot_kernel

    share, grid = 1300, 2  # not a multiple of the block
    numel = world * share
    slots = [torch.zeros(2 * 2 * numel) for _ in range(world)]
    flags = [torch.zeros(2 * grid * world, dtype=torch.int64) for _ in range(world)]
    counts = torch.zeros(grid, dtype=torch.int64)
    slot_ptrs = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    g = torch.Generator().manual_seed(world + rank)
    for call in (1, 2, 3):
        parts = [torch.randn(numel, generator=g) for _ in range(world)]
        want = push_sum_reference(parts)
        base = (call % 2) * 2 * numel
        for peer in range(world):
            if peer == rank:
                continue
            mine = slice(rank * share, (rank + 1) * share)
            theirs = slice(peer * share, (peer + 1) * share)
            slots[rank][base + peer * share:base + (peer + 1) * share] = parts[peer][mine]  # scatter
            slots[rank][base + numel + peer * share:base + numel + (peer + 1) * share] = want[theirs]  # gather
            flags[rank].view(2, grid, world)[:, :, peer] = call
        out = torch.empty(numel)
        _push_two_shot_kernel[(grid,)](parts[rank], out, slot_ptrs, flag_ptrs, counts, share,
                                       RANK=rank, WORLD=world, BLOCK=1024)
        assert torch.equal(out, want)
        for peer in range(world):
            if peer == rank:
                continue
            got = slots[peer][base + rank * share:base + (rank + 1) * share]
            assert torch.equal(got, parts[rank][peer * share:(peer + 1) * share])
            got = slots[peer][base + numel + rank * share:base + numel + (rank + 1) * share]
            assert torch.equal(got, want[rank * share:(rank + 1) * share])
            assert (flags[peer].view(2, grid, world)[:, :, rank] == call).all()
        assert counts.tolist() == [call] * grid
