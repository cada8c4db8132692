"""silu_mul (Triton) against the torch reference ``silu_mul_reference``.

Fresh random inputs every run (the seed is in every failure message), gate values out to
+-90 (exp overflow in float32, saturation in half precision), widths that are and are not
multiples of the kernel's block, gate_up with padded rows, outputs into views of NaN-filled
buffers. Interpreter on CPU (float32, float16); GPU in bfloat16.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, assert_close_rounding, fresh_seed, gpu, runs_triton  # noqa: E402

from pipeserve.kernels.silu_mul import silu_mul  # noqa: E402
from pipeserve.kernels.reference import silu_mul_reference  # noqa: E402

pytestmark = [
    runs_triton,
    # exp(90) overflows to inf, as intended (silu -> -0); numpy, under the interpreter, warns.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

WIDTHS = [1, 1000, 1536, 2816]  # I: tiny, non-power-of-two, 1.5 blocks, TinyLlama-ish


def _gate_up(T, I, dtype, seed, device=DEVICE):
    """gate_up [T, 2I] as a view of rows padded by 3; row 0's gates span [-90, 90]."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(T, 2 * I + 3, generator=gen) * 3
    buf[0, :I] = torch.linspace(-90, 90, I)
    return buf.to(dtype=dtype, device=device)[:, : 2 * I]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("I", WIDTHS)
def test_matches_reference_into_poisoned_output(dtype, I):
    seed = fresh_seed()
    T = 3
    gate_up = _gate_up(T, I, dtype, seed)
    before = gate_up.clone()
    out_buf = torch.full((T, I + 5), float("nan"), dtype=dtype, device=DEVICE)

    got = silu_mul(gate_up, out=out_buf[:, :I])

    assert_close_rounding(got, silu_mul_reference(before), seed, fp32_atol=1e-6)
    assert got.data_ptr() == out_buf.data_ptr()
    assert out_buf[:, I:].isnan().all(), "wrote past the end of a row"
    assert torch.equal(gate_up, before), "gate_up was modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_allocates_output(dtype):
    seed = fresh_seed()
    gate_up = _gate_up(4, 1000, dtype, seed)
    got = silu_mul(gate_up)
    assert got.shape == (4, 1000) and got.dtype == dtype and got.is_contiguous()
    assert_close_rounding(got, silu_mul_reference(gate_up), seed, fp32_atol=1e-6)


def test_empty_batch():
    assert silu_mul(torch.ones(0, 64, device=DEVICE)).shape == (0, 32)


def test_rejects_bad_inputs():
    with pytest.raises(AssertionError):
        silu_mul(torch.ones(3, 7, device=DEVICE))  # odd width
    with pytest.raises(AssertionError, match="contiguous"):
        silu_mul(torch.ones(8, 3, device=DEVICE).t())
    with pytest.raises(AssertionError):
        silu_mul(torch.ones(3, 8, device=DEVICE), out=torch.empty(3, 4, device=DEVICE).half())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("I", [*WIDTHS, 14336])
def test_gpu_bfloat16_matches_reference(I):
    seed = fresh_seed()
    T = 257
    gate_up = _gate_up(T, I, torch.bfloat16, seed, device="cuda")
    out_buf = torch.full((T, I + 5), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = silu_mul(gate_up, out=out_buf[:, :I])
    assert_close_rounding(got, silu_mul_reference(gate_up), seed, fp32_atol=1e-6)
    assert out_buf[:, I:].isnan().all()
