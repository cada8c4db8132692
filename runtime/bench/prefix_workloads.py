"""Prefix-sharing workloads as token-id prompts (for benchmarks of prefix caching/grouping).

- ``mooncake_requests``: the Mooncake trace (kvcache-ai/Mooncake, FAST'25; Apache-2.0; see
  ``configs/traces/ATTRIBUTION.md``). Each row names its prompt's 512-token blocks by
  ``hash_ids``; equal ids mean an equal prefix, so every id becomes one fixed run of token ids
  and prompts with equal ids get equal tokens. ``block_tokens`` shrinks a block for small
  runs (16 keeps the sharing structure at 1/32 of the length). pipeserve ships the trace as
  ``configs/traces/mooncake_synthetic_trace.jsonl`` (``MOONCAKE_TRACE``).
- ``shared_prefix_requests``: many requests over a few long shared prompts (a system prompt or
  document, each asked several questions), shuffled so that grouping has work to do.
- ``ideal_cached_fraction``: the prompt tokens an unbounded prefix cache could serve, at block
  granularity: the upper bound of the "prefill saved" a run reports.

Pure Python (no torch): token ids are drawn from ``random.Random`` seeded per block id.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeserve.scheduler.prefix_cache import hash_blocks

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens behind one Mooncake ``hash_id``."""

DEFAULT_TOKEN_RANGE = (1000, 32000)
"""Token ids drawn from here: clear of the special tokens at either end of the usual Llama,
Llama-3, Mistral and SmolLM2 vocabularies."""

TRACE_DIR = Path(__file__).resolve().parents[2] / "configs" / "traces"
"""The packaged traces (installed with pipeserve as package data; ATTRIBUTION.md there)."""
MOONCAKE_TRACE = TRACE_DIR / "mooncake_synthetic_trace.jsonl"
"""The packaged copy of the trace (see configs/traces/ATTRIBUTION.md)."""
MOONCAKE_NUM_ROWS = 3993
"""Requests (rows) in the trace."""


def token_range_for(vocab_size: int | None) -> tuple[int, int]:
    """``DEFAULT_TOKEN_RANGE``, or for a vocabulary smaller than its top (test models), the
    upper three quarters of that vocabulary."""
    lo, hi = DEFAULT_TOKEN_RANGE
    if vocab_size is None or vocab_size >= hi:
        return DEFAULT_TOKEN_RANGE
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return min(lo, vocab_size // 4), vocab_size


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    """Seconds from the start of the workload."""


def mooncake_requests(
    path: str | Path,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    start: int = 0,
    max_requests: int | None = None,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """The trace's requests in order from row ``start`` (arrival = its ``timestamp``, in ms,
    as seconds after the first chosen row's).

    A prompt is its blocks' tokens cut to ``input_length`` (scaled by
    ``block_tokens / 512``); ``max_input_len`` cuts longer prompts (keeping their prefixes,
    so sharing survives) and ``max_output_len`` caps ``max_tokens``.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    blocks = _BlockTokens(block_tokens, token_range, seed)
    out = []
    rows = _read_jsonl(path, start, max_requests)
    for row in rows:
        hash_ids = row["hash_ids"]
        length = -(-row["input_length"] * block_tokens // MOONCAKE_BLOCK_TOKENS)
        length = max(1, min(length, len(hash_ids) * block_tokens))
        if max_input_len is not None:
            length = min(length, max_input_len)
        tokens = [t for h in hash_ids[: -(-length // block_tokens)] for t in blocks[h]][:length]
        max_tokens = max(1, row["output_length"])
        if max_output_len is not None:
            max_tokens = min(max_tokens, max_output_len)
        out.append(WorkloadRequest(tokens, max_tokens, (row["timestamp"] - rows[0]["timestamp"]) / 1000.0))
    return out


def mooncake_arrivals(path: str | Path, *, start: int = 0, max_requests: int | None = None) -> list[float]:
    """Arrival times (seconds after the first chosen row) of the rows ``mooncake_requests``
    would return, without building their prompts."""
    rows = _read_jsonl(path, start, max_requests)
    return [(r["timestamp"] - rows[0]["timestamp"]) / 1000.0 for r in rows]


def shared_prefix_requests(
    *,
    num_prefixes: int,
    requests_per_prefix: int,
    prefix_len: int,
    suffix_len: int,
    max_tokens: int,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    shuffle: bool = True,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """``num_prefixes × requests_per_prefix`` prompts: a shared prefix of ``prefix_len`` tokens,
    then a suffix of ``suffix_len`` tokens of each request's own. All arrive at time 0,
    shuffled (unless ``shuffle=False``: grouped by prefix)."""
    for name, value in (("num_prefixes", num_prefixes), ("requests_per_prefix", requests_per_prefix),
                        ("max_tokens", max_tokens), ("suffix_len", suffix_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    lo, hi = token_range
    out = []
    for _ in range(num_prefixes):
        prefix = [rng.randrange(lo, hi) for _ in range(prefix_len)]
        for _ in range(requests_per_prefix):
            suffix = [rng.randrange(lo, hi) for _ in range(suffix_len)]
            out.append(WorkloadRequest(prefix + suffix, max_tokens, 0.0))
    if shuffle:
        rng.shuffle(out)
    return out


def ideal_cached_fraction(prompts: Iterable[Sequence[int]], *, block_size: int) -> float:
    """Fraction of prompt tokens an unbounded block cache could serve, in this order: every
    full block (less the one holding a prompt's last token) seen before in the same chain."""
    seen: set[bytes] = set()
    num_tokens = num_cached = 0
    for prompt in prompts:
        num_tokens += len(prompt)
        cacheable = (len(prompt) - 1) // block_size * block_size
        for key in hash_blocks(prompt[:cacheable], block_size):
            if key not in seen:
                break  # a chain stops at its first miss, as a cache lookup does
            num_cached += block_size
        seen.update(hash_blocks(prompt, block_size))
    return num_cached / num_tokens if num_tokens else 0.0


class _BlockTokens:
    """Token ids of each trace block id, drawn once (equal ids, equal tokens)."""

    def __init__(self, block_tokens: int, token_range: tuple[int, int], seed: int) -> None:
        lo, hi = token_range
        if not 0 <= lo < hi:
            raise ValueError(f"bad token_range {token_range}")
        self._n, self._lo, self._hi, self._seed = block_tokens, lo, hi, seed
        self._tokens: dict[int, list[int]] = {}

    def __getitem__(self, hash_id: int) -> list[int]:
        tokens = self._tokens.get(hash_id)
        if tokens is None:
            rng = random.Random(f"{self._seed}:{hash_id}")
            tokens = self._tokens[hash_id] = [rng.randrange(self._lo, self._hi) for _ in range(self._n)]
        return tokens


def _read_jsonl(path: str | Path, start: int, limit: int | None) -> list[dict]:
    """Non-empty rows ``start`` to ``start + limit`` (all after ``start`` with no limit)."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    rows, index = [], 0
    with open(path) as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                if index >= start:
                    rows.append(json.loads(line))
                index += 1
    return rows
