"""Per-request sampling settings, with vLLM's names, defaults and meanings.

One type from the API to the wire: a msgspec struct, so the offline API, the HTTP server and
the engine's plans to its workers all carry the same validated object (as vLLM's is). It is
frozen: derive a changed copy with ``clone(max_tokens=...)``. Values the engine learns at run
time (the resolved token cap, EOS ids) are passed beside it, never written into it.
"""

from __future__ import annotations

import json as json_module
import math

import msgspec

# vLLM's threshold: a temperature below it means greedy decoding.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024


_INT64_MAX = 2**63 - 1
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """A constraint on the output (vLLM's names): exactly one of ``json`` (a JSON schema, as a
    dict or its text), ``regex``, ``choice`` (the output is one of these strings), ``grammar``
    (EBNF, xgrammar's dialect: ``root ::= ...``) or ``json_object`` (any JSON object). Checked
    here for form only; whether the schema, regex or grammar compiles is the engine's check
    (``runtime/worker/grammar.py``), when the request is added."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured outputs json must be a JSON schema (object or string), got {self.json!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured outputs {name} must be a string, got {getattr(self, name)!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured outputs choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured outputs json_object must be a bool, got {self.json_object!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar compiles from, and its cache key."""
        kind = next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            value = json_module.dumps(value)  # in its order: properties are generated in it
        elif kind == "choice":
            value = json_module.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value


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
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (given the tokens before it) plus this many top
    logprobs at its position; the first token has none. None: none. Such a request computes its
    whole prompt: the prefix cache serves none of it."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) at the end of the output text."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted from the logit of every token the output holds already (> 0
    favours new tokens)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from a token's logit once per time the output holds it."""
    repetition_penalty: float = 1.0
    """> 0: a token the prompt or the output holds has its logit divided by it where positive,
    multiplied where negative (> 1 discourages repeats; 1 is off)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias in [-100, 100] added to its logit (before the penalties)."""
    allowed_token_ids: list[int] | None = None
    """If set (non-empty), every other token's logit is -inf."""
    bad_words: list[str] | None = None
    """Words never to generate: the last token of a word's tokens is banned wherever the output
    ends with the tokens before it (both with and without a leading space). Normalized to a list."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (guided decoding): each
    step samples only among the tokens the constraint allows."""
    _bad_words_token_ids: list[list[int]] | None = None
    """``bad_words`` as token ids, filled in where the request is tokenized (the engine's
    ``resolve_bad_words``); the sampler reads these."""

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
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            _set(name, float(_require_number(name, getattr(self, name))))
        _set("logit_bias", _normalize_logit_bias(self.logit_bias))
        _set("allowed_token_ids", _normalize_allowed_token_ids(self.allowed_token_ids))
        _set("bad_words", _normalize_bad_words(self.bad_words))
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
        if self.prompt_logprobs is not None:
            if not 0 <= _require_int("prompt_logprobs", self.prompt_logprobs) <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            # A complete grammar allows only EOS, which these would hold back: nothing to sample.
            raise ValueError("structured_outputs cannot be combined with ignore_eos or min_tokens")
        for ids in self._bad_words_token_ids or ():
            if not isinstance(ids, list) or not ids or any(_require_int("bad word token ids", i) < 0 for i in ids):
                raise ValueError(f"bad word token ids must be non-empty lists of ids >= 0, got {ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalty: the sampler counts the request's tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_token_history(self) -> bool:
        """The sampling worker must keep this request's tokens: its penalties count them, or a
        bad word of several tokens matches the output's end."""
        return self.uses_penalties or any(len(ids) > 1 for ids in self._bad_words_token_ids or ())

    @property
    def processes_logits(self) -> bool:
        """Anything besides temperature and the top-k/top-p/min-p filters changes the logits."""
        return (self.uses_penalties or self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self._bad_words_token_ids))

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


def _normalize_logit_bias(bias) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out = {}
    for token_id, value in bias.items():
        if not 0 <= _require_int("logit_bias token ids", token_id) <= _INT64_MAX:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
        if not -100.0 <= _require_number("logit_bias values", value) <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token_id}")
        out[token_id] = float(value)
    return out or None


def _normalize_allowed_token_ids(ids) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"allowed_token_ids must be a list of ints, got {ids!r}")
    if not ids:
        raise ValueError("allowed_token_ids must not be empty (None allows every token)")
    for i in ids:
        if not 0 <= _require_int("allowed_token_ids entries", i) <= _INT64_MAX:
            raise ValueError(f"allowed_token_ids must be >= 0, got {i}")
    return list(ids)


def _normalize_bad_words(words) -> list[str]:
    if words is None:
        return []
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}")
    if any(not w.strip() for w in words):
        raise ValueError("bad_words must hold non-blank strings")
    return list(words)
