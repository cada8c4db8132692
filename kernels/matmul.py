"""A batch-invariant matmul: ``out = x @ w.T`` with one fixed tiling for every shape.

cuBLAS picks its algorithm (tile shape, split-K, even the instruction) from M, N and K, so a
row of ``x @ w.T`` may round differently when the batch around it changes size, and a column
differently when ``w`` is a tensor-parallel shard of another width. This kernel fixes
everything that decides an output element's arithmetic: the tile shape, the warp count and the
walk over K (BLOCK_K at a time, in order, accumulated in float32). An element of the output is
then a function of its row of ``x``, its row of ``w`` and K alone: the same bits whatever M or
N are and whichever other rows ride along. That is what deterministic serving needs (a
request's tokens must not depend on the micro-batch it landed in, nor on the layout: a pipeline
stage sees other batch sizes, a TP shard other widths). It is slower than cuBLAS, most of all
for small M (a decode batch of 8 still fills a 64-row tile).

The reference is ``pipeserve.kernels.reference.matmul_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One configuration for every call (see the module docstring): changing any of these changes
# the rounding of every result, so deterministic runs compared with each other must share them.
_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 64, 64
_NUM_WARPS, _NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        # Masked lanes load 0: a padded row or column only ever adds exact zeros.
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)  # x: [BM, BK] @ w: [BK, BN]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` [M, N] for x [M, K] and w [N, K] (an ``nn.Linear`` weight), accumulated in
    float32 and rounded once to ``out_dtype`` (default x's dtype).

    Contract (asserted): 2-D x and w of one dtype (fp16, bf16 or fp32) on one device, sharing K;
    any strides (column slices of a weight are fine). The result's bits depend only on the
    values of its row of x, its row of w and K (see the module docstring).
    """
    # x: [M, K]; w: [N, K] -> [M, N]
    assert x.dim() == 2 and w.dim() == 2, (x.shape, w.shape)
    assert x.shape[1] == w.shape[1], f"K differs: x {tuple(x.shape)}, w {tuple(w.shape)}"
    assert x.dtype == w.dtype and x.device == w.device, (x.dtype, w.dtype, x.device, w.device)
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)  # [M, N]
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    grid = (triton.cdiv(M, _BLOCK_M), triton.cdiv(N, _BLOCK_N))
    _matmul_kernel[grid](
        x,
        w,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    return out
