"""`pipeserve bench` on the prefix workloads (Mooncake trace, shared prompts), CPU, tiny model:
prefix caching and grouping save prefill work (and report it), with caching off nothing is
saved, and greedy tokens are the same either way (float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeserve.launch import bench as B
from pipeserve.runtime.bench.harness import Bench, format_table
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.model.loader import load_model
from pipeserve.runtime.bench.prefix_workloads import MOONCAKE_NUM_ROWS, MOONCAKE_TRACE, ideal_cached_fraction
from pipeserve.runtime.bench.workload import WorkloadConfig, build_workload
from pipeserve.scheduler import SchedulerConfig

pytestmark = pytest.mark.timeout(120)

VOCAB = 256  # the conftest models'
QUIET = ("engine.device=cpu", "engine.dtype=float32", "engine.num_kv_blocks=256", "bench.warmup_requests=0",
         "bench.progress=false", "bench.plots=false", "bench.save_steps=false")
SHARED = ("workload=shared_prefix", "workload.num_requests=8", "workload.num_prefixes=2",
          "workload.shared_prefix_len=64", "workload.suffix_len=8", "workload.min_output_len=4",
          "workload.max_output_len=4")
MOONCAKE = ("workload=mooncake", "workload.start=3977", "workload.num_requests=16", "workload.block_tokens=4",
            "workload.max_prompt_len=256", "workload.max_output_len=2", "workload.time_scale=0.01",
            "scheduler.max_num_batched_tokens=64")


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(tiny_model, dtype=torch.float32, device=torch.device("cpu"))


def bench(compose, model: str, loaded, out_dir, *overrides: str) -> dict:
    return B.run_bench(compose(f"model.path={model}", *QUIET, *overrides), str(out_dir), loaded=loaded)


def test_prefix_workloads_are_token_ids_within_the_vocabulary():
    moon = build_workload(WorkloadConfig(source="mooncake", arrival="trace", start=3977, num_requests=16,
                                         block_tokens=4, max_output_len=2), vocab_size=VOCAB)
    prompts = [s.prompt_token_ids for s in moon]
    assert all(len(p) == s.prompt_len and all(64 <= t < VOCAB for t in p) for p, s in zip(prompts, moon))
    assert moon[0].arrival_s == 0.0 and moon[-1].arrival_s > 1.0  # the trace's own times
    assert 0.3 < ideal_cached_fraction(prompts, block_size=16) < 0.7  # the tail of the trace shares
    shared = build_workload(WorkloadConfig(source="shared_prefix", arrival="offline", num_requests=6,
                                           num_prefixes=3, shared_prefix_len=32, suffix_len=4, max_output_len=3))
    assert len({s.prompt_token_ids[:32] for s in shared}) == 3
    assert all(s.prompt_len == 36 and s.output_len == 3 and s.arrival_s == 0 for s in shared)
    with pytest.raises(ValueError, match="multiple of num_prefixes"):
        WorkloadConfig(source="shared_prefix", arrival="offline", num_requests=7, num_prefixes=2, max_output_len=3)
    with open(MOONCAKE_TRACE) as f:
        assert sum(1 for line in f if line.strip()) == MOONCAKE_NUM_ROWS


@pytest.mark.parametrize("workload", [SHARED, MOONCAKE], ids=["shared_prefix", "mooncake"])
def test_caching_saves_prefill_and_reports_it(workload, tiny_model, loaded, tmp_path, compose):
    # A small token budget on shared_prefix too: admitted one after another, later prompts hit.
    extra = ("scheduler.max_num_batched_tokens=64",) if workload is SHARED else ()
    off = bench(compose, tiny_model, loaded, tmp_path / "off", *workload, *extra, "+prefix=off")
    on = bench(compose, tiny_model, loaded, tmp_path / "on", *workload, *extra, "+prefix=caching")
    for r in (off, on):
        pre = r["prefill"]
        assert pre["prefill_tokens_requested"] == r["workload"]["prompt_tokens"] == r["throughput"]["prompt_tokens"]
        assert r["num_preemptions"] == 0  # so computed = requested - cache hits exactly
        assert pre["prefill_tokens_computed"] == pre["prefill_tokens_requested"] - pre["cache_hit_tokens"]
        assert pre["saved_fraction"] == pytest.approx(pre["cache_hit_rate"])
        assert 0.3 < pre["ideal_saved_fraction"] < 0.7
        assert r["throughput"]["total_tokens_per_s"] > 0
    assert off["prefill"]["saved_fraction"] == 0 and off["prefill"]["cache_hit_tokens"] == 0
    assert 0 < on["prefill"]["saved_fraction"] <= on["prefill"]["ideal_saved_fraction"] + 1e-9
    saved = json.loads((tmp_path / "on" / "result.json").read_text())["prefill"]
    assert saved == on["prefill"]
    assert "prefill tokens" in format_table(on) and "saved" in format_table(on)


def test_grouping_computes_each_shared_prefix_once(tiny_model, loaded, tmp_path, compose):
    """All eight requests at once, shuffled: with the whole batch admitted together caching
    alone finds nothing cached; grouping holds the followers until their prefix is there."""
    caching = bench(compose, tiny_model, loaded, tmp_path / "c", *SHARED, "+prefix=caching")
    grouped = bench(compose, tiny_model, loaded, tmp_path / "g", *SHARED, "+prefix=grouping")
    ideal = grouped["prefill"]["ideal_saved_fraction"]
    assert ideal == pytest.approx(6 * 64 / (8 * 72))  # 6 followers reuse 4 blocks each
    assert grouped["prefill"]["saved_fraction"] == pytest.approx(ideal)
    assert caching["prefill"]["saved_fraction"] < ideal


def test_greedy_tokens_equal_with_caching_off_on_and_grouped(tiny_model, loaded):
    specs = build_workload(WorkloadConfig(source="shared_prefix", arrival="offline", num_requests=8,
                                          num_prefixes=2, shared_prefix_len=48, suffix_len=8, min_output_len=6,
                                          max_output_len=6), vocab_size=VOCAB)
    outputs = {}
    for name, sched in (("off", {}), ("on", dict(enable_prefix_caching=True)),
                        ("grouped", dict(enable_prefix_caching=True, prefix_grouping=True))):
        config = EngineConfig(model=tiny_model, device="cpu", dtype="float32", num_kv_blocks=256,
                              scheduler=SchedulerConfig(max_num_batched_tokens=32, **sched))
        runner = Bench(config, loaded=loaded)
        run = runner.run(specs, seed=0)
        runner.close()
        outputs[name] = run.output_token_ids
        assert sorted(outputs[name]) == sorted(f"r{s.index}" for s in specs)
        assert all(len(t) == 6 for t in outputs[name].values())
        if name != "off":
            assert run.prefix_cache.num_cached_prompt_tokens > 0
    assert outputs["on"] == outputs["off"] and outputs["grouped"] == outputs["off"]


def test_cli_prints_the_prefill_line(tiny_model, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeserve.launch.cli", "bench", f"model.path={tiny_model}", *QUIET, *SHARED,
         "scheduler.enable_prefix_caching=true", "scheduler.prefix_grouping=true", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["config"]["scheduler"]["prefix_grouping"] is True and r["workload"]["name"] == "shared_prefix"
    pre = r["prefill"]
    assert f"prefill tokens {pre['prefill_tokens_requested']} requested, {pre['prefill_tokens_computed']}" \
        f" computed: {pre['saved_fraction']:.1%} saved" in proc.stdout
    assert pre["saved_fraction"] > 0.5
