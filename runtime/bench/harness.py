"""The benchmark harness: run a workload through an engine, time it, and write what it measured.

    result = run_bench(engine_config, workload, options=BenchOptions(), capacity=CapacityOptions(),
                       out_dir="runs/x", record={...})
    print(format_table(result))

Requests are added to the engine when their arrival time comes (the engine steps in between),
with random prompt token ids of the workload's lengths and ignore-EOS outputs of its output
lengths. With parallel.tp × parallel.pp > 1 the engine stays in this process and its workers
(torchrun) write their per-step timelines at shutdown (PIPESERVE_STAGE_STATS_DIR), so nothing
synchronizes the device while the run is timed. Optionally a capacity search follows
(Sarathi-Serve's: the highest arrival rate that meets the SLOs).

Writes into the run directory: result.json, trace.json (Chrome/Perfetto), latency_cdf.png,
stage_timeline.png and steps.json. Takes typed configs; `pipeserve bench` (launch/bench.py)
composes them with Hydra.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import glob
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from pipeserve.runtime.bench import metrics as M
from pipeserve.runtime.bench.prefix_workloads import ideal_cached_fraction
from pipeserve.runtime.bench.workload import (
    RequestSpec,
    WorkloadConfig,
    build_workload,
    fit_to_context,
    natural_rate,
    workload_summary,
)
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.worker.worker import STAGE_STATS_DIR_ENV
from pipeserve.runtime.engine.llm_engine import LLMEngine
from pipeserve.scheduler.prefix_cache import PrefixCacheStats
from pipeserve.scheduler.prefix_tree import group_by_prefix, schedule_order
from pipeserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    warmup_requests: int = 2
    """Short requests run (and discarded) before the timed run."""
    progress: bool = True
    """tqdm progress bar while the run goes."""
    plots: bool = True
    """Write latency_cdf.png and stage_timeline.png."""
    save_steps: bool = True
    """Write steps.json: every micro-batch's sequences, in-flight set and times."""
    peak_tflops: float | None = None
    """Per-device peak for MFU; None = a known card's bf16 dense peak (else no MFU)."""
    peak_mem_bw_gbps: float | None = None
    """Per-device memory bandwidth for MBU; None = a known card's (else no MBU)."""

    def __post_init__(self) -> None:
        if self.warmup_requests < 0:
            raise ValueError("bench.warmup_requests must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class CapacityOptions:
    enabled: bool = False
    """After the run, binary-search the arrival rate that meets the SLO below."""
    tbt_p99_slo_s: float = 0.1
    """P99 time between tokens must stay at or below this."""
    scheduling_delay_p50_slo_s: float = 2.0
    """P50 scheduling delay must stay at or below this (Sarathi-Serve's definition)."""
    start_rate: float | None = None
    """First rate probed (requests/s); None = workload.rate (or the trace's own rate)."""
    rel_tol: float = 0.05
    """Stop when the bracket is within this fraction of its upper end."""
    max_probes: int = 12
    num_requests: int | None = None
    """Requests per probe (at least); None = workload.num_requests."""
    probe_duration_s: float | None = None
    """Give each probe at least rate × this many requests, so that arrivals last this long: a
    short burst ends before an overloaded engine's queue has grown, and then passes the
    scheduling-delay SLO at any rate. None = exactly num_requests."""

    def __post_init__(self) -> None:
        if self.tbt_p99_slo_s <= 0 or self.scheduling_delay_p50_slo_s <= 0 or self.rel_tol <= 0:
            raise ValueError("capacity SLOs and rel_tol must be > 0")
        if self.probe_duration_s is not None and self.probe_duration_s <= 0:
            raise ValueError("capacity.probe_duration_s must be > 0")

    def requests_per_probe(self, rate: float, default: int) -> int:
        """How many requests a probe at ``rate`` req/s runs."""
        base = self.num_requests or default
        if self.probe_duration_s is None:
            return base
        return max(base, math.ceil(rate * self.probe_duration_s))


@dataclass(slots=True)
class RunData:
    """What one workload run leaves behind (times are time.monotonic seconds)."""

    requests: list[M.RequestTimes]
    specs: dict[str, RequestSpec]
    t0: float
    t_end: float
    first_step: int
    end_step: int
    prefix_cache: PrefixCacheStats
    """The scheduler's prefix-cache counters over this run only."""
    output_token_ids: dict[str, list[int]]
    """Each request's generated tokens (greedy runs compare them)."""


# ---- running a workload ----------------------------------------------------------------------


class Bench:
    """An engine plus the bookkeeping to time workloads on it."""

    def __init__(self, config: EngineConfig, *, loaded=None, stage_dir: str | None = None) -> None:
        # The workers record their timelines and write them here at shutdown (in a group, rank 0
        # writes every rank's; torchrun workers inherit the variable).
        self.stage_dir = stage_dir or tempfile.mkdtemp(prefix="pipeserve-stages-")
        os.environ[STAGE_STATS_DIR_ENV] = self.stage_dir
        self.engine = LLMEngine(config, loaded=loaded, record_steps=True)
        self.config = config
        self._seq = 0
        self._outputs: dict[str, list[int]] = {}  # the current run's generated tokens

    @property
    def next_step_id(self) -> int:
        records = self.engine.step_records
        return records[-1].step_id + 1 if records else 0

    def fit(self, specs: list[RequestSpec]) -> tuple[list[RequestSpec], int]:
        """Cut prompts/outputs to the engine's max_model_len; returns (specs, how many were cut)."""
        return fit_to_context(specs, self.engine.state.max_model_len)

    def run(self, specs: list[RequestSpec], *, seed: int, prefix: str = "r", progress: bool = False,
            desc: str = "bench") -> RunData:
        """Adds each request when its arrival time comes, steps the engine in between, and
        returns when every request has finished."""
        import numpy as np
        from tqdm import tqdm

        rng = np.random.default_rng(seed)
        vocab = self.engine.model_config.vocab_size
        # Drawn before the clock starts, so making prompts never delays an arrival.
        prompts = {s.index: list(s.prompt_token_ids) if s.prompt_token_ids is not None
                   else rng.integers(0, vocab, s.prompt_len).tolist() for s in specs}
        pending = deque(self._queue_order(specs, prompts))
        finished: list[M.RequestTimes] = []
        self._outputs = {}
        first_step = self.next_step_id
        cache_before = self.engine.scheduler.prefix_cache_stats
        bar = tqdm(total=len(specs), desc=desc, unit="req", disable=not progress, dynamic_ncols=True)
        t0 = time.monotonic()
        while pending or self.engine.has_unfinished_requests():
            self._add_arrivals(pending, prompts, prefix, t0)
            if not self.engine.has_unfinished_requests():
                self.engine.executor.idle()  # heartbeats while waiting for the next arrival
                time.sleep(min(max(t0 + pending[0].arrival_s - time.monotonic(), 0.0), 0.05))
                continue
            done = self._step()
            finished += done
            bar.update(len(done))
            bar.set_postfix(running=self.engine.scheduler.num_running,
                            waiting=self.engine.scheduler.num_waiting, refresh=False)
        bar.close()
        t_end = max((r.finished for r in finished), default=time.monotonic())
        by_id = {f"{prefix}{s.index}": s for s in specs}
        cache = _stats_since(cache_before, self.engine.scheduler.prefix_cache_stats)
        return RunData(finished, by_id, t0, t_end, first_step, self.next_step_id, cache, self._outputs)

    def _queue_order(self, specs: list[RequestSpec], prompts: dict[int, list[int]]) -> list[RequestSpec]:
        """Arrival order. With scheduler.prefix_grouping, requests that arrive together (an
        offline batch) are queued BatchLLM-style, as ``LLM.generate`` queues a batch: shared
        prefixes together, groups with more decode work first (``scheduler.prefix_tree``)."""
        ordered = sorted(specs, key=lambda s: s.arrival_s)
        if not self.config.scheduler.prefix_grouping:
            return ordered
        out = []
        for _, batch in itertools.groupby(ordered, key=lambda s: s.arrival_s):
            batch = list(batch)
            groups = group_by_prefix([prompts[s.index] for s in batch], [s.output_len for s in batch],
                                     block_size=self.config.block_size)
            out += [batch[i] for i in schedule_order(groups)]
        return out

    def _add_arrivals(self, pending: deque, prompts: dict, prefix: str, t0: float) -> None:
        """Every request whose arrival time has come, stamped with that time (not now: a late
        add counts as scheduling delay, as it would for a real client)."""
        now = time.monotonic()
        while pending and t0 + pending[0].arrival_s <= now:
            spec = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
            self.engine.add_request(f"{prefix}{spec.index}", prompts.pop(spec.index), params,
                                    arrival_time=t0 + spec.arrival_s)

    def _step(self) -> list[M.RequestTimes]:
        done = []
        for out in self.engine.step():
            if out.finished:
                if out.outputs[0].finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                done.append(M.RequestTimes.of(out))
                self._outputs[out.request_id] = list(out.outputs[0].token_ids)
        return done

    def warm_up(self, num_requests: int) -> None:
        """Requests before the measured run (their steps are left out of its records): the
        first with a prompt of two token budgets and more, so chunked prefills over a prior
        context and decode batches run (and compile) once before the clock starts."""
        if num_requests:
            budget = self.config.scheduler.max_num_batched_tokens
            longest = max(self.engine.state.max_model_len - 16, 16)
            lens = [min(2 * budget + 37, longest)] + [16 + 7 * i for i in range(1, num_requests)]
            self.run([RequestSpec(i, 0.0, n, 8) for i, n in enumerate(lens)], seed=1, prefix="warmup")

    def close(self) -> list[M.StageTimeline]:
        """Stops the engine (and workers); returns every rank's stage timeline."""
        self.engine.close()
        timelines = []
        # (written before the workers exited: engine.close() waits for them)
        for path in sorted(glob.glob(os.path.join(self.stage_dir, "stage_rank*.json"))):
            with open(path) as f:
                timelines.append(M.StageTimeline.from_json(json.load(f)))
        os.environ.pop(STAGE_STATS_DIR_ENV, None)
        return timelines


# ---- results ----------------------------------------------------------------------------------


def analyze(bench: Bench, run: RunData, timelines: list[M.StageTimeline], *, options: BenchOptions) -> dict:
    """The result dict of one run (without config and capacity)."""
    prompt_lens = {rid: s.prompt_len for rid, s in run.specs.items()}
    records = [r for r in bench.engine.step_records if run.first_step <= r.step_id < run.end_step]
    window = [tl.within(run.first_step) for tl in timelines]
    window = [dataclasses.replace(tl, spans=[s for s in tl.spans if s.step_id < run.end_step]) for tl in window]
    stages, loaded = M.stage_bubbles(window, run.requests, t0=run.t0, t_end=run.t_end,
                                     depth=bench.config.parallel.depth)
    saturated = M.prompt_pending_intervals(run.requests, records, prompt_lens)
    for st, tl in zip(stages, sorted(window, key=lambda t: t.rank)):
        st["bubble_fraction_saturated"] = M.bubble_in_intervals(tl, saturated)
    lead = [s for s in stages if s["tp_rank"] == 0]
    result = M.request_summary(run.requests, run.t_end - run.t0)
    result["stages"] = stages
    result["loaded_window_s"] = loaded[1] - loaded[0] if loaded else None
    result["bubble_fraction_mean"] = _mean(s["bubble_fraction"] for s in lead)
    result["bubble_fraction_loaded_mean"] = _mean(s["bubble_fraction_loaded"] for s in lead)
    result["saturated_s"] = sum(b - a for a, b in saturated)
    result["bubble_fraction_saturated_mean"] = _mean(s["bubble_fraction_saturated"] for s in lead)
    result["step_time_cv_mean"] = _mean(s["step_time_cv"] for s in lead)
    result["steps"] = M.step_summary(records, prompt_lens)
    result["prefill"] = M.prefill_summary(records, prompt_lens, run.prefix_cache)
    prompts = [s.prompt_token_ids for s in run.specs.values()]
    if all(p is not None for p in prompts):  # prefix workloads: what an unbounded cache could save
        result["prefill"]["ideal_saved_fraction"] = ideal_cached_fraction(prompts, block_size=bench.config.block_size)
    par, sch = bench.config.parallel, bench.config.scheduler
    share_distance = par.feedback_distance if sch.balance_decodes else None
    result["num_decode_stalls"] = len(M.decode_stalls(records, prompt_lens, decode_share_distance=share_distance))
    result["num_preemptions"] = bench.engine.scheduler.num_preemptions
    device = _device_name(bench.engine.state.device)
    peaks = M.card_peaks(device)
    shape = M.ModelShape.of(bench.engine.model_config, bench.engine.state.dtype.itemsize)
    busy = M.stage_busy_by_step(window)
    result["efficiency"] = M.efficiency(
        records, busy, shape, prompt_lens,
        peak_tflops=options.peak_tflops or peaks[0], peak_mem_bw_gbps=options.peak_mem_bw_gbps or peaks[1],
    )
    result["device"] = device
    return result


def _stats_since(before: PrefixCacheStats, after: PrefixCacheStats) -> PrefixCacheStats:
    names = [f.name for f in dataclasses.fields(PrefixCacheStats)]
    return PrefixCacheStats(**{n: getattr(after, n) - getattr(before, n) for n in names})


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def _device_name(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_outputs(out_dir: str, result: dict, bench: Bench, run: RunData, timelines, options: BenchOptions) -> dict:
    """trace.json, plots and steps.json beside result.json; returns their file names."""
    files = {"result": "result.json", "trace": "trace.json"}
    prompt_lens = {rid: s.prompt_len for rid, s in run.specs.items()}
    records = [r for r in bench.engine.step_records if run.first_step <= r.step_id < run.end_step]
    window = [tl.within(run.first_step) for tl in timelines]
    trace = M.chrome_trace(records=records, done_times=bench.engine.step_done_times, timelines=window,
                           arrivals={r.request_id: r.arrival for r in run.requests}, t0=run.t0,
                           prompt_lens=prompt_lens)
    _dump(os.path.join(out_dir, "trace.json"), trace)
    if options.plots:
        title = f"{result['config']['scheduler']['policy']} · {result['workload']['name']}"
        M.plot_latency_cdfs(run.requests, os.path.join(out_dir, "latency_cdf.png"), title=title)
        M.plot_stage_timeline(window, os.path.join(out_dir, "stage_timeline.png"), t0=run.t0, title=title)
        files.update(latency_cdf="latency_cdf.png", stage_timeline="stage_timeline.png")
    if options.save_steps:
        done = bench.engine.step_done_times
        steps = [{"step_id": r.step_id, "submitted_at": r.submitted_at - run.t0,
                  "done_at": done[r.step_id] - run.t0 if r.step_id in done else None,
                  "predicted_time": r.predicted_time, "in_flight": list(r.in_flight),
                  "seqs": [list(s) for s in r.seqs]} for r in records]
        _dump(os.path.join(out_dir, "steps.json"), {"prompt_lens": prompt_lens, "steps": steps})
        files["steps"] = "steps.json"
    return files


def _dump(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1 if path.endswith("result.json") else None)


def format_table(result: dict) -> str:
    """The printed summary: one line per metric, one row per stage."""
    r = result
    lines = [f"pipeserve bench · {r['workload']['name']} · {r['config']['scheduler']['policy']}"
             f" · tp={r['config']['parallel']['tp']} pp={r['config']['parallel']['pp']} · {r['device']}",
             *M.format_latency_table(r)]
    lines += ["", "| stage | rank | steps | busy s | recv wait s | idle s | bubble | while loaded"
              " | while prompts wait | step CV |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in r["stages"]:
        lines.append(f"| {s['stage']} | {s['rank']} | {s['num_steps']} | {s['busy_s']:.2f} | {s['recv_wait_s']:.2f}"
                     f" | {s['idle_s']:.2f} | {_pct(s['bubble_fraction'])} | {_pct(s.get('bubble_fraction_loaded'))}"
                     f" | {_pct(s.get('bubble_fraction_saturated'))} | {M.format_number(s['step_time_cv'])} |")
    eff = r["efficiency"]
    pre = r["prefill"]
    ideal = f", ideal {_pct(pre['ideal_saved_fraction'])}" if "ideal_saved_fraction" in pre else ""
    lines.append(f"prefill tokens {pre['prefill_tokens_requested']} requested,"
                 f" {pre['prefill_tokens_computed']} computed: {_pct(pre['saved_fraction'])} saved{ideal}"
                 f" (prefix cache hit rate {_pct(pre['cache_hit_rate'])},"
                 f" {pre['cache_evictions']} evictions)")
    lines.append(f"prefill {M.format_number(eff['prefill_tflops'])} TFLOP/s (MFU {_pct(eff['prefill_mfu'])}),"
                 f" decode {M.format_number(eff['decode_gb_per_s'])} GB/s (MBU {_pct(eff['decode_mbu'])}),"
                 f" decode stalls {r['num_decode_stalls']}, preemptions {r['num_preemptions']}")
    if cap := r.get("capacity"):
        lines.append(f"capacity {cap['capacity_rps']:.3f} req/s under P99 TBT <= {cap['tbt_p99_slo_s'] * 1e3:g} ms"
                     f" and P50 scheduling delay <= {cap['scheduling_delay_p50_slo_s']:g} s"
                     f" ({len(cap['probes'])} probes{'' if cap['converged'] else ', not converged'})")
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


# ---- capacity ---------------------------------------------------------------------------------


def search_capacity(bench: Bench, workload: WorkloadConfig, cap: CapacityOptions, *, progress: bool) -> dict:
    """Binary search on the arrival rate (each probe a fresh run of the workload on this engine)."""
    if workload.arrival == "offline":
        raise ValueError("capacity search needs arrivals at a rate (poisson, gamma or trace), not offline")
    start = cap.start_rate or workload.rate
    if start is None:
        start = natural_rate(workload)
    details = []

    def probe(rate: float) -> bool:
        vocab_size = bench.engine.model_config.vocab_size
        n = cap.requests_per_probe(rate, workload.num_requests)
        probe_workload = dataclasses.replace(workload.with_rate(rate), num_requests=n)
        specs, _ = bench.fit(build_workload(probe_workload, vocab_size=vocab_size))
        run = bench.run(specs, seed=workload.seed, prefix=f"c{len(details)}-", progress=progress,
                        desc=f"capacity {rate:.3g} req/s")
        summary = M.request_summary(run.requests, run.t_end - run.t0)
        ok = M.meets_slo(summary, tbt_p99_s=cap.tbt_p99_slo_s, scheduling_delay_p50_s=cap.scheduling_delay_p50_slo_s)
        details.append({"rate": rate, "num_requests": n, "meets_slo": ok, "tbt_p99_s": summary["tbt_s"]["p99"],
                        "scheduling_delay_p50_s": summary["scheduling_delay_s"]["p50"],
                        "throughput_rps": summary["throughput"]["requests_per_s"]})
        return ok

    found = M.find_capacity(probe, start_rate=start, rel_tol=cap.rel_tol, max_probes=cap.max_probes)
    return {"capacity_rps": found.capacity, "converged": found.converged, "probes": details,
            "tbt_p99_slo_s": cap.tbt_p99_slo_s, "scheduling_delay_p50_slo_s": cap.scheduling_delay_p50_slo_s,
            "num_requests_per_probe": cap.num_requests or workload.num_requests,
            "probe_duration_s": cap.probe_duration_s}


# ---- one run, start to end ---------------------------------------------------------------------


def run_bench(engine: EngineConfig, workload: WorkloadConfig, *, options: BenchOptions, capacity: CapacityOptions,
              out_dir: str, record: dict | None = None, loaded=None) -> dict:
    """One benchmark run: warm-up, the timed workload, the capacity search if enabled; writes
    its files into ``out_dir`` and returns the result. ``record`` is the configuration as the
    user gave it, stored in result.json as ``config`` (None = these dataclasses); ``loaded`` a
    model already in memory (``load_model``'s result) instead of loading ``engine.model``."""
    os.makedirs(out_dir, exist_ok=True)
    bench = Bench(engine, loaded=loaded)
    try:
        specs = build_workload(workload, vocab_size=bench.engine.model_config.vocab_size)
        bench.warm_up(options.warmup_requests)
        specs, num_cut = bench.fit(specs)
        run = bench.run(specs, seed=workload.seed, progress=options.progress, desc=f"bench {workload.name}")
        found = search_capacity(bench, workload, capacity, progress=options.progress) if capacity.enabled else None
    except BaseException:
        bench.close()
        raise
    timelines = bench.close()
    if record is None:
        record = {**dataclasses.asdict(engine), "workload": dataclasses.asdict(workload),
                  "bench": dataclasses.asdict(options), "capacity": dataclasses.asdict(capacity)}
    result = {
        "config": record, "date": datetime.datetime.now().isoformat(), "commit": git_commit(), "pid": os.getpid(),
        "workload": {"name": workload.name, **workload_summary(specs), "num_cut_to_max_model_len": num_cut},
    }
    result.update(analyze(bench, run, timelines, options=options))
    if found is not None:
        result["capacity"] = found
    result["files"] = write_outputs(out_dir, result, bench, run, timelines, options)
    _dump(os.path.join(out_dir, "result.json"), result)
    return result


def git_commit() -> str | None:
    """This checkout's short commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
