"""Per-request sampling settings, with vLLM's names, defaults and meanings.

One type from the API to the wire: a msgspec struct, so the offline API, the HTTP server and
the engine's plans to its workers all carry the same validated object (as vLLM's is). It is
frozen: derive a changed copy with ``clone(max_tokens=...)``. Values the engine learns at run
time (the resolved token cap, EOS ids) are passed beside it, never written into it.
"""

from __future__ import annotations

import math

import msgspec

# vLLM's threshold: a temperature below it means greedy decoding.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024


_INT64_MAX = 2**63 - 1


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """Validated on construction and when decoded from the wire (``ValueError``). Encoded as an
    array: a plan carries one per sampling sequence, and field names would dominate its size."""

    n: int = 1
    """Number of output sequences to generate for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-5 (e.g. 0) means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose probability sums to >= top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables it (normalized to 0)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Seed of this request's own random generator; None draws from the global one."""
    stop: str | list[str] | None = None
    """Strings that end the output when they appear in it; normalized to a list."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the output (besides EOS); normalized to a list."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length (engine resolves it)."""
    min_tokens: int = 0
    """Tokens to generate before EOS, stop_token_ids or stop strings may end the output."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs per step; None: none."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) at the end of the output text."""

    def __post_init__(self) -> None:
        def _set(name: str, value) -> None:  # the struct is frozen
            msgspec.structs.force_setattr(self, name, value)

        _set("stop", _normalize_stop(self.stop))
        _set("stop_token_ids", _normalize_stop_token_ids(self.stop_token_ids))
        _set("temperature", float(_require_number("temperature", self.temperature)))
        _set("top_p", float(_require_number("top_p", self.top_p)))
        _set("min_p", float(_require_number("min_p", self.min_p)))
        if _require_int("top_k", self.top_k) == -1:
            _set("top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if _require_int("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not -(2**63) <= _require_int("seed", self.seed) < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.top_k > _INT64_MAX:
            raise ValueError(f"top_k must be <= {_INT64_MAX}, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens > _INT64_MAX:
            raise ValueError(f"max_tokens must be <= {_INT64_MAX}, got {self.max_tokens}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_tokens is not None and _require_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if _require_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None:
            if not 0 <= _require_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes) -> SamplingParams:
        """A copy with ``changes`` applied, validated again."""
        return msgspec.structs.replace(self, **changes)


def _require_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _require_number(name: str, value) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _normalize_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
    for s in stop:
        if not s:
            raise ValueError("stop strings must be non-empty")
        if len(s) > MAX_STOP_STRING_LEN:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_LEN} characters, got {len(s)}"
            )
    return list(stop)


def _normalize_stop_token_ids(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
    for i in ids:
        if not 0 <= _require_int("stop_token_ids entries", i) <= _INT64_MAX:
            raise ValueError(f"stop_token_ids must be in [0, {_INT64_MAX}], got {i}")
    return list(ids)
