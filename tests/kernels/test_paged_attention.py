"""paged_attention (Triton) against the naive float64 ``attention_reference``.

Fresh random inputs every run (the seed is in every failure message). Block tables are
shuffled, and every cache slot no sequence owns (unused blocks, and the tail of each
sequence's last block) holds NaN, so a read past a context shows as NaN in the output. The
kernel's output buffer comes from the allocator right after a NaN-filled buffer of the same
size is freed (on GPU the caching allocator hands the same memory back), so an unwritten row
shows too. Runs under the Triton interpreter on CPU (float32, float16, tiny shapes; the
interpreter mishandles bfloat16) and natively on GPU (the ``gpu`` tests: bfloat16, long
contexts, head_dim 128, CUDA-graph capture of a decode batch).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import (  # noqa: E402
    DEVICE,
    assert_invariant,
    fresh_seed,
    gpu,
    interpreter_array_warning,
    runs_triton,
)

from helpers_model import MIXED_BATCH, make_metadata  # noqa: E402

from pipeserve.kernels.paged_attention import (  # noqa: E402
    attention_work_list,
    mixed_block_m,
    paged_attention,
    work_list_size,
)
from pipeserve.kernels.reference import attention_reference  # noqa: E402
from pipeserve.kernels.attention_metadata import AttentionMetadata  # noqa: E402

pytestmark = [runs_triton, interpreter_array_warning]

# max |got - reference| allowed, per dtype: rounding of q/K/V is in both; what is left is
# the probabilities' cast for P @ V and the output's rounding.
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}

MIXED = MIXED_BATCH


def _random_case(seqs, *, block_size, num_heads, num_kv_heads, head_dim, dtype, seed, pad=0):
    """q [T, h, d], a NaN-poisoned paged cache and metadata for (q_len, seq_len) seqs; then
    ``pad`` padded decode rows (q_len 1, seq_len 0, block table all zeros) at the end."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(1, num_blocks))  # block 0 stays NaN: padded table entries point there
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    cache = torch.full((2, num_blocks * block_size, num_kv_heads, head_dim), float("nan"))
    for (_, seq_len), table in zip(seqs, tables, strict=True):
        pos = torch.arange(seq_len)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        cache[:, slots] = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen)
    kv_cache = cache.view(2, num_blocks, block_size, num_kv_heads, head_dim)
    meta = make_metadata(seqs, tables, block_size)
    if pad:
        meta = _with_padded_rows(meta, pad)
    T = meta.query_start_loc_cpu[-1]
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    return q.to(DEVICE, dtype), kv_cache.to(DEVICE, dtype), _to(meta, DEVICE)


def _with_padded_rows(meta: AttentionMetadata, pad: int) -> AttentionMetadata:
    """``meta`` plus ``pad`` decode rows of an empty context, as a CUDA-graph runner pads."""
    starts = meta.query_start_loc_cpu + [meta.query_start_loc_cpu[-1] + i + 1 for i in range(pad)]
    seq_lens = meta.seq_lens_cpu + [0] * pad
    tables = torch.cat(
        [meta.block_tables, meta.block_tables.new_zeros(pad, meta.block_tables.shape[1])]
    )
    return AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1)]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        block_size=meta.block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def _to(meta: AttentionMetadata, device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens=meta.seq_lens.to(device),
        block_tables=meta.block_tables.to(device),
        block_size=meta.block_size,
        query_start_loc_cpu=list(meta.query_start_loc_cpu),
        seq_lens_cpu=list(meta.seq_lens_cpu),
    )


def _run(q, kv_cache, meta, scale, **kwargs):
    """paged_attention, its output allocated where a NaN-filled buffer just was."""
    poison = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    del poison
    return paged_attention(q, kv_cache, meta, scale, **kwargs)


def _check(got, q, kv_cache, meta, scale, seed, **options):
    assert got.shape == q.shape and got.dtype == q.dtype, (got.shape, got.dtype)
    want = attention_reference(q, kv_cache, meta, scale, **options)  # float64, CPU
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= ATOL[q.dtype], f"seed {seed}: max |err| {err:.3g} > {ATOL[q.dtype]}"


def _seed() -> int:
    return fresh_seed()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, block_size, dtype):
    seed = _seed()
    case = dict(block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    q, kv_cache, meta = _random_case(MIXED, **case, head_dim=64, dtype=dtype, seed=seed)
    _check(_run(q, kv_cache, meta, 0.125), q, kv_cache, meta, 0.125, seed)


# Contexts and chunks just either side of key-tile (64) and query-tile edges: the split into
# whole tiles (no mask) and diagonal tiles (masked) must be exact.
EDGES = [(1, 63), (1, 64), (1, 65), (3, 65), (2, 64), (1, 129), (40, 100), (70, 70), (22, 150)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 2)])
def test_tile_edges_match_reference(num_heads, num_kv_heads):
    seed = _seed()
    case = dict(block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads)
    q, kv_cache, meta = _random_case(EDGES, **case, head_dim=16, dtype=torch.float32, seed=seed)
    _check(_run(q, kv_cache, meta, 0.25), q, kv_cache, meta, 0.25, seed)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 2)])
def test_decode_batch_with_padded_rows(num_heads, num_kv_heads, block_size):
    """Decode only, as a CUDA-graph runner pads it: padded rows (seq_len 0, table -> block 0,
    whose slots are NaN) come out as zeros, the real rows match the reference."""
    seed = _seed()
    seqs = [(1, 5), (1, 40), (1, 17), (1, 64)]
    case = dict(block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    q, kv_cache, meta = _random_case(
        seqs, **case, head_dim=64, dtype=torch.float32, seed=seed, pad=2
    )
    got = _run(q, kv_cache, meta, 0.125)
    assert torch.equal(got[len(seqs) :], torch.zeros_like(got[len(seqs) :])), f"seed {seed}"
    _check(got, q, kv_cache, meta, 0.125, seed)  # the reference gives zeros there too


# Contexts either side of key-tile (64) edges, shorter than the ranges, and one range each.
SPLIT_DECODES = [(1, 1), (1, 63), (1, 64), (1, 65), (1, 129), (1, 200), (1, 7), (1, 256)]


@pytest.mark.parametrize("num_splits", [2, 4, 16])
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads", [(16, 9, 3), (32, 8, 2), (16, 4, 4)])
def test_split_decode_matches_reference(num_splits, block_size, num_heads, num_kv_heads):
    """Each context cut into ranges of whole key tiles (``paged_decode``): empty ranges, a
    range ending mid-tile and padded rows (seq_len 0: zeros) all merge to the reference."""
    seed = _seed()
    case = dict(block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    q, kv_cache, meta = _random_case(SPLIT_DECODES, **case, head_dim=32, dtype=torch.float32, seed=seed, pad=2)
    got = _run(q, kv_cache, meta, 0.2, num_splits=num_splits)
    assert torch.equal(got[-2:], torch.zeros_like(got[-2:])), f"seed {seed}"
    _check(got, q, kv_cache, meta, 0.2, seed)
    if num_splits == 2:  # the unsplit kernel agrees too (a different order of the same sums)
        one = _run(q, kv_cache, meta, 0.2, num_splits=1)
        assert (one - got).abs().max().item() <= ATOL[torch.float32], f"seed {seed}"


# Gemma's options: a window of one key, windows inside and across the key tiles (64), one
# longer than every context, and a cap alone. Decodes run unsplit and split.
WINDOWED = [(1, 63), (1, 65), (3, 65), (40, 100), (70, 70), (22, 150), (1, 1), (1, 129)]


@pytest.mark.parametrize(
    "sliding_window, softcap", [(1, None), (20, None), (64, 2.0), (None, 1.5)]
)
def test_window_and_softcap_match_reference(sliding_window, softcap):
    seed = _seed()
    options = dict(sliding_window=sliding_window, softcap=softcap)
    case = dict(block_size=16, num_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=seed)
    q, kv_cache, meta = _random_case(WINDOWED, **case)
    _check(_run(q, kv_cache, meta, 0.5, **options), q, kv_cache, meta, 0.5, seed, **options)
    q, kv_cache, meta = _random_case(SPLIT_DECODES, **case, pad=2)
    for num_splits in (1, 4):
        got = _run(q, kv_cache, meta, 0.5, num_splits=num_splits, **options)
        assert torch.equal(got[-2:], torch.zeros_like(got[-2:])), f"seed {seed}"
        _check(got, q, kv_cache, meta, 0.5, seed, **options)
    if sliding_window is not None and sliding_window < 64:  # the window really hides keys
        assert (got - _run(q, kv_cache, meta, 0.5, softcap=softcap)).abs().max() > 0.01


@pytest.mark.parametrize("head_dim", [24, 8])
def test_head_dim_not_a_power_of_two(head_dim):
    """Phi-3-mini's 96 in small: head_dim padded to a power of two (at least 16) inside the
    kernels; mixed batches and split decodes."""
    seed = _seed()
    case = dict(block_size=16, num_heads=6, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32, seed=seed)
    q, kv_cache, meta = _random_case(MIXED, **case)
    _check(_run(q, kv_cache, meta, 0.3), q, kv_cache, meta, 0.3, seed)
    q, kv_cache, meta = _random_case(SPLIT_DECODES[:4], **case, pad=1)
    _check(_run(q, kv_cache, meta, 0.3, num_splits=4), q, kv_cache, meta, 0.3, seed)


def test_split_count_depends_on_the_batch_shape_only():
    from pipeserve.kernels.paged_decode import MAX_SPLITS, decode_splits, split_count

    # 132 SMs (H100/H200), 8 KV heads: 1 decode -> 8 programs -> 33 wanted -> capped at 16;
    # 8 decodes -> 64 programs -> ceil(264 / 64) = 5 -> 8 (3.9 a SM); 9 decodes -> 72 > 66: whole.
    assert [split_count(n * 8, 132) for n in (1, 2, 4, 8, 9, 32, 256)] == [MAX_SPLITS, 16, 16, 8, 1, 1, 1]
    assert split_count(0, 132) == MAX_SPLITS and split_count(66, 132) == 4 and split_count(67, 132) == 1
    assert all(s & (s - 1) == 0 for s in (split_count(n, 132) for n in range(1, 200)))
    assert decode_splits(1, 8, torch.device("cpu")) == 1  # off CUDA: tests ask explicitly


def test_decode_batch_reads_only_device_metadata():
    """A decode-only batch must not depend on the host lists' values or on query_start_loc
    (a captured CUDA graph replays with new seq_lens / block_tables in the device tensors)."""
    seed = _seed()
    seqs = [(1, 20), (1, 3), (1, 33)]
    q, kv_cache, meta = _random_case(
        seqs,
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        seed=seed,
    )
    want = _run(q, kv_cache, meta, 0.2)
    stale = _to(meta, DEVICE)
    stale.query_start_loc_cpu = [0] + [999] * len(seqs)
    stale.seq_lens_cpu = [0] * len(seqs)
    stale.query_start_loc.fill_(12345)
    # (the same launch on the same inputs: the same bits on any host)
    assert torch.equal(_run(q, kv_cache, stale, 0.2), want), f"seed {seed}"
    _check(want, q, kv_cache, meta, 0.2, seed)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 2), (4, 4)])
def test_work_list_matches_reference(num_heads, num_kv_heads):
    """A mixed batch as a CUDA graph of a token bucket runs it: padded with a sequence of
    ``pad`` tokens and no context, attended through a work list with unused items, the host
    lists stale. The real rows match the reference, the padding rows are zeros."""
    seed = _seed()
    case = dict(block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32)
    q, kv_cache, meta = _random_case(MIXED + [(70, 90)], **case, dtype=torch.float32, seed=seed)
    T, pad, S = q.shape[0], 13, meta.num_seqs
    g = num_heads // num_kv_heads
    block_m = mixed_block_m(g)
    q_lens = [b - a for a, b in zip(meta.query_start_loc_cpu, meta.query_start_loc_cpu[1:], strict=False)] + [pad]
    size = work_list_size(T + pad, S + 1, g, block_m) + 5
    work = attention_work_list(q_lens, g, block_m, size)
    assert (work[:, 0] == -1).sum() >= 5 and work[:, 0].max() == S  # the padding sequence has items
    padded = _to(meta, DEVICE)
    padded.query_start_loc = torch.tensor(meta.query_start_loc_cpu + [T + pad], dtype=torch.int32, device=DEVICE)
    padded.seq_lens = torch.cat([padded.seq_lens, padded.seq_lens.new_zeros(1)])
    padded.block_tables = torch.cat([padded.block_tables, padded.block_tables.new_zeros(1, padded.block_tables.shape[1])])
    padded.work_list, padded.work_block_m = torch.from_numpy(work).to(DEVICE), block_m
    padded.query_start_loc_cpu, padded.seq_lens_cpu = [0] * (S + 2), [0] * (S + 1)  # stale: never read
    gen = torch.Generator().manual_seed(seed)
    q_padded = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=gen).to(q.device)])
    got = _run(q_padded, kv_cache, padded, 0.2)
    assert torch.equal(got[T:], torch.zeros_like(got[T:])), f"seed {seed}"
    _check(got[:T], q, kv_cache, meta, 0.2, seed)


def test_work_list_layout():
    """Items in sequence order, one per M tile with rows; the size bound holds for any split."""
    work = attention_work_list([1, 40, 3], g=4, block_m=64, size=8)
    assert work.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [-1, 0], [-1, 0], [-1, 0]]
    with pytest.raises(ValueError, match="do not fit"):
        attention_work_list([1, 40, 3], g=4, block_m=64, size=4)
    rng = random.Random(0)
    for _ in range(200):
        q_lens = [rng.randrange(1, 70) for _ in range(rng.randrange(1, 12))]
        g, block_m = rng.choice([(1, 64), (3, 64), (4, 64), (8, 64), (1, 16)])
        attention_work_list(q_lens, g, block_m, work_list_size(sum(q_lens), len(q_lens), g, block_m))


def test_strided_q_from_a_fused_projection():
    """q as a view of a fused [T, (h + 2 kvh) * d] qkv output (row stride > h * d)."""
    seed = _seed()
    q, kv_cache, meta = _random_case(
        [(5, 21), (1, 9), (12, 12)],
        block_size=16, num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float16, seed=seed,
    )  # fmt: skip
    T, h, d = q.shape
    qkv = torch.randn(T, (h + 4) * d, generator=torch.Generator().manual_seed(seed)).to(q.dtype).to(DEVICE)
    qkv[:, : h * d] = q.reshape(T, h * d)
    q_view = qkv[:, : h * d].view(T, h, d)
    assert not q_view.is_contiguous()
    _check(_run(q_view, kv_cache, meta, 0.3), q, kv_cache, meta, 0.3, seed)


# --- GPU: bfloat16, long contexts, head_dim 128, CUDA graphs --------------------------------

GPU_MIXED = [
    (1, 1),
    (1, 4097),  # long decode
    (128, 700),  # chunk over a long cached prefix
    (1, 63),
    (300, 300),  # whole prompt
    (37, 2000),
    (1, 512),
    (64, 64),
    (1, 17),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim", [(32, 8, 128), (9, 3, 64), (8, 8, 128), (28, 4, 128)]
)
def test_gpu_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    seed = _seed()
    case = dict(block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    q, kv_cache, meta = _random_case(GPU_MIXED, **case, head_dim=head_dim, dtype=dtype, seed=seed)
    scale = head_dim**-0.5
    _check(_run(q, kv_cache, meta, scale), q, kv_cache, meta, scale, seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "head_dim, sliding_window, softcap", [(256, 100, 50.0), (256, 1000, None), (96, 2047, None), (96, None, None)]
)
def test_gpu_gemma_and_phi3_shapes_match_reference(head_dim, sliding_window, softcap, dtype):
    """Gemma 2's shape (head_dim 256, 8 / 4 heads) and options, Phi-3-mini's head_dim 96 and
    window: mixed, decode and split decode."""
    seed = _seed()
    options = dict(sliding_window=sliding_window, softcap=softcap)
    case = dict(block_size=16, num_heads=8, num_kv_heads=4, head_dim=head_dim, dtype=dtype, seed=seed)
    q, kv_cache, meta = _random_case(GPU_MIXED, **case)
    _check(_run(q, kv_cache, meta, 0.0625, **options), q, kv_cache, meta, 0.0625, seed, **options)
    decodes = [(1, n) for n in (1, 99, 100, 101, 700, 2000)]
    q, kv_cache, meta = _random_case(decodes, **case)
    for num_splits in (1, 4):
        got = _run(q, kv_cache, meta, 0.0625, num_splits=num_splits, **options)
        _check(got, q, kv_cache, meta, 0.0625, seed, **options)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(32, 8, 128), (9, 3, 64)])
def test_gpu_decode_batch_matches_reference(num_heads, num_kv_heads, head_dim):
    seed = _seed()
    rng = random.Random(seed)
    seqs = [(1, rng.randrange(1, 3000)) for _ in range(64)]
    case = dict(block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q, kv_cache, meta = _random_case(seqs, **case, dtype=torch.bfloat16, seed=seed, pad=3)
    got = _run(q, kv_cache, meta, 0.1)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:])), f"seed {seed}"
    _check(got, q, kv_cache, meta, 0.1, seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads, num_kv_heads", [(32, 8), (28, 4)])
def test_gpu_split_decode_of_a_few_long_contexts_matches_reference(num_heads, num_kv_heads):
    """Few decodes over long contexts: the batch shape alone picks several ranges per context."""
    from pipeserve.kernels.paged_decode import decode_splits

    seed = _seed()
    rng = random.Random(seed)
    seqs = [(1, rng.randrange(3000, 4500)) for _ in range(3)] + [(1, 5)]
    assert decode_splits(len(seqs) + 1, num_kv_heads, torch.device(DEVICE)) > 1
    case = dict(block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128)
    q, kv_cache, meta = _random_case(seqs, **case, dtype=torch.bfloat16, seed=seed, pad=1)
    got = _run(q, kv_cache, meta, 128**-0.5)
    assert torch.equal(got[-1:], torch.zeros_like(got[-1:])), f"seed {seed}"
    _check(got, q, kv_cache, meta, 128**-0.5, seed)


@pytest.mark.gpu
@gpu
def test_gpu_decode_is_cuda_graph_capturable():
    """Capture a decode batch once, then replay it with new contexts written into the same
    device tensors (seq_lens, block_tables, q): each replay matches the reference."""
    seed = _seed()
    rng = random.Random(seed)
    num_seqs, max_blocks, bs = 8, 40, 16
    case = dict(block_size=bs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)

    def fresh():
        seqs = [(1, rng.randrange(1, max_blocks * bs)) for _ in range(num_seqs - 1)]
        q, kv_cache, meta = _random_case(seqs, **case, seed=rng.randrange(2**31), pad=1)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=DEVICE)
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        meta.block_tables = tables
        return q, kv_cache, meta

    q0, cache0, meta0 = fresh()
    static_q, static_meta = q0.clone(), _to(meta0, DEVICE)
    num_blocks = 2 * max_blocks * num_seqs  # more than any fresh() cache has
    static_cache = torch.zeros(2, num_blocks, bs, 8, 128, dtype=torch.bfloat16, device=DEVICE)

    def load(q, kv_cache, meta):
        static_q.copy_(q)
        static_cache.zero_()
        static_cache[:, : kv_cache.shape[1]] = kv_cache
        static_meta.seq_lens.copy_(meta.seq_lens)
        static_meta.block_tables.copy_(meta.block_tables)

    load(q0, cache0, meta0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        paged_attention(static_q, static_cache, static_meta, 0.1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_attention(static_q, static_cache, static_meta, 0.1)
    for _ in range(3):
        q, kv_cache, meta = fresh()
        load(q, kv_cache, meta)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out[-1], torch.zeros_like(static_out[-1])), f"seed {seed}"
        _check(static_out.clone(), q, static_cache, meta, 0.1, seed)


# --- batch invariance (deterministic mode) ----------------------------------------------------


def test_tile_config_is_batch_invariant():
    """Deterministic mode: one tile shape for decodes and prefills and one code path (every
    key tile masked), whatever the GQA group; the default keeps small decode tiles."""
    from pipeserve.kernels.paged_attention import tile_config

    for g in (1, 3, 4, 8):
        configs = {tile_config(g, decode_only=d, batch_invariant=True) for d in (True, False)}
        assert configs == {(64, 0)}
    assert tile_config(1, decode_only=True, batch_invariant=False) == (16, 1)
    assert tile_config(3, decode_only=False, batch_invariant=False) == (64, 1)


def _invariant(q, kv_cache, meta, scale):
    return paged_attention(q, kv_cache, meta, scale, batch_invariant=True)


INVARIANT_DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


# Under the interpreter, queries and keys at other places in their tiles may be summed in
# another order (helpers_kernels.assert_invariant): float16 outputs, within about an ulp.
INVARIANCE_TOL = dict(rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_batch_invariant_rows_ignore_chunk_starts_and_companions(dtype):
    """A 150-token prompt's last 120 queries: as part of one 150-token chunk, as a chunk over
    a 30-token cached prefix, and beside another sequence's chunk and a decode; the prompt's
    decode alone and in a mixed batch. Bit-identical in deterministic mode natively on a GPU
    (where the default mode is not: its unmasked and masked key tiles round differently);
    within rounding under the interpreter."""
    seed = _seed()
    heads = dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    # Sequence 0 of each case is the same prompt (same cache, same queries: same seed).
    whole, cache, meta_whole = _random_case([(150, 150)], dtype=dtype, seed=seed, **heads)
    out_whole = _invariant(whole, cache, meta_whole, 0.125)
    tail = whole[30:]
    meta_tail = make_metadata([(120, 150)], meta_whole.block_tables.cpu().tolist(), 16)
    assert_invariant(_invariant(tail, cache, _to(meta_tail, DEVICE), 0.125), out_whole[30:],
                     f"chunk over a prefix, seed {seed}", **INVARIANCE_TOL)
    # The same 120 queries beside another sequence's chunk and a decode (their K/V: block 0 rows).
    tables = meta_whole.block_tables.cpu().tolist() + [[1, 2], [3]]
    mixed_meta = make_metadata([(120, 150), (17, 20), (1, 9)], tables, 16)
    gen = torch.Generator().manual_seed(seed)
    other = torch.randn(18, *whole.shape[1:], generator=gen).to(dtype=dtype, device=DEVICE)
    mixed = _invariant(torch.cat([tail, other]), _finite(cache), _to(mixed_meta, DEVICE), 0.125)
    assert_invariant(mixed[:120], out_whole[30:], f"beside others, seed {seed}", **INVARIANCE_TOL)
    # The last token as a decode: alone (decode-only batch) and inside the mixed batch above.
    last = make_metadata([(1, 150)], meta_whole.block_tables.cpu().tolist(), 16)
    decoded = _invariant(whole[149:], cache, _to(last, DEVICE), 0.125)
    assert_invariant(decoded, out_whole[149:], f"decode, seed {seed}", **INVARIANCE_TOL)


@pytest.mark.parametrize("dtype", INVARIANT_DTYPES)
def test_batch_invariant_rows_ignore_the_gqa_group(dtype):
    """The same heads with g = 3 query heads per KV head (one GPU) and with one KV copy per
    query head (g = 1, a TP rank whose heads straddle a group): bit-identical natively, within
    rounding under the interpreter."""
    seed = _seed()
    q, cache, meta = _random_case([(100, 130), (1, 77)], num_heads=3, num_kv_heads=1, head_dim=64,
                                  block_size=16, dtype=dtype, seed=seed)
    grouped = _invariant(q, cache, meta, 0.125)
    copies = cache.expand(-1, -1, -1, 3, -1).contiguous()  # [2, blocks, bs, 3, d]
    assert_invariant(_invariant(q, copies, meta, 0.125), grouped, f"seed {seed}", **INVARIANCE_TOL)


def _finite(cache: torch.Tensor) -> torch.Tensor:
    """The cache with its unused (NaN) slots zeroed, for sequences written through them."""
    return torch.nan_to_num(cache)
