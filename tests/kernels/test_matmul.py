"""matmul (Triton, batch-invariant) against the float64 reference ``matmul_reference``, and
its invariance: natively on a GPU a row's bits do not depend on the batch around it, a
column's not on the width of the weight shard it came from (cuBLAS is not invariant there).
Under the interpreter on CPU the same comparisons hold to rounding only: ``tl.dot`` is
numpy's matmul there, whose BLAS kernel (chosen for the host CPU) may sum a row's products in
another order at another place in the tile (helpers_kernels.assert_invariant).

Fresh random inputs every run (the seed is in every failure message; PIPESERVE_TEST_SEED
replays one), sizes that are and are not multiples of the 64-wide tiles, strided operands
(column slices, as the row-parallel layers pass). Interpreter on CPU (float32, float16);
natively on a GPU in bfloat16 too.
"""

from __future__ import annotations

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
    seed = fresh_seed()
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
    seed = fresh_seed()
    x, w = _operands(33, 65, 200, dtype, seed)
    got = matmul(x, w, torch.float32)
    assert got.dtype == torch.float32
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=f"seed {seed}")


def _rows_in_sub_batches(dtype, seed):
    """(label, rows computed in a sub-batch, the same rows of one batch of 150): sub-batches
    of 1, 5, 64, 67 and 13 rows, each at another offset within its tiles."""
    x, w = _operands(150, 96, 320, dtype, seed)
    whole = matmul(x, w)
    start = 0
    for size in (1, 5, 64, 67, 13):
        yield f"rows {start}+{size}", matmul(x[start : start + size], w), whole[start : start + size]
        start += size


def _columns_in_shards(dtype, seed):
    """(label, a tensor-parallel column shard's product, those columns of the whole product):
    shards of another width N and at another offset."""
    x, w = _operands(40, 150, 256, dtype, seed)
    whole = matmul(x, w)
    for a, b in ((0, 75), (75, 150), (10, 17)):
        yield f"columns {a}:{b}", matmul(x, w[a:b]), whole[:, a:b]


# Under the interpreter a row or column at another place in its tile may be summed in another
# order (helpers_kernels.assert_invariant): float32 accumulation over K <= 320, one rounding.
INVARIANCE_TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
                  torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}  # (bf16 runs natively only: bits there)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_agree_whatever_the_batch(dtype):
    """Rows computed in sub-batches equal the same rows in one batch: bit for bit natively,
    within rounding under the interpreter (the bits there are the host BLAS's)."""
    seed = fresh_seed()
    for label, part, whole in _rows_in_sub_batches(dtype, seed):
        assert_invariant(part, whole, f"{label}, seed {seed}", **INVARIANCE_TOL.get(dtype, {}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_columns_agree_whatever_the_shard(dtype):
    """A column shard of w gives those columns of the whole product (bits natively, rounding
    under the interpreter); a K segment taken as strided views gives exactly the bits of the
    same segment copied out contiguously (the same tiles, loaded the same: on any host)."""
    seed = fresh_seed()
    for label, shard, whole in _columns_in_shards(dtype, seed):
        assert_invariant(shard, whole, f"{label}, seed {seed}", **INVARIANCE_TOL.get(dtype, {}))
    x, w = _operands(40, 150, 256, dtype, seed)
    seg = matmul(x[:, 64:192], w[:, 64:192], torch.float32)
    assert torch.equal(seg, matmul(x[:, 64:192].contiguous(), w[:, 64:192].contiguous(), torch.float32))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(dtype):
    """Natively the kernel fixes every output element's arithmetic (tile shape, walk over K):
    a row's bits do not depend on the batch around it, a column's not on the shard's width."""
    seed = fresh_seed()
    for label, part, whole in [*_rows_in_sub_batches(dtype, seed), *_columns_in_shards(dtype, seed)]:
        assert torch.equal(part, whole), f"{label}, seed {seed}"


def test_empty_and_rejects_bad_inputs():
    w = torch.ones(8, 16, device=DEVICE)
    assert matmul(torch.ones(0, 16, device=DEVICE), w).shape == (0, 8)
    with pytest.raises(AssertionError, match="K differs"):
        matmul(torch.ones(3, 15, device=DEVICE), w)
    with pytest.raises(AssertionError):
        matmul(torch.ones(3, 16, device=DEVICE).half(), w)
    with pytest.raises(AssertionError):
        matmul(torch.ones(2, 3, 16, device=DEVICE), w)


@pytest.mark.gpu
@gpu
def test_cublas_is_not_batch_invariant_but_this_is():
    """The reason this kernel exists, shown on the GPU: F.linear rounds some rows differently
    when the batch around them changes size (recorded, not required: cuBLAS may change); this
    kernel never does."""
    seed = fresh_seed()
    x, w = _operands(512, 4096, 4096, torch.bfloat16, seed)
    rows = slice(0, 3)
    ours_whole, ours_part = matmul(x, w)[rows], matmul(x[rows], w)
    assert torch.equal(ours_whole, ours_part), f"seed {seed}"
    cublas_differs = not torch.equal(torch.nn.functional.linear(x, w)[rows], torch.nn.functional.linear(x[rows], w))
    print(f"cuBLAS rows differ with batch size: {cublas_differs}")
