"""Deterministic serving (``engine.deterministic``): one process, a TP group and a pipeline
give the same bits for every token natively (GPUs: bf16, NCCL), where the batch-invariant
kernels fix each output element's arithmetic whatever the layout and batch.

The pure pieces (the reduction tree, the segments each TP rank holds, what is refused) are
tested first. Then whole runs under real torchrun: on CPU (gloo, the Triton kernels in the
interpreter, float16) the layouts agree to rounding only, since the interpreter's ``tl.dot``
is the host BLAS's matmul, which may sum a row at another place in its tile in another order
(tests/helpers_kernels.py); on two or more GPUs (marked) the tokens and top-k
log-probabilities must be equal bit for bit. ``python -m tools.agreement --deterministic``
is the same check on a real model.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers_model import write_tiny_model

from pipeserve import LLM, SamplingParams
from pipeserve.parallel.tp_layers import (
    check_reduction_layout,
    check_reduction_splits,
    reduction_segments,
    tree_sum,
)
from pipeserve.runtime.config import EngineConfig, ParallelConfig

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.timeout(600),
]
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU runs of the Triton kernels need the interpreter")


def test_tree_sum_order():
    """((a + b) + c) + (d + e) for five parts: the first ceil(n/2), then the rest."""
    a, b, c, d, e = (torch.tensor([v], dtype=torch.float16) for v in (1e4, -1e4, 3.0, 0.5, 0.25))
    assert tree_sum([a, b, c, d, e]).item() == ((a + b) + c + (d + e)).item()
    assert tree_sum([a]) is a
    # Halves of 8 parts are the ranks' subtrees at tp = 2 and 4: the same sum either way.
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, generator=gen) * 10**i for i in range(8)]
    assert torch.equal(tree_sum(parts), tree_sum([tree_sum(parts[:4]), tree_sum(parts[4:])]))
    quarters = [tree_sum(parts[i : i + 2]) for i in range(0, 8, 2)]
    assert torch.equal(tree_sum(parts), tree_sum(quarters))


def test_reduction_segments():
    # SmolLM2's o_proj: 9 heads of 64 over 2 segments; tp=2 ranks hold heads [0, 5) and [5, 9).
    assert reduction_segments(9, 64, 2, 1, 0, (0, 576)) == [(0, 320), (320, 576)]
    assert reduction_segments(9, 64, 2, 2, 0, (0, 320)) == [(0, 320)]
    assert reduction_segments(9, 64, 2, 2, 1, (320, 576)) == [(0, 256)]
    # down_proj 1536 over 4 segments at tp=2: two per rank, local offsets.
    assert reduction_segments(1536, 1, 4, 2, 1, (768, 1536)) == [(0, 384), (384, 768)]
    with pytest.raises(ValueError, match="not its"):  # 10 units: 4 segments 3,3,2,2 vs tp 5,5
        reduction_segments(10, 1, 4, 2, 0, (0, 5))
    with pytest.raises(ValueError, match="cannot cut"):
        reduction_segments(3, 64, 4, 1, 0, (0, 192))


def test_reduction_layout_checked_before_workers_start():
    """14 heads (Qwen2.5-0.5B) at tp=2 split 7/7: 4 segments (4/4/3/3 heads) do not fit; the
    error names the layer and the values that do."""
    shape = dict(num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864)
    check_reduction_layout(**shape, splits=2, tp_size=2)
    check_reduction_layout(**shape, splits=4, tp_size=1)
    with pytest.raises(ValueError, match=r"o_proj.*values that fit: \[2\]"):
        check_reduction_layout(**shape, splits=4, tp_size=2)


def test_reduction_splits_refused():
    check_reduction_splits(4, 2)
    check_reduction_splits(3, 3)
    for splits, tp in ((3, 2), (6, 3), (0, 1)):
        with pytest.raises(ValueError, match="deterministic reduction"):
            check_reduction_splits(splits, tp)
    with pytest.raises(ValueError, match="reduction"):
        EngineConfig(deterministic=True, reduction_splits=3, parallel=ParallelConfig(tp=2))
    with pytest.raises(ValueError, match="not torch"):
        EngineConfig(deterministic=True, kernel_backend="torch")


def _run(model: str, *, device: str = "cpu", dtype: str = "float16", **layout) -> list[tuple[list[int], list]]:
    prompts = [" ".join(f"t{(7 * i + j) % 250 + 3}" for j in range(5 + 3 * i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    with LLM(model, device=device, dtype=dtype, deterministic=True, reduction_splits=2,
             max_num_batched_tokens=16, num_kv_blocks=64, **layout) as llm:
        outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


LAYOUTS = ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
           {"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
LOGPROB_TOL = 0.01
"""|Δ log p| allowed between layouts under the interpreter (float16 activations)."""


def assert_agree_to_rounding(base, other, layout) -> None:
    """Every top-k log-probability within LOGPROB_TOL of the base's, and the same greedy tokens
    up to a near-tie: where a token differs, the base ranked it within LOGPROB_TOL of its own
    (after it the contexts differ, so nothing more is compared)."""
    for i, ((tokens, logprobs), (other_tokens, other_logprobs)) in enumerate(zip(base, other, strict=True)):
        assert len(other_tokens) == len(tokens), (layout, i)
        for j, (token, other_token) in enumerate(zip(tokens, other_tokens)):
            here, there = dict(logprobs[j]), dict(other_logprobs[j])
            where = f"{layout}, prompt {i}, token {j}"
            if token != other_token:
                assert other_token in here and here[token] - here[other_token] <= LOGPROB_TOL, where
                break
            for t in here.keys() & there.keys():
                assert abs(here[t] - there[t]) <= LOGPROB_TOL, f"{where}, top-k token {t}"


@interpreted
def test_layouts_agree_to_rounding_on_cpu(tmp_path):
    """tp=2, pp=2 and tp=2×pp=2 against one process, with prompts chunked differently across
    micro-batches (gloo, interpreter: rounding is the host's, see the module docstring)."""
    model = write_tiny_model(tmp_path / "tiny")
    one = _run(model)
    assert all(len(tokens) == 6 for tokens, _ in one)
    for layout in LAYOUTS:
        assert_agree_to_rounding(one, _run(model, **layout), layout)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layouts_give_identical_bits(tmp_path):
    """Natively the layouts reproduce one process exactly: the same tokens and the same float32
    log-probabilities (bf16 activations), with prompts chunked differently across micro-batches."""
    model = write_tiny_model(tmp_path / "tiny")
    one = _run(model, device="cuda", dtype="bfloat16")
    assert all(len(tokens) == 6 for tokens, _ in one)
    for layout in LAYOUTS[: 3 if torch.cuda.device_count() >= 4 else 2]:
        assert _run(model, device="cuda", dtype="bfloat16", **layout) == one, layout
