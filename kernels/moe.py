"""Routed SwiGLU experts as grouped GEMMs (vLLM's fused_moe scheme), [T, H] -> [T, H].

Each token goes to k experts; its (token, slot) pairs are sorted by expert and each expert's
run is padded to a multiple of BLOCK_M (``align_by_expert``), so that every block of BLOCK_M
sorted pairs belongs to one expert. One program computes a (block, BLOCK_N output columns)
tile of that expert's matmul, gathering its rows of the input through the sorted pair ids and
scattering its results to them. Two launches: [gate | up] = w13[e] x for every pair, SiLU·mul
(``silu_mul``), then w2[e] h times the pair's routing weight; a token's k results are summed
in float32 and rounded once.

The sorting runs on the device with no host sync (as CUDA-graph capture needs): the padded buffer
is sized for the worst case, T·k + min(E, T·k)·(BLOCK_M - 1) pairs, and blocks past the last
expert's run exit at once.

Rounds where the reference does: each matmul's result in the activations' dtype, as
``F.linear``, before the float32 weighting. The reference is
``pipeserve.kernels.reference.moe_experts_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeserve.kernels.silu_mul import silu_mul

_BLOCK_N, _BLOCK_K = 64, 64


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    N,
    K,
    num_pairs,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    A_ROWS_PER_TOKEN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:  # past the last expert's run
        return
    pairs = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < num_pairs  # padding holds num_pairs
    rows = (pairs // A_ROWS_PER_TOKEN).to(tl.int64)  # this pair's row of a
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    result = acc.to(a_ptr.dtype.element_ty)  # rounded as F.linear rounds
    if WEIGHTED:
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)  # [BM] float32
        result = result.to(tl.float32) * weight[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_experts): the pair ids t·k + j sorted by expert, each expert's run
    padded with ``T·k`` to a multiple of ``block_m``; the expert of every block of ``block_m``
    (-1 past the last run). Stable: an expert's pairs keep token order."""
    # topk_ids: [T, k] -> sorted_ids: [capacity] int32, block_experts: [capacity / block_m] int32
    flat = topk_ids.flatten().long()  # [P]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    order = flat.argsort(stable=True)  # [P]
    experts = flat[order]  # [P], ascending
    index_in_run = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[experts] + index_in_run] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)  # E past the end
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t -> [T, H]
    in x's dtype (see the module docstring).

    Contract (asserted): x [T, H]; w13 [E, 2I, H] ([gate | up] rows of each expert); w2
    [E, H, I]; all of one dtype on one device, last dims contiguous; topk_ids [T, k] integers
    in [0, E); topk_weights [T, k] (used in float32).
    """
    # x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_ids, topk_weights: [T, k]
    T, H = x.shape
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    assert w13.shape == (E, two_i, H) and two_i % 2 == 0, (tuple(w13.shape), H)
    assert w2.shape == (E, H, two_i // 2), (tuple(w2.shape), tuple(w13.shape))
    assert topk_ids.shape == topk_weights.shape == (T, k), (topk_ids.shape, topk_weights.shape)
    assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    assert x.device == w13.device == w2.device == topk_ids.device, "one device"
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1, "last dims must be contiguous"
    if T == 0:
        return torch.empty_like(x)
    block_m = 16 if T * k <= 16 * E else 64  # decode batches: few pairs per expert
    sorted_ids, block_experts = align_by_expert(topk_ids, E, block_m)
    weights = topk_weights.float().contiguous().flatten()  # [T * k]
    gate_up = torch.empty(T * k, two_i, dtype=x.dtype, device=x.device)  # [P, 2I]
    _grouped_gemm(x, w13, gate_up, weights, sorted_ids, block_experts, block_m, rows_per_token=k,
                  weighted=False)
    h = silu_mul(gate_up)  # [P, I]
    out = torch.empty(T * k, H, dtype=torch.float32, device=x.device)  # [P, H]
    _grouped_gemm(h, w2, out, weights, sorted_ids, block_experts, block_m, rows_per_token=1,
                  weighted=True)
    return out.view(T, k, H).sum(dim=1).to(x.dtype)


def _grouped_gemm(a, w, out, weights, sorted_ids, block_experts, block_m, *, rows_per_token, weighted):
    """out[p] = w[expert of p] a[p // rows_per_token] (times p's weight when ``weighted``) for
    every sorted pair p."""
    # a: [M, K]; w: [E, N, K]; out: [P, N]
    N, K = w.shape[1], w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(N, _BLOCK_N))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        weights,
        sorted_ids,
        block_experts,
        N,
        K,
        out.shape[0],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token,
        WEIGHTED=weighted,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        num_warps=4,
    )
