"""An ideal pipeline: the bubbles a schedule leaves when nothing but the device costs time.

    python -m tools.pipeline_sim --cost-model cost_model.json --pp 2 --rate 6 8 \\
        --num-requests 288 --runs sarathi:128 sarathi:time128 orca [--head-us 120]

The real ``Scheduler`` plans every micro-batch, driven by a virtual clock the way ``pipeserve
bench`` drives the engine: arrivals are added between steps, up to the pipeline depth of
micro-batches are in flight, the oldest result is awaited, then the scheduler is updated and
requests that reached their output length leave. A micro-batch costs the profile's prediction
for the whole model (``pipeserve profile``'s cost model, launch overhead included): the LM head
and sampling (``head_s``) on the last stage, the rest split by each stage's share of the layers.
A stage starts a micro-batch once it is free and its input is there: the plan, the previous
stage's hidden states, and on the first stage with token feedback the sampled ids of the steps
its decodes are fed from, each ``hop_s`` after the stage that made them. The result reaches the
engine ``hop_s`` after the last stage.

``--offline uniform`` (or ``decode-heavy``) runs ``benchmarks/throughput.py``'s workload
instead (its requests' lengths, all arriving at once) and adds the makespan and throughput, so
that runs at pp = 1, 2 and 4 give the most a pipeline of the profiled card can make of that
workload under this schedule:

    python -m tools.pipeline_sim --cost-model cost_model.json --pp 2 --offline uniform \
        --runs sarathi:2048,max_num_seqs=256

Nothing else costs time: no planning, no host between steps. So the bubbles are what the
schedule itself leaves (micro-batches of uneven time, the decode groups' chain, too few requests
to fill the pipeline, the drain): a floor for an engine that runs that schedule, and a comparison
of policies on equal terms. (SARATHI's pipeline-bubble figures come from such a simulation.)
Measured runs are in BENCHMARKS.md; this says how far they are from the floor.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from pipeserve.parallel.stage_plan import model_costs, plan_model_stages
from pipeserve.runtime.config import ParallelConfig
from pipeserve.runtime.engine.llm_engine import StepRecord
from pipeserve.runtime.bench.metrics import (
    RequestTimes,
    StageSpan,
    StageTimeline,
    chrome_trace,
    request_summary,
    stage_bubbles,
)
from pipeserve.runtime.bench.workload import RequestSpec, WorkloadConfig, build_workload, fit_to_context
from pipeserve.scheduler import CostModel, Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerLimits, Work

_SCHEDULER_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "scheduler"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """The device side of the simulation."""

    cost_model: CostModel
    """The whole model's time per micro-batch (one GPU's profile)."""
    layer_shares: tuple[float, ...]
    """Each stage's share of the decoder layers' time (one per stage, summing to 1)."""
    head_s: float = 0.0
    """The last stage's LM head and sampling per micro-batch: a weight read, about the same for
    a decode step and a prompt chunk's few sampled rows."""
    hop_s: float = 30e-6
    """Hidden states to the next stage, sampled ids to the first, a result to the engine."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Depth and token feedback, as the engine reads them (pp = len(layer_shares))."""

    def __post_init__(self) -> None:
        if self.parallel.pp != len(self.layer_shares) or abs(sum(self.layer_shares) - 1.0) > 1e-9:
            raise ValueError(f"need pp={self.parallel.pp} layer shares summing to 1, got {self.layer_shares}")
        if self.head_s < 0 or self.hop_s < 0:
            raise ValueError("head_s and hop_s must be >= 0")

    def stage_seconds(self, work: Work) -> list[float]:
        """Each stage's time for a micro-batch of these totals."""
        body = max(self.cost_model.predict(work) - self.head_s, 0.0)
        seconds = [body * share for share in self.layer_shares]
        seconds[-1] += self.head_s
        return seconds


@dataclass(slots=True)
class SimRun:
    """A simulated run: every stage's spans, every request's times and the engine's record of
    each micro-batch (virtual seconds from 0, the run's start)."""

    timelines: list[StageTimeline]
    requests: list[RequestTimes]
    parallel: ParallelConfig
    records: list[StepRecord]
    done_times: dict[int, float]
    """Step id -> when the engine had its result."""

    @property
    def fed_from(self) -> dict[int, tuple[int, ...]]:
        """Step id -> the steps its fed decodes take their ids from."""
        return {r.step_id: r.fed_from for r in self.records}

    def write(self, folder: str) -> None:
        """trace.json and result.json as ``pipeserve bench`` writes them, so that
        ``python -m tools.pipeline_gaps FOLDER`` reads the ideal run like a measured one."""
        os.makedirs(folder, exist_ok=True)
        trace = chrome_trace(records=self.records, done_times=self.done_times, timelines=self.timelines,
                             arrivals={r.request_id: r.arrival for r in self.requests}, t0=0.0,
                             prompt_lens={r.request_id: r.num_prompt_tokens for r in self.requests})
        result = {**self.summary(), "config": {"parallel": {"pp": self.parallel.pp,
                                                            "token_feedback": self.parallel.token_feedback,
                                                            "depth": self.parallel.depth}}}
        for name, data in (("trace.json", trace), ("result.json", result)):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(data, f)

    def summary(self) -> dict:
        """Per stage the bubble over the run and while loaded, as ``pipeserve bench`` reports
        them (its wall: the run's start to the last request's finish), and the request metrics."""
        if not self.requests:
            raise ValueError("an empty run has no bubbles")
        end = max(r.finished for r in self.requests)
        stages, _ = stage_bubbles(self.timelines, self.requests, t0=0.0, t_end=end, depth=self.parallel.depth)
        return {"stages": stages, **request_summary(self.requests, end)}


def layer_shares(config, pp: int) -> tuple[float, ...]:
    """Each stage's share of the layers in the stage plan."""
    return tuple(s.num_layers / config.num_hidden_layers for s in plan_model_stages(config, pp))


def head_floor(cost_model: CostModel, config) -> float:
    """The LM head's weight read: its share of the profile's floor for a step below the knee."""
    head = model_costs(config)["head_cost"]
    return cost_model.per_token * cost_model.knee_tokens * head / (config.num_hidden_layers + head)


def simulate(specs: Sequence[RequestSpec], config: SchedulerConfig, pipe: Pipeline, *, max_model_len: int,
             num_blocks: int = 1 << 16, block_size: int = 16) -> SimRun:
    """Runs ``specs`` (lengths within ``max_model_len``, the engine's context cap, as
    ``fit_to_context`` cuts them) through the scheduler and the ideal pipeline; each request
    generates its output length."""
    if config.enable_prefix_caching:
        raise ValueError("the simulation's prompts are placeholders: prefix caching would share them all")
    sim = _Simulation(config, pipe, max_model_len, num_blocks, block_size)
    pending = deque(sorted(specs, key=lambda s: s.arrival_s))
    while pending or sim.scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_s <= sim.clock:
            sim.add(pending.popleft())
        if not sim.scheduler.has_unfinished_requests():
            sim.clock = pending[0].arrival_s
            continue
        sim.step()
    return SimRun(sim.timelines, sorted(sim.finished, key=lambda r: r.arrival), pipe.parallel, sim.records,
                  sim.done_times)


class _Simulation:
    """The engine loop (``LLMEngine.step``) over the ideal pipeline, on a virtual clock."""

    def __init__(self, config: SchedulerConfig, pipe: Pipeline, max_model_len: int, num_blocks: int,
                 block_size: int) -> None:
        par = pipe.parallel
        limits = SchedulerLimits(max_model_len=max_model_len, feedback_distance=par.feedback_distance)
        self.pipe, self.clock = pipe, 0.0
        self.scheduler = Scheduler(config, limits=limits, num_blocks=num_blocks, block_size=block_size,
                                   cost_model=pipe.cost_model if config.time_budget_s else None,
                                   clock=lambda: self.clock)
        self.timelines = [StageTimeline(stage=s, rank=s) for s in range(par.pp)]
        self.records: list[StepRecord] = []
        self.done_times: dict[int, float] = {}
        self.finished: list[RequestTimes] = []
        self._free = [0.0] * par.pp  # when each stage is done with what it has
        self._last_end: dict[int, float] = {}  # step id -> its end on the last stage
        self._in_flight: deque = deque()
        self._times: dict[str, RequestTimes] = {}

    def add(self, spec: RequestSpec) -> None:
        rid = str(spec.index)
        self.scheduler.add_request(Request(rid, [0] * spec.prompt_len, arrival_time=spec.arrival_s,
                                           max_output_tokens=spec.output_len))
        self._times[rid] = RequestTimes(rid, spec.arrival_s, -1.0, -1.0, [], -1.0, spec.prompt_len, 0)

    def step(self) -> None:
        """Fill the pipeline, await the oldest result, update."""
        while len(self._in_flight) < self.pipe.parallel.depth:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                break
            self._in_flight.append(plan)
            self._run(plan)
        if not self._in_flight:
            raise RuntimeError("the scheduler made no progress with requests pending")
        plan = self._in_flight.popleft()
        self.clock = max(self.clock, self._last_end[plan.step_id] + self.pipe.hop_s)
        self.done_times[plan.step_id] = self.clock
        sampled = {s.request_id: 0 for s in plan.scheduled if s.needs_sample}
        for request in self.scheduler.update(plan, sampled):
            self._took_token(request)

    def _run(self, plan) -> None:
        """The plan's span on every stage, from what it waits for."""
        for s in plan.scheduled:
            if self._times[s.request_id].first_scheduled < 0:
                self._times[s.request_id].first_scheduled = self.clock
        fed = tuple(sorted({s.feed_step for s in plan.scheduled if s.feed_step >= 0}))
        seqs = tuple((s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.needs_sample)
                     for s in plan.scheduled)
        self.records.append(StepRecord(plan.step_id, self.clock, seqs, tuple(p.step_id for p in self._in_flight),
                                       plan.predicted_time, fed))
        hop = self.pipe.hop_s
        ready = max([self.clock] + [self._last_end[step] + hop for step in fed])
        work = Work.of((s.num_computed_tokens, s.num_scheduled_tokens) for s in plan.scheduled)
        for stage, seconds in enumerate(self.pipe.stage_seconds(work)):
            start = max(self._free[stage], ready)
            # A later stage waits for its input from when it could have started (a posted
            # receive); the first stage receives nothing, as in the workers' timelines.
            waiting = start if stage == 0 else min(max(self._free[stage], self.clock), start)
            self.timelines[stage].spans.append(StageSpan(plan.step_id, waiting, start, start + seconds))
            self._free[stage] = start + seconds
            ready = start + seconds + hop
        self._last_end[plan.step_id] = self._free[-1]

    def _took_token(self, request: Request) -> None:
        """The engine's postprocess: the token's time; finished at its output length."""
        times = self._times[request.request_id]
        if times.first_token < 0:
            times.first_token = self.clock
        times.token_times.append(self.clock)
        times.num_output_tokens = request.num_output_tokens
        if request.status is RequestStatus.RUNNING and request.num_output_tokens >= request.max_output_tokens:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        if request.status.is_finished:
            times.finished = self.clock
            self.finished.append(times)


def time_budget(cost_model: CostModel, tokens: int) -> float:
    """The predicted time of a ``tokens``-token micro-batch: a chunk at a 1,536-token prefix
    beside 32 decodes at 2,000 (the time budgets of the bubbles in BENCHMARKS.md)."""
    if tokens <= 32:
        raise ValueError(f"a time budget's micro-batch needs more than its 32 decodes, got {tokens} tokens")
    return cost_model.predict(Work.of([(1536, tokens - 32)] + [(2000, 1)] * 32))


def scheduler_config(run: str, cost_model: CostModel) -> SchedulerConfig:
    """The policy's configs/scheduler YAML (what ``pipeserve bench scheduler=NAME`` runs), with
    ``sarathi:N`` an N-token budget and ``sarathi:timeN`` the time budget of an N-token
    micro-batch; ``,field=value`` after it overrides a field (``orca,balance_decodes=false``)."""
    import yaml

    name, *overrides = run.split(",")
    policy, _, budget = name.partition(":")
    path = _SCHEDULER_CONFIGS / f"{policy}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown policy {policy!r}: no {path.name} in configs/scheduler")
    fields = yaml.safe_load(path.read_text())
    if budget and policy != "sarathi":
        raise ValueError(f"{run!r}: budgets are sarathi's (sarathi:N, sarathi:timeN)")
    if budget.startswith("time"):
        fields |= {"max_num_batched_tokens": 4096,
                   "time_budget_s": time_budget(cost_model, int(budget.removeprefix("time")))}
    elif budget:
        fields["max_num_batched_tokens"] = int(budget)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"{run!r}: {item!r} is not field=value of the scheduler config")
        fields[key] = yaml.safe_load(value)
    return SchedulerConfig(**fields)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def throughput_benchmark():
    """``benchmarks/throughput.py`` as a module (a script, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"
    spec = importlib.util.spec_from_file_location("throughput_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offline_specs(workload: str, seed: int = 0) -> list[RequestSpec]:
    """``benchmarks/throughput.py``'s ``workload``: its requests' prompt and output lengths (the
    same random draws), every one arriving at 0."""
    prompts, out_len = throughput_benchmark().workload_prompts(workload, seed=seed)
    return [RequestSpec(index=i, arrival_s=0.0, prompt_len=len(p), output_len=out_len) for i, p in enumerate(prompts)]


def main(argv: Sequence[str] | None = None) -> None:
    from pipeserve.runtime.bench.dummy_model import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost-model", required=True, help="cost_model.json from `pipeserve profile`")
    p.add_argument("--runs", nargs="+", default=["sarathi:512", "orca"],
                   help="a policy (its configs/scheduler YAML), sarathi:N or sarathi:timeN, then ,field=value")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--shares", type=float, nargs="+", help="each stage's share of the layers (default: the plan's)")
    p.add_argument("--head-us", type=float, help="the head and sampling per step (default: the head's weight read)")
    p.add_argument("--hop-us", type=float, default=30.0)
    p.add_argument("--no-feedback", action="store_true")
    p.add_argument("--source", default="arxiv")
    p.add_argument("--rate", type=float, nargs="+", default=[6.0])
    p.add_argument("--offline", choices=("uniform", "decode-heavy", "peers"),
                   help="benchmarks/throughput.py's workload, all at once (--source, --rate, --num-requests "
                        "and --max-output-len do not apply)")
    p.add_argument("--num-requests", type=int, default=288)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", help="write each run's trace.json and result.json under DIR/RATE-RUN "
                                       "(for pipeline_gaps)")
    args = p.parse_args(argv)
    dims = SHAPES[args.shape]
    shape = SimpleNamespace(**dims, head_dim=dims["hidden_size"] // dims["num_attention_heads"])
    cost_model = CostModel.load(args.cost_model)
    head_s = head_floor(cost_model, shape) if args.head_us is None else args.head_us * 1e-6
    try:
        shares = tuple(args.shares or layer_shares(shape, args.pp))
        pipe = Pipeline(cost_model=cost_model, layer_shares=shares, head_s=head_s, hop_s=args.hop_us * 1e-6,
                        parallel=ParallelConfig(pp=args.pp, token_feedback=not args.no_feedback))
        configs = {run: scheduler_config(run, cost_model) for run in args.runs}
    except ValueError as e:
        p.error(str(e))
    print(f"ideal pp={args.pp} pipeline: layer shares {', '.join(f'{s:.3f}' for s in shares)}, "
          f"head {head_s * 1e6:.0f} us, hop {args.hop_us:g} us, depth {pipe.parallel.depth}")
    if args.offline:
        specs = offline_specs(args.offline, args.seed)
        tokens = sum(s.prompt_len + s.output_len for s in specs)
        print(f"{args.offline}: {len(specs)} requests, {tokens:,} tokens, all at once")
        print("| run | makespan s | total tok/s | bubble per stage (loaded) |")
        print("|---|---|---|---|")
        for run, config in configs.items():
            sim_run = simulate(specs, config, pipe, max_model_len=shape.max_position_embeddings)
            out = sim_run.summary()
            end = max(r.finished for r in sim_run.requests)
            bubbles = " / ".join(f"{_percent(s['bubble_fraction'])} ({_percent(s['bubble_fraction_loaded'])})"
                                 for s in out["stages"])
            print(f"| {run} | {end:.3f} | {tokens / end:,.0f} | {bubbles} |")
        return
    print("| rate | run | bubble per stage (loaded) | P50 TTFT ms | P99 TBT ms |")
    print("|---|---|---|---|---|")
    for rate in args.rate:
        workload = WorkloadConfig(source=args.source, rate=rate, num_requests=args.num_requests,
                                  max_output_len=args.max_output_len, seed=args.seed)
        specs, _ = fit_to_context(build_workload(workload), shape.max_position_embeddings)
        for run, config in configs.items():
            sim_run = simulate(specs, config, pipe, max_model_len=shape.max_position_embeddings)
            if args.trace_dir:
                sim_run.write(os.path.join(args.trace_dir, f"{rate:g}-{run.replace(':', '-').replace(',', '-')}"))
            out = sim_run.summary()
            bubbles = " / ".join(f"{_percent(s['bubble_fraction'])} ({_percent(s['bubble_fraction_loaded'])})"
                                 for s in out["stages"])
            print(f"| {rate:g} | {run} | {bubbles} | {_ms(out['ttft_s']['p50'])} | {_ms(out['tbt_s']['p99'])} |")


if __name__ == "__main__":
    main()
