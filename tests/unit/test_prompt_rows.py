"""Which rows of a micro-batch score prompt tokens (``runtime/worker/prompt_logprobs.py``): a
pure function of the plan, checked by hand."""

import numpy as np

from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.runtime.worker.prompt_logprobs import prompt_rows
from pipeserve.scheduler import SamplingParams


def seq(rid: str, start: int, tokens: list[int], *, targets=None, k=None, fed=False, sample=False) -> SeqPlan:
    params = SamplingParams(prompt_logprobs=k) if k is not None or sample else None
    return SeqPlan(request_id=rid, num_computed_tokens=start, num_scheduled_tokens=len(tokens) + fed,
                   new_token_ids=tokens, block_table=[0], needs_sample=sample, sampling=params,
                   feed_step=3 if fed else -1, prompt_logprob_targets=targets)


def test_no_scored_chunk_no_rows():
    assert prompt_rows(StepPlan(step_id=0, seqs=[seq("a", 0, [5, 6], sample=True)])) is None


def test_rows_follow_the_packed_batch_fed_decodes_included():
    plan = StepPlan(step_id=1, seqs=[
        seq("decode", 9, [], fed=True, sample=True),  # one packed row (its token comes from the device)
        seq("mid", 4, [11, 12, 13], targets=[12, 13, 14], k=2),  # ends inside the prompt: scores the next chunk's first
        seq("plain", 0, [7, 8]),
        seq("last", 0, [21, 22, 23], targets=[22, 23], k=5, sample=True),  # the prompt's last chunk: its last row samples
    ])
    rows = prompt_rows(plan)
    assert rows.request_ids == ["mid", "last"] and rows.starts == [5, 1] and rows.counts == [3, 2]
    np.testing.assert_array_equal(rows.rows, [1, 2, 3, 6, 7])
    np.testing.assert_array_equal(rows.targets, [12, 13, 14, 22, 23])
    assert rows.num_top == 5
