"""Deterministic serving (``engine.deterministic``): one process, a TP group and a pipeline
give the same bits for every token, under real torchrun (gloo on CPU) with the Triton kernels
in the interpreter (float16: the default path's layouts differ in the last bits there).

The pure pieces (the reduction tree, the segments each TP rank holds, what is refused) are
tested first; then whole runs compare token ids and top-k log-probabilities exactly. On GPUs
(bf16, NCCL) the same check is ``python -m tools.agreement --deterministic``.
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
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPU runs of the Triton kernels need the interpreter (GPUs: tools/agreement.py)",
    ),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.timeout(600),
]


def test_tree_sum_order():
    """((a + b) + c) + (d + e) for five parts: the first ceil(n/2), then the rest."""
    a, b, c, d, e = (torch.tensor([v], dtype=torch.float16) for v in (1e4, -1e4, 3.0, 0.5, 0.25))
    assert tree_sum([a, b, c, d, e]).item() == ((a + b) + c + (d + e)).item()
    assert tree_sum([a]) is a
    # Halves of 8 parts are the ranks' subtrees at tp = 2 and 4: the same sum either way.
    parts = [torch.randn(3, dtype=torch.float32) * 10**i for i in range(8)]
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


def _run(model: str, **layout) -> list[tuple[list[int], list]]:
    prompts = [" ".join(f"t{(7 * i + j) % 250 + 3}" for j in range(5 + 3 * i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    with LLM(model, device="cpu", dtype="float16", deterministic=True, reduction_splits=2,
             max_num_batched_tokens=16, num_kv_blocks=64, **layout) as llm:
        outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


def test_layouts_give_identical_bits(tmp_path):
    """tp=2, pp=2 and tp=2×pp=2 reproduce one process exactly: the same tokens and the same
    float32 log-probabilities, with prompts chunked differently across micro-batches."""
    model = write_tiny_model(tmp_path / "tiny")
    one = _run(model)
    assert all(len(tokens) == 6 for tokens, _ in one)
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                   {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}):
        assert _run(model, **layout) == one, layout
