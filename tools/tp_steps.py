"""One micro-batch's time at tensor parallelism N against one GPU, and where it goes:

    python -m tools.tp_steps --profile                            # one GPU
    torchrun --nproc-per-node 2 -m tools.tp_steps --profile       # tp=2

Each rank loads its shard of a random-weights model (``--shape``), captures the CUDA graphs as
a worker does (every rank the same buckets, the all-reduces inside) and times each case through
the engine's ModelRunner (forward, then the greedy argmax over the vocab shards): ``--repeats``
runs back to back between CUDA events after a barrier, so the time includes what the host adds
when it cannot keep ahead of the device (eager steps past the graphed token counts). Cases: the
decode batches and mixed steps of the scaling workloads (``benchmarks/throughput.py``). Also times a
bare all-reduce of each case's hidden states (one per layer's attention and MLP output), eager
and as 64 back to back inside a CUDA graph (as a forward's sums replay): NCCL's, and the
symmetric-memory one-shot and two-shot kernels (µs a sum).

``--profile`` runs each case again under torch.profiler on rank 0 and splits its kernel time by
category (roofline's, plus the collectives). Rank 0 prints the table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.symmetric import SymmetricAllReduce
from pipeserve.runtime.bench.dummy_model import write_model_folder
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.model.loader import load_model
from pipeserve.runtime.worker.cuda_graphs import capture_cuda_graphs
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.worker.model_runner import ModelRunner
from pipeserve.kernels import kernel_ops
from pipeserve.launch.profile import Profiler
from tools.roofline import group_kernel_times, profiled_kernels

CASES = {  # name: [(cached prefix, new tokens)] per sequence
    "decode 128 × ctx 1024": [(1023, 1)] * 128,
    "decode 256 × ctx 1024": [(1023, 1)] * 256,
    "decode 128 × ctx 2048": [(2047, 1)] * 128,
    "mixed 1024 (769 prompt + 255 decodes)": [(0, 769)] + [(1023, 1)] * 255,
    "mixed 2048 (1793 prompt + 255 decodes)": [(0, 1793)] + [(1023, 1)] * 255,
    "prefill 2048": [(0, 2048)],
}


def timed(fn, repeats: int) -> float:
    """Mean seconds of ``fn`` over ``repeats`` runs back to back, after a barrier."""
    fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def graph_us(fn, x: torch.Tensor, count: int = 64, repeats: int = 10) -> float:
    """Microseconds a call of ``fn(x)`` takes among ``count`` captured back to back in one CUDA
    graph (as a forward's sums replay), timed over ``repeats`` replays after a barrier."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(count):
            fn(x)
    seconds = timed(graph.replay, repeats)
    graph.reset()
    return seconds / count * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--nccl", action="store_true", help="the forward's sums through NCCL, not symmetric memory")
    p.add_argument("--graph-max-tokens", type=int, default=EngineConfig.__dataclass_fields__["cuda_graph_max_tokens"].default,
                   help="engine.cuda_graph_max_tokens (default: the engine's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    ctx = None
    if world > 1:
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
        ctx = build_parallel_context(world, 1)
        if not args.nccl:  # as the worker sets it up (Worker._with_symmetric_sums)
            reduce = SymmetricAllReduce.create(ctx.tp_group, max_numel=2048 * 4096 * 4, dtype=torch.bfloat16,
                                               device=device)
            ctx = dataclasses.replace(ctx, tp_reduce=reduce)
    rank = dist.get_rank() if ctx else 0
    dtype, block_size = torch.bfloat16, 16
    with tempfile.TemporaryDirectory(prefix="tp-steps-") as folder:
        write_model_folder(folder, shape=args.shape, num_layers=args.num_layers, tokenizer=args.tokenizer)
        loaded = load_model(folder, dtype=dtype, device=device, load_format="dummy", parallel=ctx)
    model, cfg = loaded.model, loaded.config
    model.set_ops(kernel_ops("auto", device))
    blocks = max(sum(-(-(pre + q) // block_size) for pre, q in seqs) for seqs in CASES.values())
    kv = allocate_kv_cache(cfg, num_layers=model.num_layers, num_blocks=blocks, block_size=block_size,
                           dtype=dtype, device=device, num_kv_heads=model.num_local_kv_heads)
    engine = EngineConfig(block_size=block_size)
    engine = dataclasses.replace(engine, scheduler=dataclasses.replace(  # the scaling workloads' budgets
        engine.scheduler, max_num_batched_tokens=2048, max_num_seqs=256), cuda_graph_max_tokens=args.graph_max_tokens)
    graphs = capture_cuda_graphs(model, kv, engine, max_model_len=4096, device=device)
    runner = ModelRunner(model, kv_caches=kv, block_size=block_size, device=device, cuda_graphs=graphs)
    profiler = Profiler(runner, block_size=block_size, vocab_size=cfg.vocab_size, device=device)
    rows = {}
    for name, seqs in CASES.items():
        step = profiler.step(seqs)
        tokens = sum(q for _, q in seqs)
        hidden = torch.zeros(tokens, cfg.hidden_size, dtype=dtype, device=device)
        row = {"tokens": tokens, "graph": graphs is not None and graphs.prepare(step) is not None,
               "step_ms": timed(lambda: profiler._run(step), args.repeats) * 1e3}
        if ctx is not None:
            one = timed(lambda: dist.all_reduce(hidden, group=ctx.tp_group), args.repeats)
            row["all_reduce_us"] = one * 1e6
            row["all_reduces_ms"] = one * 2 * model.num_layers * 1e3
            if ctx.tp_reduce is not None:  # the same sum through symmetric memory, eager
                x = torch.randn(hidden.shape, generator=torch.Generator(device).manual_seed(rank), device=device,
                                dtype=torch.float32).to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=ctx.tp_group)
                row["symmetric_max_err"] = (ctx.tp_reduce(x).float() - want.float()).abs().max().item()
                row["symmetric_us"] = timed(lambda: ctx.tp_reduce(x), args.repeats) * 1e6
                reduce = ctx.tp_reduce
                sums = {"one_shot": reduce.one_shot, "two_shot": reduce.two_shot}
                for how, fn in sums.items():
                    row[f"{how}_max_err"] = (fn(x).float() - want.float()).abs().max().item()
                    row[f"{how}_graph_us"] = graph_us(fn, x)
                nccl_x = x.clone()
                row["nccl_graph_us"] = graph_us(lambda t: dist.all_reduce(t, group=ctx.tp_group), nccl_x)
        if args.profile:
            kernels = profiled_kernels(profiler, seqs)
            row["kernel_ms"] = {k: round(v * 1e3, 3) for k, v in group_kernel_times(kernels).items()}
            row["top_kernels"] = [[n[:80], round(t * 1e3, 3)] for n, t in kernels[:8]]
        rows[name] = row
    if rank == 0:
        card = torch.cuda.get_device_name()
        print(f"\n{card}; tp={world}; {args.shape} {args.num_layers} layers; mixed graphs to {args.graph_max_tokens} tokens")
        print(f"sums: {'symmetric memory' if ctx is not None and ctx.tp_reduce is not None else 'NCCL'}")
        print("| case | tokens | graph | step ms | sum in a graph, µs: NCCL / one-shot / two-shot (max err) "
              "| kernels by category (ms) |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            cats = ", ".join(f"{k} {v:.2f}" for k, v in r.get("kernel_ms", {}).items() if v)
            sums = " / ".join(f"{r[k]:.1f}" if k in r else "-" for k in
                              ("nccl_graph_us", "one_shot_graph_us", "two_shot_graph_us"))
            err = max((v for k, v in r.items() if k.endswith("_max_err")), default=0)
            print(f"| {name} | {r['tokens']} | {r['graph']} | {r['step_ms']:.2f} | {sums} ({err:.3g}) | {cats} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"card": card, "tp": world, "rows": rows}, f, indent=1)
    if ctx is not None:
        if graphs is not None:
            graphs.release()
        t0 = time.perf_counter()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            print(f"process group destroyed in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
