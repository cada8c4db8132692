"""An ideal pipeline: the bubbles a schedule leaves when nothing but the device costs time.

    python -m pipeserve.launch.pipeline_sim --cost-model cost_model.json --pp 2 --rate 6 \\
        --num-requests 288 --runs sarathi:128 sarathi:time128 orca [--half-layers]

The real ``Scheduler`` plans every micro-batch, driven by a virtual clock the way ``pipeserve
bench`` drives the engine: arrivals are added between steps, up to ``depth`` micro-batches are
in flight, the oldest result is awaited, then the scheduler is updated and finished requests
leave. On stage s a micro-batch takes the profile's prediction of the whole model (``pipeserve
profile``'s cost model) times the stage's share, which follows the stage plan (the head counted
on the last stage). A stage starts a micro-batch once it is free, the plan exists and its input
is there: the previous stage's hidden states, and on the first stage with token feedback the
sampled ids of the steps it is fed from, each ``hop_s`` after the stage that made them. The
result reaches the engine ``hop_s`` after the last stage.

Nothing else costs time: no planning, no launches, no host. So the bubbles are what the
schedule itself leaves (micro-batches of uneven time, the decode groups' chain, too few
requests to fill the pipeline, the drain): a floor for an engine that runs that schedule, and a
comparison of policies on equal terms. (SARATHI's pipeline-bubble figures come from such a
simulation.) Measured runs are in BENCHMARKS.md; this says how far they are from the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from pipeserve.parallel.stage_plan import default_costs, default_half_costs, plan_model_stages
from pipeserve.runtime.metrics import (
    RequestTimes,
    StageSpan,
    StageTimeline,
    bubble_in_window,
    loaded_window,
    request_summary,
    stage_summary,
)
from pipeserve.runtime.workload import RequestSpec, WorkloadConfig, build_workload
from pipeserve.scheduler import CostModel, Request, RequestStatus, Scheduler, SchedulerConfig, Work


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """The device side of the simulation."""

    cost_model: CostModel
    """The whole model's time per micro-batch (one GPU's profile)."""
    shares: tuple[float, ...]
    """Each stage's fraction of it (one per stage)."""
    hop_s: float = 30e-6
    """Hidden states to the next stage, sampled ids to the first, a result to the engine."""
    feedback: bool = True
    """Token feedback: a decode is planned ``pp`` steps after the one that samples its input."""

    @property
    def pp(self) -> int:
        return len(self.shares)

    @property
    def depth(self) -> int:
        """Micro-batches in flight, as ``ParallelConfig.depth``."""
        return self.pp + 1 if self.feedback and self.pp > 1 else self.pp


@dataclass(slots=True)
class SimRun:
    timelines: list[StageTimeline]
    requests: list[RequestTimes]
    depth: int

    def summary(self) -> dict:
        """Per stage: the bubble over the run and while loaded (as ``pipeserve bench``)."""
        start = min(s.start for t in self.timelines for s in t.spans)
        end = max(s.end for t in self.timelines for s in t.spans)
        window = loaded_window(self.requests, self.depth)
        stages = [{**stage_summary(t, start, end),
                   "bubble_fraction_loaded": bubble_in_window(t, *window) if window else None}
                  for t in self.timelines]
        return {"stages": stages, **request_summary(self.requests, end - start)}


def stage_shares(config, pp: int, *, half_layers: bool) -> tuple[float, ...]:
    """Each stage's share of the model's cost by the stage plan's own costs (its layers, the
    head on the last stage)."""
    shape = (config.hidden_size, config.intermediate_size, config.vocab_size,
             config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    half = default_half_costs(*shape)
    head = default_costs(*shape)["head_cost"]
    costs = []
    for i, stage in enumerate(plan_model_stages(config, pp, half_layers=half_layers)):
        halves = range(stage.start_half, stage.end_half)
        cost = sum(half["attention_cost"] if h % 2 == 0 else half["mlp_cost"] for h in halves)
        costs.append(cost + (head if i == pp - 1 else 0.0))
    return tuple(c / sum(costs) for c in costs)


def simulate(specs: Sequence[RequestSpec], config: SchedulerConfig, pipe: Pipeline, *,
             num_blocks: int = 1 << 16, block_size: int = 16) -> SimRun:
    """Runs ``specs`` (arrival order, lengths within config.max_model_len) through the
    scheduler and the ideal pipeline; each request generates exactly its output length."""
    sim = _Simulation(config, pipe, num_blocks, block_size)
    pending = deque(sorted(specs, key=lambda s: s.arrival_s))
    while pending or sim.scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_s <= sim.clock:
            sim.add(pending.popleft())
        if not sim.scheduler.has_unfinished_requests():
            sim.clock = pending[0].arrival_s
            continue
        sim.step()
    return SimRun(sim.timelines, sorted(sim.finished, key=lambda r: r.arrival), pipe.depth)


class _Simulation:
    def __init__(self, config: SchedulerConfig, pipe: Pipeline, num_blocks: int, block_size: int) -> None:
        config = dataclasses.replace(config, feedback_distance=pipe.pp if pipe.feedback and pipe.pp > 1 else None)
        self.pipe, self.clock = pipe, 0.0
        self.scheduler = Scheduler(config, num_blocks=num_blocks, block_size=block_size,
                                   cost_model=pipe.cost_model if config.time_budget_s else None,
                                   clock=lambda: self.clock)
        self.timelines = [StageTimeline(stage=s, rank=s) for s in range(pipe.pp)]
        self._free = [0.0] * pipe.pp  # when each stage is done with what it has
        self._last_end: dict[int, float] = {}  # step id -> its end on the last stage
        self._in_flight: deque = deque()
        self._times: dict[str, RequestTimes] = {}
        self._max_tokens: dict[str, int] = {}
        self.finished: list[RequestTimes] = []

    def add(self, spec: RequestSpec) -> None:
        rid = str(spec.index)
        self.scheduler.add_request(Request(rid, [0] * spec.prompt_len, arrival_time=spec.arrival_s,
                                           max_output_tokens=spec.output_len))
        self._times[rid] = RequestTimes(rid, spec.arrival_s, -1.0, -1.0, [], -1.0, spec.prompt_len, 0)
        self._max_tokens[rid] = spec.output_len

    def step(self) -> None:
        """engine.step(): fill the pipeline, await the oldest result, update."""
        while len(self._in_flight) < self.pipe.depth:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                break
            self._run(plan)
            self._in_flight.append(plan)
        if not self._in_flight:
            raise RuntimeError("the scheduler made no progress with requests pending")
        plan = self._in_flight.popleft()
        self.clock = max(self.clock, self._last_end[plan.step_id] + self.pipe.hop_s)
        sampled = {s.request_id: 0 for s in plan.scheduled if s.needs_sample}
        for request in self.scheduler.update(plan, sampled):
            self._took_token(request)

    def _run(self, plan) -> None:
        """The plan's span on every stage, from what it waits for."""
        for s in plan.scheduled:
            times = self._times[s.request_id]
            if times.first_scheduled < 0:
                times.first_scheduled = self.clock
        seconds = self.pipe.cost_model.predict(
            Work.of((s.num_computed_tokens, s.num_scheduled_tokens) for s in plan.scheduled))
        hop = self.pipe.hop_s
        ready = max([self.clock] + [self._last_end[s.feed_step] + hop for s in plan.scheduled if s.feed_step >= 0])
        for stage, share in enumerate(self.pipe.shares):
            waits_from = self._free[stage]
            start = max(waits_from, ready)
            end = start + seconds * share
            self.timelines[stage].spans.append(StageSpan(plan.step_id, min(waits_from, start), start, end, start))
            self._free[stage], ready = end, end + hop
        self._last_end[plan.step_id] = end

    def _took_token(self, request: Request) -> None:
        rid = request.request_id
        times = self._times[rid]
        if times.first_token < 0:
            times.first_token = self.clock
        times.token_times.append(self.clock)
        times.num_output_tokens = request.num_output_tokens
        if request.status is RequestStatus.RUNNING and request.num_output_tokens >= self._max_tokens[rid]:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)
        if request.status.is_finished:
            times.finished = self.clock
            self.finished.append(times)


def time_budget(cost_model: CostModel, tokens: int) -> float:
    """The predicted time of a ``tokens``-token micro-batch: a chunk at a 1,536-token prefix
    beside 32 decodes at 2,000 (the benchmarks' time budgets)."""
    return cost_model.predict(Work.of([(1536, tokens - 32)] + [(2000, 1)] * 32))


def scheduler_config(run: str, cost_model: CostModel, max_model_len: int) -> SchedulerConfig:
    """``sarathi:N`` (an N-token budget), ``sarathi:timeN`` (the time budget of an N-token
    micro-batch), or a policy name with its defaults (``orca``, ``vllm``)."""
    policy, _, budget = run.partition(":")
    if not budget:
        return SchedulerConfig(policy=policy, max_model_len=max_model_len)
    if budget.startswith("time"):
        seconds = time_budget(cost_model, int(budget.removeprefix("time")))
        return SchedulerConfig(policy=policy, max_num_batched_tokens=4096, time_budget_s=seconds,
                               max_model_len=max_model_len)
    return SchedulerConfig(policy=policy, max_num_batched_tokens=int(budget), max_model_len=max_model_len)


def fit_lengths(specs: Sequence[RequestSpec], max_model_len: int) -> list[RequestSpec]:
    """Prompts and outputs cut to max_model_len as ``pipeserve bench`` cuts them."""
    out = []
    for s in specs:
        prompt = min(s.prompt_len, max_model_len - 1)
        out.append(dataclasses.replace(s, prompt_len=prompt, output_len=max(1, min(s.output_len, max_model_len - prompt))))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from pipeserve.launch.bench_peers import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost-model", required=True, help="cost_model.json from `pipeserve profile`")
    p.add_argument("--runs", nargs="+", default=["sarathi:512", "orca"], help="sarathi:N, sarathi:timeN, orca, vllm")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--half-layers", action="store_true", help="stage boundaries may split a layer")
    p.add_argument("--shares", type=float, nargs="+", help="each stage's share of a step (default: the plan's costs)")
    p.add_argument("--hop-us", type=float, default=30.0)
    p.add_argument("--no-feedback", action="store_true")
    p.add_argument("--source", default="arxiv")
    p.add_argument("--rate", type=float, nargs="+", default=[6.0])
    p.add_argument("--num-requests", type=int, default=288)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = SimpleNamespace(**SHAPES[args.shape], head_dim=SHAPES[args.shape]["hidden_size"]
                            // SHAPES[args.shape]["num_attention_heads"])
    cost_model = CostModel.load(args.cost_model)
    shares = args.shares or stage_shares(shape, args.pp, half_layers=args.half_layers)
    if len(shares) != args.pp or any(s <= 0 for s in shares):
        p.error(f"--shares needs {args.pp} positive values")
    pipe = Pipeline(cost_model=cost_model, shares=tuple(shares), hop_s=args.hop_us * 1e-6, feedback=not args.no_feedback)
    max_model_len = shape.max_position_embeddings
    print(f"ideal pp={args.pp} pipeline, stage shares {', '.join(f'{s:.3f}' for s in pipe.shares)}, "
          f"hop {args.hop_us:g} us, depth {pipe.depth}")
    print("| rate | run | bubble per stage (loaded) | P50 TTFT ms | P99 TBT ms |")
    print("|---|---|---|---|---|")
    for rate in args.rate:
        workload = WorkloadConfig(source=args.source, rate=rate, num_requests=args.num_requests,
                                  max_output_len=args.max_output_len, seed=args.seed)
        specs = fit_lengths(build_workload(workload), max_model_len)
        for run in args.runs:
            out = simulate(specs, scheduler_config(run, cost_model, max_model_len), pipe).summary()
            bubbles = " / ".join(f"{s['bubble_fraction']:.1%} ({s['bubble_fraction_loaded']:.1%})"
                                 for s in out["stages"])
            print(f"| {rate:g} | {run} | {bubbles} | {out['ttft_s']['p50'] * 1e3:.0f} | "
                  f"{out['tbt_s']['p99'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
