"""Split sampling: the LM head's vocabulary shared by the first and the last pipeline stage.

With token feedback a pipeline of decodes runs at the pace of its slowest stage, and the last
stage is slower by the LM head: every decode step reads the whole [V, H] head (0.15–0.19 ms of
a 4.7 ms step for Llama-3-8B's 16 layers on an H100, BENCHMARKS.md), while the first stage
waits for the sampled ids. In a decode-only micro-batch whose every sampled request is greedy
(the argmax decomposes over any split of the vocabulary), the two stages share the head
instead, as in vocabulary parallelism for pipelines (Yeung et al., 2024):

- the last stage sends the final-normed rows it samples ([N, H]) to the first stage, takes the
  max of its own vocab rows' logits ([V0, V)), and sends that partial (value, id) ([2, N]);
- the first stage, which holds rows [0, V0) (loaded as the last stage loads its head: from
  ``lm_head.weight``, else from the embedding), takes its max, combines the two (a tie goes to the lower id, as ``argmax`` does) and feeds the
  ids to the next plans, as if the last stage had sent them;
- it sends the ids back to the last stage, whose driver reports them to the engine as usual.

Every rank decides from the plan alone whether a step is split (``splits``), so no flag travels.
The first stage combines on a CUDA stream of its own, so a combine (which waits for the last
stage's step) never holds back a forward queued after it; when the engine waits for a split
step followed by fewer than pp − 1 plans (which the first stage would wait for before posting
it), it asks the first stage to post at once (``wire.PostFeedback``).

What it buys is small: in steady decoding the last stage's step loses half the head (≈ 0.08 ms
of a 4.7 ms step at Llama-3-8B's 16 layers with a 50k vocabulary), and the first stage waits
for the combination's chain instead (rows → its half → ids: ≈ 0.18 ms after the last stage's
step, measured). On 2 × H100 it gave 8.5%/8.1% bubbles, within the spread of other calls
without it; off by default until a same-call comparison shows a gain (BENCHMARKS.md, eighth
session).

Steps that carry prompt tokens (a one-token last chunk aside), sample randomly, or ask for logprobs or ``min_tokens`` keep the
last stage's full head. Off in deterministic mode (a split changes the head's product shapes),
with tensor parallelism (each stage would need its TP ranks' shards combined) and without
token feedback (``ParallelConfig.split_lm_head``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeserve.parallel.wire import StepPlan
from pipeserve.scheduler.sampling_params import _SAMPLING_EPS  # SamplingParams.is_greedy's


def split_rows(vocab_size: int) -> int:
    """V0: the first stage's share of the vocabulary, rows [0, V0); the last stage takes the
    rest. Half each: the two stages then read the same bytes of head per step."""
    if vocab_size < 2:
        raise ValueError(f"cannot split a vocabulary of {vocab_size}")
    return vocab_size // 2


def splits(plan: StepPlan) -> bool:
    """Whether ``plan``'s sampling is split: every sequence schedules one token and every
    sampled one is greedy, without logprobs, past its ``min_tokens`` (no token masked)."""
    sampled = False
    for s in plan.seqs:
        if s.num_scheduled_tokens != 1:
            return False
        if s.needs_sample:
            spec = s.sampling
            if (spec is None or spec.temperature >= _SAMPLING_EPS or spec.logprobs is not None
                    or s.num_output_tokens < spec.min_tokens):
                return False
            sampled = True
    return sampled


def partial_max(rows: torch.Tensor, weight: torch.Tensor, offset: int) -> torch.Tensor:
    """The last stage's partial: [2, N] float32, each row's max logit over ``weight``'s vocab
    rows and its vocabulary id (``offset`` + its row; exact in float32 below 2**24)."""
    values, ids = F.linear(rows, weight).max(dim=-1)  # logits in the model's dtype, as the full head's
    return torch.stack((values.float(), (ids + offset).float()))


class SplitStep:
    """The first stage's buffers for one split step, allocated when its plan is taken (a later
    allocation could synchronize the device where that would deadlock: feedback.py)."""

    def __init__(self, num_rows: int, hidden_size: int, vocab_rows: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        empty = lambda *shape, dtype=dtype: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
        self.rows = empty(num_rows, hidden_size)  # the last stage's final-normed rows
        self.partial = empty(2, num_rows, dtype=torch.float32)  # its (max logit, id)
        self.logits = empty(num_rows, vocab_rows)
        self.values = empty(num_rows)
        self.ids = empty(num_rows, dtype=torch.int64)
        self.other_ids = empty(num_rows, dtype=torch.int64)
        self.take_other = empty(num_rows, dtype=torch.bool)
        self.token_ids = empty(num_rows, dtype=torch.int64)  # the result: fed, and sent back

    def combine(self, weight: torch.Tensor) -> torch.Tensor:
        """After ``rows`` and ``partial`` arrived: this stage's max over ``weight`` (rows [0, V0))
        against the partial; the sampled ids (``token_ids``). Allocates no tensor of its own (a
        reduction may still take scratch from the caching allocator: ``FeedbackReceiver`` runs
        one combination at start-up)."""
        torch.mm(self.rows, weight.t(), out=self.logits)
        torch.max(self.logits, dim=-1, out=(self.values, self.ids))
        torch.gt(self.partial[0], self.values, out=self.take_other)  # a tie keeps the lower id
        self.other_ids.copy_(self.partial[1])
        return torch.where(self.take_other, self.other_ids, self.ids, out=self.token_ids)
