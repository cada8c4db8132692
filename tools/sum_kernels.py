"""Candidate one-shot all-reduce kernels against PyTorch's, for a decode step's TP sums:

    torchrun --nproc-per-node 2 -m tools.sum_kernels [--rows 16 64 128 256]

A decode step of 128 sequences at tp=2 spends 64 × 14.7 µs in PyTorch's symmetric-memory
one-shot sum (1 MB, two H200s of a 4 × H200 machine), about as long as its 64 KB floor (6.9 µs) plus moving the
megabyte at ~130 GB/s, a fraction of what NVLink carries. A first Triton kernel of pipeserve's
own (one program per SM, scalar flags counting calls) took 32 µs and was reverted. This probe
times variants of a second one, each inside a CUDA graph of 64 back-to-back sums as the forward
replays them, beside PyTorch's one-shot and two-shot, and checks four eager calls of each on
different inputs against the sum (two ranks: exact, the sum rounded once; more: within a bf16
ulp of the largest); the graph replays that are timed are not checked:

- the barrier as a vector over the peers (each flag raised and awaited by one thread, not a
  scalar atomic every thread of the program spins on);
- ``--grids``: programs (few programs move less at once; many signal more);
- ``--blocks`` × ``--warps``: elements a program moves per iteration;
- ``--scopes``: the flags' memory scope, ``sys`` (what NVLink peers need for ordering) and
  ``gpu`` (cheaper fences, printed for the comparison only: not a correct choice).

Rank 0 prints each size's PyTorch times and the five fastest variants (WRONG after a variant
whose result failed the check on rank 0). ``--rows 8 16 32 48 64 96 128 192 256 --grids 132
--blocks 2048 --warps 8 --scopes sys`` gives the one-shot / two-shot cross-over table of
BENCHMARKS.md (PyTorch's columns).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.symmetric import SymmetricAllReduce
from tools.tp_steps import graph_us


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, slot_ptrs, flag_ptrs, counts_ptr, numel, slot_numel,
                     RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK: tl.constexpr,
                     SCOPE: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    count = tl.load(counts_ptr + pid) + 1  # this program's calls: the same on every rank
    tl.store(counts_ptr + pid, count)
    slot = (count % 2) * slot_numel  # consecutive calls alternate slots
    offs = tl.arange(0, BLOCK)
    own = tl.load(slot_ptrs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
    for start in range(pid * BLOCK, numel, step):
        idx = start + offs
        mask = idx < numel
        tl.store(own + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
    tl.debug_barrier()
    peers = tl.arange(0, WORLD_P2)
    live = peers < WORLD
    pads = tl.load(flag_ptrs + peers, mask=live, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(pads + pid * WORLD + RANK, count.to(tl.int64) + tl.zeros([WORLD_P2], tl.int64), mask=live,
                   sem="release", scope=SCOPE)
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64)) + pid * WORLD + peers
    zero = tl.zeros([WORLD_P2], tl.int64)
    seen = tl.atomic_add(mine, zero, mask=live, sem="acquire", scope=SCOPE)
    while tl.min(tl.where(live, seen, count)) < count:
        seen = tl.atomic_add(mine, zero, mask=live, sem="acquire", scope=SCOPE)
    tl.debug_barrier()
    for start in range(pid * BLOCK, numel, step):
        idx = start + offs
        mask = idx < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank rounds the same sum
            buf = tl.load(slot_ptrs + r).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
            acc += tl.load(buf + idx, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


class Candidate:
    """One variant's memory: two slots of ``max_numel``, flags for ``grid`` programs."""

    def __init__(self, group, *, grid: int, block: int, warps: int, scope: str, max_numel: int,
                 device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.grid, self.block, self.warps, self.scope = grid, block, warps, scope
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.slot_numel = max_numel
        self.slots = symm_mem.empty(2 * max_numel, dtype=torch.bfloat16, device=device)
        self.flags = symm_mem.empty(grid * self.world, dtype=torch.int64, device=device)
        self.flags.zero_()
        self.counts = torch.zeros(grid, dtype=torch.int64, device=device)
        self._handles = [symm_mem.rendezvous(t, group) for t in (self.slots, self.flags)]
        self.slot_ptrs, self.flag_ptrs = (torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device)
                                          for h in self._handles)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before any rank raises one

    @property
    def name(self) -> str:
        return f"grid {self.grid}, block {self.block}, {self.warps} warps, {self.scope}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        _one_shot_kernel[(self.grid,)](
            x, out, self.slot_ptrs, self.flag_ptrs, self.counts, x.numel(), self.slot_numel,
            RANK=self.rank, WORLD=self.world, WORLD_P2=max(2, triton.next_power_of_2(self.world)),
            BLOCK=self.block, SCOPE=self.scope, num_warps=self.warps)
        return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256], help="of 4096 bf16 (8 KB a row)")
    p.add_argument("--grids", type=int, nargs="+", default=[16, 32, 64, 132])
    p.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--scopes", nargs="+", default=["sys", "gpu"])
    p.add_argument("--out", default=None, help="rank 0 writes each size's timings here (JSON)")
    args = p.parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=3))
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = build_parallel_context(world, 1)
    hidden, max_numel = 4096, max(args.rows) * 4096
    reduce = SymmetricAllReduce.create(ctx.tp_group, max_numel=max_numel, dtype=torch.bfloat16, device=device)
    candidates = [Candidate(ctx.tp_group, grid=g, block=b, warps=w, scope=s, max_numel=max_numel, device=device)
                  for g, b, w, s in itertools.product(args.grids, args.blocks, args.warps, args.scopes)]
    results = {}
    for rows in args.rows:
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows * 10 + rank)).to(torch.bfloat16)
        x = x.to(device)
        checks = []  # other inputs each call: a barrier that lets a rank read its peer's previous rows fails
        for call in range(4):
            xc = x + call
            exact = xc.float()
            dist.all_reduce(exact, group=ctx.tp_group)
            checks.append((xc, exact.to(torch.bfloat16)))
        timings = []
        for cand in candidates:
            # Every rank makes every call (a call skipped on one rank would leave the ranks' flags
            # out of step for the rest of the run). Two ranks: the sum rounded once, exactly;
            # more: within a bf16 ulp of the largest (the exact sum's rounding order may differ).
            got = [(cand(xc), want_c) for xc, want_c in checks]
            ok = all(torch.equal(a, b) if world == 2 else
                     (a.float() - b.float()).abs().max().item() <= 2 ** -7 * b.float().abs().max().item()
                     for a, b in got)
            timings.append((graph_us(cand, x), cand.name, ok))
        ok_all = torch.tensor([all(ok for _, _, ok in timings)], device=device, dtype=torch.int32)
        dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
        ref = {"one-shot": graph_us(reduce.one_shot, x), "two-shot": graph_us(reduce.two_shot, x)}
        if rank == 0:
            print(f"\ntp={world}, {rows} rows ({rows * hidden * 2 // 1024} KB): PyTorch one-shot "
                  f"{ref['one-shot']:.1f} µs, two-shot {ref['two-shot']:.1f} µs")
            for us, name, ok in sorted(timings)[:5]:
                print(f"  {us:6.1f} µs  {name}{'' if ok else '  WRONG'}")
            bad = [name for _, name, ok in timings if not ok]
            if bad:
                print(f"  wrong results on rank 0: {', '.join(bad)}")
            best = min((t for t in timings if t[2] and t[1].endswith("sys")), default=None)
            results[rows] = {"torch_one_shot_us": ref["one-shot"], "torch_two_shot_us": ref["two-shot"],
                             "best_us": best and best[0], "best": best and best[1],
                             "all_correct_on_every_rank": bool(ok_all.item())}
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"tp": world, "rows": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
