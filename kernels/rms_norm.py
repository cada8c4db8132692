"""Fused residual add + RMSNorm over token rows (a program normalizes one or more rows).

Torch reference: ``pipeserve.kernels.reference.add_rms_norm_reference``. Rounds where it does
(HF Llama's order): ``x + residual`` in the activation dtype, the norm in float32, the normed row cast to the activation dtype, then
times the weight, rounded again. Only the sum of squares accumulates in another order, so
results agree to an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One program holds whole rows in registers; past this, a row would spill.
MAX_HIDDEN_SIZE = 65536
# Rows of a small hidden size share a program, up to about this many elements.
_TILE = 4096


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    T,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = (rows[:, None] < T) & (cols[None, :] < H)  # [BLOCK_T, BLOCK_H]
    rows = rows.to(tl.int64)[:, None]  # int64: T * stride may pass 2**31
    cols = cols[None, :]
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_residual + cols, mask=mask, other=0.0)
        # The sum rounded to the activation dtype, as the reference's `x + residual`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=1) / H  # [BLOCK_T]; masked lanes are 0
    normed = (xf * tl.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=cols < H, other=0.0)  # [1, BLOCK_H]
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * stride_out + cols, out, mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); with no residual, (norm(x) * weight, x)
    with x itself returned, as the reference does.

    Inputs are not modified. ``out`` / ``residual_out`` ([T, H], rows may be strided) receive
    the results when given, else they are allocated. ``batch_invariant`` keeps the tile (and so
    each row's reduction order) the same for every T; by default small batches get a smaller
    tile, which may round a row's sum of squares differently.
    """
    # x, residual, out, residual_out: [T, H]; weight: [H]
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with unit stride, {x.stride()}"
    T, H = x.shape
    assert H <= MAX_HIDDEN_SIZE, f"hidden size {H} > {MAX_HIDDEN_SIZE}"
    assert weight.shape == (H,) and weight.is_contiguous(), weight.shape
    assert weight.dtype == x.dtype, f"weight {weight.dtype} vs activations {x.dtype}"
    assert weight.device == x.device
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    _check_like(out, x, "out")
    if residual is None:
        new_residual = x
    else:
        _check_like(residual, x, "residual")
        new_residual = residual_out
        if new_residual is None:
            new_residual = torch.empty((T, H), dtype=x.dtype, device=x.device)
        _check_like(new_residual, x, "residual_out")
    if T == 0:
        return out, new_residual
    residual_in = x if residual is None else residual  # unread without a residual
    block_t, block_h, num_warps = row_tile(T, H, batch_invariant=batch_invariant)
    _add_rms_norm_kernel[(triton.cdiv(T, block_t),)](
        x,
        residual_in,
        weight,
        out,
        new_residual,  # unwritten without a residual: it is x
        x.stride(0),
        residual_in.stride(0),
        out.stride(0),
        new_residual.stride(0),
        T,
        H,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return out, new_residual


def row_tile(T: int, H: int, *, batch_invariant: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, num_warps). A row's sum of squares is reduced in an order set by the
    tile, so ``batch_invariant`` keeps one tile for every T; by default a small batch gets a
    smaller tile."""
    block_h = triton.next_power_of_2(H)
    block_t = max(_TILE // block_h, 1)
    if not batch_invariant:
        block_t = min(block_t, triton.next_power_of_2(T))
    return block_t, block_h, min(max(block_t * block_h // 512, 1), 16)


def _check_like(t: torch.Tensor, x: torch.Tensor, name: str) -> None:
    assert t.shape == x.shape, f"{name} {tuple(t.shape)} vs x {tuple(x.shape)}"
    assert t.dtype == x.dtype and t.device == x.device, f"{name}: {t.dtype} on {t.device}"
    assert t.stride(1) == 1, f"{name} rows must be contiguous, strides {t.stride()}"
