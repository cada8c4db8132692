"""FP8 GEMMs of the Llama-3-8B projections against bf16, by batch size: where the FP8 layers
(``kernels/fp8.py``) gain and where they lose.

For each projection shape (N, K) and batch M: bf16 ``F.linear`` (cuBLAS) against
``fp8_linear`` (per-token activation quantization + ``torch._scaled_mm``, both operands FP8).
Device time per call (CUDA events, the median of 50 after warm-up), and the weights' read rate
it implies.

    python -m tools.fp8_gemm [--out fp8_gemm.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pipeserve.kernels.fp8 import fp8_linear
from pipeserve.parallel.tp_layers import quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 16, 64, 128, 256, 512, 2048)


def device_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print("| shape | M | bf16 ms | fp8 ms | fp8 / bf16 | weights GB/s bf16 / fp8 |\n|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        wq, ws = quantize_rows(w)
        for M in BATCHES:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            bf16 = device_ms(lambda: F.linear(x, w))  # noqa: B023
            fp8 = device_ms(lambda: fp8_linear(x, wq, ws))  # noqa: B023
            rows.append({"shape": name, "N": N, "K": K, "M": M, "bf16_ms": bf16, "fp8_ms": fp8})
            print(f"| {name} {N}×{K} | {M} | {bf16:.4f} | {fp8:.4f} | {fp8 / bf16:.2f} | "
                  f"{N * K * 2 / bf16 / 1e6:,.0f} / {N * K / fp8 / 1e6:,.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
