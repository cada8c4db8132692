"""add_rms_norm (Triton) against the torch reference ``add_rms_norm_reference``.

Fresh random inputs every run (the seed is in every failure message). Outputs land in views
of NaN-filled buffers, so an element the kernel skips, or a write past a row, shows. The
new residual must equal the reference's bit for bit (same rounding); the normed rows must
agree to an ulp, and almost all exactly in half precision. Runs under the Triton
interpreter on CPU (float32, float16; the interpreter mishandles bfloat16) and natively on
GPU (the ``gpu`` tests, bfloat16).
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, assert_close_rounding, fresh_seed, gpu, runs_triton  # noqa: E402

from pipeserve.kernels.rms_norm import add_rms_norm  # noqa: E402
from pipeserve.kernels.reference import add_rms_norm_reference  # noqa: E402

pytestmark = runs_triton

EPS = 1e-6
HIDDEN_SIZES = [576, 1000, 4096]  # SmolLM2, a non-power-of-two, Llama


def _inputs(T, H, dtype, seed, device=DEVICE):
    """x, residual [T, H] (as strided views of wider rows), weight [H]. Row 0 of x + residual
    is zero (the eps path); row 1 is large, so its squares overflow float16 unless the
    norm runs in float32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H + 7, generator=gen)[:, :H] * 2  # [T, H], row stride H + 7
    residual = torch.randn(T, H, generator=gen)
    weight = 1 + 0.2 * torch.randn(H, generator=gen)
    x[0], residual[0] = 0.0, 0.0
    if T > 1:
        x[1] *= 100
    cast = {"dtype": dtype, "device": device}
    return x.to(**cast), residual.to(**cast), weight.to(**cast)


def _poisoned(T, H, dtype, device=DEVICE):
    """A [T, H] view of a NaN-filled [T, H + 5] buffer, and the buffer."""
    buf = torch.full((T, H + 5), float("nan"), dtype=dtype, device=device)
    return buf[:, :H], buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H", HIDDEN_SIZES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_reference_into_poisoned_outputs(dtype, H, with_residual):
    seed = fresh_seed()
    T = 3
    x, residual, weight = _inputs(T, H, dtype, seed)
    residual = residual if with_residual else None
    x_before = x.clone()
    residual_before = None if residual is None else residual.clone()
    out, out_buf = _poisoned(T, H, dtype)
    residual_out, residual_buf = _poisoned(T, H, dtype)

    got, got_residual = add_rms_norm(x, residual, weight, EPS, out=out, residual_out=residual_out)
    want, want_residual = add_rms_norm_reference(x_before, residual_before, weight, EPS)

    assert got is out
    assert_close_rounding(got, want, seed, fp32_atol=1e-5)
    assert out_buf[:, H:].isnan().all(), "wrote past the end of a row"
    assert torch.equal(got_residual, want_residual), f"seed {seed}"
    if with_residual:
        assert got_residual is residual_out and residual_buf[:, H:].isnan().all()
        assert torch.equal(residual, residual_before), "residual was modified"
    else:
        assert got_residual is x, "without a residual, x itself is the new residual"
        assert residual_buf.isnan().all(), "residual_out written without a residual"
    assert torch.equal(x, x_before), "x was modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_allocates_outputs(dtype):
    seed = fresh_seed()
    x, residual, weight = _inputs(5, 1000, dtype, seed)
    got, got_residual = add_rms_norm(x, residual, weight, EPS)
    want, want_residual = add_rms_norm_reference(x, residual, weight, EPS)
    for t in (got, got_residual):
        assert t.shape == (5, 1000) and t.dtype == dtype and t.is_contiguous()
    assert_close_rounding(got, want, seed, fp32_atol=1e-5)
    assert torch.equal(got_residual, want_residual), f"seed {seed}"


def test_empty_batch():
    x, residual, weight = _inputs(1, 64, torch.float32, 0)
    got, got_residual = add_rms_norm(x[:0], residual[:0], weight, EPS)
    assert got.shape == got_residual.shape == (0, 64)


def test_rejects_mismatched_inputs():
    x, residual, weight = _inputs(2, 64, torch.float32, 0)
    with pytest.raises(AssertionError, match="weight"):
        add_rms_norm(x, residual, weight.half(), EPS)
    with pytest.raises(AssertionError, match="residual"):
        add_rms_norm(x, residual[:, :32], weight, EPS)
    with pytest.raises(AssertionError, match="stride"):
        add_rms_norm(x.t().contiguous().t(), residual, weight, EPS)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H", [*HIDDEN_SIZES, 8192])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gpu_bfloat16_matches_reference(H, with_residual):
    seed = fresh_seed()
    T = 257
    x, residual, weight = _inputs(T, H, torch.bfloat16, seed, device="cuda")
    residual = residual if with_residual else None
    out, out_buf = _poisoned(T, H, torch.bfloat16, device="cuda")
    got, got_residual = add_rms_norm(x, residual, weight, EPS, out=out)
    want, want_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert_close_rounding(got, want, seed, fp32_atol=1e-5)
    assert out_buf[:, H:].isnan().all()
    assert torch.equal(got_residual, want_residual), f"seed {seed}"


def test_row_tile_is_batch_invariant():
    """Deterministic mode: one tile (and so one reduction order per row) for every T."""
    from pipeserve.kernels.rms_norm import row_tile

    for H in (64, 576, 4096, 8192):
        assert len({row_tile(T, H, batch_invariant=True) for T in (1, 2, 7, 64, 1000)}) == 1
    assert row_tile(1, 64, batch_invariant=False) != row_tile(1000, 64, batch_invariant=False)
