"""Split-KV paged attention for decode-only batches (flash-decoding), in two Triton launches.

Semantics are those of ``paged_attention`` for a decode-only batch (every q_len 1): token i is
sequence i's query at position ``seq_len - 1``, and it sees all of its ``seq_len`` keys.

Why: ``paged_attention`` runs one program per (sequence, KV head) for a decode batch, each
walking its whole context alone. A few decodes over long contexts then leave most of the GPU
idle while a handful of programs walk thousands of keys one tile after another: on an H200 a
32-layer Llama-3-8B step of one decode took 5.2 ms at 512 tokens of context and 8.3 ms at
4,096, where reading that KV takes 0.1 ms (measured with torch.profiler). Here
each (sequence, KV head) is cut into ``num_splits`` ranges of whole key tiles, each range a
program of its own (``_split_kernel``: its partial softmax state, the max and sum in log2 units
and the unnormalized output), and ``_combine_kernel`` merges a sequence's ranges.

The launches depend only on the batch size, the head counts, ``num_splits`` and the tile sizes:
each program reads its sequence's ``seq_len`` and block table from the device and computes its
own range from them (a range past the context is empty: it stores m = -inf, l = 0), so the
batch is CUDA-graph capturable as ``paged_attention``'s decode path is.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.kernels.attention_tiles import attend_keys, head_dim_block, score_args

MAX_SPLITS = 16


@triton.jit
def _split_kernel(
    acc_ptr,
    ml_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOW:  # the ranges cover the window only, from the tile holding its oldest key
        lo = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    # Whole key tiles per range, so that only the range holding the context's end is masked.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    full_end = tl.maximum(tl.minimum(end, seq_len // BLOCK_N * BLOCK_N), start)
    if WINDOW:  # every tile masked (attention_tiles)
        full_end = start

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]: the G query heads of this KV head, then padding
    row_valid = rows < G
    heads = kv_head * G + tl.where(row_valid, rows, 0)
    dims = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_M, BLOCK_D]
    q_rows = seq.to(tl.int64) * stride_qt + heads * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1  # every key < seq_len is visible

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    acc, m_i, l_i = attend_keys(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head_off, start, full_end, end,
        seq_len, q_pos, qk_scale, softcap, window, stride_kb, stride_ks, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
        BLOCK_D, DOT_PRECISION, SOFTCAP, WINDOW,
    )  # fmt: skip

    # partials: acc [S, NUM_SPLITS, NUM_HEADS, HEAD_DIM], ml [2, S, NUM_SPLITS, NUM_HEADS]
    part = (seq * NUM_SPLITS + split).to(tl.int64) * NUM_HEADS + heads  # [BLOCK_M]
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=io_mask)
    tl.store(ml_ptr + part, m_i, mask=row_valid)
    tl.store(ml_ptr + tl.num_programs(0) * NUM_SPLITS * NUM_HEADS + part, l_i, mask=row_valid)


@triton.jit
def _combine_kernel(
    out_ptr,
    acc_ptr,
    ml_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    col_ok = dims < HEAD_DIM
    part = (seq * NUM_SPLITS + splits).to(tl.int64) * NUM_HEADS + head  # [NUM_SPLITS]
    m = tl.load(ml_ptr + part)
    l_part = tl.load(ml_ptr + tl.num_programs(0) * NUM_SPLITS * NUM_HEADS + part)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    # Empty ranges (m = -inf) weigh 0; a padded row (seq_len 0) has no range at all: output 0.
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # [NUM_SPLITS]
    l_sum = tl.sum(w * l_part, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum == 0.0, 1.0, l_sum)  # [BLOCK_D]
    o = seq.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o + dims, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """``split_count`` for a decode batch on ``device``; 1 off CUDA (the interpreter's tests ask
    for splits explicitly)."""
    return split_count(num_seqs * num_kv_heads, _num_sms(device)) if device.type == "cuda" else 1


def split_count(num_programs: int, num_sms: int) -> int:
    """Ranges per (sequence, KV head) for a decode batch of ``num_programs`` unsplit programs.

    A batch whose programs would occupy at least half the SMs is left whole (1): at 32 decodes
    of Llama-3-8B on an H200 (256 programs) two ranges each made the step slower (measured).
    Smaller ones get at least two programs per SM (2-4: the count is
    rounded up to a power of two, for the combine's arange), at most MAX_SPLITS ranges. It
    depends on the batch's shape only, not on its contexts (a captured graph keeps it): short
    contexts get mostly empty ranges, each a program that stores an empty state and returns.
    """
    num_programs = max(1, num_programs)
    if 2 * num_programs > num_sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(-(-2 * num_sms // num_programs)))


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor,
    num_splits: int,
    block_m: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a decode-only batch (``q`` [S, h, d], one token per sequence), each context
    cut into ``num_splits`` ranges, into ``out`` [S, h, d] (returned). ``paged_attention``
    checks the contract and calls this; ``block_m`` rows per program hold a KV head's query
    heads. With a ``sliding_window`` the ranges cut the window, not the whole context."""

    S, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, num_splits
    assert meta.seq_lens.shape == (S,) and meta.block_tables.shape[0] == S, "one decode per sequence"
    assert meta.work_list is None, "a work list is for mixed batches"
    g = h // kvh
    assert h % kvh == 0 and block_m >= g and block_m & (block_m - 1) == 0, (h, kvh, block_m)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    acc = torch.empty((S, num_splits, h, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((2, S, num_splits, h), dtype=torch.float32, device=q.device)  # max, sum (log2)
    _split_kernel[(S, num_splits, kvh)](
        acc, ml, q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
        *score_args(scale, softcap, sliding_window),
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        meta.block_tables.stride(0),
        NUM_HEADS=h, G=g, HEAD_DIM=d, BLOCK_D=head_dim_block(d), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=64,
        NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap is not None, WINDOW=sliding_window is not None,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    _combine_kernel[(S, h)](
        out, acc, ml, out.stride(0), out.stride(1), NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=head_dim_block(d),
        NUM_SPLITS=num_splits, num_warps=4,
    )  # fmt: skip
    return out
