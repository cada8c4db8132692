"""A request's token accounting: what is known, what is computed, what is in flight."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


class Request:
    """One generation request as the scheduler sees it.

    ``num_computed_tokens`` counts tokens whose KV is computed *or in flight*: the scheduler
    advances it when it schedules a chunk, not when the chunk's result comes back. A chunk that
    reaches the end of the request's tokens samples one more: that token is *pending* until
    ``Scheduler.update`` appends it (``awaiting_token``). Without token feedback a request with
    a pending token is not schedulable; with it (``SchedulerLimits.feedback_distance``) its next
    decode may be, taking the newest pending token as input on the device, so up to a few
    tokens can be pending. While any is, ``num_computed_tokens == num_tokens +
    num_pending_tokens - 1``. ``sampling_params`` is opaque here; the engine reads it.

    ``skip_reading_prefix_cache``: the request computes every position of its prompt, never
    starting from a cached prefix (it still adds its blocks to the cache for others). A request
    that asks for prompt logprobs needs the logits of every prompt position (vLLM does the
    same).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "num_prompt_tokens",
        "output_token_ids",
        "num_computed_tokens",
        "status",
        "arrival_time",
        "sampling_params",
        "num_preemptions",
        "num_pending_tokens",
        "sample_step",
        "max_output_tokens",
        "num_inflight_chunks",
        "first_scheduled_time",
        "skip_reading_prefix_cache",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        arrival_time: float = 0.0,
        sampling_params: object = None,
        max_output_tokens: int | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # never changes
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = arrival_time
        self.sampling_params = sampling_params
        self.num_preemptions = 0
        self.num_pending_tokens = 0  # sampled in flight, not yet appended
        self.sample_step = -1  # step id of the newest chunk that samples a pending token
        # Most output tokens (None: up to max_model_len); token feedback never plans past it.
        self.max_output_tokens = max_output_tokens
        # Scheduled chunks whose results update() has not yet seen (pipeline depth > 1).
        self.num_inflight_chunks = 0
        self.first_scheduled_time: float | None = None
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list each call)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (a decode step reads
        one token; copying the whole context each step would cost O(context))."""
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def awaiting_token(self) -> bool:
        """A sampled token of this request is in flight (not yet appended)."""
        return self.num_pending_tokens > 0

    @property
    def num_remaining_tokens(self) -> int:
        """Known tokens not yet computed nor in flight (0, or below 0 with token feedback, while
        sampled tokens are pending)."""
        return self.num_prompt_tokens + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest sampled token is left to compute.

        That is a fresh prompt not yet fully scheduled, or a preempted request recomputing its
        prompt and outputs. A decode has exactly its last sampled token left (or is awaiting
        the next one).
        """
        return self.num_computed_tokens < max(self.num_prompt_tokens, self.num_tokens - 1)

    @property
    def is_in_flight(self) -> bool:
        """A chunk of this request is scheduled and its result not yet back."""
        return self.num_inflight_chunks > 0 or self.awaiting_token

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_prompt_tokens}"
            f"+{self.num_output_tokens}, computed={self.num_computed_tokens},"
            f" inflight={self.num_inflight_chunks}, pending={self.num_pending_tokens})"
        )
