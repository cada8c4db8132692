"""What the Triton kernel tests share: where they can run, the half-precision check of a
kernel that rounds where its torch reference does, and the invariance check (bits natively,
rounding under the interpreter)."""

from __future__ import annotations

import os
import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NATIVE = DEVICE == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
"""The kernels are compiled for the device (else they run in the interpreter)."""

# On CPU the kernels run only under the interpreter (tests/conftest.py sets it without a GPU).
runs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Triton 3.6's interpreter turns 1-element arrays into loop bounds the deprecated way.
interpreter_array_warning = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def fresh_seed() -> int:
    """A new seed every run, for tests that put it in their failure messages; set
    PIPESERVE_TEST_SEED to that number to replay a failure."""
    return int(os.environ.get("PIPESERVE_TEST_SEED") or random.randrange(2**31))


def assert_invariant(got, want, msg: str, *, rtol: float, atol: float) -> None:
    """Two computations a kernel makes bit-identical natively (one output element's arithmetic
    fixed whatever the batch, shard or schedule around it): the same bits on a GPU; within
    ``rtol``/``atol`` under the interpreter. There ``tl.dot`` is numpy's matmul, and the BLAS
    kernel numpy picks for the host CPU may sum a tile's products in an order that depends on
    the row's or column's place in the tile, so the bits there are the host's, not the kernel's."""
    if NATIVE:
        assert torch.equal(got, want), msg
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=msg)


def assert_close_rounding(got, want, seed, *, fp32_atol: float, min_exact: float = 0.95) -> None:
    """float32: within ``fp32_atol``. Half precision: within two ulps, and mostly bit-equal
    (the rounding points are the reference's; only an accumulation order may differ)."""
    msg = f"seed {seed}"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=fp32_atol, msg=msg)
        return
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * ulp, atol=1e-5, msg=msg)
    exact = (got == want).float().mean().item()
    assert exact >= min_exact, f"only {exact:.3f} of elements match exactly, {msg}"


def captured_graph(warm_up, capture):
    """``warm_up()`` on a side stream (compiling outside the capture), then ``capture()`` captured
    in a CUDA graph on it: (the graph, what ``capture`` returned: the outputs each replay refills)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = capture()
    return graph, outs
