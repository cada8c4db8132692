"""Prompt logprobs on the last stage: the LM head over the prompt rows of the chunks that ask
for them, and their logprobs.

A chunk of a request with ``SamplingParams.prompt_logprobs`` carries the prompt tokens its
leading rows predict (``SeqPlan.prompt_logprob_targets``). Row j of the chunk (position
``num_computed_tokens + j``) scores target j, the prompt token at the next position. Only those
rows go through the LM head, beside the usual last row of each sampled sequence: a step without
such chunks costs nothing more, and a chunk's other rows are never projected onto the
vocabulary. The rows go in slices of at most ``max_rows`` (the most rows whose logits the KV
pool sizing measured), so a long chunk's logits never need more memory than a step's sampled
logits. With TP > 1 the LM head is a collective: every last-stage rank runs the same slices,
and only the driver computes the logprobs (``sampler.compute_logprobs``: raw logits, ranks over
the whole vocabulary), brought to the host once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.parallel.wire import LogprobRows, PromptLogprobs, StepPlan
from pipeserve.runtime.model.llama import LlamaForCausalLM
from pipeserve.runtime.worker.batch import host_to_device
from pipeserve.runtime.worker.sampler import compute_logprobs, logprob_rows


@dataclass(kw_only=True, slots=True)
class PromptRows:
    """A step's prompt rows on the host, in plan order: per request, ``counts[i]`` rows whose
    tokens sit at prompt positions ``starts[i] ..``."""

    request_ids: list[str]
    starts: list[int]
    counts: list[int]
    rows: np.ndarray  # [R] int64: rows of the step's packed hidden states
    targets: np.ndarray  # [R] int64: the prompt token each row scores
    num_top: int  # top tokens per row: the most any of the requests asks for


def prompt_rows(plan: StepPlan) -> PromptRows | None:
    """The rows of ``plan`` that score prompt tokens; None when none does."""
    if all(s.prompt_logprob_targets is None for s in plan.seqs):
        return None
    offsets = np.cumsum([0] + [s.num_scheduled_tokens for s in plan.seqs], dtype=np.int64)
    seqs = [(i, s) for i, s in enumerate(plan.seqs) if s.prompt_logprob_targets is not None]
    counts = [len(s.prompt_logprob_targets) for _, s in seqs]
    rows = np.concatenate([np.arange(offsets[i], offsets[i] + n, dtype=np.int64) for (i, _), n in zip(seqs, counts)])
    return PromptRows(
        request_ids=[s.request_id for _, s in seqs],
        starts=[s.num_computed_tokens + 1 for _, s in seqs],
        counts=counts,
        rows=rows,
        targets=np.fromiter((t for _, s in seqs for t in s.prompt_logprob_targets), dtype=np.int64, count=len(rows)),
        num_top=max(s.sampling.prompt_logprobs for _, s in seqs),
    )


def compute_prompt_logprobs(
    model: LlamaForCausalLM, hidden: torch.Tensor, rows: PromptRows, *, max_rows: int, driver: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The LM head over ``rows`` of ``hidden`` ([T, H], this step's last-stage output), in
    slices of ``max_rows``; on the driver their ``compute_logprobs`` tensors ([R, num_top + 1]
    each, on the device), elsewhere None. Every last-stage rank calls it (TP collective)."""
    device = hidden.device
    index = host_to_device(rows.rows, torch.int64, device)  # [R]
    targets = host_to_device(rows.targets, torch.int64, device) if driver else None  # [R]
    pieces = []
    for start in range(0, len(rows.rows), max_rows):
        part = slice(start, start + max_rows)
        logits = model.compute_logits(hidden.index_select(0, index[part]))  # [r, V] float32
        if driver:
            pieces.append(compute_logprobs(logits, targets[part], rows.num_top))
    if not driver:
        return None
    return pieces[0] if len(pieces) == 1 else tuple(torch.cat(t) for t in zip(*pieces))


def prompt_logprobs_of(rows: PromptRows, tensors: tuple[torch.Tensor, ...]) -> list[PromptLogprobs]:
    """``compute_prompt_logprobs``' tensors on the host (waits for them), one entry per request."""
    flat = logprob_rows(*tensors)
    width = rows.num_top + 1
    out, first = [], 0
    for request_id, start, count in zip(rows.request_ids, rows.starts, rows.counts):
        part = slice(first * width, (first + count) * width)
        chunk = LogprobRows(num_top=rows.num_top, token_ids=flat.token_ids[part], logprobs=flat.logprobs[part],
                            ranks=flat.ranks[part])
        out.append(PromptLogprobs(request_id=request_id, start=start, rows=chunk))
        first += count
    return out
