"""Split sampling (parallel/split_head.py): which steps split, and that the two stages' shares of
the LM head combine into the full head's argmax, ties included."""

from __future__ import annotations

import pytest
import torch

from pipeserve.parallel.split_head import SplitStep, partial_max, split_rows, splits
from pipeserve.parallel.wire import SamplingSpec, SeqPlan, StepPlan

GREEDY = SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, logprobs=None)


def _seq(rid: str, *, tokens: int = 1, sample: bool = True, spec: SamplingSpec | None = GREEDY, outputs: int = 3):
    return SeqPlan(request_id=rid, num_computed_tokens=10, num_scheduled_tokens=tokens, new_token_ids=[1] * tokens,
                   block_table_diff=[], needs_sample=sample, sampling=spec if sample else None,
                   num_output_tokens=outputs)


def test_which_steps_split():
    step = lambda *seqs: StepPlan(step_id=0, seqs=list(seqs))  # noqa: E731
    assert splits(step(_seq("a"), _seq("b")))
    assert not splits(step(_seq("a"), _seq("b", tokens=16, sample=False)))  # a prompt chunk rides along
    assert not splits(step(_seq("a", tokens=5)))  # a last prompt chunk that samples
    assert not splits(step(_seq("a", sample=False)))  # nothing sampled
    assert not splits(step(_seq("a"), _seq("b", spec=SamplingSpec(**{**_fields(GREEDY), "temperature": 0.7}))))
    assert not splits(step(_seq("a", spec=SamplingSpec(**{**_fields(GREEDY), "logprobs": 2}))))
    min_tokens = SamplingSpec(**{**_fields(GREEDY), "min_tokens": 5})
    assert not splits(step(_seq("a", spec=min_tokens, outputs=4)))  # EOS still masked
    assert splits(step(_seq("a", spec=min_tokens, outputs=5)))


def _fields(spec: SamplingSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shares_combine_into_the_full_argmax(dtype):
    torch.manual_seed(0)
    vocab, hidden, n = 101, 32, 24
    weight = torch.randn(vocab, hidden).to(dtype)
    v0 = split_rows(vocab)
    assert v0 == 50
    rows = torch.randn(n, hidden).to(dtype)
    # Ties across the split: rows 0-3 see the same best logit in both halves (id 7 and v0 + 7, or
    # v0 + 9 and 9): the lower id wins, as the full argmax's first maximum.
    weight[v0 + 7] = weight[7]
    weight[v0 + 9] = weight[9]
    rows[0:2] = weight[7] * 4
    rows[2:4] = weight[9] * 4
    full = torch.nn.functional.linear(rows, weight).float().argmax(dim=-1)
    assert full[0].item() == 7 and full[2].item() == 9
    step = SplitStep(n, hidden, v0, dtype, torch.device("cpu"))
    step.rows.copy_(rows)
    step.partial.copy_(partial_max(rows, weight[v0:], v0))
    assert step.partial.dtype == torch.float32 and step.partial.shape == (2, n)
    ids = step.combine(weight[:v0])
    assert ids.tolist() == full.tolist()
    assert (ids >= v0).any() and (ids < v0).any()  # both halves won somewhere


def test_split_rows_needs_two_entries():
    with pytest.raises(ValueError):
        split_rows(1)
