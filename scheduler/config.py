"""Scheduler configuration (values known before the run; the KV pool size is not one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    max_model_len: int = 2048
    """Longest context (prompt + outputs). Longer prompts are rejected; a request is finished
    with FINISHED_LENGTH once its tokens reach this length."""

    time_budget_s: float | None = None
    """Sarathi only: fill each micro-batch up to this *predicted* time (cost model) instead of
    the token budget; max_num_batched_tokens still caps the tokens."""

    allow_same_request_in_consecutive_chunks: bool = True
    """Let a prompt's next chunk enter the next micro-batch while the previous chunk is still
    in flight (each stage runs micro-batches in order, so the earlier chunk's KV is there in
    time). False restores Sarathi-Serve's rule: one chunk per request in flight."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; expected one of {POLICIES}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.time_budget_s is not None:
            if self.policy != "sarathi":
                raise ValueError("time_budget_s is only supported by the sarathi policy")
            if not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
                raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s!r}")
        if not isinstance(self.allow_same_request_in_consecutive_chunks, bool):
            raise ValueError("allow_same_request_in_consecutive_chunks must be a bool")
