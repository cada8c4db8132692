"""RoPE (NeoX / rotate-half layout) on queries and keys in place, one launch for both.

Torch reference: ``pipeserve.kernels.reference.rope_reference``. Dimension i pairs with i + d/2:

    out[:half] = x[:half] * cos[:half] - x[half:] * sin[:half]
    out[half:] = x[half:] * cos[half:] + x[:half] * sin[half:]

Each product and the sum are rounded to the activation dtype, as the reference's
``x * cos + rotate_half(x) * sin`` in that dtype is. q and k may be strided views (e.g. out
of a fused qkv projection); only their last dimension must be contiguous. The kernel sees
each of them as T * heads rows of one head each; a program rotates a block of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program rotates about this many element pairs: rows x half a head.
_TILE = 2048


@triton.jit
def _rotate(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    stride_h,
    stride_cos,
    stride_sin,
    block,
    num_rows,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotates rows [block * BLOCK_R, +BLOCK_R) of x in place; row r is head r % num_heads
    of token r // num_heads."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (rows[:, None] < num_rows) & (dims < HALF)  # [BLOCK_R, BLOCK_D]
    token = (rows // num_heads).to(tl.int64)[:, None]  # int64: T * stride may pass 2**31
    head = (rows % num_heads)[:, None]
    ptr1 = x_ptr + token * stride_t + head * stride_h + dims  # [BLOCK_R, BLOCK_D]
    ptr2 = ptr1 + HALF
    cos_row = cos_ptr + token * stride_cos + dims
    sin_row = sin_ptr + token * stride_sin + dims
    cos1 = tl.load(cos_row, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # Round each product, then the sum, to the activation dtype (the reference's order).
    a1 = (x1f * cos1).to(dtype).to(tl.float32)
    b1 = (x2f * sin1).to(dtype).to(tl.float32)
    a2 = (x2f * cos2).to(dtype).to(tl.float32)
    b2 = (x1f * sin2).to(dtype).to(tl.float32)
    tl.store(ptr1, (a1 - b1).to(dtype), mask=mask)
    tl.store(ptr2, (a2 + b2).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    T,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The first cdiv(T * num_q_heads, BLOCK_R) programs rotate q's rows, the rest k's."""
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(T * num_q_heads, BLOCK_R)
    # Two calls, not one on merged variables: a count or stride of 1 is specialized to a
    # constant, and the branches' values would then differ in type.
    if pid < num_q_blocks:
        _rotate(
            q_ptr,
            cos_ptr,
            sin_ptr,
            stride_qt,
            stride_qh,
            stride_cos,
            stride_sin,
            pid,
            T * num_q_heads,
            num_q_heads,
            HALF,
            BLOCK_R,
            BLOCK_D,
        )
    else:
        _rotate(
            k_ptr,
            cos_ptr,
            sin_ptr,
            stride_kt,
            stride_kh,
            stride_cos,
            stride_sin,
            pid - num_q_blocks,
            T * num_k_heads,
            num_k_heads,
            HALF,
            BLOCK_R,
            BLOCK_D,
        )


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, h, d] and k [T, kvh, d] IN PLACE by cos, sin [T, d]; returns (q, k).

    q and k must not overlap each other (views of disjoint parts of one tensor are fine).
    """
    # q: [T, h, d]; k: [T, kvh, d]; cos, sin: [T, d]
    assert q.dim() == 3 and k.dim() == 3, f"q {tuple(q.shape)}, k {tuple(k.shape)}"
    T, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (T, num_kv_heads, d), f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert d % 2 == 0, f"head_dim {d} must be even"
    assert cos.shape == (T, d) and sin.shape == (T, d), f"cos {cos.shape}, sin {sin.shape}"
    assert q.stride(2) == 1 and k.stride(2) == 1, f"strides q {q.stride()}, k {k.stride()}"
    assert cos.stride(1) == 1 and sin.stride(1) == 1, "cos/sin rows must be contiguous"
    for t in (k, cos, sin):
        assert t.dtype == q.dtype and t.device == q.device, f"{t.dtype} on {t.device}"
    if T == 0:
        return q, k
    half = d // 2
    block_d = triton.next_power_of_2(half)
    rows = T * max(num_heads, num_kv_heads)
    block_r = min(max(_TILE // block_d, 1), triton.next_power_of_2(rows))
    grid = (triton.cdiv(T * num_heads, block_r) + triton.cdiv(T * num_kv_heads, block_r),)
    _rope_kernel[grid](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        T,
        num_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return q, k
