"""A row-parallel layer's GEMM and its sum at tp=2, with and without the GEMM storing the rows
the peer sums straight into the peer's buffer (the two-shot's scatter done by cuBLAS):

    torchrun --nproc-per-node 2 -m tools.gemm_scatter [--rows 1024 2048] [--k 2048 7168]

Per (rows, K), µs a layer among 8 captured back to back in a CUDA graph (``tp_steps.graph_us``),
x [rows, K] @ w.T, w [4096, K] bf16 (the 8B shape's o_proj at tp=2 has K 2048, its down_proj 7168):

- ``gemm``: cuBLAS's product alone, the floor;
- ``gemm + two-shot``: the product, then the push's two-shot (what the forward does above 4 MB);
- ``halves``: the product as two cuBLAS calls of half the rows each, both stored locally;
- ``halves, one remote``: the same with the half the peer sums stored into the peer's buffer;
- ``scatter gemm``: that, then one kernel (``_finish_kernel``) that raises a flag, sums its half
  with the rows the peer's cuBLAS stored here, stores the sum into its output and the peer's
  gather region, and after a second flag copies the peer's sum out.

``scatter gemm`` is first checked on four eager calls, with other rows each call, against the
float32 product summed over the ranks (within bf16 rounding of the partial products). Rank 0
prints the table; ``--out`` writes it as JSON.
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
from torch.distributed import _symmetric_memory as symm_mem

from pipeserve.kernels.push_sum import BLOCK, NUM_WARPS, exchange_flags, next_count
from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.symmetric import _PushState
from tools.tp_steps import graph_us

HIDDEN = 4096


@triton.jit
def _finish_kernel(own_ptr, out_ptr, slot_ptrs, flag_ptrs, counts_ptr, share, gather_offset,
                   RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    step = programs * BLOCK
    count = next_count(counts_ptr, pid)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    exchange_flags(flag_ptrs, 0, pid, count, RANK, WORLD)  # every peer's product stored my rows here
    mine = tl.load(slot_ptrs + RANK).to(tl.pointer_type(dtype))
    for start in range(pid * BLOCK, share, step):
        idx = start + offs
        mask = idx < share
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(own_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            else:
                acc += tl.load(mine + r * share + idx, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        red = acc.to(dtype)
        tl.store(out_ptr + RANK * share + idx, red, mask=mask)
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            dst = tl.load(slot_ptrs + peer).to(tl.pointer_type(dtype)) + gather_offset + RANK * share
            tl.store(dst + idx, red, mask=mask)
    exchange_flags(flag_ptrs, programs * WORLD, pid, count, RANK, WORLD)
    for start in range(pid * BLOCK, share, step):
        idx = start + offs
        mask = idx < share
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            v = tl.load(mine + gather_offset + peer * share + idx, mask=mask, cache_modifier=".cg")
            tl.store(out_ptr + peer * share + idx, v, mask=mask)


class ScatterGemm:
    """x @ w.T summed over two ranks, the peer's half of the rows stored by cuBLAS into its buffer."""

    def __init__(self, group, *, numel: int, device: torch.device) -> None:
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        assert self.world == 2
        programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.numel = numel
        self.slots = symm_mem.empty(2 * numel, dtype=torch.bfloat16, device=device)  # scatter | gather
        self.flags = symm_mem.empty(2 * programs * self.world, dtype=torch.int64, device=device)
        self.flags.zero_()
        self.counts = torch.zeros(programs, dtype=torch.int64, device=device)
        self.handle = symm_mem.rendezvous(self.slots, group)
        flag_handle = symm_mem.rendezvous(self.flags, group)
        self.slot_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.peer = 1 - self.rank
        self.peer_slots = self.handle.get_buffer(self.peer, (2 * numel,), torch.bfloat16, 0)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def halves(self, x: torch.Tensor, w: torch.Tensor, *, remote: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """My half's partial product (local) and the peer's half's, stored into the peer's
        scatter region (``remote``) or locally."""
        half, n = x.shape[0] // 2, w.shape[0]
        share = half * n
        own = torch.mm(x[self.rank * half:(self.rank + 1) * half], w.t())
        other = x[self.peer * half:(self.peer + 1) * half]
        if remote:
            dst = self.peer_slots[self.rank * share:(self.rank + 1) * share].view(half, n)
            return own, torch.mm(other, w.t(), out=dst)
        return own, torch.mm(other, w.t())

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert x.shape[0] % 2 == 0 and x.shape[0] * w.shape[0] <= self.numel
        own, _ = self.halves(x, w, remote=True)
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        _finish_kernel[(self.counts.numel(),)](own, out, self.slot_ptrs, self.flag_ptrs, self.counts, own.numel(),
                                               self.numel, RANK=self.rank, WORLD=self.world, BLOCK=BLOCK,
                                               num_warps=NUM_WARPS)
        return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--k", type=int, nargs="+", default=[2048, 7168])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=3))
    rank = dist.get_rank()
    group = build_parallel_context(dist.get_world_size(), 1).tp_group
    numel = max(args.rows) * HIDDEN
    scatter = ScatterGemm(group, numel=numel, device=device)
    two_shot = _PushState(group, numel=numel, dtype=torch.bfloat16, device=device, two_shot=True)
    table = {}
    for k in args.k:
        gen = torch.Generator().manual_seed(k + rank)
        w = (torch.randn(HIDDEN, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device)
        for rows in args.rows:
            errs = []
            for call in range(4):  # other rows each call: a stale read of the peer's rows shows
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(device)
                want = x.float() @ w.float().t()
                dist.all_reduce(want, group=group)
                errs.append((scatter(x, w).float() - want).abs().max().item())
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(device)
            row = {"max_err": max(errs)}
            cases = {
                "gemm": lambda t: torch.mm(t, w.t()),
                "gemm + two-shot": lambda t: two_shot(torch.mm(t, w.t())),
                "halves": lambda t: scatter.halves(t, w, remote=False),
                "halves, one remote": lambda t: scatter.halves(t, w, remote=True),
                "scatter gemm": lambda t: scatter(t, w),
            }
            for name, fn in cases.items():
                row[name] = graph_us(fn, x, count=8, repeats=20)
            table[f"{rows} x {k}"] = row
    if rank == 0:
        names = ["gemm", "gemm + two-shot", "halves", "halves, one remote", "scatter gemm"]
        print(f"\n{torch.cuda.get_device_name()}; tp=2; µs a layer, 8 in a CUDA graph")
        print("| rows × K | " + " | ".join(names) + " | scatter's max err |")
        print("|---" * (len(names) + 2) + "|")
        for key, row in table.items():
            print(f"| {key} | " + " | ".join(f"{row[n]:.1f}" for n in names) + f" | {row['max_err']:.3g} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"card": torch.cuda.get_device_name(), "rows": table}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return table


if __name__ == "__main__":
    main()
