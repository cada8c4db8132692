"""Benchmark metrics: per-request latencies, per-stage busy/wait/idle times, MFU/MBU, the
capacity search, decode-stall checks, Chrome/Perfetto traces and plots; and the live
per-stage bubble window that the server's /metrics export.

Everything here works on plain records gathered during a run (RequestMetrics, StepRecord,
worker stage timelines); nothing touches the device. matplotlib is imported only to plot.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pipeserve.scheduler.cost_model import SlidingLayers, Work

# ---- statistics --------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict:
    """count, mean, P50/P90/P99 and max (NaN-free: None when there are no values)."""
    v = sorted(values)
    if not v:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(v),
        "mean": sum(v) / len(v),
        "p50": percentile(v, 50),
        "p90": percentile(v, 90),
        "p99": percentile(v, 99),
        "max": v[-1],
    }


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    """Population std / mean; None for fewer than two values."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    if mean == 0:
        return None
    var = sum((x - mean) ** 2 for x in values) / len(values)
    return math.sqrt(var) / mean


# ---- requests ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestTimes:
    """One finished request's timeline (time.monotonic seconds) and lengths."""

    request_id: str
    arrival: float
    first_scheduled: float
    first_token: float
    token_times: list[float]
    finished: float
    num_prompt_tokens: int
    num_output_tokens: int

    @classmethod
    def of(cls, output) -> RequestTimes:
        """From a finished RequestOutput whose ``metrics`` the engine filled in."""
        m = output.metrics
        return cls(
            request_id=output.request_id,
            arrival=m.arrival_time,
            first_scheduled=m.first_scheduled_time,
            first_token=m.first_token_time,
            token_times=list(m.token_times),
            finished=m.finished_time,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_output_tokens=len(output.outputs[0].token_ids),
        )

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def scheduling_delay(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def tbts(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT): the decode time over the tokens
        it made, whether they arrived one by one or several at once; None for one token."""
        if self.num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.num_output_tokens - 1)


def request_summary(requests: Sequence[RequestTimes], wall_s: float) -> dict:
    """TTFT, TPOT, TBT, end-to-end latency and scheduling delay distributions; throughput."""
    prompt = sum(r.num_prompt_tokens for r in requests)
    output = sum(r.num_output_tokens for r in requests)
    return {
        "num_requests": len(requests),
        "ttft_s": distribution(r.ttft for r in requests),
        "tpot_s": distribution(r.tpot for r in requests if r.tpot is not None),
        "tbt_s": distribution(x for r in requests for x in r.tbts),
        "e2e_s": distribution(r.e2e for r in requests),
        "scheduling_delay_s": distribution(r.scheduling_delay for r in requests),
        "throughput": {
            "wall_s": wall_s,
            "requests_per_s": len(requests) / wall_s if wall_s > 0 else None,
            "output_tokens_per_s": output / wall_s if wall_s > 0 else None,
            "total_tokens_per_s": (prompt + output) / wall_s if wall_s > 0 else None,
            "prompt_tokens": prompt,
            "output_tokens": output,
        },
    }


def format_latency_table(summary: Mapping) -> list[str]:
    """The throughput line and the latency table (ms) of a ``request_summary``, as `pipeserve
    bench` and `pipeserve bench serve` print them; a distribution without values shows "-"."""
    thr = summary["throughput"]

    def ms(d: Mapping, key: str) -> str:
        return "-" if d.get(key) is None else f"{d[key] * 1e3:.1f}"

    lines = [f"requests {summary['num_requests']}   wall {thr['wall_s']:.2f} s"
             f"   {format_number(thr['requests_per_s'])} req/s   {format_number(thr['output_tokens_per_s'])} output tok/s"
             f"   {format_number(thr['total_tokens_per_s'])} total tok/s",
             "| metric (ms) | mean | P50 | P90 | P99 | max |", "|---|---|---|---|---|---|"]
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("TBT", "tbt_s"), ("end-to-end", "e2e_s"),
                      ("scheduling delay", "scheduling_delay_s")):
        d = summary[key]
        lines.append(f"| {name} | " + " | ".join(ms(d, k) for k in ("mean", "p50", "p90", "p99", "max")) + " |")
    return lines


def format_number(x) -> str:
    return "-" if x is None else f"{x:.3g}"


# ---- stages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageSpan:
    """One micro-batch on one rank: waiting for its input from ``recv_start`` to ``start``,
    computing from ``start`` to ``end`` (host time.monotonic seconds). ``queued``: when the
    rank's host had queued the micro-batch's last kernel (None where unknown); a span that ends
    right after it ran at the pace of the host's launches, not the device's."""

    step_id: int
    recv_start: float
    start: float
    end: float
    queued: float | None = None

    @property
    def busy(self) -> float:
        return self.end - self.start

    @property
    def recv_wait(self) -> float:
        return self.start - self.recv_start


@dataclass(slots=True)
class StageTimeline:
    """The spans of one rank (TP rank 0 of a stage stands for its stage in lanes and tables)."""

    stage: int
    rank: int
    spans: list[StageSpan] = field(default_factory=list)
    tp_rank: int = 0
    num_layers: int | None = None
    host: dict | None = None  # the worker's host summary (launch times, allocator), whole run

    @classmethod
    def from_json(cls, data: Mapping) -> StageTimeline:
        spans = [StageSpan(int(s[0]), *s[1:]) for s in data["spans"]]  # (4 items before ``queued``)
        return cls(stage=data["stage"], rank=data["rank"], spans=spans, tp_rank=data.get("tp_rank", 0),
                   num_layers=data.get("num_layers"), host=data.get("host"))

    def within(self, first_step: int) -> StageTimeline:
        """Only the micro-batches from ``first_step`` on (drops warm-up steps)."""
        spans = [s for s in self.spans if s.step_id >= first_step]
        return StageTimeline(self.stage, self.rank, spans, self.tp_rank, self.num_layers, self.host)


def stage_summary(timeline: StageTimeline, wall_start: float, wall_end: float) -> dict:
    """Busy, receive-wait and idle seconds of one rank over [wall_start, wall_end]; bubble
    fraction = 1 - busy / wall; CV of its per-micro-batch compute time."""
    wall = max(wall_end - wall_start, 0.0)
    busy = sum(s.busy for s in timeline.spans)
    recv = sum(s.recv_wait for s in timeline.spans)
    steps = [s.busy for s in timeline.spans]
    return {
        "stage": timeline.stage,
        "rank": timeline.rank,
        "tp_rank": timeline.tp_rank,
        "num_layers": timeline.num_layers,
        "num_steps": len(steps),
        "wall_s": wall,
        "busy_s": busy,
        "recv_wait_s": recv,
        "idle_s": max(wall - busy - recv, 0.0),
        "bubble_fraction": 1.0 - busy / wall if wall > 0 else None,
        "step_time_mean_s": sum(steps) / len(steps) if steps else None,
        "step_time_cv": coefficient_of_variation(steps),
        **({"host": timeline.host} if timeline.host is not None else {}),
    }


def loaded_window(requests: Sequence[RequestTimes], depth: int) -> tuple[float, float] | None:
    """[first arrival, the moment fewer than ``depth`` requests are left unfinished]: the span in
    which the engine could keep ``depth`` micro-batches in flight. After it (the drain) a
    pipeline has bubbles by construction, since a request decodes at most once per ``pp``
    micro-batches. None when there are fewer than ``depth`` requests."""
    finishes = sorted(r.finished for r in requests)
    if len(finishes) < depth or depth < 1:
        return None
    return min(r.arrival for r in requests), finishes[len(finishes) - depth]


def stage_bubbles(timelines: Sequence[StageTimeline], requests: Sequence[RequestTimes], *, t0: float,
                  t_end: float, depth: int) -> tuple[list[dict], tuple[float, float] | None]:
    """Every rank's ``stage_summary`` over [t0, t_end] (in rank order) with its
    ``bubble_fraction_loaded`` over ``loaded_window``, and that window."""
    loaded = loaded_window(requests, depth)
    stages = []
    for timeline in sorted(timelines, key=lambda t: t.rank):
        stage = stage_summary(timeline, t0, t_end)
        stage["bubble_fraction_loaded"] = bubble_in_window(timeline, *loaded) if loaded else None
        stages.append(stage)
    return stages, loaded


def bubble_in_window(timeline: StageTimeline, start: float, end: float) -> float | None:
    """1 - busy / (end - start), counting only the compute inside [start, end]."""
    return bubble_in_intervals(timeline, [(start, end)])


def prompt_pending_intervals(requests: Sequence[RequestTimes], records: Sequence,
                             prompt_lens: Mapping[str, int]) -> list[tuple[float, float]]:
    """The union of every request's [arrival, submission of the last micro-batch carrying its
    prompt tokens) (StepRecords): the times some prompt had tokens waiting to be scheduled, so a
    scheduler could fill micro-batches with them (the pipeline could be saturated). Sorted,
    disjoint. Outside them only decodes were left, whose micro-batches shrink with the requests
    still running (a light load, or the drain)."""
    last: dict[str, float] = {}
    for r in records:
        for rid, start, _, _ in r.seqs:
            if start < prompt_lens.get(rid, 0):
                last[rid] = max(last.get(rid, r.submitted_at), r.submitted_at)
    spans = sorted((r.arrival, last.get(r.request_id, r.first_scheduled)) for r in requests)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def bubble_in_intervals(timeline: StageTimeline, intervals: Sequence[tuple[float, float]]) -> float | None:
    """1 - busy / (their total length), counting only the compute inside sorted, disjoint
    intervals."""
    if any(b0 > a1 for (_, b0), (a1, _) in zip(intervals, intervals[1:])):
        raise ValueError("intervals must be sorted and disjoint")
    total = sum(max(0.0, b - a) for a, b in intervals)
    if total <= 0:
        return None
    starts = [a for a, _ in intervals]
    busy = 0.0
    for s in timeline.spans:
        i = max(bisect.bisect_right(starts, s.start) - 1, 0)  # the first interval that may overlap
        while i < len(intervals) and intervals[i][0] < s.end:
            a, b = intervals[i]
            busy += max(0.0, min(s.end, b) - max(s.start, a))
            i += 1
    return 1.0 - busy / total


def stage_busy_by_step(timelines: Sequence[StageTimeline]) -> dict[int, float]:
    """Device-seconds each micro-batch took, summed over every rank (every TP rank of every
    stage: a stage's ranks need not be equally busy, e.g. only the driver samples)."""
    out: dict[int, float] = {}
    for tl in timelines:
        for s in tl.spans:
            out[s.step_id] = out.get(s.step_id, 0.0) + s.busy
    return out


class BubbleWindow:
    """Live per-stage bubble fraction, ``1 - Δbusy/Δactive`` over the last ``window_s`` seconds
    of *active* time (time the engine had unfinished requests), from cumulative counters.

    Idle time is not a bubble: while the engine is idle the window does not move, so the
    figure holds that of the latest work (and is None before any). Busy figures may arrive
    after the active time they belong to (workers report on their heartbeat); a sample whose
    active time did not advance replaces the previous one, so the late busy time still counts
    and an idle server adds no samples. The deque holds about ``window_s`` / stats interval."""

    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque()  # (active_s, busy_s per stage)

    def add(self, busy_s: Sequence[float], active_s: float) -> None:
        """One reading of the cumulative counters (per-stage busy seconds, engine active seconds)."""
        busy = tuple(busy_s)
        if self._samples and len(self._samples[-1][1]) != len(busy):
            self._samples.clear()  # another pipeline: the old counters say nothing about it
        if self._samples and active_s <= self._samples[-1][0]:
            self._samples[-1] = (self._samples[-1][0], busy)
        else:
            self._samples.append((active_s, busy))
        # Keep one sample at or before the window's start as the baseline.
        while len(self._samples) > 2 and active_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def bubble_fractions(self) -> list[float] | None:
        """Per stage, in [0, 1]; None until the window holds some active time."""
        if len(self._samples) < 2:
            return None
        (a0, b0), (a1, b1) = self._samples[0], self._samples[-1]
        active = a1 - a0
        return [min(1.0, max(0.0, 1.0 - (y - x) / active)) for x, y in zip(b0, b1)]


# ---- steps, stalls ------------------------------------------------------------------------------


def step_summary(records: Sequence, prompt_lens: Mapping[str, int]) -> dict:
    """Shape of the micro-batches: tokens, prefill vs decode, predicted time (StepRecords)."""
    tokens = [sum(n for _, _, n, _ in r.seqs) for r in records]
    prefill = [_prefill_tokens(r, prompt_lens) for r in records]
    predicted = [r.predicted_time for r in records if r.predicted_time > 0]
    return {
        "num_steps": len(records),
        "tokens_per_step": distribution(tokens),
        "steps_with_prefill": sum(1 for p in prefill if p > 0),
        "decode_only_steps": sum(1 for p in prefill if p == 0),
        "max_prefill_tokens_in_step": max(prefill, default=0),
        "predicted_time_s": distribution(predicted),
        "predicted_time_cv": coefficient_of_variation(predicted),
    }


def _prefill_tokens(record, prompt_lens: Mapping[str, int]) -> int:
    """Tokens of prompt chunks in a step (a recomputation after preemption counts too)."""
    return sum(n for rid, start, n, _ in record.seqs if start < prompt_lens.get(rid, 0) or n > 1)


def prefill_summary(records: Sequence, prompt_lens: Mapping[str, int], cache) -> dict:
    """Prefill work the prompts asked for against what the steps computed (StepRecords), and
    the prefix cache's counters over the run (``scheduler.PrefixCacheStats``): what prefix
    caching and grouping save. A recomputation after preemption counts as computed, so the
    saved fraction can fall below the cache hit rate (or below 0)."""
    requested = sum(prompt_lens.values())
    computed = sum(_prefill_tokens(r, prompt_lens) for r in records)
    return {
        "prefill_tokens_requested": requested,
        "prefill_tokens_computed": computed,
        "saved_fraction": 1.0 - computed / requested if requested else 0.0,
        "cache_hit_tokens": cache.num_cached_prompt_tokens,
        "cache_hit_rate": cache.prompt_hit_rate,
        "cache_hit_tokens_with_restarts": cache.num_cached_tokens,
        "cache_evictions": cache.num_evictions,
    }


def decode_stalls(records: Sequence, prompt_lens: Mapping[str, int], *,
                  decode_share_distance: int | None = None) -> list[tuple[int, str]]:
    """(step id, request id) for every micro-batch that carried prompt tokens while a request
    in its decode phase was left out though it could have run (its previous token was back).

    A request is in its decode phase at step k when its last prompt chunk ran in a step before
    k and it runs a decode step (start >= its prompt length) after k. Under stall-free batching
    (sarathi) this list is empty: decodes go first into every micro-batch. Under vllm every
    whole-prompt batch stalls the ongoing decodes. (Preemption is not modelled: a preempted
    request waiting for readmission would be listed.)

    ``decode_share_distance``: token feedback's decode balancing (``SchedulerConfig.balance_decodes``)
    at this feedback distance. A micro-batch then takes at most ceil(decoding / distance) decodes
    whether or not prompts ride along, so one that took at least that many of the requests seen
    decoding here stalled no one (those seen are a subset of what the scheduler counted: the
    share checked is never above the one it applied).
    """
    steps = {r.step_id: r for r in records}
    order = sorted(steps)
    prompt_done: dict[str, int] = {}  # request -> step of its last prompt chunk
    last_decode: dict[str, int] = {}
    for sid in order:
        for rid, start, n, _ in steps[sid].seqs:
            plen = prompt_lens.get(rid)
            if plen is None:
                continue
            if start >= plen:
                last_decode[rid] = sid
            elif start + n >= plen:
                prompt_done.setdefault(rid, sid)
    stalls = []
    for sid in order:
        rec = steps[sid]
        if _prefill_tokens(rec, prompt_lens) == 0:
            continue
        decoding = [rid for rid, done in prompt_done.items() if done < sid < last_decode.get(rid, -1)]
        if decode_share_distance is not None:
            share = -(-len(decoding) // decode_share_distance)
            num_decodes = sum(1 for rid, start, _, _ in rec.seqs if rid in prompt_lens and start >= prompt_lens[rid])
            if num_decodes >= share:
                continue
        busy = {rid for other in rec.in_flight if other in steps for rid, _, _, _ in steps[other].seqs}
        stalls.extend((sid, rid) for rid in decoding if rid not in busy)
    return stalls


# ---- model FLOPs and bytes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What FLOP and byte counts need of a Llama-family model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int
    num_experts: int = 0
    """Experts per layer of a mixture-of-experts model; 0: a dense MLP."""
    num_experts_per_tok: int = 0
    layer_weight_bytes: int | None = None
    """Bytes per weight of the decoder layers' projections: 1 with FP8 weights; None: dtype_bytes."""
    sliding_layers: SlidingLayers | None = None
    """Layers that attend over a sliding window (Gemma, Phi-3); None: every layer full."""

    @classmethod
    def of(cls, config, dtype_bytes: int) -> ModelShape:
        fp8 = getattr(config, "quantization", None) == "fp8"
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                   config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                   config.vocab_size, dtype_bytes, getattr(config, "num_local_experts", 0),
                   getattr(config, "num_experts_per_tok", 0), 1 if fp8 else None,
                   SlidingLayers.of(getattr(config, "layer_windows", ())))

    @property
    def layer_params(self) -> int:
        """Weights one token's matmuls use in a layer: an MoE's router and its k experts."""
        return self._layer_params(self.num_experts_per_tok)

    @property
    def layer_weights(self) -> int:
        """Weights a layer holds: every expert of an MoE."""
        return self._layer_params(self.num_experts)

    def _layer_params(self, num_experts_counted: int) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            mlp = h * self.num_experts + num_experts_counted * mlp  # router + experts
        return h * q + 2 * h * kv + q * h + mlp

    def flops(self, num_tokens: int, attn_work: float, num_sampled: int) -> float:
        """Matmul FLOPs of a micro-batch: 2 per weight per token, QK^T and PV over each
        request's context (attn_work = sum of q_i * ctx_i, a mean over the layers: ``Work.of``
        with ``sliding_layers``), the LM head for sampled rows."""
        linear = 2.0 * self.num_layers * self.layer_params * num_tokens
        attention = 4.0 * self.num_layers * self.num_heads * self.head_dim * attn_work
        return linear + attention + 2.0 * self.hidden_size * self.vocab_size * num_sampled

    def bytes_moved(self, context_tokens: float) -> float:
        """Bytes a decode micro-batch must read: every weight once (norms aside), plus the KV of
        its contexts (``context_tokens``: a mean over the layers, ``Work.kv_tokens``; a sliding
        layer reads its window only).
        An MoE counts every expert: a batch of B tokens reads up to B·k of them, so this is
        exact once B·k covers the experts and an upper bound before."""
        layers = self.num_layers * self.layer_weights * (self.layer_weight_bytes or self.dtype_bytes)
        head = self.hidden_size * self.vocab_size
        kv = 2 * self.num_layers * self.num_kv_heads * self.head_dim * context_tokens
        return float(layers + (head + kv) * self.dtype_bytes)


# Dense bf16 tensor-core peak (TFLOP/s) and memory bandwidth (GB/s), SXM parts, from the
# vendors' data sheets. Matched against torch.cuda.get_device_name().
KNOWN_CARDS = {
    "H200": (989.4, 4800.0),
    "H100": (989.4, 3350.0),
    "A100": (312.0, 2039.0),
    "L40S": (362.0, 864.0),
    "A10G": (70.0, 600.0),
}


def card_peaks(device_name: str) -> tuple[float | None, float | None]:
    for key, peaks in KNOWN_CARDS.items():
        if key in device_name:
            return peaks
    return None, None


def efficiency(records: Sequence, busy_by_step: Mapping[int, float], shape: ModelShape, prompt_lens,
               *, peak_tflops: float | None, peak_mem_bw_gbps: float | None) -> dict:
    """Prefill MFU (steps carrying prompt tokens) and decode MBU (decode-only steps), each over
    the device-seconds those steps were busy (so pipeline bubbles do not count against them)."""
    pre_flops = pre_time = dec_bytes = dec_time = 0.0
    for r in records:
        t = busy_by_step.get(r.step_id)
        if not t:
            continue
        work = Work.of(((start, q) for _, start, q, _ in r.seqs), shape.sliding_layers)
        if _prefill_tokens(r, prompt_lens) > 0:
            pre_flops += shape.flops(work.num_tokens, work.attn_work, sum(1 for *_, s in r.seqs if s))
            pre_time += t
        else:
            dec_bytes += shape.bytes_moved(work.kv_tokens)
            dec_time += t
    tflops = pre_flops / pre_time / 1e12 if pre_time else None
    gbps = dec_bytes / dec_time / 1e9 if dec_time else None
    return {
        "prefill_tflops": tflops,
        "decode_gb_per_s": gbps,
        "peak_tflops": peak_tflops,
        "peak_mem_bw_gbps": peak_mem_bw_gbps,
        "prefill_mfu": tflops / peak_tflops if tflops is not None and peak_tflops else None,
        "decode_mbu": gbps / peak_mem_bw_gbps if gbps is not None and peak_mem_bw_gbps else None,
    }


# ---- capacity under an SLO -------------------------------------------------------------------------


@dataclass(slots=True)
class CapacityResult:
    capacity: float
    """Highest arrival rate (requests/s) found to meet the SLO; 0.0 if none did."""
    probes: list[tuple[float, bool]]
    """(rate, met the SLO?) in the order tried."""
    converged: bool


def find_capacity(meets_slo: Callable[[float], bool], *, start_rate: float, rel_tol: float = 0.05,
                  max_probes: int = 16, min_rate: float = 1e-3) -> CapacityResult:
    """Binary search for the highest rate at which ``meets_slo(rate)`` holds, assuming it holds
    below some threshold and fails above it (latency grows with load).

    Doubles (or halves) from ``start_rate`` to bracket the threshold, then bisects until the
    bracket is within ``rel_tol`` of its upper end or ``max_probes`` probes were spent.
    """
    if start_rate <= 0 or rel_tol <= 0 or max_probes < 1:
        raise ValueError("start_rate, rel_tol and max_probes must be positive")
    probes: list[tuple[float, bool]] = []

    def probe(rate: float) -> bool:
        ok = bool(meets_slo(rate))
        probes.append((rate, ok))
        return ok

    good, bad = 0.0, math.inf
    rate = start_rate
    while len(probes) < max_probes and bad == math.inf:  # bracket from below: double
        if probe(rate):
            good, rate = rate, rate * 2
        else:
            bad = rate
    while len(probes) < max_probes and good == 0.0 and bad > min_rate:  # nothing passed: halve
        rate = bad / 2
        if probe(rate):
            good = rate
        else:
            bad = rate
    while len(probes) < max_probes and good > 0 and bad - good > rel_tol * bad:
        rate = (good + bad) / 2
        if probe(rate):
            good = rate
        else:
            bad = rate
    converged = good > 0 and bad != math.inf and bad - good <= rel_tol * bad
    return CapacityResult(capacity=good, probes=probes, converged=converged)


def meets_slo(summary: Mapping, *, tbt_p99_s: float, scheduling_delay_p50_s: float) -> bool:
    """Sarathi-Serve's capacity criterion on a request_summary: P99 TBT and P50 scheduling
    delay within their limits (a run without any TBT sample only checks the delay)."""
    tbt = summary["tbt_s"]["p99"]
    delay = summary["scheduling_delay_s"]["p50"]
    return (tbt is None or tbt <= tbt_p99_s) and delay is not None and delay <= scheduling_delay_p50_s


# ---- Chrome / Perfetto trace -----------------------------------------------------------------------


def chrome_trace(*, records: Sequence, done_times: Mapping[int, float], timelines: Sequence[StageTimeline],
                 arrivals: Mapping[str, float], t0: float, prompt_lens: Mapping[str, int]) -> dict:
    """Trace-event JSON: an engine lane (micro-batch lifetimes, request arrivals) and one lane
    per stage (waiting for input, computing), in microseconds since ``t0``."""
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    pid = 1
    lanes = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": "pipeserve"}},
             {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "engine"}},
             {"ph": "M", "pid": pid, "tid": 0, "name": "thread_sort_index", "args": {"sort_index": 0}}]
    events: list[dict] = []
    for r in records:
        done = done_times.get(r.step_id)
        args = {"tokens": sum(n for _, _, n, _ in r.seqs), "seqs": len(r.seqs),
                "prefill_tokens": _prefill_tokens(r, prompt_lens),
                "predicted_ms": round(r.predicted_time * 1e3, 3), "fed_from": list(r.fed_from)}
        events.append({"ph": "i", "s": "t", "pid": pid, "tid": 0, "name": f"submit {r.step_id}",
                       "ts": us(r.submitted_at), "args": args})
        if done is not None:  # micro-batches overlap under pp: async slices get their own rows
            events.append({"ph": "b", "cat": "microbatch", "id": r.step_id, "pid": pid, "tid": 0,
                           "name": f"mb {r.step_id}", "ts": us(r.submitted_at), "args": args})
            events.append({"ph": "e", "cat": "microbatch", "id": r.step_id, "pid": pid, "tid": 0,
                           "name": f"mb {r.step_id}", "ts": us(done)})
    for rid, t in arrivals.items():
        events.append({"ph": "i", "s": "t", "pid": pid, "tid": 0, "name": f"arrive {rid}", "ts": us(t)})
    tokens = {r.step_id: sum(n for _, _, n, _ in r.seqs) for r in records}
    for tl in sorted(timelines, key=lambda t: t.rank):
        tid = 1 + tl.rank
        name = f"stage {tl.stage}" + (f" tp{tl.tp_rank}" if tl.tp_rank else "")
        lanes.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
        lanes.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        for s in tl.spans:
            if s.recv_wait > 0:
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": "recv wait", "cat": "wait",
                               "ts": us(s.recv_start), "dur": round(s.recv_wait * 1e6, 3),
                               "args": {"step": s.step_id}})
            args = {"step": s.step_id, "tokens": tokens.get(s.step_id)}
            if s.queued is not None:  # after the start: the host was still launching meanwhile
                args["queued_ms"] = round((s.queued - s.start) * 1e3, 3)
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": f"mb {s.step_id}", "cat": "compute",
                           "ts": us(s.start), "dur": round(s.busy * 1e6, 3), "args": args})
    return {"traceEvents": lanes + events, "displayTimeUnit": "ms"}


# ---- plots --------------------------------------------------------------------------------------


def plot_latency_cdfs(requests: Sequence[RequestTimes], path: str, title: str = "") -> None:
    """CDFs of TTFT, TBT, end-to-end latency and scheduling delay (seconds), one panel each."""
    plt = _pyplot()
    panels = [("TTFT", [r.ttft for r in requests]), ("TBT", [x for r in requests for x in r.tbts]),
              ("end-to-end latency", [r.e2e for r in requests]),
              ("scheduling delay", [r.scheduling_delay for r in requests])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, panels):
        v = sorted(values)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(percentile(v, q), color="grey", linestyle=style, label=f"P{q} {percentile(v, q):.3g}s")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_stage_timeline(timelines: Sequence[StageTimeline], path: str, *, t0: float, title: str = "") -> None:
    """One row per stage: compute (blue) and waiting for input (orange) over time."""
    plt = _pyplot()
    rows = sorted((tl for tl in timelines if tl.tp_rank == 0), key=lambda t: t.stage)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * max(len(rows), 1)))
    for i, tl in enumerate(rows):
        # Thin edges keep sub-pixel spans visible on long runs.
        ax.broken_barh([(s.recv_start - t0, s.recv_wait) for s in tl.spans if s.recv_wait > 0],
                       (i - 0.35, 0.7), facecolors="tab:orange", edgecolors="tab:orange", linewidth=0.3)
        ax.broken_barh([(s.start - t0, s.busy) for s in tl.spans], (i - 0.35, 0.7), facecolors="tab:blue",
                       edgecolors="tab:blue", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"stage {tl.stage}" for tl in rows])
    ax.set_xlabel("seconds since the run started")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange")]
    ax.legend(handles, ["compute", "waiting for input"], loc="upper right", fontsize=8)
    ax.set_title(title or "stage timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt
