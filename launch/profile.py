"""`pipeserve profile`: measure the scheduler's cost model on this device (configs/profile.yaml).

    pipeserve profile                                     # SmolLM2 on whatever device is here
    pipeserve profile model.path=/models/llama3-8b engine.load_format=dummy profile.out=llama3.json

Runs synthetic micro-batches through the model runner (the whole model in this process):
single prompt chunks of varied length at varied prefix lengths, batches of decodes at varied
context lengths, and mixes of both; times each on the device (the fastest of a few repeats;
see ``Profiler.time``: this is a profile, not a serving run); fits

    t = per_token * max(num_tokens, knee_tokens) + per_attn * sum(q_i * ctx_i)
        + per_kv * sum(ctx_i) + per_seq * num_seqs + fixed

(the attention terms counted as the scheduler counts them, sliding-window layers capped at
their window: ``SlidingLayers``) with CostModel.fit; and writes the coefficients, the samples and the fit error to a JSON file
that `scheduler.cost_model_path` reads (bench runs and sweeps reuse it). It prints the
prediction for a typical micro-batch: the value to give `scheduler.time_budget_s`. With pipeline
parallelism too the budget is the whole model's prediction (the scheduler compares it with
whole-model predictions); each stage then takes about 1/pp of it.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from pipeserve.runtime.bench.dummy_model import DummyModelConfig, with_dummy_model
from pipeserve.runtime.worker.batch import StepInputs
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.model.loader import load_model, set_kernels
from pipeserve.runtime.worker.model_runner import ModelRunner
from pipeserve.scheduler import CostModel, SlidingLayers, Work


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    chunk_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    """Prompt-chunk lengths (one sequence per micro-batch)."""
    prefix_lens: tuple[int, ...] = (0, 256, 1024)
    """Tokens already in the KV cache before a chunk (a chunk late in a long prompt)."""
    decode_batch_sizes: tuple[int, ...] = (1, 8, 32)
    """Decodes per micro-batch."""
    decode_context_lens: tuple[int, ...] = (128, 1024)
    """Context length of every decode in a decode batch."""
    repeats: int = 3
    """Timed runs per shape (the fastest counts), after one untimed warm-up run."""
    out: str = "cost_model.json"
    """Where to write the profile (relative paths: inside the run directory)."""

    def __post_init__(self) -> None:
        if self.repeats < 1 or not self.chunk_tokens or not self.decode_batch_sizes:
            raise ValueError("profile needs repeats >= 1, chunk_tokens and decode_batch_sizes")

    def shapes(self) -> list[list[tuple[int, int]]]:
        """Every micro-batch to time, as (prefix length, query length) per sequence."""
        prefill = [[(p, q)] for q in self.chunk_tokens for p in self.prefix_lens]
        decode = [[(c, 1)] * n for n in self.decode_batch_sizes for c in self.decode_context_lens]
        mixed = [[(c, 1)] * n + [(p, q)] for n in self.decode_batch_sizes[-2:] for c in self.decode_context_lens[-2:]
                 for q in self.chunk_tokens[-2:] for p in self.prefix_lens[-2:]]
        return prefill + decode + mixed


_HEAD_START_S, _MAX_HEAD_START_S = 0.05, 1.0


class DeviceSleep:
    """Queues a sleep of about ``seconds`` on the current CUDA stream (a no-op on CPU), so that
    the host can queue work behind it and the device then runs that work back to back."""

    def __init__(self, device: torch.device) -> None:
        self.cycles_per_s = None
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # (warm-up)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)

    def __call__(self, seconds: float) -> None:
        if self.cycles_per_s is not None:
            torch.cuda._sleep(int(seconds * self.cycles_per_s))


class Profiler:
    """Times synthetic micro-batches on a ModelRunner over a KV pool big enough for the largest."""

    def __init__(self, runner: ModelRunner, *, block_size: int, vocab_size: int, device: torch.device) -> None:
        self.runner, self.block_size, self.vocab, self.device = runner, block_size, vocab_size, device
        self._gen = torch.Generator().manual_seed(0)
        self._head_start = _HEAD_START_S  # device sleep queued before a timed step (grows if short)
        self.sleep = DeviceSleep(device)

    def step(self, seqs: list[tuple[int, int]]) -> StepInputs:
        """Sequence i attends over `prefix` cached tokens plus its `q` new ones; blocks are laid out
        back to back (their contents are whatever the pool holds: timing only)."""
        tables, next_block = [], 0
        for prefix, q in seqs:
            n = -(-(prefix + q) // self.block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        total = sum(q for _, q in seqs)
        return StepInputs(
            request_ids=[str(i) for i in range(len(seqs))],
            token_ids=torch.randint(0, self.vocab, (total,), generator=self._gen).tolist(),
            query_lens=[q for _, q in seqs],
            start_positions=[p for p, _ in seqs],
            block_tables=tables,
            needs_sample=[True] * len(seqs),
        )

    def time(self, seqs: list[tuple[int, int]], repeats: int) -> float:
        """Seconds of one micro-batch (forward, then greedy sampling as the worker samples): the
        fastest of ``repeats`` timed runs, which shrugs off other load on a shared machine.

        On CUDA this is the *device's* time, between events, with the whole step queued behind
        a device sleep first: serving replays CUDA graphs, whose launch costs the host well
        under a millisecond, while launching an eager step kernel by kernel takes the host
        longer than the device takes to run it (measured on an H100 for an 8B stage), so wall
        time here would measure this host's launches. On CPU: wall time."""
        step = self.step(seqs)
        self._run(step)  # warm-up (compiles, allocator)
        times = []
        for _ in range(repeats):
            times.append(self._device_time(step) if self.device.type == "cuda" else self._wall_time(step))
        return min(times)

    def run(self, seqs: list[tuple[int, int]], times: int) -> None:
        """The step ``times`` times, untimed and with no sleep between (under a tracer)."""
        step = self.step(seqs)
        for _ in range(times):
            self._run(step)
        self.sync()

    def _run(self, step: StepInputs) -> torch.Tensor:
        return self.runner.forward_greedy(step)  # greedy sampling, left on the device

    def _wall_time(self, step: StepInputs) -> float:
        t0 = time.perf_counter()
        self._run(step)
        return time.perf_counter() - t0

    def _device_time(self, step: StepInputs) -> float:
        for _ in range(4):
            self.sync()
            self.sleep(self._head_start)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            self._run(step)
            end.record()
            launch = time.perf_counter() - t0
            end.synchronize()
            if launch < 0.5 * self._head_start:  # queued whole while the device slept
                self._head_start = max(_HEAD_START_S, self._head_start / 2)  # (one slow launch: back down)
                return start.elapsed_time(end) / 1e3
            self._head_start = min(4 * self._head_start, _MAX_HEAD_START_S)  # the host caught up: start earlier
        raise RuntimeError(f"launching a step took the host {launch:.3f} s even behind a {self._head_start:.1f} s"
                           " device sleep (something in the step synchronizes)")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def relative_errors(model: CostModel, samples: list[tuple[Work, float]]) -> dict[str, float]:
    """Mean and max of |predicted / measured - 1| over the samples."""
    errors = [abs(model.predict(w) - t) / t for w, t in samples]
    return {"mean": statistics.fmean(errors), "max": max(errors)}


def blocks_needed(shapes: list[list[tuple[int, int]]], block_size: int) -> int:
    return max(sum(-(-(p + q) // block_size) for p, q in seqs) for seqs in shapes)


def run_profile(cfg: DictConfig, out_dir: str, *, progress: bool = True) -> dict:
    from tqdm import tqdm

    from pipeserve.launch.generate import engine_config

    dummy = DummyModelConfig(**OmegaConf.to_container(cfg.dummy_model, resolve=True))
    engine = with_dummy_model(engine_config(cfg), dummy, out_dir)
    options = ProfileOptions(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in OmegaConf.to_container(cfg.profile, resolve=True).items()})
    device = engine.torch_device()
    dtype = engine.torch_dtype(device)
    loaded = load_model(engine.model, dtype=dtype, device=device, load_format=engine.load_format,
                        quantization=engine.quantization)
    set_kernels(loaded.model, engine, device)
    shapes = options.shapes()
    num_blocks = blocks_needed(shapes, engine.block_size)
    kv = allocate_kv_cache(loaded.config, num_layers=loaded.config.num_hidden_layers, num_blocks=num_blocks,
                           block_size=engine.block_size, dtype=dtype, device=device)
    runner = ModelRunner(loaded.model, kv_caches=kv, block_size=engine.block_size, device=device)
    profiler = Profiler(runner, block_size=engine.block_size, vocab_size=loaded.config.vocab_size, device=device)
    sliding = SlidingLayers.of(loaded.config.layer_windows)
    samples = [(Work.of(seqs, sliding), profiler.time(seqs, options.repeats))
               for seqs in tqdm(shapes, desc="profile", unit="shape", disable=not progress)]
    model = CostModel.fit(samples)
    three = CostModel.fit(samples, memory_terms=False)
    # A starting point for scheduler.time_budget_s: what a full token-budget chunk of a long
    # prompt costs midway (prefix 1024) in the token-budget mode.
    chunk = engine.scheduler.max_num_batched_tokens
    result = {
        "cost_model": model.to_dict(),
        "relative_error": relative_errors(model, samples),
        "three_feature_fit": {"cost_model": three.to_dict(), "relative_error": relative_errors(three, samples)},
        "suggested_time_budget_s": model.predict(Work.of([(1024, chunk)], sliding)),
        "timing": "device" if device.type == "cuda" else "wall",
        "model": loaded.path, "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "block_size": engine.block_size, "date": datetime.datetime.now().isoformat(),
        "samples": [dict(seqs=[list(x) for x in seqs], num_tokens=w.num_tokens, attn_work=w.attn_work,
                         kv_tokens=w.kv_tokens, num_seqs=w.num_seqs, seconds=t)
                    for seqs, (w, t) in zip(shapes, samples)],
    }
    path = options.out if os.path.isabs(options.out) else os.path.join(out_dir, options.out)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    result["path"] = path
    return result


@hydra.main(version_base=None, config_path="../configs", config_name="profile")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    result = run_profile(cfg, HydraConfig.get().runtime.output_dir)
    print(f"cost model on {result['device']} ({result['dtype']}, {result['timing']} time): "
          + ", ".join(f"{k}={v:.3g}" for k, v in result["cost_model"].items()))
    err, three = result["relative_error"], result["three_feature_fit"]["relative_error"]
    print(f"fit error: mean {err['mean']:.1%}, max {err['max']:.1%} over {len(result['samples'])} shapes"
          f" (without per_kv and the knee: mean {three['mean']:.1%}, max {three['max']:.1%})")
    print(f"wrote {result['path']}\n  use: scheduler.cost_model_path={result['path']}"
          f" scheduler.time_budget_s={result['suggested_time_budget_s']:.4g}")


if __name__ == "__main__":
    main()
