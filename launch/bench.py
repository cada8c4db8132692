"""`pipeserve bench`: run a workload through the engine and measure it (configs/bench.yaml).

    pipeserve bench                                   # ShareGPT lengths, Poisson arrivals, SmolLM2
    pipeserve bench workload=arxiv workload.rate=2 parallel.pp=2 scheduler=vllm
    pipeserve bench --multirun scheduler=sarathi,vllm,orca scheduler.max_num_batched_tokens=256,512
    pipeserve bench dummy_model.shape=llama3-8b engine.dtype=bfloat16   # random weights (GPU)

This app composes the configuration and hands typed configs to the harness
(runtime/bench/harness.py), which runs the workload and writes result.json, trace.json, plots
and steps.json into the run directory, then prints a result table. Started under torchrun (one
node or several: launch/slurm/bench_multinode.sbatch), global rank 0 runs the harness in a child
process and every rank serves as a worker (launch/multinode.py). Under --multirun every point
runs in its own process and the parent writes one table (launch/sweep.py).

SIGTERM (`scancel --signal=TERM`, Slurm's warning before the time limit, a requeue) stops a run
that has not ended: the engine shuts its workers down, no result.json is written, and the
process says so and exits 0, as from any orderly stop.
"""

from __future__ import annotations

import signal
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeserve.launch import multinode, sweep
from pipeserve.launch.generate import engine_config
from pipeserve.runtime.bench import harness
from pipeserve.runtime.bench.dummy_model import DummyModelConfig, with_dummy_model
from pipeserve.runtime.bench.harness import BenchOptions, CapacityOptions, format_table
from pipeserve.runtime.bench.workload import WorkloadConfig
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.engine import spmd


def configs_from(cfg: DictConfig) -> tuple[EngineConfig, WorkloadConfig, BenchOptions, CapacityOptions]:
    """Hydra selects; validated dataclasses come out (ValueError on a bad value)."""
    return (engine_config(cfg), WorkloadConfig(**_plain(cfg.workload)), BenchOptions(**_plain(cfg.bench)),
            CapacityOptions(**_plain(cfg.capacity)))


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True)


def run_bench(cfg: DictConfig, out_dir: str, *, loaded=None) -> dict:
    """One benchmark run from a composed config; writes its files into ``out_dir``."""
    engine, workload, options, capacity = configs_from(cfg)
    engine = with_dummy_model(engine, DummyModelConfig(**_plain(cfg.dummy_model)), out_dir)
    return harness.run_bench(engine, workload, options=options, capacity=capacity, out_dir=out_dir,
                             record=_plain(cfg), loaded=loaded)


class Stopped(Exception):
    """SIGTERM came before the run ended."""


def stop_on_sigterm() -> None:
    """From now on the first SIGTERM raises ``Stopped``: the run unwinds and its engine shuts
    its workers down (they ignore SIGTERM), where dying of it would leave them behind."""

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        raise Stopped

    signal.signal(signal.SIGTERM, stop)


def _stopped(out_dir: str) -> None:
    print(f"pipeserve bench: stopped by SIGTERM before the run ended; no result.json in {out_dir}",
          file=sys.stderr, flush=True)


def point_command(overrides: list[str], out_dir: str) -> list[str]:
    """The child process of one sweep point: this app with the point's overrides."""
    return [sys.executable, "-m", "pipeserve.launch.bench", *overrides, f"hydra.run.dir={out_dir}"]


@hydra.main(version_base=None, config_path="../configs", config_name="bench")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    out_dir = hydra_cfg.runtime.output_dir
    if hydra_cfg.mode == RunMode.MULTIRUN:  # the sweep parent: this point runs in its own process
        overrides = list(hydra_cfg.overrides.task)
        return sweep.run_sweep_point(point_command(overrides, out_dir), overrides=overrides, out_dir=out_dir,
                                     config=_plain(cfg))
    if spmd.under_torchrun() and cfg.parallel.tp * cfg.parallel.pp > 1:  # one node or several
        engine, workload, options, capacity = configs_from(cfg)
        # every rank writes the config-only model folder it loads
        engine = with_dummy_model(engine, DummyModelConfig(**_plain(cfg.dummy_model)), out_dir)
        if not spmd.is_worker_rank(engine):  # the other ranks leave when its engine stops them
            stop_on_sigterm()
        try:
            code = multinode.bench(engine, workload, options=options, capacity=capacity, out_dir=out_dir,
                                   record=_plain(cfg))
        except Stopped:
            return _stopped(out_dir)
        if code:
            raise SystemExit(code)
        return None
    stop_on_sigterm()
    try:
        result = run_bench(cfg, out_dir)
    except Stopped:
        return _stopped(out_dir)
    print(format_table(result))
    print(f"\nwrote {out_dir}/" + ", ".join(result["files"].values()))
    return result


if __name__ == "__main__":
    main()
