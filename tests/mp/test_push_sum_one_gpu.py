"""kernels/push_sum between two processes that share one GPU: each rank allocates its push and
two-shot memory, hands it to the other through CUDA IPC (``torch.multiprocessing``) and maps the
other's, laid out as ``parallel/symmetric._PushState``'s, so every kernel's stores, flags and
waits cross a real process boundary. (PyTorch's symmetric memory refuses two ranks on one device;
the GPU time-slices the two processes' kernels, so a rank spinning on a flag yields to the one
that raises it.) On 2,048 rows of 4,096: the push (1 to 512 rows) and its fused norm, the two-shot
(up to 2,048 rows) and its fused norm over slices of whole rows (odd row counts: the last slice
shorter), interleaved on the same memory, eager and as one CUDA graph replayed with rank 1 held
back on the device: every sum exact, every new residual exact, every norm within bf16's rounding
of the torch reference and the same bits on both ranks. On two GPUs the same kernels run under
``parallel/symmetric`` in tests/mp/test_symmetric_allreduce.py; speed needs two GPUs
(``tools/sum_kernels.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp
from helpers_kernels import captured_graph

from pipeserve.kernels.reference import add_rms_norm_reference, push_sum_reference

HIDDEN, EPS = 4096, 1e-5
PUSH_ROWS, TWO_SHOT_ROWS = 512, 2048  # the memory's sizes (4 MB and 16 MB of bf16), as on two GPUs
# (rows, fused): the push's sizes, then the two-shot's (513, 1,025, 2,047 rows: slices of 257,
# 513 and 1,024 rows, the second rank's one shorter)
CALLS = [(1, False), (1, True), (7, True), (128, False), (512, True), (513, True), (1024, False),
         (1025, True), (2047, True), (2048, False), (2048, True), (64, True), (600, False)]


def _inputs(rows: int, rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_000 * k + 10 * rows + rank)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16).cuda()


class _Memory:
    """One rank's memory for a push kernel (``two_shot``: the two-shot's), shared with the peer."""

    def __init__(self, numel: int, programs: int, two_shot: bool) -> None:
        regions, rounds = (2, 2) if two_shot else (2, 1)  # two ranks: a region each, or scatter + gather
        self.slot_numel, self.programs = numel, programs
        self.slots = torch.zeros(2 * regions * numel, dtype=torch.bfloat16, device="cuda")
        self.flags = torch.zeros(rounds * programs * 2, dtype=torch.int64, device="cuda")

    def kwargs(self, rank: int, peer_slots: torch.Tensor, peer_flags: torch.Tensor) -> dict:
        """A kernel's memory arguments on ``rank``, the peer's memory mapped here."""
        slots, flags = (self.slots, peer_slots), (self.flags, peer_flags)
        if rank == 1:
            slots, flags = slots[::-1], flags[::-1]
        return dict(rank=rank, world=2, slot_numel=self.slot_numel,
                    slot_ptrs=torch.tensor([t.data_ptr() for t in slots], device="cuda"),
                    flag_ptrs=torch.tensor([t.data_ptr() for t in flags], device="cuda"),
                    counts=torch.zeros(self.programs, dtype=torch.int64, device="cuda"))


def _rank(rank: int, to_peer, from_peer, results) -> None:
    from pipeserve.kernels import push_sum as ps

    torch.cuda.set_device(0)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    push, two_shot = _Memory(PUSH_ROWS * HIDDEN, programs, False), _Memory(TWO_SHOT_ROWS * HIDDEN, programs, True)
    torch.cuda.synchronize()  # zeroed before the peer can raise a flag here
    to_peer.put((push.slots, push.flags, two_shot.slots, two_shot.flags))
    peer = from_peer.get(timeout=60)  # the peer's tensors, mapped into this process
    on_push, on_two_shot = push.kwargs(rank, *peer[:2]), two_shot.kwargs(rank, *peer[2:])
    weight = (torch.rand(HIDDEN, generator=torch.Generator().manual_seed(5)) + 0.5).to(torch.bfloat16).cuda()

    def call(x, residual):
        small = x.shape[0] <= PUSH_ROWS
        if residual is None:
            kernel = ps.push_sum if small else ps.push_two_shot
            return kernel(x, torch.empty_like(x), **(on_push if small else on_two_shot))
        kernel = ps.push_add_rms_norm if small else ps.push_two_shot_add_rms_norm
        return kernel(x, residual, weight, EPS, **(on_push if small else on_two_shot))

    def case(k: int, rows: int, fused: bool):
        """This rank's arguments of call k and what it must give."""
        parts = [_inputs(rows, r, k) for r in (0, 1)]
        total = push_sum_reference(parts)
        if not fused:
            return (parts[rank], None), total
        residual = _inputs(rows, 7, k)
        return (parts[rank], residual), add_rms_norm_reference(total, residual, weight, EPS)

    def check(got, want) -> bool:
        if isinstance(want, torch.Tensor):
            return torch.equal(got, want)
        return torch.equal(got[1], want[1]) and torch.allclose(got[0].float(), want[0].float(), rtol=1.6e-2, atol=1e-2)

    cases = [case(k, rows, fused) for k, (rows, fused) in enumerate(CALLS)]
    eager = [check(call(*args), want) for args, want in cases]
    # the same calls in one graph, replayed twice on other inputs, rank 1 held back before each
    statics = [tuple(None if t is None else t.clone() for t in args) for args, _ in cases]
    graph, outs = captured_graph(lambda: [call(*args) for args in statics], lambda: [call(*args) for args in statics])
    replayed, normed = [], []
    for replay in (1, 2):
        fresh = [case(100 * replay + k, rows, fused) for k, (rows, fused) in enumerate(CALLS)]
        for static, (args, _) in zip(statics, fresh):
            for s, a in zip(static, args):
                if s is not None:
                    s.copy_(a)
        torch.cuda.synchronize()
        to_peer.put("ready")  # a barrier: both ranks' inputs are in place
        assert from_peer.get(timeout=60) == "ready"
        if rank == 1:
            torch.cuda._sleep(50_000_000)  # ~25 ms of device time: rank 0 runs ahead into the flags
        graph.replay()
        torch.cuda.synchronize()
        replayed.append([check(out, want) for out, (_, want) in zip(outs, fresh)])
        # numpy, pickled by value (a CPU tensor would travel as a handle to this process's memory)
        normed.append([out[0].float().cpu().numpy() for out, (rows, fused) in zip(outs, CALLS) if fused])
    graph.reset()
    results.put((rank, eager, replayed, normed))
    to_peer.put("done")  # each keeps its memory mapped until the peer has finished with it
    assert from_peer.get(timeout=60) == "done"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_processes_on_one_gpu_sum_and_norm_exactly():
    ctx = tmp.get_context("spawn")
    queues = [ctx.Queue(), ctx.Queue()]  # queues[r]: what rank r receives
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, queues[1 - r], queues[r], results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, eager, replayed, normed = results.get(timeout=240)
            got[rank] = (eager, replayed, normed)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        eager, replayed, _ = got[rank]
        assert eager == [True] * len(CALLS), (rank, [c for c, ok in zip(CALLS, eager) if not ok])
        for oks in replayed:
            assert oks == [True] * len(CALLS), (rank, [c for c, ok in zip(CALLS, oks) if not ok])
    for mine, theirs in zip(got[0][2], got[1][2]):  # the norms: the same bits on both ranks
        assert all((a == b).all() for a, b in zip(mine, theirs))
