"""SwiGLU's activation: silu(gate) * up for gate_up = [gate | up], [T, 2I] -> [T, I].

Torch reference: ``pipeserve.kernels.reference.silu_mul_reference``. Rounds where it does:
silu in float32, rounded to the activation dtype (as ``F.silu`` does), then times ``up``,
rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program covers up to _BLOCK_I columns of up to _TILE // block_i rows.
_BLOCK_I = 1024
_TILE = 4096


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    T,
    I,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    mask = (rows[:, None] < T) & (cols[None, :] < I)  # [BLOCK_T, BLOCK_I]
    rows = rows.to(tl.int64)[:, None]  # int64: T * 2I may pass 2**31
    cols = cols[None, :]
    gate_ptr = gate_up_ptr + rows * stride_in + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0)
    up = tl.load(gate_ptr + I, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * stride_out + cols, out, mask=mask)


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] -> [T, I]; ``out`` (rows may be strided)
    receives it when given, else it is allocated."""
    # gate_up: [T, 2I]; out: [T, I]
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, tuple(gate_up.shape)
    assert gate_up.stride(1) == 1, f"gate_up rows must be contiguous, strides {gate_up.stride()}"
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (T, I) and out.stride(1) == 1, f"out {tuple(out.shape)} {out.stride()}"
    assert out.dtype == gate_up.dtype and out.device == gate_up.device
    if T == 0 or I == 0:
        return out
    block_i = min(_BLOCK_I, triton.next_power_of_2(I))
    block_t = min(_TILE // block_i, triton.next_power_of_2(T))
    grid = (triton.cdiv(T, block_t), triton.cdiv(I, block_i))
    _silu_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        T,
        I,
        BLOCK_T=block_t,
        BLOCK_I=block_i,
        num_warps=4,
    )
    return out
