"""The online-softmax steps that ``paged_attention`` and ``paged_decode`` share (Triton device
functions, inlined into each kernel): one tile of keys gathered through a block table, and a
range of keys walked tile by tile. Scores are kept in log2 units (the scale times LOG2E, then
``exp2``), so a kernel's running max and sum are in those units too.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head_off,
    start_n,
    seq_len,
    q_pos,
    qk_scale,
    stride_kb,
    stride_ks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys: gather K/V through the block table, update the online softmax."""
    k_pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    in_ctx = k_pos < seq_len  # [BLOCK_N]; all True for an unmasked tile
    if MASKED:
        blocks = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=in_ctx, other=0)
    else:
        blocks = tl.load(table_ptr + k_pos // BLOCK_SIZE)
    # [BLOCK_N] element offset of each key's row for this KV head
    rows = blocks.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head_off
    if MASKED:
        k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None], mask=in_ctx[None, :], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None])  # [HEAD_DIM, BLOCK_N]
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :])  # [BLOCK_N, HEAD_DIM]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 then, not -inf (NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
    p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_keys(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head_off,
    start,
    full_end,
    end,
    seq_len,
    q_pos,
    qk_scale,
    stride_kb,
    stride_ks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys [start, end), BLOCK_N at a time: those before ``full_end`` unmasked (every row sees
    them whole), the rest masked (the causal diagonal, the context's end)."""
    for start_n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head_off, start_n,
            seq_len, q_pos, qk_scale, stride_kb, stride_ks,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head_off, start_n,
            seq_len, q_pos, qk_scale, stride_kb, stride_ks,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i
