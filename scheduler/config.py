"""Scheduler configuration (values known before the run) and the limits the engine works out at
start-up (``SchedulerLimits``); the KV pool size, also found at start-up, is passed on its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost_model import SlidingLayers

POLICIES = ("sarathi", "vllm", "orca", "faster_transformer")


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    policy: str = "sarathi"
    """Batching policy: "sarathi" (stall-free chunked prefill), "vllm" (prefill-prioritized,
    whole prompts), "orca" (iteration-level, whole prompts with decodes) or
    "faster_transformer" (request-level)."""

    max_num_batched_tokens: int = 512
    """Token budget of one micro-batch. Sarathi chunks prompts to fit it. The whole-prompt
    policies (vllm, orca, faster_transformer) never chunk: they admit prompts while the total
    stays within the budget, except that a prompt longer than the whole budget may go as the
    first prompt of a micro-batch (with orca's decodes). vLLM v0 instead demands
    max_num_batched_tokens >= max_model_len; we relax that rather than reject the config."""

    max_num_seqs: int = 128
    """Most sequences in one micro-batch. With pipeline parallelism several micro-batches are
    in flight, so more requests than this may be running at once; the KV pool bounds those."""

    time_budget_s: float | None = None
    """Sarathi only: fill each micro-batch up to this *predicted* time (cost model) instead of
    the token budget; max_num_batched_tokens still caps the tokens."""

    cost_model_path: str | None = None
    """JSON profile written by `pipeserve profile` (CostModel coefficients). Read by the engine,
    never here; None with time_budget_s set means CostModel.analytic_default() (CPU scale)."""

    enable_prefix_caching: bool = False
    """Automatic prefix caching (vLLM's APC): full KV blocks are indexed by a chained hash of
    their tokens once computed, shared by every request with the same prefix (reference
    counted), and kept after their last user finishes until evicted, least recently used
    first. A request starts with its longest cached prefix counted as computed (never all of
    it: one token is always left to compute). Off by default; greedy outputs are the same
    either way."""

    prefix_grouping: bool = False
    """BatchLLM-style admission for large offline batches whose requests share prefixes (needs
    enable_prefix_caching; pair it with ``LLM.generate(..., prefix_grouping=True)``, which
    orders the batch by prefix group). A waiting request is held while another request's
    in-flight chunk computes the next block of its prefix (so shared KV is computed once),
    and is admitted only if the KV its whole run may need (prompt + max_tokens, less its
    cache hit) fits beside what the running requests may still grow into, so admissions do
    not evict the live groups' prefixes or cause preemptions."""

    balance_decodes: bool = True
    """With token feedback: no micro-batch takes more than its share of the decoding requests,
    ceil(decoding / ``SchedulerLimits.feedback_distance``), the longest-waiting first. Each
    request decodes in every ``feedback_distance``-th micro-batch, so requests fall into that
    many groups; a group left empty (all decodes admitted into the same micro-batch, or one
    group finishing first) leaves the pipeline a micro-batch short and a stage idle until the
    sampled tokens are back. Holding the excess back one step moves it into the short group
    (vLLM's pipeline keeps requests spread over its virtual engines for the same reason).
    False: every schedulable decode joins."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; expected one of {POLICIES}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.time_budget_s is not None:
            if self.policy != "sarathi":
                raise ValueError("time_budget_s is only supported by the sarathi policy")
            if not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
                raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s!r}")
        if self.cost_model_path is not None and not isinstance(self.cost_model_path, str):
            raise ValueError(f"cost_model_path must be a path string, got {self.cost_model_path!r}")
        for name in ("enable_prefix_caching", "prefix_grouping", "balance_decodes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        if self.prefix_grouping and not self.enable_prefix_caching:
            raise ValueError("prefix_grouping needs enable_prefix_caching")


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerLimits:
    """What the engine works out at start-up and the scheduler obeys (not user configuration):
    the context cap resolved against the model, token feedback from the parallel layout, and the
    model's sliding-window layers for the cost model."""

    max_model_len: int
    """Longest context (prompt + outputs): ``EngineConfig.max_model_len`` or the model's. Longer
    prompts are rejected; a request is finished with FINISHED_LENGTH once its tokens reach this
    length."""

    feedback_distance: int | None = None
    """Token feedback (set by the engine for pipeline parallelism, ``parallel.token_feedback``):
    a request whose sampled token is not back yet may have its next decode scheduled once this
    many micro-batches (the number of stages) have been scheduled since the one that samples
    it; the last stage hands the token to the first on the device. None: a request waits for
    its token (``Scheduler.update``) before its next decode."""

    sliding_layers: SlidingLayers | None = None
    """The model's sliding-window layers (``SlidingLayers.of`` its layers' windows): the cost
    model's attention terms charge them the keys within the window only, so a time budget holds
    more of a long context's work. None: every layer attends over the whole context."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_model_len, int) or isinstance(self.max_model_len, bool) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {self.max_model_len!r}")
        if self.feedback_distance is not None and (
            not isinstance(self.feedback_distance, int) or self.feedback_distance < 1
        ):
            raise ValueError(f"feedback_distance must be a positive int or None, got {self.feedback_distance!r}")
        if self.sliding_layers is not None and not isinstance(self.sliding_layers, SlidingLayers):
            raise ValueError(f"sliding_layers must be a SlidingLayers or None, got {self.sliding_layers!r}")
