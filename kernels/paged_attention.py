"""Paged attention over a packed mixed batch, in one Triton launch (flash-attention style).

Semantics are those of the torch reference ``pipeserve.kernels.reference.paged_attention``:
sequence i's ``q_len`` queries are the last q_len of its ``seq_len`` positions (query j sits
at ``seq_len - q_len + j``, causal, bottom-right aligned), and query head h reads KV head
``h // g`` with ``g = num_heads // num_kv_heads``.

One program handles BLOCK_M rows of one (sequence, KV head): the rows fold that KV head's g
query heads into the M dimension (row r is query ``r // g``, head ``kv_head * g + r % g``), so
GQA reads each K/V tile once per group. It walks the sequence's keys BLOCK_N at a time, looking
each key's block up in the block table, with an online softmax in float32: first the tiles
every row sees whole (no mask), then the tiles along the causal diagonal (masked).

Grid: ``(num_seqs, cdiv(max_q_len * g, BLOCK_M), num_kv_heads)``; programs past their
sequence's rows return at once. With a work list (``attention_work_list``: each program's
sequence and M tile, on the device) the grid is ``(list length, 1, num_kv_heads)`` and does not
depend on the batch's query lengths, so a mixed batch padded to a token bucket is captured in
a CUDA graph too. A decode-only batch (T == num_seqs) uses small M tiles
(16 rows, or g rounded up to a power of two: one tile per sequence and KV head) and never
reads query_start_loc, so it can be captured in a CUDA graph (``batch_invariant``: 64-row
tiles and one code path for every tile, see ``tile_config``). Tile sizes are untuned
defaults (BLOCK_N 64; BLOCK_M 64 for mixed batches, 16 for decodes). A decode batch runs S * kvh
programs, each over its whole context; one too small to fill the GPU goes to ``paged_decode``
(split-KV) instead. The per-tile online softmax both share is in ``attention_tiles``.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.kernels.attention_tiles import attend_keys, head_dim_block, score_args
from pipeserve.kernels.paged_decode import decode_splits, paged_decode

@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    work_ptr,
    qk_scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    WORK_LIST: tl.constexpr,
    UNMASKED_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    kv_head = tl.program_id(2)
    if WORK_LIST:  # program i runs work item i: (sequence, M tile), or (-1, 0) for none
        seq = tl.load(work_ptr + 2 * tl.program_id(0))
        m_block = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    else:
        seq = tl.program_id(0)
        m_block = tl.program_id(1)
    if seq < 0:  # an unused work item
        return
    if DECODE_ONLY:  # token i is sequence i's only query
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len * G:  # past this sequence's rows
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached prefix; -q_len for padding (seq_len 0): no key is visible

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_valid = rows < q_len * G
    q_idx = rows // G  # query within the sequence
    heads = kv_head * G + rows % G
    q_pos = ctx_len + q_idx  # absolute position of each row's query
    dims = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_M, BLOCK_D]
    q_rows = (q_start + q_idx).to(tl.int64) * stride_qt + heads * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kh

    # Keys [0, full_end) are visible to every row of this tile (all precede its first query);
    # keys [full_end, kv_end) straddle the diagonal or the context's end and need the mask.
    first_q = (m_block * BLOCK_M) // G
    last_q = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
    # UNMASKED_TILES 0 sends every tile through the masked path: the two paths round the scores
    # differently (the unmasked one fuses scale and max into one FMA), and which path a tile
    # takes depends on the chunk's start and the tile's rows, not on the token alone.
    full_end = (ctx_len + first_q + 1) // BLOCK_N * BLOCK_N * UNMASKED_TILES  # >= 0
    kv_end = ctx_len + last_q + 1  # <= seq_len
    start = 0
    if WINDOW:  # from the tile holding the first row's oldest visible key, every tile masked
        start = tl.maximum(ctx_len + first_q - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = start
    acc, m_i, l_i = attend_keys(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head_off, start, full_end, kv_end,
        seq_len, q_pos, qk_scale, softcap, window, stride_kb, stride_ks, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
        BLOCK_D, DOT_PRECISION, SOFTCAP, WINDOW,
    )  # fmt: skip

    # A row with no visible key (a padded row with seq_len 0) has l = 0 and acc = 0: output 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + q_idx).to(tl.int64) * stride_ot + heads * stride_oh  # [BLOCK_M]
    tl.store(
        out_ptr + o_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def tile_config(g: int, *, decode_only: bool, batch_invariant: bool) -> tuple[int, int]:
    """(BLOCK_M, UNMASKED_TILES) for query heads grouped ``g`` per KV head.

    Decodes get 16-row tiles (one tile per sequence and KV head), mixed batches 64. With
    ``batch_invariant`` a row's arithmetic must not depend on its batch: one tile shape for
    decodes and prefills, and every key tile through the masked path (UNMASKED_TILES 0).
    """
    if batch_invariant:
        return max(64, triton.next_power_of_2(g)), 0
    return max(16 if decode_only else 64, triton.next_power_of_2(g)), 1


def mixed_block_m(g: int, *, batch_invariant: bool = False) -> int:
    """Rows (query, head of the group) per program of a batch that is not decode-only."""
    return tile_config(g, decode_only=False, batch_invariant=batch_invariant)[0]


def work_list_size(num_tokens: int, num_seqs: int, g: int, block_m: int) -> int:
    """Work items enough for any batch of ``num_tokens`` tokens over at most ``num_seqs``
    sequences: sequence i needs cdiv(q_i * g, block_m) < q_i * g / block_m + 1 of them."""
    return -(-num_tokens * g // block_m) + num_seqs


def attention_work_list(query_lens: np.ndarray, g: int, block_m: int, size: int) -> np.ndarray:
    """[size, 2] int32: (sequence, M tile) of every program with rows to attend, in sequence
    order, then (-1, 0) for the unused rest (``paged_attention`` with ``meta.work_list``)."""
    q = np.asarray(query_lens, dtype=np.int64)
    tiles = -(-q * g // block_m)  # [S] M tiles per sequence
    n = int(tiles.sum())
    if n > size:
        raise ValueError(f"{n} work items do not fit a list of {size}")
    out = np.zeros((size, 2), dtype=np.int32)
    out[n:, 0] = -1
    out[:n, 0] = np.repeat(np.arange(len(q)), tiles)
    out[:n, 1] = np.arange(n) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    return out


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    batch_invariant: bool = False,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context; returns [T, h, d].

    The new tokens' K/V must already be in ``kv_cache`` (``write_kv`` first). A
    ``sliding_window`` W hides keys older than the window (a query at p sees ``p - W < k <=
    p``); ``softcap`` c maps each scaled score s to ``c * tanh(s / c)`` (Gemma's options, as
    the torch reference).

    Contract (asserted): q is ``[T, h, d]`` with unit stride on d; ``kv_cache`` is a contiguous
    ``[2, num_blocks, block_size, kvh, d]`` of q's dtype (fp16, bf16 or fp32); h % kvh == 0;
    any d (one that is not a power of two >= 16 is padded to one inside the kernel); ``meta.seq_lens`` [S], ``meta.query_start_loc`` [S+1] and
    ``meta.block_tables`` [S, max_blocks] are int32 on q's device. Every sequence has
    q_len >= 1 and q_len <= seq_len, except padding: a sequence with seq_len 0 (a padded
    decode row, q_len 1, or a mixed graph's padding tokens, any q_len) reads nothing and
    outputs zeros, and with a work list a sequence past the padding may have q_len 0 (no
    work item names it). Block-table entries past ``cdiv(seq_len, block_size)``
    are never read. The output is float32-accumulated and has q's dtype.

    Decode-only batches (T == S, i.e. every q_len is 1) are CUDA-graph capturable: the launch
    depends only on S, the head counts, d and block_size; the kernel reads seq_lens and
    block_tables from the device tensors and does not read query_start_loc at all (token i is
    sequence i's query). No host list of ``meta`` is read there. Other batches read
    ``meta.query_start_loc_cpu`` on the host for the grid's max query length, unless
    ``meta.work_list`` (``attention_work_list``) names every program's (sequence, M tile) on
    the device: then the grid is that list's length, nothing on the host is read, and a mixed
    batch is capturable too (a CUDA-graph runner fills the list per step; its unused items,
    sequence -1, return at once).

    A decode-only batch too small to fill the GPU goes to ``paged_decode`` instead, each context
    cut into ranges run by programs of their own (``num_splits``; None: ``decode_splits``
    chooses from the batch's shape, 1 keeps this kernel). Never with ``batch_invariant``.

    ``batch_invariant``: a token's result is the same bits whatever its micro-batch held, where
    its prompt's chunks started and however many query heads share its KV head (``tile_config``:
    one tile shape, one code path; a row's arithmetic never depends on the other rows of its
    tile; keys are walked BLOCK_N at a time from position 0, and fully masked tiles change
    nothing; with a window, the walk starts at a tile edge before the window, every tile it
    skips fully masked).
    """
    # q: [T, h, d]; kv_cache: [2, num_blocks, block_size, kvh, d]
    T, h, d = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache: [2, num_blocks, bs, kvh, d]"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    _, _, block_size, kvh, d_cache = kv_cache.shape
    assert d_cache == d and h % kvh == 0, (q.shape, kv_cache.shape)
    assert block_size == meta.block_size, (block_size, meta.block_size)
    assert q.stride(2) == 1, "q's last dim must be contiguous"
    assert q.dtype == kv_cache.dtype, (q.dtype, kv_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    num_seqs = meta.seq_lens.shape[0]
    assert meta.query_start_loc.shape == (num_seqs + 1,), (meta.query_start_loc.shape, num_seqs)
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == num_seqs
    for t in (meta.seq_lens, meta.query_start_loc, meta.block_tables):
        assert t.dtype == torch.int32 and t.device == q.device, (t.dtype, t.device)
    assert meta.block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert softcap is None or softcap > 0, softcap
    options = dict(sliding_window=sliding_window, softcap=softcap)

    out = torch.empty((T, h, d), dtype=q.dtype, device=q.device)  # [T, h, d]
    if T == 0 or num_seqs == 0:
        return out
    g = h // kvh
    work = meta.work_list
    # Every sequence has q_len >= 1, so T == num_seqs means all are 1 (a work list may list
    # sequences with more, over a padded batch: it always takes the mixed tiles).
    decode_only = T == num_seqs and work is None
    block_m, unmasked_tiles = tile_config(g, decode_only=decode_only, batch_invariant=batch_invariant)
    if decode_only and not batch_invariant:
        splits = decode_splits(num_seqs, kvh, q.device) if num_splits is None else num_splits
        if splits > 1:
            return paged_decode(q, kv_cache, meta, scale, out=out, num_splits=splits, block_m=block_m, **options)
    block_n, num_warps = 64, 4
    if work is not None:
        assert meta.work_block_m == block_m, f"work list made for {meta.work_block_m}-row tiles, not {block_m}"
        assert work.dtype == torch.int32 and work.device == q.device and work.dim() == 2, work
        grid = (work.shape[0], 1, kvh)
    else:
        max_q_len = 1 if decode_only else meta.max_query_len
        grid = (num_seqs, triton.cdiv(max_q_len * g, block_m), kvh)
    _paged_attention_kernel[grid](
        out,
        q,
        kv_cache[0],
        kv_cache[1],
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.seq_lens if work is None else work,  # (not read without a work list)
        *score_args(scale, softcap, sliding_window),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        G=g,
        HEAD_DIM=d,
        BLOCK_D=head_dim_block(d),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DECODE_ONLY=decode_only,
        WORK_LIST=work is not None,
        UNMASKED_TILES=unmasked_tiles,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap is not None,
        WINDOW=sliding_window is not None,
        num_warps=num_warps,
        num_stages=3,  # with 16-divisible strides the K/V gathers become cp.async pipelines
    )
    return out
