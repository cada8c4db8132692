"""``tp_sum_add_rms_norm`` (parallel/context.py), the choice a deferred TP sum makes at the next
norm: the fused kernel where the group's symmetric sums take the rows and the residual, else
the sum (``tp_all_reduce``) and then the norm, the operations a layer's own sum and its norm
make. Symmetric memory needs CUDA and two GPUs (tests/mp/test_symmetric_allreduce.py runs the
real one and its kernels); here a stand-in with its interface sums this rank's rows with a
simulated peer's by the kernels' torch references and records which of its paths ran."""

from __future__ import annotations

import pytest
import torch

from pipeserve.kernels.reference import add_rms_norm_reference, push_sum_reference
from pipeserve.parallel.context import ParallelContext, tp_sum_add_rms_norm

H, EPS = 64, 1e-5


class _SimulatedSums:
    """SymmetricAllReduce's interface over a simulated peer: the buffer holds ``max_rows`` rows,
    the push (and so the fused norm) ``push_rows``."""

    def __init__(self, peer: torch.Tensor, *, max_rows: int, push_rows: int) -> None:
        self.peer, self.max_numel, self.push_numel = peer, max_rows * H, push_rows * H
        self.calls: list[str] = []

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return residual is not None and x.numel() <= self.push_numel and self.fits(x)

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
    (8, True, "fused"),  # within the push: one kernel sums, adds and norms
    (32, True, "sum"),  # beyond the push (the two-shot's sizes): the sum, then the norm
    (8, False, "sum"),  # no residual (a stage's first norm): nothing to fuse
])
def test_the_sum_and_norm_take_the_fused_kernel_only_where_it_fits(rows, with_residual, path):
    g = torch.Generator().manual_seed(rows)
    mine, peer = torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g)
    residual = torch.randn(rows, H, generator=g) if with_residual else None
    weight = torch.rand(H, generator=g) + 0.5
    sums = _SimulatedSums(peer, max_rows=64, push_rows=16)
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
