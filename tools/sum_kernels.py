"""The TP sum's kernels side by side, per size, for the choice ``parallel/symmetric.py`` makes:

    torchrun --nproc-per-node 2 -m tools.sum_kernels [--rows 16 64 128 256 512 1024 2048] [--grids 64 132]
    torchrun --nproc-per-node 2 -m tools.sum_kernels --norms [--rows ...]
    python -m tools.sum_kernels --simulated [--rows ...]

Each kernel timed inside a CUDA graph of 64 back-to-back sums, as a forward replays them:
NCCL's all-reduce (what sums larger than the symmetric buffer take), PyTorch's symmetric-memory one-shot (every peer's rows read whole) and two-shot (a slice
reduced per rank, then gathered), and pipeserve's push kernel and its two-shot
(``kernels/push_sum.py``: the rows, or a slice of them per peer, stored into the peers'
buffers), each with one program per SM and with each of ``--grids``. Every kernel is first
checked on four eager calls with other rows each call against the exact sum (two ranks: bit for
bit, the sum rounded once; more: within a bf16 ulp of the largest); the graph replays that are
timed are not checked. Rank 0 prints a table of µs a sum; ``--out``
writes it as JSON.

``--norms``: a sum followed by the layer's next residual add and RMSNorm, as a forward makes
them: the forward's choice of sum and then ``kernels/rms_norm``'s kernel, against the push's and
its two-shot's fused kernels (``push_add_rms_norm``, ``push_two_shot_add_rms_norm``) where their
memory holds the rows. At any rank count, four too, where the forward does not push: whether
fusing would pay there. Checked as above (the new residual; the norm within bf16's rounding).

``--simulated``: one GPU, no torchrun. pipeserve's kernels for two ranks with the peer simulated
in local memory (its flags raised far ahead, so no kernel waits): each push kernel alone, then
with the norm kernel after it, then fused. What a kernel costs besides the link (its
instructions, its local reads and writes), where only one GPU is at hand; the stores that would
cross NVLink go to local memory, so the figures are not those of two GPUs. Timed only (the
results with simulated peers are checked in tests/kernels/test_push_sum.py).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeserve.kernels.reference import add_rms_norm_reference
from pipeserve.kernels.rms_norm import add_rms_norm
from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.symmetric import SymmetricAllReduce, _PushState, push_max_bytes
from tools.tp_steps import graph_us

HIDDEN = 4096


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024, 2048],
                   help="of 4096 bf16 (8 KB a row)")
    p.add_argument("--grids", type=int, nargs="+", default=[64], help="push programs besides one per SM")
    p.add_argument("--norms", action="store_true", help="sums followed by the next residual add and RMSNorm")
    p.add_argument("--simulated", action="store_true", help="one GPU: two ranks' kernels, the peer simulated")
    p.add_argument("--out", default=None, help="rank 0 writes the table here (JSON)")
    args = p.parse_args(argv)
    if args.simulated:
        return _simulated(args)
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

    if args.norms:
        return _norms(args, reduce, group, max_numel, device)
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
    return _report(table, list(kernels), args.out, device, "µs a sum")


def _report(table: dict, names: list[str], out: str | None, device: torch.device, what: str) -> dict:
    """Rank 0 prints ``table`` (and writes it to ``out``); every rank learns whether all were exact."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ok_all = torch.tensor([all(k["exact"] for r in table.values() for k in r.values())], device=device,
                          dtype=torch.int32)
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"\n{torch.cuda.get_device_name()}; tp={world}; {what}, 64 in a CUDA graph"
              f"{'' if ok_all.item() else '; WRONG results on some rank (marked * on rank 0)'}")
        _print_table(table, names)
        _write(out, world, table, all_exact=bool(ok_all.item()))
    dist.barrier()
    dist.destroy_process_group()
    return table


def _print_table(table: dict, names: list[str]) -> None:
    print("| rows of 4096 (KB) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for rows, row in table.items():
        cells = [f"{row[n]['us']:.1f}{'*' if row[n]['exact'] is False else ''}" if n in row else "" for n in names]
        print(f"| {rows} ({rows * HIDDEN * 2 // 1024}) | " + " | ".join(cells) + " |")


def _write(out: str | None, tp: int, table: dict, **more) -> None:
    if out:
        with open(out, "w") as f:
            json.dump({"tp": tp, "card": torch.cuda.get_device_name(), **more, "rows": table}, f, indent=1)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


def _norms(args, reduce: SymmetricAllReduce, group, max_numel: int, device: torch.device) -> dict:
    """``--norms``: per size, µs of the forward's sum then the norm kernel, and of each fused kernel
    whose memory holds the rows."""
    world, rank = dist.get_world_size(), dist.get_rank()
    push_numel = min(max_numel, push_max_bytes(2) // 2)  # the push's size at two ranks, whatever the count here
    push = _PushState(group, numel=push_numel, dtype=torch.bfloat16, device=device)
    two_shot = _PushState(group, numel=max_numel, dtype=torch.bfloat16, device=device, two_shot=True)
    g = torch.Generator().manual_seed(5)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16).to(device)
    eps = 1e-5
    table = {}
    for rows in args.rows:
        residual = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16).to(device)
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows * 10 + rank)).to(torch.bfloat16)
        x = x.to(device)
        kernels = {"sum, then norm": lambda t: add_rms_norm(reduce(t), residual, weight, eps)}
        for name, state in (("push, norm fused", push), ("two-shot, norm fused", two_shot)):
            if state.fits_norm(rows, HIDDEN):  # (the same on every rank)
                kernels[name] = lambda t, state=state: state.add_rms_norm(t, residual, weight, eps)
        row = {}
        for name, fn in kernels.items():  # every rank makes every call, in the same order
            ok = True
            for call in range(4):  # other rows each call, as above
                xc = x + call
                exact = xc.float()
                dist.all_reduce(exact, group=group)
                want_normed, want_residual = add_rms_norm_reference(exact.to(torch.bfloat16), residual, weight, eps)
                normed, new_residual = fn(xc)
                # four ranks: PyTorch's sum may round another way, within bf16's rounding
                ok = ok and (torch.equal(new_residual, want_residual) or world > 2 and _close(new_residual, want_residual))
                ok = ok and _close(normed, want_normed)
            row[name] = {"us": graph_us(fn, x), "exact": ok}
        table[rows] = row
    names = ["sum, then norm", "push, norm fused", "two-shot, norm fused"]
    return _report(table, names, args.out, device, "µs a sum + residual add + RMSNorm")


def _simulated(args) -> dict:
    """``--simulated``: µs a call of each of pipeserve's kernels for two ranks on this one GPU."""
    from pipeserve.kernels import push_sum

    torch.cuda.set_device(0)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    kept = []  # the simulated peer's memory, alive while the kernels hold its address

    def memory(numel: int, two_shot: bool) -> dict:
        regions, rounds = (2, 2) if two_shot else (2, 1)
        slots = [torch.zeros(2 * regions * numel, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        flags = [torch.full((rounds * programs * 2,), 1 << 40, dtype=torch.int64, device="cuda") for _ in range(2)]
        kept.append((slots, flags))
        return dict(rank=0, world=2, slot_numel=numel, counts=torch.zeros(programs, dtype=torch.int64, device="cuda"),
                    slot_ptrs=torch.tensor([t.data_ptr() for t in slots], device="cuda"),
                    flag_ptrs=torch.tensor([t.data_ptr() for t in flags], device="cuda"))

    push = memory(min(max(args.rows), push_max_bytes(2) // 2 // HIDDEN) * HIDDEN, False)
    two_shot = memory(max(args.rows) * HIDDEN, True)
    g = torch.Generator().manual_seed(5)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16).cuda()
    table = {}
    for rows in args.rows:
        x, residual = (torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
        out = torch.empty_like(x)
        kernels = {}
        for name, on, plain, fused in (("push", push, push_sum.push_sum, push_sum.push_add_rms_norm),
                                       ("two-shot", two_shot, push_sum.push_two_shot,
                                        push_sum.push_two_shot_add_rms_norm)):
            if x.numel() > on["slot_numel"]:
                continue
            kernels[name] = lambda t, on=on, plain=plain: plain(t, out, **on)
            kernels[f"{name}, then norm"] = lambda t, on=on, plain=plain: add_rms_norm(plain(t, out, **on), residual,
                                                                                       weight, 1e-5)
            kernels[f"{name}, norm fused"] = lambda t, on=on, fused=fused: fused(t, residual, weight, 1e-5, **on)
        table[rows] = {name: {"us": graph_us(fn, x), "exact": None} for name, fn in kernels.items()}
    names = list(dict.fromkeys(n for row in table.values() for n in row))
    print(f"\n{torch.cuda.get_device_name()}; two ranks' kernels on one GPU, the peer simulated; µs a call, "
          "64 in a CUDA graph")
    _print_table(table, names)
    _write(args.out, 2, table, simulated=True)
    return table


if __name__ == "__main__":
    main()
