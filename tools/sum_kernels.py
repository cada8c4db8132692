"""The TP sum's kernels side by side, per size, for the choice ``parallel/symmetric.py`` makes:

    torchrun --nproc-per-node 2 -m tools.sum_kernels [--rows 16 64 128 256 512 1024 2048] [--grids 64 132]

Each kernel timed inside a CUDA graph of 64 back-to-back sums, as a forward replays them:
NCCL's all-reduce (what sums larger than the symmetric buffer take), PyTorch's symmetric-memory one-shot (every peer's rows read whole) and two-shot (a slice
reduced per rank, then gathered), and pipeserve's push kernel and its two-shot
(``kernels/push_sum.py``: the rows, or a slice of them per peer, stored into the peers'
buffers), each with one program per SM and with each of ``--grids``. Every kernel is first
checked on four eager calls with other rows each call against the exact sum (two ranks: bit for
bit, the sum rounded once; more: within a bf16 ulp of the largest); the graph replays that are
timed are not checked. Rank 0 prints a table of µs a sum; ``--out``
writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.symmetric import SymmetricAllReduce, _PushState
from tools.tp_steps import graph_us

HIDDEN = 4096


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024, 2048],
                   help="of 4096 bf16 (8 KB a row)")
    p.add_argument("--grids", type=int, nargs="+", default=[64], help="push programs besides one per SM")
    p.add_argument("--out", default=None, help="rank 0 writes the table here (JSON)")
    args = p.parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=3))
    world, rank = dist.get_world_size(), dist.get_rank()
    group = build_parallel_context(world, 1).tp_group
    max_numel = max(args.rows) * HIDDEN
    reduce = SymmetricAllReduce.create(group, max_numel=max_numel, dtype=torch.bfloat16, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    def nccl(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    kernels = {"NCCL": nccl, "one-shot": reduce.one_shot, "two-shot": reduce.two_shot}
    for grid in [sms] + [g for g in args.grids if g != sms]:
        kernels[f"push, {grid} programs"] = _PushState(group, numel=max_numel, dtype=torch.bfloat16, device=device,
                                                        programs=grid)
    for grid in [sms] + [g for g in args.grids if g != sms]:
        kernels[f"push two-shot, {grid} programs"] = _PushState(group, numel=max_numel, dtype=torch.bfloat16,
                                                                device=device, programs=grid, two_shot=True)
    table = {}
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows * 10 + rank)).to(torch.bfloat16)
        x = x.to(device)
        checks = []  # other rows each call: a barrier that lets a rank read its peer's previous rows fails
        for call in range(4):
            xc = x + call
            exact = xc.float()
            dist.all_reduce(exact, group=group)
            checks.append((xc, exact.to(torch.bfloat16)))
        row = {}
        for name, fn in kernels.items():  # every rank makes every call, in the same order
            got = [(fn(xc), want) for xc, want in checks]
            ok = all(torch.equal(a, b) if world == 2 else
                     (a.float() - b.float()).abs().max().item() <= 2 ** -7 * b.float().abs().max().item()
                     for a, b in got)
            row[name] = {"us": graph_us(fn, x), "exact": ok}
        table[rows] = row
    ok_all = torch.tensor([all(k["exact"] for r in table.values() for k in r.values())], device=device,
                          dtype=torch.int32)
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
    if rank == 0:
        names = list(kernels)
        print(f"\n{torch.cuda.get_device_name()}; tp={world}; µs a sum, 64 in a CUDA graph"
              f"{'' if ok_all.item() else '; WRONG results on some rank (marked * on rank 0)'}")
        print("| rows of 4096 (KB) | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for rows, row in table.items():
            cells = [f"{row[n]['us']:.1f}{'' if row[n]['exact'] else '*'}" for n in names]
            print(f"| {rows} ({rows * HIDDEN * 2 // 1024}) | " + " | ".join(cells) + " |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"tp": world, "card": torch.cuda.get_device_name(), "all_exact": bool(ok_all.item()),
                           "rows": table}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return table


if __name__ == "__main__":
    main()
