"""The TP sums through symmetric memory (``parallel/symmetric.py``) on two GPUs: pipeserve's
push kernel and its two-shot, PyTorch's one-shot and two-shot, and the choice among them that
the forward makes, eager and replayed inside a CUDA graph (twice, on other rows each time: the
push kernels' slots alternate and their flags count replays), equal the exact sum rounded once
(what NCCL gives for two ranks); the forward's choice pushes up to 4 MB and takes the push's
two-shot above; 32 sums of either push kernel back to back in one graph, sizes changing, one
rank held back on its device, stay exact; a tensor the buffer cannot hold goes through NCCL. The
sum fused with the residual add and RMSNorm (``push_add_rms_norm``: the push's up to 4 MB, the
two-shot's above, over slices of whole rows; each between plain sums of the same kernel, eager
and replayed, and 16 of them between 16 plain sums in one graph with a rank held back) gives the
exact sum plus the residual bit for bit, its norm within bf16's rounding of the torch
reference's and the same bits on both ranks. On CPU, ``create`` declines and the
sums stay with the process group."""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers_kernels import captured_graph

from pipeserve.kernels.reference import add_rms_norm_reference
from pipeserve.parallel.context import ParallelContext, tp_all_reduce
from pipeserve.parallel.symmetric import SymmetricAllReduce

HIDDEN = 4096
ROWS = (1, 128, 512, 513, 1025, 2048, 4096)  # 8 KB to 32 MB of bf16: both sides of the push limit (4 MB)


def _inputs(rows: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rows + rank)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16).to(device)


def _rank(rank: int, port: int, results) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60), device_id=device)
    try:
        group = dist.new_group([0, 1])
        reduce = SymmetricAllReduce.create(group, max_numel=2048 * HIDDEN, dtype=torch.bfloat16, device=device)
        assert reduce is not None
        ctx = ParallelContext(rank=rank, world_size=2, tp_size=2, pp_size=1, tp_group=group, tp_reduce=reduce)
        out = {}
        assert reduce.push_max_numel == 512 * HIDDEN and reduce.push_two_shot_max_numel == 2048 * HIDDEN
        pushed, two_shot_pushed = [], []  # sizes the forward's choice sent through either push kernel
        push, push_two_shot = reduce.push, reduce.push_two_shot
        reduce.push = lambda t: pushed.append(t.numel() // HIDDEN) or push(t)
        reduce.push_two_shot = lambda t: two_shot_pushed.append(t.numel() // HIDDEN) or push_two_shot(t)
        ways = {"auto": lambda t: tp_all_reduce(t, ctx), "push": push, "push two-shot": push_two_shot,
                "one-shot": reduce.one_shot, "two-shot": reduce.two_shot}
        for rows in ROWS:
            calls = []  # three calls' rows, each rank's other than the last call's
            for k in range(3):
                parts = [_inputs(rows, r, device) + k for r in (0, 1)]
                calls.append((parts[rank], (parts[0].float() + parts[1].float()).to(torch.bfloat16)))
            for how, fn in ways.items():
                limit = {"auto": None, "push": reduce.push_max_numel}.get(how, reduce.buffer.numel())
                if limit is not None and rows * HIDDEN > limit:
                    continue
                eager = [torch.equal(fn(x.clone()), want) for x, want in calls]
                static = calls[0][0].clone()
                graph, summed = captured_graph(lambda: fn(static.clone()), lambda: fn(static))
                replayed = []
                for x, want in calls[1:]:
                    static.copy_(x)
                    graph.replay()
                    torch.cuda.synchronize()
                    replayed.append(torch.equal(summed, want))
                out[(rows, how)] = (all(eager), all(replayed), rows * HIDDEN <= reduce.buffer.numel())
                graph.reset()
        out["fused"] = _fused(reduce, push, push_two_shot, rank, device)
        out["burst fused"] = _burst_fused(reduce, push, (1, 64, 512, 7), rank, device)
        out["burst fused two-shot"] = _burst_fused(reduce, push_two_shot, (1024, 513, 2048, 1025), rank, device)
        out["auto pushed"] = sorted(set(pushed)), sorted(set(two_shot_pushed))
        out["burst"] = _burst(push, (1, 64, 512, 7), rank, device)
        out["burst two-shot"] = _burst(push_two_shot, (1024, 600, 2048, 8), rank, device)
        results.put((rank, out))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _replayed_held_back(graph: torch.cuda.CUDAGraph, rank: int, check) -> bool:
    """Two replays of ``graph`` after a barrier, rank 1 held back on its device before each (rank 0
    runs ahead into the flags), ``check()`` after each; then the graph freed. Whether both held."""
    ok = True
    for _ in range(2):
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            torch.cuda._sleep(50_000_000)  # ~25 ms of device time before its first sum
        graph.replay()
        torch.cuda.synchronize()
        ok = check() and ok
    graph.reset()
    return ok


def _fused(reduce: SymmetricAllReduce, push, push_two_shot, rank: int, device) -> list:
    """Per size: (residual exact, norm within rounding), eager and replayed, each fused call
    after a plain sum of the same kernel (the push's up to 512 rows, the two-shot's above); and
    this rank's normed rows, for the ranks to compare."""
    g = torch.Generator().manual_seed(5)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16).to(device)
    results = []
    for rows in (1, 128, 512, 513, 1025, 2047, 2048):  # the push's sizes (up to 4 MB), the two-shot's
        calls = []
        for k in range(3):
            parts = [_inputs(rows, r, device) * (k + 1) for r in (0, 1)]
            residual = _inputs(rows, 7, device) + k
            total = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
            calls.append((parts[rank], residual, add_rms_norm_reference(total, residual, weight, 1e-5)))

        def check(got, want):
            return (torch.equal(got[1], want[1])
                    and torch.allclose(got[0].float(), want[0].float(), rtol=1.6e-2, atol=1e-2))

        def step(x, residual):
            # a plain sum between: the fused kernel shares the plain one's slots and counts
            (push if x.numel() <= reduce.push_max_numel else push_two_shot)(x)
            return reduce.push_add_rms_norm(x, residual, weight, 1e-5)

        assert reduce.fits_norm(calls[0][0], calls[0][1])
        eager = [check(step(x, r), want) for x, r, want in calls]
        static_x, static_r = calls[0][0].clone(), calls[0][1].clone()
        graph, got = captured_graph(lambda: step(static_x.clone(), static_r.clone()), lambda: step(static_x, static_r))
        replayed = []
        for x, r, want in calls[1:]:
            static_x.copy_(x)
            static_r.copy_(r)
            graph.replay()
            torch.cuda.synchronize()
            replayed.append(check(got, want))
        results.append((rows, all(eager), all(replayed), got[0].cpu()))
        graph.reset()
    return results


def _burst(push, rows: tuple, rank: int, device) -> bool:
    """32 pushes of other rows and sizes back to back in one graph, with no host sync between
    them (the slots alternate under load), replayed with rank 1 held back on its device first
    (rank 0 runs ahead into the flags): every sum exact."""
    sizes = [rows[k % 4] for k in range(32)]
    inputs = [[_inputs(rows, r, device) * (k + 1) for r in (0, 1)] for k, rows in enumerate(sizes)]
    wants = [(a.float() + b.float()).to(torch.bfloat16) for a, b in inputs]
    statics = [parts[rank].clone() for parts in inputs]
    graph, outs = captured_graph(lambda: push(statics[0].clone()), lambda: [push(x) for x in statics])
    return _replayed_held_back(graph, rank, lambda: all(torch.equal(o, w) for o, w in zip(outs, wants)))


def _burst_fused(reduce: SymmetricAllReduce, plain, rows: tuple, rank: int, device) -> bool:
    """``_burst`` with the plain sums (``plain``: the push or its two-shot, whose sizes ``rows``
    are) alternating with fused sums + norms on the same slots and counts (the kernels cover
    the rows differently: blocks against whole rows), rank 1 held back: every sum and new
    residual exact, every norm within rounding."""
    g = torch.Generator().manual_seed(9)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16).to(device)
    sizes = [rows[k % 4] for k in range(32)]
    inputs = [[_inputs(n, r, device) * (k + 1) for r in (0, 1)] for k, n in enumerate(sizes)]
    residuals = [_inputs(n, 7, device) + k for k, n in enumerate(sizes)]
    totals = [(a.float() + b.float()).to(torch.bfloat16) for a, b in inputs]
    statics = [parts[rank].clone() for parts in inputs]

    def calls():
        return [plain(x) if k % 2 == 0 else reduce.push_add_rms_norm(x, residuals[k], weight, 1e-5)
                for k, x in enumerate(statics)]

    graph, outs = captured_graph(calls, calls)

    def check() -> bool:
        ok = True
        for k, out in enumerate(outs):
            if k % 2 == 0:
                ok = ok and torch.equal(out, totals[k])
                continue
            normed, new_residual = add_rms_norm_reference(totals[k], residuals[k], weight, 1e-5)
            ok = ok and torch.equal(out[1], new_residual) and torch.allclose(
                out[0].float(), normed.float(), rtol=1.6e-2, atol=1e-2)
        return ok

    return _replayed_held_back(graph, rank, check)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sums_equal_the_exact_sum_eager_and_in_a_graph():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:  # a rank that failed leaves its peer spinning in a kernel: end it rather than wait
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for (rows, eager, replayed, normed), (_, _, _, peers) in zip(got[0].pop("fused"), got[1].pop("fused")):
        assert eager and replayed, rows
        assert torch.equal(normed, peers), rows  # both ranks the same bits
    for rank in (0, 1):
        for burst in ("burst", "burst two-shot", "burst fused", "burst fused two-shot"):
            assert got[rank].pop(burst), (rank, burst)
        # up to 4 MB the push, above it the push's two-shot up to the buffer's 16 MB
        assert got[rank].pop("auto pushed") == ([1, 128, 512], [513, 1025, 2048]), rank
        for (rows, how), (eager, replayed, symmetric_path) in got[rank].items():
            assert eager and replayed, (rank, rows, how)
        assert sum(how == "push" for _, how in got[rank]) == 3  # 1, 128 and 512 rows
        assert sum(how == "push two-shot" for _, how in got[rank]) == 6  # every size the buffer holds
        # 4096 rows exceed the 2048-row buffer: those went through NCCL
        assert [fits for (rows, how), (_, _, fits) in got[rank].items() if how == "auto"] == [True] * 6 + [False]


def test_cpu_keeps_the_process_group_sums():
    assert SymmetricAllReduce.create(None, max_numel=1024, dtype=torch.float32, device=torch.device("cuda")) is None
    assert SymmetricAllReduce.create(object(), max_numel=1024, dtype=torch.float32, device=torch.device("cpu")) is None
