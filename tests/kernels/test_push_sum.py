"""kernels/push_sum, one rank's side of a two- and a three-rank sum with the peers simulated in
memory (their rows already pushed into this rank's slots, their flags already raised), over
several calls: this rank's rows land in every peer's region for it, in the slot the call
alternates to; its flags count the calls; the sum is the reference's, bit for bit. The same for
the two-shot (``push_two_shot``: slices scattered, each rank's slice summed and gathered), with
sums of other sizes one after another, and for the two-shot fused with the norm
(``push_two_shot_add_rms_norm``, slices of whole rows) between plain two-shots; and for the sum fused with the residual add and RMSNorm
(``push_add_rms_norm``), called between plain sums on the same slots, flags and counts: its new
residual is the reference's bit for bit, its norm the reference's to rounding (the squares may
add in another order). In the Triton interpreter (float32) and natively on one GPU (float32 and bfloat16: the simulated peers are
tensors on the same device). The peers' side runs on two GPUs in
tests/mp/test_symmetric_allreduce.py."""

from __future__ import annotations

import pytest
import torch
from helpers_kernels import DEVICE, NATIVE, interpreter_array_warning, runs_triton

from pipeserve.kernels.reference import add_rms_norm_reference, push_sum_reference

pytestmark = [runs_triton, interpreter_array_warning]
# The interpreter's bfloat16 is wrong (numpy has none): float32 there.
DTYPES = [torch.float32, torch.bfloat16] if NATIVE else [torch.float32]


def _memory(world: int, rank: int, slot_numel: int, grid: int, dtype: torch.dtype,
            two_shot: bool = False) -> tuple[list, list, dict]:
    """Every rank's slots and flags (this rank's and the simulated peers'; laid out as
    ``parallel/symmetric._PushState``'s), and the keyword arguments of this rank's calls."""
    regions, rounds = (2, 2) if two_shot else (world, 1)
    slots = [torch.zeros(2 * regions * slot_numel, dtype=dtype, device=DEVICE) for _ in range(world)]
    flags = [torch.zeros(rounds * grid * world, dtype=torch.int64, device=DEVICE) for _ in range(world)]
    memory = dict(rank=rank, world=world, slot_numel=slot_numel,
                  slot_ptrs=torch.tensor([t.data_ptr() for t in slots], dtype=torch.int64, device=DEVICE),
                  flag_ptrs=torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=DEVICE),
                  counts=torch.zeros(grid, dtype=torch.int64, device=DEVICE))
    return slots, flags, memory


def _peers_push(slots, flags, parts, rank: int, call: int, slot_numel: int) -> None:
    """The peers' side of call ``call``: their rows in this rank's regions for them, their flags
    raised."""
    world = len(slots)
    slot = (call % 2) * world * slot_numel
    for peer in range(world):
        if peer != rank:
            region = slot + peer * slot_numel
            slots[rank][region:region + parts[peer].numel()] = parts[peer].reshape(-1)
            flags[rank][peer::world] = call


def _check_pushed(slots, flags, memory, mine: torch.Tensor, call: int) -> None:
    """This rank's rows in every peer's region for it, its flags there and its counts at ``call``."""
    world, rank, slot_numel = memory["world"], memory["rank"], memory["slot_numel"]
    region = (call % 2) * world * slot_numel + rank * slot_numel
    grid = memory["counts"].numel()
    for peer in range(world):
        if peer != rank:
            assert torch.equal(slots[peer][region:region + mine.numel()], mine.reshape(-1))
            assert flags[peer][rank::world].tolist() == [call] * grid
    assert memory["counts"].tolist() == [call] * grid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 1)])
def test_one_rank_sums_with_simulated_peers(world, rank, dtype):
    from pipeserve.kernels.push_sum import push_sum

    n, slot_numel, grid = 7000, 8192, 3  # 7,000: three strides of the grid (3 × 1,024), the last one partial
    slots, flags, memory = _memory(world, rank, slot_numel, grid, dtype)
    g = torch.Generator().manual_seed(7 * world + rank)
    for call in (1, 2, 3):
        parts = [torch.randn(n, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
        _peers_push(slots, flags, parts, rank, call, slot_numel)
        out = push_sum(parts[rank], torch.empty_like(parts[rank]), **memory)
        assert torch.equal(out, push_sum_reference(parts))
        _check_pushed(slots, flags, memory, parts[rank], call)


def _peers_two_shot(slots, flags, rank: int, call: int, slot_numel: int, share: int, scattered: dict,
                    gathered: dict) -> None:
    """The peers' side of two-shot call ``call``: peer p's ``scattered[p]`` in this rank's scatter
    region and its ``gathered[p]`` in its gather region (each at p × ``share``), both its flags
    raised."""
    world, grid = len(slots), flags[rank].numel() // (2 * len(slots))
    scatter = (call % 2) * 2 * slot_numel
    for peer in range(world):
        if peer != rank:
            for region, values in ((scatter, scattered[peer]), (scatter + slot_numel, gathered[peer])):
                slots[rank][region + peer * share:region + peer * share + values.numel()] = values.reshape(-1)
            flags[rank].view(2, grid, world)[:, :, peer] = call


def _check_two_shot_stores(slots, flags, before, memory, call: int, share: int, scattered: dict,
                           gathered: torch.Tensor) -> None:
    """What this rank stored on each peer p in call ``call``: ``scattered[p]`` in p's scatter
    region and ``gathered`` in its gather region, both at this rank × ``share``, and nothing else
    (every other element of p's slots as it was, ``before[p]``); its flags there and its counts."""
    world, rank, slot_numel = memory["world"], memory["rank"], memory["slot_numel"]
    grid = memory["counts"].numel()
    scatter = (call % 2) * 2 * slot_numel
    for peer in range(world):
        if peer != rank:
            want = before[peer].clone()
            for region, values in ((scatter, scattered[peer]), (scatter + slot_numel, gathered)):
                want[region + rank * share:region + rank * share + values.numel()] = values.reshape(-1)
            assert torch.equal(slots[peer], want), peer
            assert (flags[peer].view(2, grid, world)[:, :, rank] == call).all()
    assert memory["counts"].tolist() == [call] * grid


def _plain_two_shot(slots, flags, memory, call: int, share: int, g: torch.Generator, dtype: torch.dtype) -> None:
    """Call ``call``, a plain ``push_two_shot`` of ``world`` × ``share`` elements with the peers
    simulated: its sum exact, its stores on the peers (and only those) as they must be."""
    from pipeserve.kernels.push_sum import push_two_shot

    world, rank = memory["world"], memory["rank"]
    parts = [torch.randn(world * share, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
    want = push_sum_reference(parts)
    mine = slice(rank * share, (rank + 1) * share)
    _peers_two_shot(slots, flags, rank, call, memory["slot_numel"], share,
                    scattered={p: parts[p][mine] for p in range(world)},
                    gathered={p: want[p * share:(p + 1) * share] for p in range(world)})
    before = [t.clone() for t in slots]
    assert torch.equal(push_two_shot(parts[rank], torch.empty_like(parts[rank]), **memory), want)
    _check_two_shot_stores(slots, flags, before, memory, call, share,
                           scattered={p: parts[rank][p * share:(p + 1) * share] for p in range(world)},
                           gathered=want[mine])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,rank", [(2, 1), (4, 2)])
def test_one_rank_of_a_two_shot_with_simulated_peers(world, rank, dtype):
    """The peers' slices already in this rank's scatter region and their sums in its gather
    region, both their flags raised; three calls of other sizes (the regions' places do not move
    with the size)."""
    slot_numel, grid = 4 * 1300, 2
    slots, flags, memory = _memory(world, rank, slot_numel, grid, dtype, two_shot=True)
    g = torch.Generator().manual_seed(world + rank)
    for call, share in ((1, 1300), (2, 700), (3, 1300)):  # 1,300: not a multiple of the block
        _plain_two_shot(slots, flags, memory, call, share, g, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,rank", [(2, 1), (3, 2), (3, 0)])
def test_the_two_shots_fused_norm_with_simulated_peers(world, rank, dtype):
    """``push_two_shot_add_rms_norm``, one rank's side, between plain two-shots on the same
    memory: slices of whole rows, uneven (the last shorter), a single row (only rank 0's slice
    holds it), rows that fill the regions exactly. Its new residual is the reference's bit for
    bit, its norm within rounding; it stores its rows of each peer's slice and its own slice's
    new residual rows there and nothing past them."""
    from pipeserve.kernels.push_sum import push_two_shot_add_rms_norm, two_shot_norm_rows

    H, grid, eps = 48, 3, 1e-5
    slot_numel = 4 * world * H  # 4 rows a slice at most
    slots, flags, memory = _memory(world, rank, slot_numel, grid, dtype, two_shot=True)
    g = torch.Generator().manual_seed(13 * world + rank)
    weight = (torch.rand(H, generator=g) + 0.5).to(dtype).to(DEVICE)
    for call, T in enumerate((7, None, 1, 4 * world, world + 1, None), start=1):  # None: a plain two-shot
        for peer in range(world):  # whatever this call leaves unwritten must stay as it was
            if peer != rank:
                slots[peer].fill_(-3.0)
        if T is None:
            _plain_two_shot(slots, flags, memory, call, slot_numel // world - 5, g, dtype)
            continue
        rows = two_shot_norm_rows(T, world)
        slices = [slice(min(T, p * rows), min(T, (p + 1) * rows)) for p in range(world)]
        parts = [torch.randn(T, H, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
        residual = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
        want_normed, want_residual = add_rms_norm_reference(push_sum_reference(parts), residual, weight, eps)
        _peers_two_shot(slots, flags, rank, call, slot_numel, rows * H,
                        scattered={p: parts[p][slices[rank]] for p in range(world)},
                        gathered={p: want_residual[slices[p]] for p in range(world)})
        before = [t.clone() for t in slots]
        normed, new_residual = push_two_shot_add_rms_norm(parts[rank], residual, weight, eps, **memory)
        assert torch.equal(new_residual, want_residual), T
        tol = {} if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(normed, want_normed, **tol)  # the squares' order: an ulp
        _check_two_shot_stores(slots, flags, before, memory, call, rows * H,
                               scattered={p: parts[rank][slices[p]] for p in range(world)},
                               gathered=want_residual[slices[rank]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,rank,H", [(2, 1, 48), (3, 2, 48), (2, 0, 4096)])
def test_the_fused_norm_shares_the_sums_memory(world, rank, H, dtype):
    from pipeserve.kernels.push_sum import push_add_rms_norm, push_sum

    T, grid, eps = 7, 3, 1e-5  # 7 rows: three strides of the grid, the last partial
    slot_numel = T * H + 64
    slots, flags, memory = _memory(world, rank, slot_numel, grid, dtype)
    g = torch.Generator().manual_seed(11 * world + rank)
    weight = (torch.rand(H, generator=g) + 0.5).to(dtype).to(DEVICE)
    for call, fused in ((1, False), (2, True), (3, True), (4, False)):
        parts = [torch.randn(T, H, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
        _peers_push(slots, flags, parts, rank, call, slot_numel)
        if fused:
            residual = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
            normed, new_residual = push_add_rms_norm(parts[rank], residual, weight, eps, **memory)
            want_normed, want_residual = add_rms_norm_reference(push_sum_reference(parts), residual, weight, eps)
            assert torch.equal(new_residual, want_residual)
            tol = {} if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(normed, want_normed, **tol)  # the squares' order: an ulp
        else:
            out = push_sum(parts[rank], torch.empty_like(parts[rank]), **memory)
            assert torch.equal(out, push_sum_reference(parts))
        _check_pushed(slots, flags, memory, parts[rank], call)
