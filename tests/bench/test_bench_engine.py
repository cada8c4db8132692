"""The bench loop on a real engine in this process (CPU): stall-free batching against vLLM's
prefill-first batching, the time budget from a profile, and a capacity search."""

from __future__ import annotations

import json

import pytest

from pipeserve.launch import bench as B
from pipeserve.runtime.bench import harness
from pipeserve.runtime.bench.harness import Bench, BenchOptions, CapacityOptions, format_table
from pipeserve.launch.profile import run_profile
from pipeserve.runtime.bench import metrics as M
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.model.loader import load_model
from pipeserve.runtime.bench.workload import RequestSpec, WorkloadConfig
from pipeserve.scheduler import CostModel, SchedulerConfig, Work

pytestmark = pytest.mark.timeout(300)

BUDGET = 128
LONG = 1024


def mixed_workload() -> list[RequestSpec]:
    """Four short requests decoding for a while; three long prompts land in the middle."""
    decoders = [RequestSpec(i, 0.0, 16, 100) for i in range(4)]
    longs = [RequestSpec(4 + i, 0.05 + 0.1 * i, LONG, 4) for i in range(3)]
    return decoders + longs


def engine_config(model: str, policy: str, **sched) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=2048,
                        scheduler=SchedulerConfig(policy=policy, max_num_batched_tokens=BUDGET, **sched))


def run_policy(model: str, loaded, policy: str, **sched):
    bench = Bench(engine_config(model, policy, **sched), loaded=loaded)
    bench.warm_up(1)
    run = bench.run(mixed_workload(), seed=0)
    records = [r for r in bench.engine.step_records if r.step_id >= run.first_step]
    timelines = bench.close()
    return run, records, timelines


def test_sarathi_beats_vllm_p99_tbt_and_never_stalls_a_decode(small_model):
    loaded = load_model(small_model, dtype=__import__("torch").float32, device=__import__("torch").device("cpu"))
    results = {}
    for policy in ("sarathi", "vllm"):
        run, records, _ = run_policy(small_model, loaded, policy)
        prompt_lens = {rid: s.prompt_len for rid, s in run.specs.items()}
        summary = M.request_summary(run.requests, run.t_end - run.t0)
        assert summary["num_requests"] == 7
        assert all(r.num_output_tokens == run.specs[r.request_id].output_len for r in run.requests)
        results[policy] = (summary, M.decode_stalls(records, prompt_lens), M.step_summary(records, prompt_lens))
    (sarathi, s_stalls, s_steps), (vllm, v_stalls, v_steps) = results["sarathi"], results["vllm"]
    # No decode waits behind a whole long prefill: chunks ride along with every ongoing decode.
    assert s_stalls == []
    assert s_steps["max_prefill_tokens_in_step"] <= BUDGET
    # vLLM runs each long prompt whole, alone, while the decodes wait (the checker sees it).
    assert v_steps["max_prefill_tokens_in_step"] == LONG
    assert len(v_stalls) >= 2 * 4  # at least two whole prompts ran while all four decoded
    print("P99 TBT sarathi", sarathi["tbt_s"]["p99"], "vllm", vllm["tbt_s"]["p99"])
    assert sarathi["tbt_s"]["p99"] < vllm["tbt_s"]["p99"], (sarathi["tbt_s"], vllm["tbt_s"])


def test_profile_writes_a_fitted_cost_model(tiny_model, tmp_path, compose):
    cfg = compose(f"model.path={tiny_model}", "engine.device=cpu", "profile.chunk_tokens=[8,32,64]",
                        "profile.prefix_lens=[0,64]", "profile.decode_batch_sizes=[1,4]",
                        "profile.decode_context_lens=[16,64]", "profile.repeats=1", config_name="profile")
    profile = run_profile(cfg, str(tmp_path), progress=False)
    data = json.loads(open(profile["path"]).read())
    samples = data["samples"]
    assert len(samples) == 3 * 2 + 2 * 2 + 2 * 2 * 2 * 2  # prefill chunks, decode batches, mixes
    assert all(s["seconds"] > 0 for s in samples) and data["timing"] == "wall"
    totals = {(s["num_tokens"], s["attn_work"], s["kv_tokens"], s["num_seqs"]) for s in samples}
    assert totals >= {(32, 32 * 96, 96, 1), (4, 4 * 65, 4 * 65, 4), (4 + 64, 4 * 65 + 64 * 128, 4 * 65 + 128, 5)}
    cost = CostModel.load(profile["path"])
    errors = [abs(cost.predict(Work.of(s["seqs"])) - s["seconds"]) / s["seconds"] for s in samples]
    assert data["relative_error"]["max"] == pytest.approx(max(errors))
    three = CostModel.from_dict(data["three_feature_fit"]["cost_model"])
    assert three.per_kv == three.knee_tokens == 0.0


def test_time_budget_fills_micro_batches_to_a_predicted_time(tiny_model, tmp_path):
    """With a profile, each chunk of a lone prompt is the longest whose predicted time fits the
    budget: chunks shrink as the prefix (attention work) grows. Even chunks take as many, within
    the budget, and vary less. Token mode keeps them equal."""
    coef = dict(per_token=1e-4, per_attn=1e-6, per_seq=0.0, fixed=1e-3)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"cost_model": coef}))
    cost = CostModel(**coef)
    budget = cost.predict(Work.of([(0, 48)]))
    full, done = [], 0
    while done < 200:  # brute force: the largest q that fits
        q = max(q for q in range(1, min(200 - done, BUDGET) + 1)
                if q == 1 or cost.predict(Work.of([(done, q)])) <= budget)
        full.append(q)
        done += q
    assert full[0] == 48 and full[-2] < 40  # the premise: later chunks must shrink

    def chunks(**sched):
        bench = Bench(engine_config(tiny_model, "sarathi", **sched))
        bench.run([RequestSpec(0, 0.0, 200, 2)], seed=0)
        records = bench.engine.step_records
        bench.close()
        return [n for r in records for rid, start, n, _ in r.seqs if start < 200], records

    timed, records = chunks(time_budget_s=budget, cost_model_path=str(path))
    assert timed == full
    assert all(r.predicted_time <= budget * (1 + 1e-9) for r in records)
    tokens, _ = chunks()
    assert tokens == [BUDGET, 200 - BUDGET]


def test_capacity_search_end_to_end_tiny(tiny_model, tmp_path, compose):
    cfg = compose(
        f"model.path={tiny_model}", "engine.device=cpu", "engine.num_kv_blocks=256", "workload=uniform",
        "workload.num_requests=6", "workload.max_prompt_len=48", "workload.max_output_len=8",
        "workload.rate=4", "bench.warmup_requests=1", "bench.progress=false", "bench.plots=false",
        "capacity.enabled=true", "capacity.max_probes=3", "capacity.tbt_p99_slo_s=5", "capacity.num_requests=4",
    )
    result = B.run_bench(cfg, str(tmp_path))
    cap = result["capacity"]
    assert len(cap["probes"]) == 3
    # A 5 s TBT SLO holds at every rate tried here, so the search keeps doubling.
    assert [p["rate"] for p in cap["probes"]] == [4.0, 8.0, 16.0]
    assert all(p["meets_slo"] for p in cap["probes"]) and cap["capacity_rps"] == 16.0
    assert [p["num_requests"] for p in cap["probes"]] == [4, 4, 4]
    assert "capacity" in format_table(result)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["capacity"]["capacity_rps"] == 16.0


def test_capacity_probe_size_follows_the_rate_when_a_duration_is_set():
    fixed = CapacityOptions(num_requests=64)
    assert fixed.requests_per_probe(24.0, default=16) == 64
    sustained = CapacityOptions(num_requests=64, probe_duration_s=60)
    # Arrivals over 60 s: 1,440 requests at 24 req/s, never fewer than num_requests.
    assert sustained.requests_per_probe(24.0, default=16) == 1440
    assert sustained.requests_per_probe(0.5, default=16) == 64
    assert CapacityOptions(probe_duration_s=10).requests_per_probe(2.05, default=16) == 21
    with pytest.raises(ValueError, match="probe_duration_s"):
        CapacityOptions(probe_duration_s=0)


def test_harness_runs_from_typed_configs_alone(tiny_model, tmp_path):
    """No Hydra: the harness takes dataclasses, and result.json records their values."""
    engine = EngineConfig(model=tiny_model, device="cpu", dtype="float32", num_kv_blocks=128)
    workload = WorkloadConfig(source="uniform", arrival="offline", num_requests=3, max_prompt_len=24,
                              max_output_len=4)
    options = BenchOptions(warmup_requests=0, progress=False, plots=False, save_steps=False)
    result = harness.run_bench(engine, workload, options=options, capacity=CapacityOptions(), out_dir=str(tmp_path))
    assert result["num_requests"] == 3 and result["files"] == {"result": "result.json", "trace": "trace.json"}
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["config"]["scheduler"]["policy"] == engine.scheduler.policy
    assert saved["config"]["workload"]["num_requests"] == 3 and saved["config"]["bench"]["plots"] is False
    assert "pipeserve bench · workload" in format_table(result)
