"""What the engine hands back for a request (vLLM's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """Which outputs ``LLMEngine.step()`` returns for a request."""

    CUMULATIVE = enum.auto()
    """One after every step that adds a token, with everything so far (the default)."""
    FINAL_ONLY = enum.auto()
    """Only the last one, once the request finishes: for callers that read nothing before that
    (non-streaming requests), which then cost no output per token."""


class Logprob(float):
    """vLLM's ``Logprob``: ``.logprob`` (of the raw model distribution: the log-softmax of the
    logits before any sampling setting), ``.rank`` and ``.decoded_token``. The rank is 1 + the
    number of tokens of the whole vocabulary with a strictly larger logprob (1: the most likely
    token; tied tokens share a rank), for every token returned: the top ones, and the sampled
    or prompt token wherever it falls. It is also the float it holds, so code written for plain
    logprobs keeps working."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


# The engine builds CompletionOutput and RequestOutput with positional arguments, once per
# request per step: keep their fields in this order.


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[dict] | None = None  # per token: {token id: (logprob, rank)} (TokenLogprobs; offline Logprob)
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if any
    cumulative_logprob: float | None = None  # offline, with logprobs: the sum of the sampled tokens'

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of one request's life, for TTFT/TBT and delays."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache served at the first scheduling (vLLM's num_cached_tokens)."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: list[dict | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: per prompt token its logprobs (as
    ``CompletionOutput.logprobs``: the token's own and the top ones at its position), None for
    the first token, which has no context."""
