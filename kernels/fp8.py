"""FP8 linear layers: ``y = x W^T`` with W held in ``float8_e4m3fn`` and one float32 scale per
output row, on Hopper (and Ada) tensor cores.

A weight row w is stored as ``q = round_fp8(w / s)`` with ``s = max|w| / 448`` (448: the
largest e4m3 value; ``parallel.tp_layers.quantize_rows``), so ``w ≈ q · s``: half the bytes
of bf16, which halves what a decode step reads and leaves room for more KV blocks.
Activations are quantized the same way per token, on the fly (``quantize_tokens``: one kernel
reads each row twice, for its max and to cast), and ``torch._scaled_mm`` multiplies the two
FP8 operands on the tensor cores, applying the token scale to each row and the weight scale to
each column of the product in float32 before it is rounded to the activations' dtype:

    y[t, n] = xs[t] · s[n] · Σ_k xq[t, k] · q[n, k]

Per-token activation scales follow each token's own range (a static per-tensor scale, as some
checkpoints carry, is ignored: the per-token one is at least as fine). The reference
(``pipeserve.kernels.reference.fp8_linear_reference``, what the CPU runs) dequantizes the
weight and multiplies in the activations' dtype, leaving the activations unquantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still divides by something positive
_BLOCK = 1024


@triton.jit(do_not_specialize=["M"])
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, MIN_SCALE: tl.constexpr,
                            FP8_MAX_: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -FP8_MAX_), FP8_MAX_)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float8_e4m3fn, xs [M, 1] float32): each row of ``x`` [M, K] scaled to 448 at
    its largest magnitude (the weights' rule, ``parallel.tp_layers.quantize_rows``, in one kernel)."""
    M, K = x.shape
    xq = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        _quantize_tokens_kernel[(M,)](x, xq, xs, M, K, x.stride(0), xq.stride(0), MIN_SCALE=_MIN_SCALE,
                                      FP8_MAX_=FP8_MAX, BLOCK=_BLOCK)
    return xq, xs


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ (w [N, K] float8_e4m3fn · w_scale [N])^T + bias -> [M, N] in
    x's dtype (see the module docstring)."""
    x = x.contiguous()
    xq, xs = quantize_tokens(x)
    # w.t() is [K, N] column-major, the layout _scaled_mm wants for its second operand.
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias

