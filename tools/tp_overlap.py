"""Can a token-heavy step hide its tensor-parallel sums behind its GEMMs? A probe at the layer
level, before any change to the model:

    torchrun --nproc-per-node 2 -m tools.tp_overlap [--tokens 2048 1024 512] [--sums symmetric|nccl|pull]
    python -m tools.tp_overlap --device cpu          # one process: the schedule's arithmetic only

The part of a decoder layer around its two sums, on random bf16 weights of the shard's shapes
(``--shape``, tp = the world size): QKV projection, O projection of the attention output, sum,
residual add + RMSNorm, gate/up projection, SiLU·mul, down projection, sum, residual add +
RMSNorm (the next layer's input norm). Attention itself is left out: it needs every row and is
the same either way. ``--layers`` of them back to back in one CUDA graph, three ways:

- serial: as the model runs now, each sum between the GEMMs on the one stream;
- halves: the rows in two halves; each half's sums go to a second stream, so that one half's
  sum runs while the other half's GEMMs do (the O projection of both halves waits for both
  halves' QKV, as attention would);
- no sums: serial without the sums, the floor either could reach;
- async TP (with the worker's sums only, on GPUs): the layers sequence-parallel, each sum a
  reduce-scatter inside the GEMM before it and an all-gather inside the GEMM after it, both on
  the copy engines (PyTorch's ``fused_matmul_reduce_scatter`` / ``fused_all_gather_matmul``).

Sums through the worker's symmetric-memory all-reduce (``--sums nccl``: NCCL's; ``--sums pull``:
``PullAllReduce`` below, whose bytes move on the copy engines, not the SMs that the other half's
GEMMs need). Prints, per token count, ms per layer for each and the share of the sums the halves hid:
(serial − halves) / (serial − no sums), and each schedule's largest difference from serial. On
the CPU (gloo, or one process) there are no streams: it checks that the halves compute what
serial does, not the time.

On 2 and 4 GPUs of an H200 machine none of them beat serial by more than 2% of the sums' time:
the halves added 3–69% of it (symmetric sums) and −2% to 75% (pull), async TP ran 6–128% slower (BENCHMARKS.md,
"What the sums cost and what did not hide them").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeserve.kernels import kernel_ops, torch_ops
from pipeserve.parallel.context import build_parallel_context, tp_all_reduce
from pipeserve.parallel.symmetric import SymmetricAllReduce
from pipeserve.runtime.bench.dummy_model import SHAPES
from tools.tp_steps import graph_us


CHECK_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""``--shape check``: small enough for a CPU test of the schedule."""


class Layer:
    """One layer's shard: weights [in, out] as ``x @ w`` takes them."""

    def __init__(self, shape: dict, tp: int, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
        d = h // heads
        inter = shape["intermediate_size"]

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g) / rows ** 0.5).to(dtype).to(device)

        self.attn_width = heads * d // tp
        self.qkv = w(h, (heads + 2 * kv) * d // tp)
        self.o = w(self.attn_width, h)
        self.gate_up = w(h, 2 * inter // tp)
        self.down = w(inter // tp, h)
        self.norm = torch.ones(h, dtype=dtype, device=device)


class PullAllReduce:
    """A sum whose transfers run on the copy engines: each rank puts its partial in its own
    symmetric slot, and after one barrier reads the peers' slots with plain peer copies
    (``Tensor.copy_`` of a peer's mapped buffer: a DMA, no SM); the adds are the only kernels.
    Two ranks pull the peer's partial whole; more pull their own slice from every peer, add,
    and after a second barrier pull the others' reduced slices (half the bytes, as two-shot).
    Two alternating slots: a rank writes a slot again only after a later barrier, which every
    peer reaches only after its reads of that slot (all of a sum runs on one stream)."""

    def __init__(self, group, *, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.dtype, self.max_numel = dtype, max_numel
        self.slot = max_numel + max_numel // self.world + self.world  # partial, then reduced slice
        self.buffer = symm_mem.empty(2 * self.slot, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def _peer(self, rank: int, offset: int, numel: int) -> torch.Tensor:
        return self.handle.get_buffer(rank, (numel,), self.dtype, offset)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        base = (self.calls % 2) * self.slot
        self.calls += 1
        n, flat = x.numel(), x.view(-1)
        peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        self.buffer[base:base + n].copy_(flat)
        self.handle.barrier(channel=0)
        if self.world == 2 or n % self.world:
            out = flat.clone()
            for p in peers:
                out += self._peer(p, base, n).clone()  # clone: the copy engine's pull
            return out.view(x.shape)
        share = n // self.world
        mine = slice(self.rank * share, (self.rank + 1) * share)
        red = flat[mine].clone()
        for p in peers:
            red += self._peer(p, base + mine.start, share).clone()
        self.buffer[base + n:base + n + share].copy_(red)
        self.handle.barrier(channel=0)
        out = torch.empty_like(flat)
        out[mine] = red
        for p in peers:
            out[p * share:(p + 1) * share].copy_(self._peer(p, base + n, share))
        return out.view(x.shape)


class Sums:
    """The TP sum, and the second stream the halves put it on (none on the CPU)."""

    def __init__(self, ctx, device: torch.device) -> None:
        self.ctx = ctx
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.ctx is None else tp_all_reduce(x, self.ctx)

    def on_side(self, x: torch.Tensor):
        """``x``'s sum on the second stream, after the work queued so far on this one: (the
        sum, an event ``join`` waits for before reading it)."""
        if self.side is None:
            return self(x), None
        self.side.wait_stream(torch.cuda.current_stream())
        x.record_stream(self.side)  # read there: not handed to the main stream's next allocation
        with torch.cuda.stream(self.side):
            out = self(x)
            done = torch.cuda.Event()
            done.record()
        out.record_stream(torch.cuda.current_stream())  # read on the main stream after join
        return out, done

    def join(self, done) -> None:
        if done is not None:
            torch.cuda.current_stream().wait_event(done)


def serial(layers, x, residual, attn, ops, sums: Sums | None, eps: float = 1e-5):
    """The layers as the model runs them: sums in line (``sums`` None: no sums at all)."""
    total = sums if sums is not None else (lambda t: t)
    for layer in layers:
        attn.copy_((x @ layer.qkv)[:, :layer.attn_width])  # stands in for attention's output
        x, residual = ops.add_rms_norm(total(attn @ layer.o), residual, layer.norm, eps)
        x, residual = ops.add_rms_norm(total(ops.silu_mul(x @ layer.gate_up) @ layer.down), residual, layer.norm, eps)
    return x, residual


def halves(layers, x, residual, attn, ops, sums: Sums, eps: float = 1e-5):
    """The same in two halves of rows, each half's sums on the second stream."""
    m = x.shape[0] // 2
    parts = (slice(0, m), slice(m, None))
    xs, rs = [x[:m], x[m:]], [residual[:m], residual[m:]]
    pending: list = [None, None]  # per half: the previous layer's MLP sum, its event
    for layer in layers:
        for i, rows in enumerate(parts):
            if pending[i] is not None:  # this half's next-layer input norm
                sums.join(pending[i][1])
                xs[i], rs[i] = ops.add_rms_norm(pending[i][0], rs[i], layer.norm, eps)
            attn[rows] = (xs[i] @ layer.qkv)[:, :layer.attn_width]
        partial = [sums.on_side(attn[rows] @ layer.o) for rows in parts]  # (after both halves' QKV)
        for i in range(2):
            sums.join(partial[i][1])
            xs[i], rs[i] = ops.add_rms_norm(partial[i][0], rs[i], layer.norm, eps)
            pending[i] = sums.on_side(ops.silu_mul(xs[i] @ layer.gate_up) @ layer.down)
    outs = []
    for i in range(2):
        sums.join(pending[i][1])
        outs.append(ops.add_rms_norm(pending[i][0], rs[i], layers[-1].norm, eps))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def async_tp(layers, x, residual, attn, ops, group, eps: float = 1e-5):
    """The layers sequence-parallel, their communication inside the GEMMs (PyTorch's async TP,
    ``torch.ops.symm_mem``): each rank norms its slice of the rows; the QKV and gate/up GEMMs
    gather the other slices over the copy engines as they consume them, and the O and down GEMMs
    send each peer its rows' partials as they produce them (a reduce-scatter that ends in one
    local sum). The same bytes as the two-shot sums, overlapped with the GEMMs and off the SMs.
    Takes and returns every row (sliced and gathered outside the layers)."""
    ops_sm = torch.ops.symm_mem
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    share = x.shape[0] // world
    rows = slice(rank * share, (rank + 1) * share)
    xs, rs = x[rows], residual[rows]
    for layer in layers:
        _, (qkv,) = ops_sm.fused_all_gather_matmul(xs, [layer.qkv], 0, group.group_name, return_A=False)
        attn.copy_(qkv[:, :layer.attn_width])
        xs, rs = ops.add_rms_norm(ops_sm.fused_matmul_reduce_scatter(attn, layer.o, "sum", 0, group.group_name),
                                  rs, layer.norm, eps)
        _, (gate_up,) = ops_sm.fused_all_gather_matmul(xs, [layer.gate_up], 0, group.group_name, return_A=False)
        down = ops_sm.fused_matmul_reduce_scatter(ops.silu_mul(gate_up), layer.down, "sum", 0, group.group_name)
        xs, rs = ops.add_rms_norm(down, rs, layer.norm, eps)
    outs = [torch.empty(share * world, x.shape[1], dtype=x.dtype, device=x.device) for _ in range(2)]
    for out, part in zip(outs, (xs, rs)):
        dist.all_gather_into_tensor(out, part.contiguous(), group=group)
    return outs[0], outs[1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES) + ["check"], default="llama3-8b")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 1024, 512])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sums", choices=("symmetric", "nccl", "pull"), default="symmetric",
                   help="the worker's symmetric-memory sum, NCCL's, or PullAllReduce (copy engines)")
    p.add_argument("--out", default=None, help="rank 0 writes the rows here (JSON)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = CHECK_SHAPE if args.shape == "check" else SHAPES[args.shape]
    ctx = None
    if world > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5),
                                **({"device_id": device} if cuda else {}))
        ctx = build_parallel_context(world, 1)
        numel = max(args.tokens) * shape["hidden_size"]
        if cuda and args.sums == "symmetric":
            reduce = SymmetricAllReduce.create(ctx.tp_group, max_numel=numel, dtype=dtype, device=device)
            ctx = dataclasses.replace(ctx, tp_reduce=reduce)
        elif cuda and args.sums == "pull":
            ctx = dataclasses.replace(ctx, tp_reduce=PullAllReduce(ctx.tp_group, max_numel=numel, dtype=dtype,
                                                                   device=device))
    rank = dist.get_rank() if ctx else 0
    ops = kernel_ops("auto", device) if cuda else torch_ops()
    sums = Sums(ctx, device)
    layers = [Layer(shape, world, device, dtype, seed=1000 * k + rank) for k in range(args.layers)]
    async_ok = cuda and ctx is not None and args.sums == "symmetric"  # async TP: its own symmetric workspace
    if async_ok:
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(ctx.tp_group.group_name)
    rows = {}
    for tokens in args.tokens:
        g = torch.Generator(device="cpu").manual_seed(tokens)
        x = torch.randn(tokens, shape["hidden_size"], generator=g).to(dtype).to(device)
        residual = torch.randn(tokens, shape["hidden_size"], generator=g).to(dtype).to(device)
        attn = torch.empty(tokens, layers[0].attn_width, dtype=dtype, device=device)
        want = serial(layers, x, residual, attn, ops, sums)
        got = halves(layers, x, residual, attn, ops, sums)
        if cuda:
            torch.cuda.synchronize()
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        row = {"max_err": err}
        if ctx is not None:  # the sum itself against the process group's
            probe = torch.randn(tokens, shape["hidden_size"], generator=g).to(dtype).to(device)
            ref = probe.clone()
            dist.all_reduce(ref)
            mine = sums(probe)
            if cuda:
                torch.cuda.synchronize()
            row["sum_err"] = (mine.float() - ref.float()).abs().max().item()
        if cuda:
            runs = {"serial": lambda: serial(layers, x, residual, attn, ops, sums),
                    "halves": lambda: halves(layers, x, residual, attn, ops, sums),
                    "no_sums": lambda: serial(layers, x, residual, attn, ops, None)}
            # ms a layer: each run captured once in a CUDA graph, its replays timed
            row.update({name: graph_us(lambda _, fn=fn: fn(), None, count=1, repeats=args.repeats) / 1e3 / args.layers
                        for name, fn in runs.items()})
            if async_ok:
                got = async_tp(layers, x, residual, attn, ops, ctx.tp_group)
                torch.cuda.synchronize()
                row["async_err"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                row["async_tp"] = graph_us(lambda _: async_tp(layers, x, residual, attn, ops, ctx.tp_group), None,
                                           count=1, repeats=args.repeats) / 1e3 / args.layers
            exposed = row["serial"] - row["no_sums"]
            row["hidden"] = (row["serial"] - row["halves"]) / exposed if exposed > 0 else None
        rows[tokens] = row
    if rank == 0:
        sums_kind = "none (one rank)" if ctx is None else ("the process group" if args.sums == "nccl" or not cuda else args.sums)
        print(f"{args.shape} layer shards at tp={world}, {args.device}, sums: {sums_kind}")
        print("| tokens | serial ms/layer | halves ms/layer | no sums ms/layer | sums hidden | halves − serial max err | sum − NCCL's max err | async TP ms/layer | async − serial max err |")
        print("|---|---|---|---|---|---|---|---|---|")
        for tokens, r in rows.items():
            cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("serial", "halves", "no_sums")]
            hidden = "-" if r.get("hidden") is None else f"{r['hidden']:.0%}"
            print(f"| {tokens} | {' | '.join(cells)} | {hidden} | {r['max_err']:.3g} | {r.get('sum_err', float('nan')):.3g} | {r.get('async_tp', float('nan')):.3f} | {r.get('async_err', float('nan')):.3g} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"tp": world, "shape": args.shape, "rows": rows}, f, indent=1)
    if ctx is not None:
        dist.barrier()
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
