"""KV-cache write: store each new token's K and V rows at its flat cache slot (Triton).

The torch reference is ``pipeserve.kernels.reference.write_kv``. One program per token copies
its ``[kvh, d]`` K and V rows (any strides, so the views of a fused qkv split need no copy) to
``kv_cache[0|1].view(-1, kvh, d)[slot]``, casting to the cache dtype. A negative slot means
"padding row, store nothing" (the CUDA-graph runner pads decode batches with slot -1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row
        return
    heads = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    t = token.to(tl.int64)
    k = tl.load(
        k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask
    )
    # The cache is contiguous: slot s starts at s * kvh * d, head h at h * d.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V at their cache slots (slot = block_id * block_size + offset).

    Contract (asserted): k, v are ``[T, kvh, d]`` with any strides (views of a fused qkv
    projection are fine) and are cast to the cache dtype; ``kv_cache`` is a contiguous
    ``[2, num_blocks, block_size, kvh, d]``; ``slot_mapping`` is ``[T]`` int32/int64 on the
    same device. Slots < 0 are skipped (padding rows); slots >= num_blocks * block_size are a
    caller bug and are not checked on the device. The launch depends only on T and the shapes,
    so it is CUDA-graph capturable.
    """
    # k, v: [T, kvh, d]; kv_cache: [2, num_blocks, block_size, kvh, d]; slot_mapping: [T]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache: [2, num_blocks, bs, kvh, d]"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    _, _, _, kvh, d = kv_cache.shape
    T = k.shape[0]
    assert k.shape == (T, kvh, d) and v.shape == (T, kvh, d), (k.shape, v.shape, kv_cache.shape)
    assert slot_mapping.shape == (T,), (slot_mapping.shape, T)
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    assert k.device == v.device == kv_cache.device == slot_mapping.device
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        *k.stride(),
        *v.stride(),
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=1 if kvh * d <= 512 else 4,
    )
