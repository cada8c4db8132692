"""The TP sums through symmetric memory (``parallel/symmetric.py``) on two GPUs: one-shot and
two-shot, eager and replayed inside a CUDA graph, equal the exact sum rounded once (what NCCL
gives for two ranks); a tensor the buffer cannot hold goes through NCCL. On CPU, ``create``
declines and the sums stay with the process group."""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pipeserve.parallel.context import ParallelContext, tp_all_reduce
from pipeserve.parallel.symmetric import SymmetricAllReduce

HIDDEN = 4096
ROWS = (1, 128, 256, 2048)  # 8 KB to 16 MB of bf16: both sides of the one-shot limit


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
        reduce = SymmetricAllReduce.create(group, max_numel=1024 * HIDDEN, dtype=torch.bfloat16, device=device)
        assert reduce is not None
        ctx = ParallelContext(rank=rank, world_size=2, tp_size=2, pp_size=1, tp_group=group, tp_reduce=reduce)
        out = {}
        for rows in ROWS:
            x = _inputs(rows, rank, device)
            want = (_inputs(rows, 0, device).float() + _inputs(rows, 1, device).float()).to(torch.bfloat16)
            for how, limit in (("one-shot", 1 << 62), ("two-shot", 0)):
                reduce.one_shot_max_bytes = limit
                eager = tp_all_reduce(x.clone(), ctx)
                static = x.clone()
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    tp_all_reduce(static.clone(), ctx)  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph, stream=stream):
                    replayed = tp_all_reduce(static, ctx)
                static.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                out[(rows, how)] = (torch.equal(eager, want), torch.equal(replayed, want),
                                    rows * HIDDEN <= reduce.buffer.numel())
                graph.reset()
        results.put((rank, out))
    finally:
        dist.barrier()
        dist.destroy_process_group()


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
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        for (rows, how), (eager, replayed, symmetric_path) in got[rank].items():
            assert eager and replayed, (rank, rows, how)
        # 2048 rows exceed the 1024-row buffer: those went through NCCL
        assert [fits for (rows, how), (_, _, fits) in got[rank].items() if how == "one-shot"] == [True, True, True, False]


def test_cpu_keeps_the_process_group_sums():
    assert SymmetricAllReduce.create(None, max_numel=1024, dtype=torch.float32, device=torch.device("cuda")) is None
    assert SymmetricAllReduce.create(object(), max_numel=1024, dtype=torch.float32, device=torch.device("cpu")) is None
