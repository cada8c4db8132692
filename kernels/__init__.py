"""GPU kernels (Triton), one per file, each beside its plain-torch reference.

The model calls its hot operations through a ``KernelOps`` table, so the same module runs
the torch references (CPU, tests, parity with transformers) or the Triton kernels (GPU):

    add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)   # x, residual: [T, H]
    rope(q, k, cos, sin) -> (q, k)               # q: [T, h, d]; k: [T, kvh, d]; cos, sin: [T, d]
    silu_mul(gate_up) -> out                      # gate_up: [T, 2I] -> [T, I]
    write_kv(k, v, kv_cache, slot_mapping) -> None
    paged_attention(q, kv_cache, meta, scale, *, sliding_window=None, softcap=None) -> out  # [T, h, d]
    moe_experts(x, w13, w2, topk_ids, topk_weights) -> out  # routed SwiGLU experts: [T, H] -> [T, H]
    fp8_linear(x, w, w_scale, bias) -> y          # FP8 weight [N, K] with a scale per row: [M, K] -> [M, N]
    matmul(x, w, out_dtype) -> x @ w.T, or None     # None: the layers' F.linear (cuBLAS)
    race_max(logits, inv_temperature, seeds, vocab_start) -> (values, ids), or None  # sampling's race: [N, V] -> [N], [N]

``kernel_ops(backend, device)`` picks the table: ``torch``, ``triton``, or ``auto`` (Triton on
CUDA when it imports, torch elsewhere). ``batch_invariant=True`` gives the deterministic table:
Triton kernels whose per-token results do not depend on the micro-batch (the batch-invariant
matmul, fixed norm tiles, one attention tile shape for decodes and prefills).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

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
    moe_experts: Callable
    fp8_linear: Callable
    matmul: Callable | None = None
    race_max: Callable | None = None
    """Temperature sampling's race over a vocab shard (``kernels/race.py``); None: the sampler's
    own race serves every row (the CPU's, where a Philox per token would cost more)."""


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
        moe_experts=reference.moe_experts_reference,
        fp8_linear=reference.fp8_linear_reference,
    )


def compile_cache_dir() -> str:
    """Where Triton keeps compiled kernels: ``TRITON_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/pipeserve/triton`` (``~/.cache/pipeserve/triton``), set here for this
    process and the workers it starts. Every kernel shape the configured budgets can need is
    compiled at start-up (CUDA-graph capture); a restart loads them from this folder instead."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(base, "pipeserve", "triton")
    return os.environ["TRITON_CACHE_DIR"]


def triton_ops() -> KernelOps:
    """The Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests)."""
    compile_cache_dir()  # (before the first compile)
    from pipeserve.kernels.fp8 import fp8_linear
    from pipeserve.kernels.kv_cache import write_kv
    from pipeserve.kernels.moe import moe_experts
    from pipeserve.kernels.paged_attention import paged_attention
    from pipeserve.kernels.race import race_max
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
        moe_experts=moe_experts,
        fp8_linear=fp8_linear,
        race_max=race_max,
    )


def batch_invariant_ops() -> KernelOps:
    """The Triton kernels configured so that no token's result depends on its micro-batch."""
    from pipeserve.kernels.matmul import matmul

    ops = triton_ops()
    return replace(
        ops,
        name="triton-batch-invariant",
        add_rms_norm=functools.partial(ops.add_rms_norm, batch_invariant=True),
        paged_attention=functools.partial(ops.paged_attention, batch_invariant=True),
        matmul=matmul,
    )


def kernel_ops(backend: str, device: torch.device, *, batch_invariant: bool = False,
               split_decode: bool = True) -> KernelOps:
    """The op table for ``backend`` (auto | torch | triton) on ``device``; ``batch_invariant``
    (deterministic serving) needs the Triton kernels; ``split_decode=False`` keeps small decode
    batches to one attention program per sequence and KV head (no split-KV)."""
    ops = _kernel_ops(backend, device, batch_invariant=batch_invariant)
    if split_decode or ops.name != "triton":
        return ops
    unsplit = functools.partial(ops.paged_attention, num_splits=1)
    return replace(ops, name="triton-unsplit-decode", paged_attention=unsplit)


def _kernel_ops(backend: str, device: torch.device, *, batch_invariant: bool) -> KernelOps:
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    if batch_invariant:
        if backend == "torch":
            raise ValueError("deterministic mode needs kernel_backend auto or triton, not torch")
        _require_triton_device(device, "deterministic mode")
        try:
            return batch_invariant_ops()
        except ImportError as e:
            raise ValueError(f"deterministic mode needs Triton, which does not import here: {e}") from None
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return torch_ops()
    if backend == "auto":
        try:
            return triton_ops()
        except ImportError:  # no triton on this machine
            return torch_ops()
    _require_triton_device(device, "kernel_backend=triton")
    return triton_ops()


def _require_triton_device(device: torch.device, what: str) -> None:
    """Triton runs on CUDA; on a CPU device only through its interpreter (tests)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what} needs a CUDA device (or TRITON_INTERPRET=1), got {device}")
