"""Can a token-heavy step hide its tensor-parallel sums behind its GEMMs? A probe at the layer
level, before any change to the model:

    torchrun --nproc-per-node 2 -m tools.tp_overlap [--tokens 2048 1024 512] [--nccl]
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
- no sums: serial without the sums, the floor either could reach.

Sums through the worker's symmetric-memory all-reduce (``--nccl``: NCCL's). Prints, per token
count, ms per layer for each and the share of the sums the halves hid:
(serial − halves) / (serial − no sums). On the CPU (gloo, or one process) there are no streams:
it checks that the halves compute what serial does, not the time.
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES) + ["check"], default="llama3-8b")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 1024, 512])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--nccl", action="store_true", help="the sums through NCCL, not symmetric memory")
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
        if cuda and not args.nccl:
            reduce = SymmetricAllReduce.create(ctx.tp_group, max_numel=max(args.tokens) * shape["hidden_size"],
                                               dtype=dtype, device=device)
            ctx = dataclasses.replace(ctx, tp_reduce=reduce)
    rank = dist.get_rank() if ctx else 0
    ops = kernel_ops("auto", device) if cuda else torch_ops()
    sums = Sums(ctx, device)
    layers = [Layer(shape, world, device, dtype, seed=1000 * k + rank) for k in range(args.layers)]
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
        if cuda:
            runs = {"serial": lambda: serial(layers, x, residual, attn, ops, sums),
                    "halves": lambda: halves(layers, x, residual, attn, ops, sums),
                    "no_sums": lambda: serial(layers, x, residual, attn, ops, None)}
            # ms a layer: each run captured once in a CUDA graph, its replays timed
            row.update({name: graph_us(lambda _, fn=fn: fn(), None, count=1, repeats=args.repeats) / 1e3 / args.layers
                        for name, fn in runs.items()})
            exposed = row["serial"] - row["no_sums"]
            row["hidden"] = (row["serial"] - row["halves"]) / exposed if exposed > 0 else None
        rows[tokens] = row
    if rank == 0:
        sums_kind = "none (one rank)" if ctx is None else ("the process group" if args.nccl or not cuda else "symmetric memory")
        print(f"{args.shape} layer shards at tp={world}, {args.device}, sums: {sums_kind}")
        print("| tokens | serial ms/layer | halves ms/layer | no sums ms/layer | sums hidden | halves − serial max err |")
        print("|---|---|---|---|---|---|")
        for tokens, r in rows.items():
            cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("serial", "halves", "no_sums")]
            hidden = "-" if r.get("hidden") is None else f"{r['hidden']:.0%}"
            print(f"| {tokens} | {' | '.join(cells)} | {hidden} | {r['max_err']:.3g} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"tp": world, "shape": args.shape, "rows": rows}, f, indent=1)
    if ctx is not None:
        dist.barrier()
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
