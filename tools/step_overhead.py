"""Engine CPU time per scheduled step, without a model.

    python -m tools.step_overhead                      # 256 running decodes
    python -m tools.step_overhead --num-requests 64 256 512 --plan wire
    python -m tools.step_overhead --num-requests 64 256 512 --plan engine

Builds a sarathi scheduler with ``--num-requests`` requests of ``--prompt-len`` tokens, runs
their prefills, then times ``--steps`` decode steps of

    schedule()  →  plan building  →  update(fake sampled ids)

where plan building is what happens before a forward: the executor's ``StepPlan`` (block-table
diffs) and the worker's inputs from it (``PlanInputs`` + ``to_tensors`` on CPU; ``--plan local``,
one device, in one process), the plan msgpack-encoded as for torchrun workers (``--plan wire``),
or nothing (``--plan none``). Prints the median and
P90 per step of each phase and of the whole, in milliseconds. Every request stays running
(the KV pool is large enough and max_tokens is never reached), so each step schedules all of
them; a block boundary is crossed every ``block_size`` steps, as in serving.

``--plan engine`` times the whole ``LLMEngine.step()`` instead, on the embedded SmolLM2
tokenizer and config: scheduling, the plans and the model inputs (as a one-device worker builds
them, on CPU), detokenization, stop checks and outputs are the real ones; only the forward and
sampling are replaced by an executor that answers every plan at once with token ids
drawn at random from those of an English passage (real text's token frequencies; uniform draws
from the whole vocabulary would be mostly rare, multi-byte tokens). Add ``--stop`` to give
every request stop strings to search (ones absent from that passage: no request may finish), and
``--output-kind final_only`` to time requests whose outputs are built only at the end (as for
non-streaming requests).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import pstats
import random
import statistics
import time
from collections.abc import Callable

import torch

from pipeserve.parallel.wire import encode
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.engine.executor import PlanBuilder, Sampled, SampleRequest
from pipeserve.runtime.engine.llm_engine import LLMEngine
from pipeserve.runtime.worker.batch import PlanInputs, to_tensors
from pipeserve.runtime.model.loader import LoadedModel, read_config_and_tokenizer
from pipeserve.runtime.engine.outputs import RequestOutputKind
from pipeserve.scheduler.sampling_params import SamplingParams
from pipeserve.scheduler import Request, Scheduler, SchedulerConfig, SchedulerLimits, SchedulerOutput

BuildPlan = Callable[[SchedulerOutput], object]
GREEDY = SampleRequest(SamplingParams(temperature=0.0), 0)


def make_scheduler(num_requests: int, prompt_len: int, num_steps: int, *, block_size: int,
                   prefix_caching: bool) -> Scheduler:
    """A scheduler whose requests are all running decodes (prefills done, in one step).

    Prompt lengths are staggered over a block so that each step about 1/block_size of the
    requests crosses a block boundary, as in serving.
    """
    max_model_len = prompt_len + block_size + 2 * num_steps  # the timed and the warm-up steps
    config = SchedulerConfig(
        policy="sarathi", max_num_batched_tokens=num_requests * (prompt_len + block_size),
        max_num_seqs=num_requests, enable_prefix_caching=prefix_caching,
    )
    num_blocks = num_requests * -(-max_model_len // block_size)
    scheduler = Scheduler(config, limits=SchedulerLimits(max_model_len=max_model_len), num_blocks=num_blocks,
                          block_size=block_size)
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(32000) for _ in range(prompt_len + i % block_size)]
        scheduler.add_request(Request(str(i), prompt))
    out = scheduler.schedule()
    assert out.num_seqs == num_requests and all(s.needs_sample for s in out.scheduled)
    scheduler.update(out, fake_samples(out))
    return scheduler


def fake_samples(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: 7 for s in out.scheduled if s.needs_sample}


def local_plan_builder(block_size: int) -> BuildPlan:
    """The plan, then the worker's inputs from it (both persist across steps)."""
    plans, inputs = PlanBuilder(), PlanInputs()

    def build(out: SchedulerOutput) -> object:
        plan = plans.build(out, {s.request_id: GREEDY for s in out.scheduled if s.needs_sample})
        step = inputs.step_inputs(plan, can_feed=False)
        return to_tensors(step, block_size=block_size, device=torch.device("cpu"))

    return build


def wire_plan_builder() -> BuildPlan:
    plans = PlanBuilder()

    def build(out: SchedulerOutput) -> bytes:
        return encode(plans.build(out, {s.request_id: GREEDY for s in out.scheduled if s.needs_sample}))

    return build


def time_steps(scheduler: Scheduler, build_plan: BuildPlan | None, num_steps: int, *,
               clock: Callable[[], float] = time.process_time) -> dict[str, list[float]]:
    """Seconds per step of each phase (and their sum), one entry per step."""
    times: dict[str, list[float]] = {"schedule": [], "plan": [], "update": [], "total": []}
    for _ in range(num_steps):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        if build_plan is not None:
            build_plan(out)
        t2 = clock()
        scheduler.update(out, fake_samples(out))
        t3 = clock()
        times["schedule"].append(t1 - t0)
        times["plan"].append(t2 - t1)
        times["update"].append(t3 - t2)
        times["total"].append(t3 - t0)
    return times


SAMPLE_TEXT = (
    "The scheduler decides which requests run in the next step and how many tokens each one "
    "computes. A request waits until enough KV blocks are free for its prompt; once it runs, "
    "every decode step appends one token, and a new block is allocated when the last one is "
    "full. When the pool runs out, the newest request is preempted and its blocks are freed, "
    "so that older requests can finish first. Outputs stream back to the client as text."
)


class InstantExecutor:
    """The in-process executor without a model: the plan and the worker's inputs are built, then
    every sampled sequence gets a token drawn from `token_ids`."""

    max_in_flight = 1

    def __init__(self, token_ids: list[int], *, block_size: int, seed: int = 0) -> None:
        self.token_ids = token_ids
        self.build = local_plan_builder(block_size)
        self.rng = random.Random(seed)
        self._done: dict[int, Sampled] = {}

    def submit(self, plan: SchedulerOutput, samples: dict[str, SampleRequest]) -> None:
        self.build(plan)
        self._done[plan.step_id] = Sampled({rid: self.rng.choice(self.token_ids) for rid in samples}, None, {}, [])

    def result(self, plan: SchedulerOutput) -> Sampled:
        return self._done.pop(plan.step_id)

    def stage_busy_seconds(self) -> list[float]:
        return [0.0]

    def free(self, request_id: str) -> None:
        pass  # (the plans' freed lists are the builder's: this executor never announces frees)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


class _NoModel:
    """Stands in for the weights, which an engine over InstantExecutor never runs: one layer's
    worth of attributes for the worker the engine builds first."""

    ops = argparse.Namespace(name="none")
    start_layer, num_layers = 0, 1

    def __init__(self, num_kv_heads: int) -> None:
        self.num_local_kv_heads = num_kv_heads

    def set_ops(self, ops, **options) -> None:
        pass


def make_engine(num_requests: int, prompt_len: int, num_steps: int, *, block_size: int,
                prefix_caching: bool, stop: list[str],
                output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> LLMEngine:
    """An engine over InstantExecutor whose requests are all running decodes (prefills done)."""
    model_config, tokenizer, path = read_config_and_tokenizer(None)
    max_model_len = prompt_len + block_size + 2 * num_steps + 8
    scheduler = SchedulerConfig(
        policy="sarathi", max_num_batched_tokens=num_requests * (prompt_len + block_size),
        max_num_seqs=num_requests, enable_prefix_caching=prefix_caching,
    )
    config = EngineConfig(device="cpu", dtype="float32", block_size=block_size, max_model_len=max_model_len,
                          num_kv_blocks=num_requests * -(-max_model_len // block_size), scheduler=scheduler)
    # One layer: a small KV cache (never touched) for the forward that never runs.
    loaded = LoadedModel(_NoModel(model_config.num_key_value_heads), dataclasses.replace(model_config, num_hidden_layers=1),
                         tokenizer, path)
    engine = LLMEngine(config, loaded=loaded)
    engine.executor = InstantExecutor(tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False),
                                      block_size=block_size)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_model_len - prompt_len - block_size, stop=stop)
    for i in range(num_requests):
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len + i % block_size)]
        engine.add_request(str(i), prompt, params, output_kind=output_kind)
    engine.step()  # all prefills, in one step
    assert engine.scheduler.num_running == num_requests
    return engine


def time_engine_steps(engine: LLMEngine, num_steps: int, *,
                      clock: Callable[[], float] = time.process_time) -> dict[str, list[float]]:
    """Seconds per ``LLMEngine.step()``, one entry per step."""
    times: dict[str, list[float]] = {"step": []}
    for _ in range(num_steps):
        t0 = clock()
        outputs = engine.step()
        times["step"].append(clock() - t0)
        assert not any(o.finished for o in outputs), "a request finished"
    return times


def summarize(times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"median {statistics.median(ms):.3f}  P90 {p90:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, nargs="+", default=[256])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--plan", choices=("local", "wire", "none", "engine"), default="local")
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings of every request (--plan engine)")
    parser.add_argument("--output-kind", choices=[k.name.lower() for k in RequestOutputKind], default="cumulative",
                        help="which outputs step() builds (--plan engine)")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="this process's CPU time (default; robust on a shared host) or wall time")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps instead")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for n in args.num_requests:
        if args.plan == "engine":
            engine = make_engine(n, args.prompt_len, args.steps, block_size=args.block_size,
                                 prefix_caching=args.prefix_caching, stop=args.stop,
                                 output_kind=RequestOutputKind[args.output_kind.upper()])
            scheduler = engine.scheduler
            run = functools.partial(time_engine_steps, engine)
        else:
            scheduler = make_scheduler(n, args.prompt_len, args.steps, block_size=args.block_size,
                                       prefix_caching=args.prefix_caching)
            build_plan = {"local": local_plan_builder(args.block_size), "wire": wire_plan_builder(),
                          "none": None}[args.plan]
            run = functools.partial(time_steps, scheduler, build_plan)
        run(args.block_size)  # warm-up (the wire plan's full tables)
        if args.profile:
            with cProfile.Profile() as prof:
                run(args.steps, clock=clock)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        times = run(args.steps, clock=clock)
        assert scheduler.num_running == n, "a request left the running set"
        print(f"{n} running, plan={args.plan}, caching={'on' if args.prefix_caching else 'off'}, "
              f"{args.steps} steps ({args.clock} ms/step):")
        for phase, ts in times.items():
            print(f"  {phase:9s} {summarize(ts)}")

if __name__ == "__main__":
    main()
