"""The online-softmax steps that ``paged_attention`` and ``paged_decode`` share (Triton device
functions, inlined into each kernel): one tile of keys gathered through a block table, and a
range of keys walked tile by tile. Scores are kept in log2 units (the scale times LOG2E, then
``exp2``), so a kernel's running max and sum are in those units too.

Two options of a layer (Gemma's), both constexpr switches so that other models compile the
kernels as before: ``SOFTCAP`` maps each score s (``qk_scale`` is then the plain scale, not
times LOG2E) to ``softcap * tanh(s / softcap)`` before the mask, as HF does, and ``WINDOW``
hides keys at or before ``q_pos - window`` (a sliding window of ``window`` keys). With a window
the edge moves along a tile's rows, so a kernel sends every tile through the masked path.
A head_dim that is not a power of two (Phi-3-mini's 96) is padded to ``BLOCK_D``, one.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def score_args(scale: float, softcap: float | None, sliding_window: int | None) -> tuple[float, float, int]:
    """The kernels' (qk_scale, softcap, window) arguments: the scale in log2 units, unless a
    softcap takes the plain scores and converts after the cap (``attention_tiles``)."""
    if softcap is None:
        return scale * LOG2E, 0.0, sliding_window or 0
    return scale, float(softcap), sliding_window or 0


def head_dim_block(d: int) -> int:
    """The head_dim tile: d padded to a power of two, at least 16 (``tl.dot``'s least K)."""
    return max(16, triton.next_power_of_2(d))


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
    softcap,
    window,
    stride_kb,
    stride_ks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """One BLOCK_N tile of keys: gather K/V through the block table, update the online softmax."""
    k_pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]: head_dim, padded to a power of two
    in_ctx = k_pos < seq_len  # [BLOCK_N]; all True for an unmasked tile
    if MASKED:
        blocks = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=in_ctx, other=0)
    else:
        blocks = tl.load(table_ptr + k_pos // BLOCK_SIZE)
    # [BLOCK_N] element offset of each key's row for this KV head
    rows = blocks.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head_off
    if BLOCK_D != HEAD_DIM:  # the pad's columns load as 0 (they add 0 to q.k, fill unread ones)
        col_ok = dims < HEAD_DIM
        k_ok, v_ok = in_ctx[None, :] & col_ok[:, None], in_ctx[:, None] & col_ok[None, :]
        k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None], mask=k_ok, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=v_ok, other=0.0)
    elif MASKED:
        k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None], mask=in_ctx[None, :], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + rows[None, :] + dims[:, None])  # [HEAD_DIM, BLOCK_N]
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :])  # [BLOCK_N, HEAD_DIM]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if SOFTCAP:  # s is scale * q.k here; tanh(x) = 1 - 2 / (exp(2x) + 1), then log2 units
        tanh = 1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0)
        s = tanh * (softcap * 1.4426950408889634)
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
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
    softcap,
    window,
    stride_kb,
    stride_ks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Keys [start, end), BLOCK_N at a time: those before ``full_end`` unmasked (every row sees
    them whole), the rest masked (the causal diagonal, the context's end, a window's edge)."""
    for start_n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head_off, start_n,
            seq_len, q_pos, qk_scale, softcap, window, stride_kb, stride_ks,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False, DOT_PRECISION, SOFTCAP, WINDOW,
        )  # fmt: skip
    for start_n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head_off, start_n,
            seq_len, q_pos, qk_scale, softcap, window, stride_kb, stride_ks,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True, DOT_PRECISION, SOFTCAP, WINDOW,
        )  # fmt: skip
    return acc, m_i, l_i
