"""``tp_sum_add_rms_norm`` (parallel/context.py), the choice a deferred TP sum makes at the next
norm: the fused kernel where the group's symmetric sums take the rows and the residual, else
the sum (``tp_all_reduce``) and then the norm, the operations a layer's own sum and its norm
make. Symmetric memory needs CUDA and two GPUs (tests/mp/test_symmetric_allreduce.py runs the
real one and its kernels); here a stand-in with its interface sums this rank's rows with a
simulated peer's by the kernels' torch references and records which of its paths ran. And
``SymmetricAllReduce``'s own choice of fused kernel by size (its memory's sizes set by hand, as
``create`` would size it; no kernel runs)."""

from __future__ import annotations

import pytest
import torch

from pipeserve.kernels.reference import add_rms_norm_reference, push_sum_reference
from pipeserve.parallel.context import ParallelContext, tp_sum_add_rms_norm
from pipeserve.parallel.symmetric import SymmetricAllReduce, _PushState

H, EPS = 64, 1e-5


class _SimulatedSums:
    """SymmetricAllReduce's interface over a simulated peer: the buffer holds ``max_rows`` rows,
    the fused norms' memory ``norm_rows``."""

    def __init__(self, peer: torch.Tensor, *, max_rows: int, norm_rows: int) -> None:
        self.peer, self.max_numel, self.norm_numel = peer, max_rows * H, norm_rows * H
        self.calls: list[str] = []

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return residual is not None and x.numel() <= self.norm_numel and self.fits(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("sum")
        return push_sum_reference([x, self.peer])

    def push_add_rms_norm(self, x, residual, weight, eps):
        self.calls.append("fused")
        return add_rms_norm_reference(push_sum_reference([x, self.peer]), residual, weight, eps)


def _context(sums: _SimulatedSums) -> ParallelContext:
    # the group is never used here: every sum fits the stand-in's buffer
    return ParallelContext(rank=1, world_size=2, tp_size=2, pp_size=1, tp_group=object(), tp_reduce=sums)


@pytest.mark.parametrize(("rows", "with_residual", "path"), [
    (8, True, "fused"),  # within the fused norms' memory: one kernel sums, adds and norms
    (32, True, "sum"),  # beyond it: the sum, then the norm
    (8, False, "sum"),  # no residual (a stage's first norm): nothing to fuse
])
def test_the_sum_and_norm_take_the_fused_kernel_only_where_it_fits(rows, with_residual, path):
    g = torch.Generator().manual_seed(rows)
    mine, peer = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)
    residual = torch.randn(rows, H, generator=g) if with_residual else None
    weight = torch.rand(H, generator=g) + 0.5
    sums = _SimulatedSums(peer, max_rows=64, norm_rows=16)
    normed, new_residual = tp_sum_add_rms_norm(mine, residual, weight, EPS, _context(sums), add_rms_norm_reference)
    assert sums.calls == [path]
    want_normed, want_residual = add_rms_norm_reference(push_sum_reference([mine, peer]), residual, weight, EPS)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)


def test_one_rank_norms_without_a_sum():
    g = torch.Generator().manual_seed(3)
    x, residual, weight = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g), torch.rand(H, generator=g)
    got = tp_sum_add_rms_norm(x, residual, weight, EPS, ParallelContext.single(), add_rms_norm_reference)
    want = add_rms_norm_reference(x, residual, weight, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _sums(*, world: int, max_rows: int, push_rows: int, two_shot: bool, hidden: int = H) -> SymmetricAllReduce:
    """A ``SymmetricAllReduce`` of ``world`` ranks whose buffer holds ``max_rows`` rows of
    ``hidden``, its push ``push_rows`` and (``two_shot``) its two-shot the whole buffer, float32."""
    sums = SymmetricAllReduce.__new__(SymmetricAllReduce)
    sums.dtype, sums.world = torch.float32, world
    sums.buffer = torch.empty(max_rows * hidden)

    def memory(rows: int, is_two_shot: bool) -> _PushState:
        state = _PushState.__new__(_PushState)
        state.world, state.slot_numel, state.two_shot = world, rows * hidden, is_two_shot
        return state

    sums._push = memory(push_rows, False) if push_rows else None
    sums._push_two_shot = memory(max_rows, True) if two_shot else None
    return sums


@pytest.mark.parametrize(("world", "max_rows", "push_rows", "two_shot", "fused"), [
    # two ranks: the push to its 8 rows, the two-shot's slices (rows / 2, rounded up) to the buffer's
    (2, 64, 8, True, {1: "push", 8: "push", 9: "two-shot", 63: "two-shot", 64: "two-shot", 65: None}),
    # an odd buffer: 63 rows would take two slices of 32, one row more than it holds
    (2, 63, 8, True, {8: "push", 61: "two-shot", 62: "two-shot", 63: None}),
    # four ranks keep PyTorch's kernels: nothing fused
    (4, 64, 0, False, {1: None, 64: None}),
    # no two-shot of pipeserve's (a buffer within the push): the push's sizes only
    (2, 8, 8, False, {8: "push", 9: None}),
])
def test_the_fused_norm_takes_the_push_then_the_two_shot(world, max_rows, push_rows, two_shot, fused):
    sums = _sums(world=world, max_rows=max_rows, push_rows=push_rows, two_shot=two_shot)
    states = {"push": sums._push, "two-shot": sums._push_two_shot, None: None}
    for rows, want in fused.items():
        x = torch.zeros(rows, H)
        assert sums._norm_state(x, torch.zeros(rows, H)) is states[want], (rows, want)
        assert sums.fits_norm(x, torch.zeros(rows, H)) == (want is not None)


def test_the_fused_norm_declines_what_its_kernels_cannot_take():
    sums = _sums(world=2, max_rows=64, push_rows=8, two_shot=True)
    x = torch.zeros(4, H)
    assert sums.fits_norm(x, torch.zeros(4, H))
    assert not sums.fits_norm(x, None)  # nothing to add: a stage's first norm
    assert not sums.fits_norm(x, torch.zeros(H, 4).T)  # a residual not contiguous
    assert not sums.fits_norm(x, torch.zeros(4, H, dtype=torch.bfloat16))  # a residual of another dtype
    assert not sums.fits_norm(x, torch.zeros(2, H))  # or shape
    assert not sums.fits_norm(x.to(torch.bfloat16), torch.zeros(4, H, dtype=torch.bfloat16))  # not its dtype
    assert not sums.fits_norm(torch.zeros(4 * H), torch.zeros(4 * H))  # not rows
    wide = _sums(world=2, max_rows=64, push_rows=8, two_shot=True, hidden=32768)
    assert not wide.fits_norm(torch.zeros(1, 32768), torch.zeros(1, 32768))  # a row past a program's registers
