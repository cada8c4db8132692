"""Decide, after each new token, whether a request is finished, and cut its text at a stop string.

Pure Python, no torch: the engine calls ``check_stop`` once per request per step, after it has
appended the new token and its detokenized text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pipeserve.scheduler.sampling_params import SamplingParams


class StopDecision(NamedTuple):
    finish_reason: str | None
    """"stop", "length", or None while the request goes on."""
    stop_reason: int | str | None
    """vLLM's ``stop_reason``: the stop_token_id or stop string that ended the request; None
    for EOS, "length" and unfinished requests."""
    output_text: str
    """The output text, cut at a matched stop string or stop token when one ended it."""


def check_stop(
    *,
    output_token_ids: Sequence[int],
    output_text: str,
    new_text_len: int | None = None,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    max_tokens: int,
) -> StopDecision:
    """Whether the request finishes now that ``output_token_ids[-1]`` has been generated.

    output_token_ids: every token generated so far, the new one last.
    output_text: the detokenized output so far, including the new token's text.
    new_text_len: characters this step appended to output_text (0 while the detokenizer holds
        back an incomplete character, more than one token's worth once it releases it). Pass
        it: None means "unknown", and then the whole text is searched for stop strings each
        step (quadratic in the output length) and a stop token's text cannot be dropped.
    eos_token_ids: the model's EOS ids; they stop the request unless ``params.ignore_eos``.
    max_tokens: the resolved cap on output tokens (``params.max_tokens``, or what the context
        length leaves when that is None or smaller).

    Checks, in order (the first that fires wins):
    1. EOS, then ``stop_token_ids``: "stop"; the token's text is dropped from output_text unless
       ``include_stop_str_in_output`` (as vLLM does).
    2. A stop string that ends inside the new text (only the tail
       ``len(stop) - 1 + new_text_len`` chars are searched, since earlier matches were found at
       earlier steps): "stop", with output_text cut before it (or just after it with
       ``include_stop_str_in_output``). If several match, the one starting first wins; then
       the shortest.
    3. ``len(output_token_ids) >= max_tokens``: "length". A stop on the last allowed token
       reports "stop", as vLLM v0 did (v1 reports "length").
    Checks 1 and 2 apply only once more than ``min_tokens`` tokens exist: the first
    min_tokens tokens cannot end the request (the sampler also masks EOS/stop ids there).

    The engine should not stream the last ``max(len(s) for s in params.stop) - 1`` characters
    before the request finishes, since a stop string may still begin in them.
    """
    num_tokens = len(output_token_ids)
    assert num_tokens >= 1, "check_stop runs after a token was appended"
    assert new_text_len is None or 0 <= new_text_len <= len(output_text)
    if num_tokens > params.min_tokens:
        decision = _check_stop_token(
            output_token_ids[-1], output_text, new_text_len, params, eos_token_ids
        )
        if decision is None and params.stop:
            decision = _check_stop_strings(output_text, new_text_len, params)
        if decision is not None:
            return decision
    if num_tokens >= max_tokens:
        return StopDecision("length", None, output_text)
    return StopDecision(None, None, output_text)


def _check_stop_token(
    token_id: int,
    output_text: str,
    new_text_len: int | None,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
) -> StopDecision | None:
    is_eos = not params.ignore_eos and token_id in eos_token_ids
    if not is_eos and token_id not in params.stop_token_ids:
        return None
    if new_text_len and not params.include_stop_str_in_output:
        output_text = output_text[: len(output_text) - new_text_len]
    return StopDecision("stop", None if is_eos else token_id, output_text)


def _check_stop_strings(
    output_text: str, new_text_len: int | None, params: SamplingParams
) -> StopDecision | None:
    if new_text_len == 0:
        return None
    if new_text_len is None:
        new_text_len = len(output_text)
    best: tuple[int, int, str] | None = None  # (start, length, stop string)
    for stop in params.stop:
        start = output_text.find(stop, max(0, len(output_text) - new_text_len - len(stop) + 1))
        if start != -1 and (best is None or (start, len(stop)) < best[:2]):
            best = (start, len(stop), stop)
    if best is None:
        return None
    start, length, stop = best
    end = start + length if params.include_stop_str_in_output else start
    return StopDecision("stop", stop, output_text[:end])
