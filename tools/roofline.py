"""Single-step targets of the GPU fast path, on this card: prefill MFU with 2048-token chunks,
and a decode-only step at batch 64 against the weight-read floor.

- MFU = matmul FLOPs of the micro-batch (``ModelShape.flops``) / step time / the card's dense
  bf16 peak. Chunks of 2048 tokens over cached prefixes of 0 and 2048 tokens.
- Decode floor = bytes a decode step must read (every weight once + the batch's KV,
  ``ModelShape.bytes_moved``) / the measured device-to-device copy bandwidth (bytes read and
  written, 2 GiB buffers). Target: the step within 1.25× of it.

Each step goes through the engine's ModelRunner (forward, then the argmax of greedy sampling)
as serving runs it, CUDA graphs included, and is timed on the device (``Profiler.time``:
between CUDA events, the step queued whole behind a device sleep); the fastest of
``--repeats`` timed runs counts.

``--profile`` then runs each step again under torch.profiler and splits its GPU kernel time
into GEMM / attention / norm / rope / silu·mul / KV write / other (by kernel name), against the
step's timed device time (the gap: the device idle between kernels), with the GEMMs' own rate:
TFLOP/s in prefill, GB/s of weights in decode (and the attention's GB/s of KV).

    python -m tools.roofline [--profile] [--out roofline.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from pipeserve.kernels import kernel_ops
from pipeserve.launch.profile import Profiler
from pipeserve.runtime.bench import metrics as M
from pipeserve.runtime.bench.dummy_model import load_dummy_model
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.worker.cuda_graphs import capture_cuda_graphs
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.worker.model_runner import ModelRunner
from pipeserve.scheduler.cost_model import attention_work


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the copy's roofline)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * n * 2 * repeats / (start.elapsed_time(end) / 1e3)


# (category, lower-case substrings of kernel or CPU operator names); the first match wins, so an
# attention kernel whose template arguments name cutlass types is attention, not GEMM. The
# Triton kernels are kernels/*.py's: _paged_attention_kernel, _add_rms_norm_kernel,
# _rope_kernel, _silu_mul_kernel, _write_kv_kernel, _matmul_kernel (batch-invariant GEMM), and the
# TP sums' _push_sum_kernel and _push_add_rms_norm_kernel (a sum with the next norm: collective).
KERNEL_CATEGORIES = (
    ("collective", ("nccl", "allreduce", "all_reduce", "allgather", "cross_device_reduce", "_push_")),
    ("attention", ("attention", "flash_fwd", "fmha")),
    ("norm", ("rms_norm", "layer_norm")),
    ("rope", ("_rope", "rotary")),
    ("silu·mul", ("silu",)),
    ("KV write", ("write_kv", "reshape_and_cache")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "cublas", "_matmul_kernel", "aten::mm", "aten::addmm", "aten::bmm")),
)
CATEGORY_ORDER = ("GEMM", "attention", "norm", "rope", "silu·mul", "KV write", "collective", "other")


def kernel_category(name: str) -> str:
    lower = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in lower for k in keys)), "other")


def group_kernel_times(kernels: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds per category, in CATEGORY_ORDER, of (kernel name, seconds) pairs."""
    totals = dict.fromkeys(CATEGORY_ORDER, 0.0)
    for name, seconds in kernels:
        totals[kernel_category(name)] += seconds
    return totals


def profiled_kernels(profiler: Profiler, seqs: list[tuple[int, int]], runs: int = 3) -> list[tuple[str, float]]:
    """(name, seconds per step) of what a step runs, summed by name, largest first, from `runs`
    runs under torch.profiler: GPU kernels (and copies) on CUDA, operators' self time on CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = profiler.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        profiler.run(seqs, runs)
    micros = defaultdict(float)
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):  # a record_function range, on the GPU too: no kernel
            continue
        if cuda and e.device_type == DeviceType.CUDA:
            micros[e.name] += e.time_range.elapsed_us()
        elif not cuda and e.device_type == DeviceType.CPU:
            micros[e.name] += e.self_cpu_time_total
    return sorted(((name, us / 1e6 / runs) for name, us in micros.items()), key=lambda kv: -kv[1])


def profile_cases(profiler: Profiler, cases: dict, rows: dict, shape: M.ModelShape) -> None:
    """Adds ``profile`` to each row of ``rows`` (timed already) and prints its table."""
    for name, seqs in cases.items():
        kernels = profiled_kernels(profiler, seqs)
        cats = group_kernel_times(kernels)
        prof = {"categories_s": cats, "kernel_s": sum(cats.values()), "timed_s": rows[name]["seconds"],
                "top_kernels": [[n, t, kernel_category(n)] for n, t in kernels[:12]]}
        gemm_s, attn_s = cats["GEMM"] or float("nan"), cats["attention"] or float("nan")
        if name.startswith("prefill"):  # the weights' matmuls and the LM head: attention work 0
            prof["gemm_tflops"] = shape.flops(sum(q for _, q in seqs), 0, len(seqs)) / gemm_s / 1e12
        else:
            weights = shape.bytes_moved(0)
            prof["gemm_GBps"] = weights / gemm_s / 1e9
            prof["attention_GBps"] = (shape.bytes_moved(sum(p + q for p, q in seqs)) - weights) / attn_s / 1e9
        rows[name]["profile"] = prof
        print(format_profile(name, prof))


def format_profile(name: str, prof: dict) -> str:
    wall, kernel = prof["timed_s"], prof["kernel_s"]
    gap = wall - kernel
    if "gemm_tflops" in prof:
        rate = f"GEMM {prof['gemm_tflops']:.0f} TFLOP/s"
    else:
        rate = f"GEMM {prof['gemm_GBps']:,.0f} GB/s of weights, attention {prof['attention_GBps']:,.0f} GB/s of KV"
    lines = [f"\n{name}: kernels {kernel * 1e3:.3f} ms of the timed {wall * 1e3:.3f} ms; gap {gap * 1e3:.3f} ms"
             f" ({gap / wall:.0%}: the device idle between kernels); {rate}",
             "| kernels | ms | share of kernel time |", "|---|---|---|"]
    for cat, t in prof["categories_s"].items():
        lines.append(f"| {cat} | {t * 1e3:.3f} | {t / kernel if kernel else 0:.1%} |")
    others = [f"{n[:60]} {t * 1e3:.3f} ms" for n, t, cat in prof["top_kernels"] if cat == "other"][:3]
    if others:
        lines.append("largest other: " + "; ".join(others))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: a generated GPT-2-size vocabulary)")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quantization", default=None, help="fp8: the projections in FP8 (the floor counts their bytes)")
    p.add_argument("--profile", action="store_true", help="then a kernel-time breakdown of each step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    loaded = load_dummy_model(shape=args.shape, num_layers=args.num_layers, dtype=dtype, device=device,
                              tokenizer=args.tokenizer, quantization=args.quantization)
    loaded.model.set_ops(kernel_ops(args.kernel_backend, device))
    cfg = loaded.config
    shape = M.ModelShape.of(cfg, dtype.itemsize)
    peak_tflops, _ = M.card_peaks(torch.cuda.get_device_name())
    cases = {"prefill 2048 (prefix 0)": [(0, 2048)], "prefill 2048 (prefix 2048)": [(2048, 2048)],
             "decode 64 × ctx 512": [(511, 1)] * 64, "decode 64 × ctx 2048": [(2047, 1)] * 64}
    blocks = sum(-(-(pre + q) // args.block_size) for seqs in cases.values() for pre, q in seqs)
    kv = allocate_kv_cache(cfg, num_layers=cfg.num_hidden_layers, num_blocks=blocks,
                           block_size=args.block_size, dtype=dtype, device=device)
    engine = EngineConfig(block_size=args.block_size)  # default scheduler: graphs up to its batch limit
    graphs = capture_cuda_graphs(loaded.model, kv, engine, max_model_len=4096, device=device)
    runner = ModelRunner(loaded.model, kv_caches=kv, block_size=args.block_size, device=device, cuda_graphs=graphs)
    profiler = Profiler(runner, block_size=args.block_size, vocab_size=cfg.vocab_size, device=device)
    bandwidth = copy_bandwidth(device)
    rows = {}
    for name, seqs in cases.items():
        t = profiler.time(seqs, args.repeats)
        tokens = sum(q for _, q in seqs)
        work = sum(attention_work(pre, q) for pre, q in seqs)
        row = {"seconds": t, "tokens": tokens}
        if name.startswith("prefill"):
            flops = shape.flops(tokens, work, len(seqs))
            row.update(tflops=flops / t / 1e12, mfu=flops / t / 1e12 / peak_tflops if peak_tflops else None)
        else:
            floor = shape.bytes_moved(sum(pre + q for pre, q in seqs)) / bandwidth
            row.update(floor_seconds=floor, ratio_to_floor=t / floor)
        rows[name] = row
    card = torch.cuda.get_device_name()
    print(f"card {card}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s; peak {peak_tflops} TFLOP/s; "
          f"kernels {loaded.model.ops.name}; graphs {graphs is not None}; weights {args.quantization or 'bf16'}")
    print("| step | ms | TFLOP/s | MFU | floor ms | ÷ floor |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        print(f"| {name} | {r['seconds'] * 1e3:.2f} | {r.get('tflops', 0):.0f} | {mfu} | "
              f"{r.get('floor_seconds', 0) * 1e3:.2f} | {r.get('ratio_to_floor', 0):.2f} |")
    if args.profile:
        profile_cases(profiler, cases, rows, shape)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": card, "copy_bandwidth_Bps": bandwidth, "peak_tflops": peak_tflops,
                       "kernels": loaded.model.ops.name, "quantization": args.quantization, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
