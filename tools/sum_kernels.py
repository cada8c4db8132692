"""The TP sum's kernels side by side, per size, for the choice ``parallel/symmetric.py`` makes:

    torchrun --nproc-per-node 2 -m tools.sum_kernels [--rows 16 64 128 256 512 1024 2048] [--grids 64 132]

Each kernel timed inside a CUDA graph of 64 back-to-back sums, as a forward replays them:
PyTorch's symmetric-memory one-shot (every peer's rows read whole) and two-shot (a slice
reduced per rank, then gathered), pipeserve's push kernel (``kernels/push_sum.py``: the rows
stored into every peer's buffer) and a candidate two-shot of it for more ranks
(``_push_two_shot_kernel`` below, not yet timed on GPUs), each with one program per SM and with
each of ``--grids``. Every
kernel is first checked on four eager calls with other rows each call against the exact sum
(two ranks: bit for bit, the sum rounded once; more: within a bf16 ulp of the largest); the
graph replays that are timed are not checked. Rank 0 prints a table of µs a sum; ``--out``
writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from pipeserve.kernels.push_sum import exchange_flags
from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.symmetric import SymmetricAllReduce, _PushState
from tools.tp_steps import graph_us

HIDDEN = 4096


@triton.jit
def _push_two_shot_kernel(x_ptr, out_ptr, slot_ptrs, flag_ptrs, counts_ptr, share,
                          RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """A candidate for more than two ranks: the push kernel's stores, as a two-shot. Rank r owns
    slice r of the rows (``share`` elements). Each rank stores slice k of its rows into rank k's
    scatter region (at its own rank's place), raises its first flag, awaits the peers', sums its
    slice (rank order), stores the sum into its output and every peer's gather region, raises
    its second flag, awaits the peers' and copies their sums out of its gather region. A rank
    stores 2 (W - 1) / W of its rows, where the one-shot push stores W - 1 copies of them.
    Memory per rank: two slots (calls alternate), each a scatter and a gather region of W
    slices; flags [2, programs, W]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    step = programs * BLOCK
    count = tl.load(counts_ptr + pid) + 1
    tl.debug_barrier()  # every warp has read the count before one thread stores the next
    tl.store(counts_ptr + pid, count)
    numel = WORLD * share
    slot = (count % 2) * 2 * numel  # [scatter region | gather region]
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, share, step):
        idx = start + offs
        mask = idx < share
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            v = tl.load(x_ptr + peer * share + idx, mask=mask)
            dst = tl.load(slot_ptrs + peer).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot + RANK * share
            tl.store(dst + idx, v, mask=mask)
    exchange_flags(flag_ptrs, 0, pid, count, RANK, WORLD)
    own = tl.load(slot_ptrs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
    for start in range(pid * BLOCK, share, step):
        idx = start + offs
        mask = idx < share
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + RANK * share + idx, mask=mask, other=0.0).to(tl.float32)
            else:
                acc += tl.load(own + r * share + idx, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        red = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + RANK * share + idx, red, mask=mask)
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            dst = tl.load(slot_ptrs + peer).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot + numel + RANK * share
            tl.store(dst + idx, red, mask=mask)
    exchange_flags(flag_ptrs, programs * WORLD, pid, count, RANK, WORLD)  # the second flags
    for start in range(pid * BLOCK, share, step):
        idx = start + offs
        mask = idx < share
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            v = tl.load(own + numel + peer * share + idx, mask=mask, cache_modifier=".cg")
            tl.store(out_ptr + peer * share + idx, v, mask=mask)


class PushTwoShot:
    """``_push_two_shot_kernel``'s memory on this rank (the same layout as ``_PushState``'s,
    with a gather region beside each slot's scatter region and a second flag per program)."""

    def __init__(self, group, *, numel: int, device: torch.device, programs: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.slots = symm_mem.empty(2 * 2 * numel, dtype=torch.bfloat16, device=device)
        self.flags = symm_mem.empty(2 * programs * self.world, dtype=torch.int64, device=device)
        self.flags.zero_()
        self.counts = torch.zeros(programs, dtype=torch.int64, device=device)
        handles = [symm_mem.rendezvous(t, group) for t in (self.slots, self.flags)]
        self.slot_ptrs, self.flag_ptrs = (torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device)
                                          for h in handles)
        self.numel = numel
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.is_contiguous() and x.numel() % self.world == 0 and x.numel() <= self.numel
        out = torch.empty_like(x)
        _push_two_shot_kernel[(self.counts.numel(),)](x, out, self.slot_ptrs, self.flag_ptrs, self.counts,
                                                      x.numel() // self.world, RANK=self.rank, WORLD=self.world,
                                                      BLOCK=1024, num_warps=8)
        return out


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
    kernels = {"one-shot": reduce.one_shot, "two-shot": reduce.two_shot}
    for grid in [sms] + [g for g in args.grids if g != sms]:
        kernels[f"push, {grid} programs"] = _PushState(group, numel=max_numel, dtype=torch.bfloat16, device=device,
                                                        programs=grid)
    for grid in [sms] + [g for g in args.grids if g != sms]:
        kernels[f"push two-shot, {grid} programs"] = PushTwoShot(group, numel=max_numel, device=device, programs=grid)
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
