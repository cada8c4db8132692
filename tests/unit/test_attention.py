"""paged_attention / write_kv against the naive float64 reference on random paged caches."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers_model

from helpers_model import MIXED_BATCH, make_metadata  # noqa: E402

from pipeserve.kernels.reference import attention_reference, paged_attention, write_kv  # noqa: E402

NUM_BLOCKS = 48
HEAD_DIM = 16


def _random_case(
    seqs, *, block_size, num_heads, num_kv_heads, seed, dtype=torch.float64, device="cpu"
):
    """A random cache, shuffled non-contiguous block tables, queries for (q_len, seq_len) seqs."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-seq_len // block_size))] for _, seq_len in seqs]
    meta = make_metadata(seqs, tables, block_size, device)
    kv_cache = torch.randn(
        2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=gen, dtype=dtype
    )
    T = sum(q_len for q_len, _ in seqs)
    q = torch.randn(T, num_heads, HEAD_DIM, generator=gen, dtype=dtype)
    return q.to(device), kv_cache.to(device), meta


MIXED = MIXED_BATCH


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (6, 1), (4, 4)])
def test_mixed_batch_matches_reference(block_size, num_heads, num_kv_heads):
    q, kv_cache, meta = _random_case(
        MIXED,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seed=block_size + num_heads,
    )
    scale = HEAD_DIM**-0.5
    got = paged_attention(q, kv_cache, meta, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(
        got, attention_reference(q, kv_cache, meta, scale), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 5), (1, 40), (1, 17)],  # decode only, adjacent
        [(30, 30)],  # one whole prompt
        [(4, 20), (1, 9), (1, 3), (7, 7), (1, 60)],  # decodes scattered between prefills
    ],
    ids=["decodes", "prompt", "scattered"],
)
def test_batch_shapes_match_reference(seqs):
    q, kv_cache, meta = _random_case(
        seqs, block_size=16, num_heads=4, num_kv_heads=2, seed=len(seqs)
    )
    torch.testing.assert_close(
        paged_attention(q, kv_cache, meta, 0.3),
        attention_reference(q, kv_cache, meta, 0.3),
        rtol=0,
        atol=1e-10,
    )


def test_batch_order_does_not_matter():
    """Each sequence's output depends only on its own context, not on its batch neighbours."""
    q, kv_cache, meta = _random_case(MIXED, block_size=16, num_heads=4, num_kv_heads=2, seed=7)
    packed = paged_attention(q, kv_cache, meta, 0.25)
    starts = meta.query_start_loc_cpu
    for i, seq in enumerate(MIXED):
        one = make_metadata([seq], [meta.block_tables[i].tolist()], 16)
        alone = paged_attention(q[starts[i] : starts[i + 1]], kv_cache, one, 0.25)
        torch.testing.assert_close(packed[starts[i] : starts[i + 1]], alone, rtol=0, atol=1e-12)


def test_float32_and_bfloat16_stay_close_to_reference():
    q, kv_cache, meta = _random_case(MIXED, block_size=16, num_heads=4, num_kv_heads=2, seed=3)
    want = attention_reference(q, kv_cache, meta, 0.25)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        got = paged_attention(q.to(dtype), kv_cache.to(dtype), meta, 0.25)
        assert got.dtype == dtype
        assert (got.double() - want).abs().max().item() < atol


def test_write_kv_stores_rows_at_their_slots():
    block_size, kvh = 16, 2
    kv_cache = torch.zeros(2, 8, block_size, kvh, HEAD_DIM)
    slots = torch.tensor([5 * 16 + 3, 0, 7 * 16 + 15, 2 * 16 + 8])
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, kvh, HEAD_DIM, generator=gen), torch.randn(4, kvh, HEAD_DIM, generator=gen)
    write_kv(k, v, kv_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, block, offset], k[i])
        assert torch.equal(kv_cache[1, block, offset], v[i])
    assert kv_cache.abs().sum(dim=(-1, -2)).count_nonzero() == 2 * len(slots)


def test_written_then_attended_equals_dense_causal_attention():
    """End to end on one prompt written through write_kv: matches plain dense causal softmax
    attention (GQA heads expanded), an independent formulation from the reference."""
    T, h, kvh, bs = 37, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(T, n, HEAD_DIM, generator=gen, dtype=torch.float64) for n in (h, kvh, kvh)
    )
    kv_cache = torch.zeros(2, 8, bs, kvh, HEAD_DIM, dtype=torch.float64)
    meta = make_metadata([(T, T)], [[6, 1, 4]], bs)
    write_kv(k, v, kv_cache, meta.slot_mapping)
    got = paged_attention(q, kv_cache, meta, 0.25)
    kx, vx = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)  # [T, h, d]
    scores = torch.einsum("qhd,khd->hqk", q, kx) * 0.25
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vx)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_mixed_batch_matches_reference(dtype, atol):
    seqs = MIXED + [(1, 300), (64, 200)]
    q, kv_cache, meta = _random_case(
        seqs, block_size=16, num_heads=8, num_kv_heads=2, seed=11, device="cuda"
    )
    want = attention_reference(q, kv_cache, meta, 0.25)
    got = paged_attention(q.to(dtype), kv_cache.to(dtype), meta, 0.25)
    assert (got.double().cpu() - want).abs().max().item() < atol
