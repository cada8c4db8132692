"""GPU kernels (Triton), one per file, each beside its plain-torch reference.

The model calls its five hot operations through a ``KernelOps`` table, so the same module runs
the torch references (CPU, tests, parity with transformers) or the Triton kernels (GPU):

    add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)   # x, residual: [T, H]
    rope(q, k, cos, sin) -> (q, k)               # q: [T, h, d]; k: [T, kvh, d]; cos, sin: [T, d]
    silu_mul(gate_up) -> out                      # gate_up: [T, 2I] -> [T, I]
    write_kv(k, v, kv_cache, slot_mapping) -> None
    paged_attention(q, kv_cache, meta, scale) -> out    # [T, h, d]

``kernel_ops(backend, device)`` picks the table: ``torch``, ``triton``, or ``auto`` (Triton on
CUDA when it imports, torch elsewhere).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True, slots=True)
class KernelOps:
    name: str
    add_rms_norm: Callable
    rope: Callable
    silu_mul: Callable
    write_kv: Callable
    paged_attention: Callable


def torch_ops() -> KernelOps:
    """The plain-torch references (what CPU runs and the transformers parity tests use)."""
    from pipeserve.kernels import reference

    return KernelOps(
        name="torch",
        add_rms_norm=reference.add_rms_norm_reference,
        rope=reference.rope_reference,
        silu_mul=reference.silu_mul_reference,
        write_kv=reference.write_kv,
        paged_attention=reference.paged_attention,
    )


def triton_ops() -> KernelOps:
    """The Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests)."""
    from pipeserve.kernels.kv_cache import write_kv
    from pipeserve.kernels.paged_attention import paged_attention
    from pipeserve.kernels.rms_norm import add_rms_norm
    from pipeserve.kernels.rope import rope
    from pipeserve.kernels.silu_mul import silu_mul

    return KernelOps(
        name="triton",
        add_rms_norm=add_rms_norm,
        rope=rope,
        silu_mul=silu_mul,
        write_kv=write_kv,
        paged_attention=paged_attention,
    )


def kernel_ops(backend: str, device: torch.device) -> KernelOps:
    """The op table for ``backend`` (auto | torch | triton) on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return torch_ops()
    if backend == "auto":
        try:
            return triton_ops()
        except ImportError:  # no triton on this machine
            return torch_ops()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernel_backend=triton needs a CUDA device (or TRITON_INTERPRET=1), got {device}")
    return triton_ops()
