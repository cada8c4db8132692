"""matmul (Triton, batch-invariant) against the float64 reference ``matmul_reference``, and
its invariance: a row's bits do not depend on the batch around it, a column's not on the
width of the weight shard it came from.

Fresh random inputs every run (the seed is in every failure message), sizes that are and are
not multiples of the 64-wide tiles, strided operands (column slices, as the row-parallel
layers pass). Interpreter on CPU (float32, float16); natively on a GPU in bfloat16 too, where
invariance is the point (cuBLAS is not invariant there).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, gpu, interpreter_array_warning, runs_triton  # noqa: E402

from pipeserve.kernels.matmul import matmul  # noqa: E402
from pipeserve.kernels.reference import matmul_reference  # noqa: E402

pytestmark = [runs_triton, interpreter_array_warning]

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _operands(M, N, K, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype=dtype, device=DEVICE)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (37, 100, 130), (70, 130, 576)])
def test_matches_reference(dtype, M, N, K):
    seed = random.randrange(2**31)
    x, w = _operands(M, N, K, dtype, seed)
    got = matmul(x, w)
    want = matmul_reference(x, w)
    assert got.shape == (M, N) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    else:  # float32 accumulation, one rounding: within one ulp of the exact result
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=ulp, atol=1e-3, msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if DEVICE == "cuda" else torch.float16])
def test_float32_output(dtype):
    seed = random.randrange(2**31)
    x, w = _operands(33, 65, 200, dtype, seed)
    got = matmul(x, w, torch.float32)
    assert got.dtype == torch.float32
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_batch(dtype):
    """Every row computed in sub-batches of other sizes (1, 5, 64, 67 rows, each at another
    offset within its tiles) is bit-identical to the same row in one batch of 150."""
    seed = random.randrange(2**31)
    x, w = _operands(150, 96, 320, dtype, seed)
    whole = matmul(x, w)
    start = 0
    for size in (1, 5, 64, 67, 13):
        part = matmul(x[start : start + size], w)
        assert torch.equal(part, whole[start : start + size]), f"rows {start}+{size}, seed {seed}"
        start += size


@pytest.mark.parametrize("dtype", DTYPES)
def test_columns_do_not_depend_on_the_shard(dtype):
    """A tensor-parallel column shard of w (another N, another offset) gives the same bits as
    those columns of the whole product; so do column slices of x and w (a K segment)."""
    seed = random.randrange(2**31)
    x, w = _operands(40, 150, 256, dtype, seed)
    whole = matmul(x, w)
    for a, b in ((0, 75), (75, 150), (10, 17)):
        assert torch.equal(matmul(x, w[a:b]), whole[:, a:b]), f"columns {a}:{b}, seed {seed}"
    # A K segment taken as strided views equals the same segment copied out contiguously.
    seg = matmul(x[:, 64:192], w[:, 64:192], torch.float32)
    assert torch.equal(seg, matmul(x[:, 64:192].contiguous(), w[:, 64:192].contiguous(), torch.float32))


def test_empty_and_rejects_bad_inputs():
    w = torch.randn(8, 16, device=DEVICE)
    assert matmul(torch.randn(0, 16, device=DEVICE), w).shape == (0, 8)
    with pytest.raises(AssertionError, match="K differs"):
        matmul(torch.randn(3, 15, device=DEVICE), w)
    with pytest.raises(AssertionError):
        matmul(torch.randn(3, 16, device=DEVICE).half(), w)
    with pytest.raises(AssertionError):
        matmul(torch.randn(2, 3, 16, device=DEVICE), w)


@pytest.mark.gpu
@gpu
def test_cublas_is_not_batch_invariant_but_this_is():
    """The reason this kernel exists, shown on the GPU: F.linear rounds some rows differently
    when the batch around them changes size (recorded, not required: cuBLAS may change); this
    kernel never does."""
    seed = random.randrange(2**31)
    x, w = _operands(512, 4096, 4096, torch.bfloat16, seed)
    rows = slice(0, 3)
    ours_whole, ours_part = matmul(x, w)[rows], matmul(x[rows], w)
    assert torch.equal(ours_whole, ours_part), f"seed {seed}"
    cublas_differs = not torch.equal(torch.nn.functional.linear(x, w)[rows], torch.nn.functional.linear(x[rows], w))
    print(f"cuBLAS rows differ with batch size: {cublas_differs}")
