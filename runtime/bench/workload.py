"""Benchmark workloads: request lengths and arrival times, from real traces or synthetic.

A workload is a list of ``RequestSpec`` (arrival offset in seconds, prompt and output lengths);
the bench turns each into random prompt token ids and an ignore-EOS request of that output
length. Sources:

- ``arxiv``, ``sharegpt``: prompt/output token counts (no timestamps), sampled with the seed,
  paired with an arrival process (``poisson`` or ``gamma`` at ``rate`` requests/s);
- ``azure_code``, ``azure_conv``: the Azure LLM inference traces 2023, replayed with their real
  arrival times (``arrival: trace``), optionally time-scaled;
- ``uniform``, ``zipf``: synthetic lengths in [min, max];
- ``mooncake``, ``shared_prefix``: prompts that share prefixes, given as token ids
  (``runtime/bench/prefix_workloads.py``): the Mooncake trace (its arrival times, or any process) and
  many requests over a few long shared prompts (a batch by default), for prefix caching and
  grouping;
- ``arrival: offline``: every request at t = 0 (a batch), with any length source.

The trace files live in ``configs/traces/`` (see ATTRIBUTION.md there). Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import datetime as dt
import functools
import math
import os
import random
from dataclasses import dataclass

from pipeserve.runtime.bench.prefix_workloads import (
    TRACE_DIR,
    mooncake_arrivals,
    mooncake_requests,
    shared_prefix_requests,
    token_range_for,
)

DEFAULT_TRACE_DIR = os.fspath(TRACE_DIR)  # package data: configs/traces (ATTRIBUTION.md there)

LENGTH_TRACES = {
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}
TIMESTAMP_TRACES = {
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
}
SYNTHETIC = ("uniform", "zipf")
PREFIX_TRACES = {"mooncake": "mooncake_synthetic_trace.jsonl"}
PREFIX_SOURCES = (*PREFIX_TRACES, "shared_prefix")
"""Sources whose prompts are token ids that share prefixes (RequestSpec.prompt_token_ids)."""
SOURCES = (*LENGTH_TRACES, *TIMESTAMP_TRACES, *SYNTHETIC, *PREFIX_SOURCES)
ARRIVAL_TRACES = (*TIMESTAMP_TRACES, *PREFIX_TRACES)
ARRIVALS = ("poisson", "gamma", "trace", "offline")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One benchmark request: when it arrives (seconds after the run starts) and its lengths."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    """The prompt, where the workload fixes it (prefix sources); None = random tokens."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadConfig:
    name: str = "workload"
    """Label in results and tables."""
    source: str = "sharegpt"
    """Where lengths come from: arxiv, sharegpt, azure_code, azure_conv, uniform or zipf; or
    prompts that share prefixes: mooncake or shared_prefix."""
    arrival: str = "poisson"
    """poisson or gamma (at ``rate``), trace (the Azure or Mooncake timestamps) or offline (all
    at t=0)."""
    num_requests: int = 64
    """Requests in the run."""
    rate: float | None = None
    """Mean arrival rate in requests/s (poisson, gamma)."""
    gamma_cv: float = 1.0
    """Coefficient of variation of gamma inter-arrival times (1 = Poisson; > 1 burstier)."""
    time_scale: float = 1.0
    """Trace arrivals: multiply every inter-arrival gap by this (0.5 replays twice as fast)."""
    start: int = 0
    """Timestamped traces and mooncake: first row to replay (rows are taken in order from here)."""
    length_scale: float = 1.0
    """Multiply every trace length by this before clamping (shrinks real traces for CPU runs)."""
    min_prompt_len: int = 1
    """Synthetic: shortest prompt. Traces: shorter prompts are raised to it."""
    max_prompt_len: int | None = None
    """Synthetic: longest prompt (required). Traces: longer prompts are cut to it."""
    min_output_len: int = 1
    """Synthetic: shortest output. Traces: shorter outputs are raised to it."""
    max_output_len: int | None = None
    """Synthetic: longest output (required). Traces: longer outputs are cut to it."""
    zipf_theta: float = 1.1
    """Zipf exponent: P(length = min + k) is proportional to 1 / (k + 1) ** theta."""
    seed: int = 0
    """Seeds length sampling and arrivals (and the bench's random prompt tokens)."""
    trace_dir: str | None = None
    """Folder of the trace files; None = the packaged configs/traces."""
    block_tokens: int = 512
    """mooncake: tokens behind one trace hash id (512 in the trace). Smaller shrinks every
    prompt in proportion and keeps its sharing (16: one hash block per 16-token KV block)."""
    num_prefixes: int = 4
    """shared_prefix: distinct shared prompts; num_requests are split evenly among them."""
    shared_prefix_len: int = 1024
    """shared_prefix: tokens of each shared prompt."""
    suffix_len: int = 32
    """shared_prefix: tokens each request adds after its shared prompt (its question)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"workload.source must be one of {SOURCES}, got {self.source!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"workload.arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "trace" and self.source not in ARRIVAL_TRACES:
            raise ValueError(f"arrival=trace needs a timestamped source {ARRIVAL_TRACES}")
        if self.arrival in ("poisson", "gamma") and not (self.rate and self.rate > 0):
            raise ValueError(f"arrival={self.arrival} needs workload.rate > 0 (requests/s)")
        if self.num_requests < 1:
            raise ValueError("workload.num_requests must be >= 1")
        if self.source in SYNTHETIC and (self.max_prompt_len is None or self.max_output_len is None):
            raise ValueError(f"source={self.source} needs max_prompt_len and max_output_len")
        if self.min_prompt_len < 1 or self.min_output_len < 1:
            raise ValueError("min_prompt_len and min_output_len must be >= 1")
        for lo, hi in ((self.min_prompt_len, self.max_prompt_len), (self.min_output_len, self.max_output_len)):
            if hi is not None and hi < lo:
                raise ValueError(f"a max length ({hi}) is below its min ({lo})")
        if self.gamma_cv <= 0 or self.time_scale <= 0 or self.length_scale <= 0:
            raise ValueError("gamma_cv, time_scale and length_scale must be > 0")
        if self.start < 0:
            raise ValueError("workload.start must be >= 0")
        if self.source in PREFIX_SOURCES:
            self._check_prefix_source()

    def _check_prefix_source(self) -> None:
        if self.block_tokens < 1 or self.num_prefixes < 1 or self.shared_prefix_len < 0 or self.suffix_len < 1:
            raise ValueError("block_tokens, num_prefixes and suffix_len must be >= 1, shared_prefix_len >= 0")
        if self.source == "shared_prefix":
            if self.max_output_len is None:
                raise ValueError("source=shared_prefix needs max_output_len (every request's output)")
            if self.num_requests % self.num_prefixes:
                raise ValueError(f"shared_prefix: num_requests ({self.num_requests}) must be a multiple"
                                 f" of num_prefixes ({self.num_prefixes})")

    def with_rate(self, rate: float) -> WorkloadConfig:
        """The same workload at another arrival rate (trace arrivals: time-scaled to it)."""
        import dataclasses

        if self.arrival == "trace":
            return dataclasses.replace(self, time_scale=self.time_scale * natural_rate(self) / rate)
        return dataclasses.replace(self, rate=rate)


# ---- trace files --------------------------------------------------------------------------------


def trace_path(source: str, trace_dir: str | None = None) -> str:
    name = LENGTH_TRACES.get(source) or TIMESTAMP_TRACES.get(source) or PREFIX_TRACES.get(source)
    if name is None:
        raise ValueError(f"{source!r} is not a trace; traces: {(*LENGTH_TRACES, *TIMESTAMP_TRACES, *PREFIX_TRACES)}")
    path = os.path.join(trace_dir or DEFAULT_TRACE_DIR, name)
    if not os.path.exists(path):
        raise ValueError(f"trace file {path} is missing (see configs/traces/ATTRIBUTION.md)")
    return path


@functools.lru_cache(maxsize=8)
def load_length_trace(source: str, trace_dir: str | None = None) -> tuple[tuple[int, int], ...]:
    """(prompt tokens, output tokens) of every row of a length-only trace (arxiv, sharegpt)."""
    if source not in LENGTH_TRACES:
        raise ValueError(f"{source!r} is not a length trace; expected one of {tuple(LENGTH_TRACES)}")
    with open(trace_path(source, trace_dir), newline="") as f:
        return tuple((int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f))


@functools.lru_cache(maxsize=8)
def load_timestamp_trace(source: str, trace_dir: str | None = None) -> tuple[tuple[float, int, int], ...]:
    """(seconds since the first row, prompt tokens, output tokens) of every row of an Azure
    trace, in file order (which is time order)."""
    if source not in TIMESTAMP_TRACES:
        raise ValueError(f"{source!r} is not a timestamped trace; expected one of {tuple(TIMESTAMP_TRACES)}")
    rows = []
    with open(trace_path(source, trace_dir), newline="") as f:
        for r in csv.DictReader(f):
            rows.append((_parse_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    t0 = rows[0][0]
    return tuple((t - t0, p, o) for t, p, o in rows)


def _parse_timestamp(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) → POSIX seconds (UTC)."""
    date, _, frac = text.strip().partition(".")
    whole = dt.datetime.strptime(date, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
    return whole.timestamp() + (float("0." + frac) if frac else 0.0)


def natural_rate(config: WorkloadConfig) -> float:
    """Requests/s of the selected trace rows replayed at time_scale 1."""
    if config.source in PREFIX_TRACES:
        times = mooncake_arrivals(trace_path(config.source, config.trace_dir), start=config.start,
                                  max_requests=config.num_requests)
    else:
        rows = load_timestamp_trace(config.source, config.trace_dir)
        times = [t for t, _, _ in rows[config.start : config.start + config.num_requests]]
    span = times[-1] - times[0]
    return (len(times) - 1) / span if span > 0 else math.inf


# ---- building a workload ----------------------------------------------------------------------


def fit_to_context(specs: list[RequestSpec], max_model_len: int) -> tuple[list[RequestSpec], int]:
    """Prompts cut to max_model_len - 1 and outputs to what is left (at least one token), as an
    engine of that context serves them; returns (specs, how many were cut)."""
    out, cut = [], 0
    for s in specs:
        prompt = min(s.prompt_len, max_model_len - 1)
        output = max(1, min(s.output_len, max_model_len - prompt))
        cut += (prompt, output) != (s.prompt_len, s.output_len)
        ids = None if s.prompt_token_ids is None else s.prompt_token_ids[:prompt]
        out.append(dataclasses.replace(s, prompt_len=prompt, output_len=output, prompt_token_ids=ids))
    return out, cut


def build_workload(config: WorkloadConfig, *, vocab_size: int | None = None) -> list[RequestSpec]:
    """The requests of ``config`` in arrival order (deterministic for a seed). ``vocab_size``
    bounds the token ids of prefix sources (``prefix_workloads.token_range_for``)."""
    rng = random.Random(config.seed)
    if config.source in PREFIX_SOURCES:
        return _prefix_workload(config, rng, token_range_for(vocab_size))
    if config.source in TIMESTAMP_TRACES:
        rows = load_timestamp_trace(config.source, config.trace_dir)
        chosen = rows[config.start : config.start + config.num_requests]
        if len(chosen) < config.num_requests:
            raise ValueError(f"{config.source} has {len(rows)} rows; start + num_requests exceeds it")
        lengths = [(p, o) for _, p, o in chosen]
        trace_times = [t - chosen[0][0] for t, _, _ in chosen]
    elif config.source in LENGTH_TRACES:
        rows = load_length_trace(config.source, config.trace_dir)
        lengths = [rows[rng.randrange(len(rows))] for _ in range(config.num_requests)]
        trace_times = None
    else:
        lengths = _synthetic_lengths(config, rng)
        trace_times = None
    if config.source not in SYNTHETIC:
        lengths = [_clamp_lengths(config, p, o) for p, o in lengths]
    arrivals = _arrivals(config, rng, trace_times)
    return [RequestSpec(i, t, p, o) for i, (t, (p, o)) in enumerate(zip(arrivals, lengths))]


def _prefix_workload(config: WorkloadConfig, rng: random.Random, token_range: tuple[int, int]) -> list[RequestSpec]:
    """mooncake (prompts cut to max_prompt_len, outputs to max_output_len) or shared_prefix
    (every output max_output_len), as token-id prompts."""
    n = config.num_requests
    if config.source == "mooncake":
        requests = mooncake_requests(
            trace_path(config.source, config.trace_dir), block_tokens=config.block_tokens, start=config.start,
            max_requests=n, max_input_len=config.max_prompt_len, max_output_len=config.max_output_len,
            token_range=token_range, seed=config.seed,
        )
        if len(requests) < n:
            raise ValueError(f"the Mooncake trace has too few rows for start={config.start} + num_requests={n}")
        trace_times = [r.arrival_time for r in requests]
    else:
        assert config.max_output_len is not None
        requests = shared_prefix_requests(
            num_prefixes=config.num_prefixes, requests_per_prefix=n // config.num_prefixes,
            prefix_len=config.shared_prefix_len, suffix_len=config.suffix_len, max_tokens=config.max_output_len,
            token_range=token_range, seed=config.seed,
        )
        trace_times = None
    arrivals = _arrivals(config, rng, trace_times)
    return [RequestSpec(i, t, len(r.prompt_token_ids), max(config.min_output_len, r.max_tokens),
                        tuple(r.prompt_token_ids)) for i, (t, r) in enumerate(zip(arrivals, requests))]


def _clamp_lengths(config: WorkloadConfig, prompt: int, output: int) -> tuple[int, int]:
    def clamp(n: int, lo: int, hi: int | None) -> int:
        n = max(lo, round(n * config.length_scale))
        return n if hi is None else min(n, hi)

    return (clamp(prompt, config.min_prompt_len, config.max_prompt_len),
            clamp(output, config.min_output_len, config.max_output_len))


def _synthetic_lengths(config: WorkloadConfig, rng: random.Random) -> list[tuple[int, int]]:
    assert config.max_prompt_len is not None and config.max_output_len is not None
    if config.source == "uniform":
        draw = lambda lo, hi: rng.randint(lo, hi)  # noqa: E731
    else:
        draw = lambda lo, hi: zipf_draw(rng, lo, hi, config.zipf_theta)  # noqa: E731
    return [
        (draw(config.min_prompt_len, config.max_prompt_len), draw(config.min_output_len, config.max_output_len))
        for _ in range(config.num_requests)
    ]


def zipf_draw(rng: random.Random, lo: int, hi: int, theta: float) -> int:
    """A value in [lo, hi] with P(lo + k) ∝ 1 / (k + 1) ** theta (short lengths most likely)."""
    return lo + bisect.bisect_left(_zipf_cdf(hi - lo + 1, theta), rng.random())


@functools.lru_cache(maxsize=32)
def _zipf_cdf(n: int, theta: float) -> tuple[float, ...]:
    weights = [1.0 / (k + 1) ** theta for k in range(n)]
    total, acc, cdf = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        cdf.append(acc)
    cdf[-1] = 1.0
    return tuple(cdf)


def _arrivals(config: WorkloadConfig, rng: random.Random, trace_times: list[float] | None) -> list[float]:
    n = config.num_requests
    if config.arrival == "offline":
        return [0.0] * n
    if config.arrival == "trace":
        assert trace_times is not None
        return [t * config.time_scale for t in trace_times]
    assert config.rate is not None
    if config.arrival == "poisson":
        gaps = [rng.expovariate(config.rate) for _ in range(n - 1)]
    else:  # gamma with mean 1/rate and the given CV: shape k = 1/cv², scale = 1/(rate k)
        shape = 1.0 / config.gamma_cv**2
        gaps = [rng.gammavariate(shape, 1.0 / (config.rate * shape)) for _ in range(n - 1)]
    times = [0.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    return times


def workload_summary(requests: list[RequestSpec]) -> dict:
    """Totals for the result file."""
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outputs),
        "mean_prompt_len": sum(prompts) / len(prompts),
        "max_prompt_len": max(prompts),
        "mean_output_len": sum(outputs) / len(outputs),
        "arrival_span_s": span,
        "offered_rate": (len(requests) - 1) / span if span > 0 else None,
    }
