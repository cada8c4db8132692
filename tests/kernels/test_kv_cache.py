"""write_kv (Triton) against the torch reference ``pipeserve.kernels.reference.write_kv``.

Fresh random inputs every run (the seed is in every failure message). The cache starts as
garbage with NaNs, the same in both; after the write the whole cache must equal the
reference's bit for bit (a copy and a cast round the same way), so a missed slot, a write to
the wrong slot or to a padding row's slot (-1, skipped) shows. K and V arrive as strided views
of a fused qkv projection, as the model passes them. Runs under the Triton interpreter on CPU
(float32, float16) and natively on GPU (the ``gpu`` tests, bfloat16).
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, fresh_seed, gpu, interpreter_array_warning, runs_triton  # noqa: E402

from pipeserve.kernels.kv_cache import write_kv  # noqa: E402
from pipeserve.kernels.reference import write_kv as write_kv_reference  # noqa: E402

pytestmark = [runs_triton, interpreter_array_warning]


def _case(T, num_heads, num_kv_heads, head_dim, num_blocks, block_size, dtype, seed, num_pad):
    """k, v [T, kvh, d] as views of a fused qkv output; a garbage cache; distinct random slots
    with ``num_pad`` of them -1 (padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(T, q_size + 2 * kv_size, generator=gen).to(DEVICE, dtype)
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    k = k.view(T, num_kv_heads, head_dim)  # [T, kvh, d], row stride (h + 2 kvh) * d
    v = v.view(T, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache[cache > 1.5] = float("nan")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:num_pad]] = -1
    return k, v, cache.to(DEVICE, dtype), slots.to(DEVICE)


def _check(k, v, cache, slots, seed):
    want = cache.clone()
    keep = slots >= 0
    write_kv_reference(k[keep], v[keep], want, slots[keep].long())  # index_copy_: int64
    write_kv(k, v, cache, slots)
    # equal_nan: the untouched garbage slots keep their NaNs in both.
    torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 32), (4, 1, 16)]
)
def test_write_kv_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    seed = fresh_seed()
    k, v, cache, slots = _case(
        23, num_heads, num_kv_heads, head_dim, 6, block_size, dtype, seed, num_pad=4
    )
    _check(k, v, cache, slots, seed)


def test_write_kv_casts_and_takes_int32_slots():
    """float32 K/V into a float16 cache, int32 slots, contiguous K/V."""
    seed = fresh_seed()
    k, v, cache, slots = _case(9, 2, 2, 32, 4, 16, torch.float16, seed, num_pad=1)
    gen = torch.Generator().manual_seed(seed)
    k32 = torch.randn(k.shape, generator=gen).to(DEVICE)
    v32 = torch.randn(v.shape, generator=gen).to(DEVICE)
    _check(k32, v32, cache, slots.to(torch.int32), seed)


def test_write_kv_all_padding_writes_nothing():
    seed = fresh_seed()
    k, v, cache, slots = _case(5, 2, 2, 16, 2, 16, torch.float32, seed, num_pad=5)
    before = cache.clone()
    write_kv(k, v, cache, slots)
    torch.testing.assert_close(cache, before, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(32, 8, 128, 16), (9, 3, 64, 32), (28, 4, 128, 32), (8, 8, 128, 16)],
)
def test_gpu_write_kv_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    seed = fresh_seed()
    k, v, cache, slots = _case(
        3000, num_heads, num_kv_heads, head_dim, 400, block_size, dtype, seed, num_pad=100
    )
    _check(k, v, cache, slots, seed)
