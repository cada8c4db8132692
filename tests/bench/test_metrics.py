"""Metrics on plain records: percentiles, stage accounting, stalls, FLOPs, capacity search,
Chrome trace and plots (no engine)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from pipeserve.runtime.bench import metrics as M
from pipeserve.runtime.engine.llm_engine import StepRecord
from pipeserve.scheduler import CostModel, SchedulerConfig, SlidingLayers, Work


def test_percentiles_match_numpy():
    rng = random.Random(0)
    values = [rng.expovariate(3.0) for _ in range(1001)]
    d = M.distribution(values)
    for q in (50, 90, 99):
        assert d[f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert d["mean"] == pytest.approx(np.mean(values)) and d["max"] == max(values) and d["count"] == 1001
    assert M.distribution([])["p99"] is None
    assert M.coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)


def test_request_times_and_summary():
    r = M.RequestTimes("a", arrival=10.0, first_scheduled=10.5, first_token=11.0, token_times=[11.0, 11.1, 11.4],
                       finished=11.4, num_prompt_tokens=100, num_output_tokens=3)
    assert (r.ttft, r.scheduling_delay, r.e2e) == pytest.approx((1.0, 0.5, 1.4))
    assert r.tbts == pytest.approx([0.1, 0.3])
    s = M.request_summary([r, r], wall_s=2.0)
    assert s["tbt_s"]["count"] == 4 and s["throughput"]["total_tokens_per_s"] == pytest.approx(103.0)


# ---- capacity search ----------------------------------------------------------------------------


@pytest.mark.parametrize("threshold, start", [(3.7, 1.0), (3.7, 50.0), (0.2, 1.0), (123.0, 0.5)])
def test_capacity_search_converges_on_a_monotone_function(threshold, start):
    found = M.find_capacity(lambda rate: rate <= threshold, start_rate=start, rel_tol=0.02, max_probes=40)
    assert found.converged
    assert threshold * 0.98 <= found.capacity <= threshold
    assert all(ok == (rate <= threshold) for rate, ok in found.probes)


def test_capacity_search_with_noisy_latency_model():
    """A queueing-like P99 TBT (blows up near saturation 5 req/s) against a 100 ms SLO."""
    def tbt_p99(rate):
        return 0.02 / max(1e-9, 1 - rate / 5.0)

    found = M.find_capacity(lambda r: tbt_p99(r) <= 0.1, start_rate=1.0, rel_tol=0.01, max_probes=30)
    assert found.capacity == pytest.approx(4.0, rel=0.01)


def test_capacity_search_respects_the_probe_budget_and_reports_nothing_passing():
    calls = []
    found = M.find_capacity(lambda r: calls.append(r) or False, start_rate=1.0, max_probes=5)
    assert found.capacity == 0.0 and not found.converged and len(calls) == 5
    with pytest.raises(ValueError):
        M.find_capacity(lambda r: True, start_rate=0.0)


def test_meets_slo_is_sarathi_serves_criterion():
    def summary(tbt99, delay50):
        return {"tbt_s": {"p99": tbt99}, "scheduling_delay_s": {"p50": delay50}}

    assert M.meets_slo(summary(0.09, 1.0), tbt_p99_s=0.1, scheduling_delay_p50_s=2.0)
    assert not M.meets_slo(summary(0.11, 1.0), tbt_p99_s=0.1, scheduling_delay_p50_s=2.0)
    assert not M.meets_slo(summary(0.05, 2.5), tbt_p99_s=0.1, scheduling_delay_p50_s=2.0)


# ---- stages and steps ----------------------------------------------------------------------------


def test_stage_summary_accounts_busy_wait_and_idle():
    spans = [M.StageSpan(0, 0.0, 0.5, 1.5), M.StageSpan(1, 2.0, 2.0, 3.0), M.StageSpan(2, 3.0, 3.5, 4.5)]
    s = M.stage_summary(M.StageTimeline(stage=1, rank=1, spans=spans), 0.0, 10.0)
    assert s["busy_s"] == pytest.approx(3.0) and s["recv_wait_s"] == pytest.approx(1.0)
    assert s["idle_s"] == pytest.approx(6.0) and s["bubble_fraction"] == pytest.approx(0.7)
    assert s["step_time_cv"] == pytest.approx(0.0) and s["num_steps"] == 3


def rec(step_id, seqs, in_flight=None, predicted=0.0):
    return StepRecord(step_id, float(step_id), tuple(seqs), tuple(in_flight or (step_id,)), predicted)


def test_decode_stalls_flags_whole_prompt_batches_not_piggybacked_chunks():
    prompt = {"d": 4, "long": 100}
    # d's prompt in step 0, then it decodes; the long prompt arrives at step 2.
    vllm = [rec(0, [("d", 0, 4, True)]), rec(1, [("d", 4, 1, True)]), rec(2, [("long", 0, 100, True)]),
            rec(3, [("d", 5, 1, True), ("long", 100, 1, True)])]
    assert M.decode_stalls(vllm, prompt) == [(2, "d")]
    sarathi = [rec(0, [("d", 0, 4, True)]), rec(1, [("d", 4, 1, True)]),
               rec(2, [("d", 5, 1, True), ("long", 0, 50, False)]),
               rec(3, [("d", 6, 1, True), ("long", 50, 50, True)]), rec(4, [("d", 7, 1, True), ("long", 100, 1, True)])]
    assert M.decode_stalls(sarathi, prompt) == []
    # pp=2: d's previous step is still in flight, so leaving it out is no stall.
    piped = [rec(0, [("d", 0, 4, True)]), rec(1, [("d", 4, 1, True)]), rec(2, [("long", 0, 50, False)], (1, 2)),
             rec(3, [("d", 5, 1, True)], (2, 3))]
    assert M.decode_stalls(piped, prompt) == []
    summary = M.step_summary(vllm, prompt)
    assert summary["max_prefill_tokens_in_step"] == 100 and summary["decode_only_steps"] == 2


def test_decode_stalls_with_token_feedback_balancing():
    """Feedback's decode balancing takes ceil(decoding / distance) decodes per micro-batch, with
    or without prompts: the decode it leaves out rides the next micro-batch, not a stall. Fewer
    decodes than that share while one waits is still flagged."""
    prompt = {"a": 4, "b": 4, "p": 40}
    steps = [rec(0, [("a", 0, 4, True), ("b", 0, 4, True)]),
             rec(1, [("a", 4, 1, True), ("p", 0, 20, False)]),  # share 1 of 2 decoding: b waits
             rec(2, [("b", 4, 1, True), ("p", 20, 20, True)], (1, 2))]
    assert M.decode_stalls(steps, prompt) == [(1, "b")]
    assert M.decode_stalls(steps, prompt, decode_share_distance=2) == []
    starved = [steps[0], rec(1, [("p", 0, 20, False)]), rec(2, [("a", 4, 1, True), ("b", 4, 1, True)], (1, 2))]
    assert M.decode_stalls(starved, prompt, decode_share_distance=2) == [(1, "a"), (1, "b")]


@pytest.mark.parametrize("seed", range(40))
def test_sarathi_with_token_feedback_never_stalls_a_decode(seed):
    """The real scheduler at pp=2 with token feedback (distance 2, three micro-batches in
    flight) under random arrivals and output lengths, results back in order as in the engine:
    no micro-batch with prompt tokens leaves out a decode beyond the balancing share."""
    from collections import deque

    from pipeserve.scheduler import Request, RequestStatus, Scheduler, SchedulerLimits

    rng = random.Random(seed)
    lens = [rng.randint(2, 96) for _ in range(12)]
    outs = dict((f"r{i}", rng.randint(1, 12)) for i in range(12))
    config = SchedulerConfig(policy="sarathi", max_num_batched_tokens=64)
    sched = Scheduler(config, limits=SchedulerLimits(max_model_len=256, feedback_distance=2), num_blocks=256,
                      block_size=16, clock=lambda: 0.0)
    pending = deque(Request(f"r{i}", [1 + (i + j) % 50 for j in range(n)], arrival_time=float(i))
                    for i, n in enumerate(lens))
    in_flight: deque = deque()
    records = []
    while pending or in_flight or sched.has_unfinished_requests():
        while pending and (rng.random() < 0.3 or not in_flight and not sched.has_unfinished_requests()):
            sched.add_request(pending.popleft())
        while len(in_flight) < 3 and not (plan := sched.schedule()).is_empty:
            in_flight.append(plan)
            records.append(StepRecord.of(plan, in_flight))
        if in_flight:
            done = in_flight.popleft()
            sampled = {s.request_id: 7 for s in done.scheduled if s.needs_sample}
            for r in sched.update(done, sampled):
                if not r.is_finished and r.num_output_tokens >= outs[r.request_id]:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
    prompt = {f"r{i}": n for i, n in enumerate(lens)}
    assert M.decode_stalls(records, prompt, decode_share_distance=2) == []


def tiny_hf_param_count(**shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    per_layer = sum(p.numel() for n, p in model.model.layers[0].named_parameters() if "norm" not in n)
    return per_layer, model


def test_model_flops_count_every_weight_twice_per_token():
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    per_layer, _ = tiny_hf_param_count(**shape)
    s = M.ModelShape(64, 96, 3, 4, 2, 16, 300, dtype_bytes=2)
    assert s.layer_params == per_layer
    assert s.flops(10, 0, 0) == 2 * 10 * 3 * per_layer
    # attention: QK^T and PV, each 2 * head_dim FLOPs per (query, key) pair per head per layer
    assert s.flops(0, 7, 0) == 7 * 3 * 4 * 16 * 2 * 2
    assert s.flops(0, 0, 2) == 2 * 2 * 64 * 300
    assert s.bytes_moved(5) == 2 * (3 * per_layer + 64 * 300 + 2 * 3 * 2 * 16 * 5)


def test_moe_flops_count_active_experts_and_bytes_every_expert():
    """A Mixtral layer holds its router and 4 experts (transformers' count); a token's matmuls
    use the router and 2 of them."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2)
    layer = MixtralForCausalLM(config).model.layers[0]
    held = sum(p.numel() for n, p in layer.named_parameters() if "norm" not in n)
    s = M.ModelShape(64, 96, 3, 4, 2, 16, 300, dtype_bytes=2, num_experts=4, num_experts_per_tok=2)
    assert s.layer_weights == held
    assert s.layer_params == held - 2 * 3 * 64 * 96  # two experts idle per token
    assert s.flops(10, 0, 0) == 2 * 10 * 3 * s.layer_params
    assert s.bytes_moved(0) == 2 * (3 * held + 64 * 300)


def test_efficiency_counts_the_keys_a_sliding_layer_reads():
    """Gemma 2's alternation over 3 layers (window 4, full, window 4): the prefill's attention
    FLOPs and the decode's KV bytes count, layer by layer, the keys each query sees."""
    s = M.ModelShape(64, 96, 3, 4, 2, 16, 300, dtype_bytes=2, sliding_layers=SlidingLayers.of([4, None, 4]))
    records = [rec(0, [("a", 0, 8, True)]), rec(1, [("a", 8, 1, True)])]
    e = M.efficiency(records, {0: 1.0, 1: 1.0}, s, {"a": 8}, peak_tflops=None, peak_mem_bw_gbps=None)
    # Prefill of 8: q * ctx = 64 (query, key) pairs on the full layer; the window hides keys
    # k <= p - 4 from the queries p = 4..7 (1 + 2 + 3 + 4 keys) on each sliding one.
    pairs = 64 + 2 * (64 - 10)
    linear, head = 2 * 8 * 3 * s.layer_params, 2 * 64 * 300
    assert e["prefill_tflops"] * 1e12 == pytest.approx(linear + 4 * 4 * 16 * pairs + head, rel=1e-12)
    # The decode at position 8 reads 9 keys on the full layer, 4 on each sliding one.
    kv_bytes = 2 * 2 * 16 * (9 + 4 + 4) * 2  # K and V, kv heads, head_dim, tokens, bytes
    assert e["decode_gb_per_s"] * 1e9 == pytest.approx(2 * (3 * s.layer_weights + 64 * 300) + kv_bytes, rel=1e-12)


def test_efficiency_splits_prefill_and_decode_steps():
    s = M.ModelShape(64, 96, 3, 4, 2, 16, 300, dtype_bytes=2)
    records = [rec(0, [("a", 0, 8, True)]), rec(1, [("a", 8, 1, True)])]
    e = M.efficiency(records, {0: 2.0, 1: 0.5}, s, {"a": 8}, peak_tflops=1e-9, peak_mem_bw_gbps=None)
    assert e["prefill_tflops"] == pytest.approx(s.flops(8, 64, 1) / 2.0 / 1e12)
    assert e["prefill_mfu"] == pytest.approx(e["prefill_tflops"] / 1e-9)
    assert e["decode_gb_per_s"] == pytest.approx(s.bytes_moved(9) / 0.5 / 1e9) and e["decode_mbu"] is None
    assert M.card_peaks("NVIDIA H100 80GB HBM3") == (989.4, 3350.0) and M.card_peaks("cpu") == (None, None)


# ---- trace and plots --------------------------------------------------------------------------


def test_chrome_trace_has_an_engine_lane_and_one_lane_per_stage():
    records = [rec(0, [("a", 0, 8, True)]), rec(1, [("a", 8, 1, True)])]
    timelines = [M.StageTimeline(stage=i, rank=i, spans=[M.StageSpan(k, k + 0.1 * i, k + 0.2 * i + 0.05, k + 0.5)
                                                         for k in range(2)]) for i in range(3)]
    trace = M.chrome_trace(records=records, done_times={0: 0.9, 1: 1.9}, timelines=timelines,
                           arrivals={"a": 0.0}, t0=0.0, prompt_lens={"a": 8})
    json.dumps(trace)  # serializable
    ev = trace["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {0: "engine", 1: "stage 0", 2: "stage 1", 3: "stage 2"}
    for tid in (1, 2, 3):
        compute = [e for e in ev if e["ph"] == "X" and e["tid"] == tid and e["cat"] == "compute"]
        assert [e["args"]["step"] for e in compute] == [0, 1]
    waits = [e for e in ev if e["ph"] == "X" and e["cat"] == "wait"]
    assert {e["tid"] for e in waits} == {1, 2, 3} and all(e["dur"] > 0 for e in waits)
    assert sum(e["ph"] == "b" for e in ev) == sum(e["ph"] == "e" for e in ev) == 2
    assert all("queued_ms" not in e["args"] for e in ev if e.get("cat") == "compute")  # none known


def test_timeline_json_with_and_without_the_queued_instant():
    old = M.StageTimeline.from_json({"stage": 0, "rank": 0, "spans": [[3, 1.0, 1.5, 2.0]]})
    new = M.StageTimeline.from_json({"stage": 0, "rank": 0, "spans": [[3, 1.0, 1.5, 2.0, 1.75]]})
    assert old.spans[0].queued is None and new.spans[0] == M.StageSpan(3, 1.0, 1.5, 2.0, 1.75)
    trace = M.chrome_trace(records=[], done_times={}, timelines=[new], arrivals={}, t0=0.0, prompt_lens={})
    (compute,) = [e for e in trace["traceEvents"] if e.get("cat") == "compute"]
    assert compute["args"]["queued_ms"] == pytest.approx(250.0)


def test_plots_are_pngs(tmp_path):
    r = M.RequestTimes("a", 0.0, 0.1, 0.2, [0.2, 0.3, 0.45], 0.45, 10, 3)
    M.plot_latency_cdfs([r, r], str(tmp_path / "cdf.png"))
    M.plot_stage_timeline([M.StageTimeline(0, 0, [M.StageSpan(0, 0.0, 0.1, 0.3)])], str(tmp_path / "tl.png"), t0=0.0)
    for name in ("cdf.png", "tl.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- cost model plumbing ------------------------------------------------------------------------


def test_cost_model_loads_from_a_profile_or_a_bare_dict(tmp_path):
    coef = dict(per_token=1e-4, per_attn=1e-9, per_seq=1e-6, fixed=1e-3)
    (tmp_path / "p.json").write_text(json.dumps({"cost_model": coef, "samples": []}))
    (tmp_path / "bare.json").write_text(json.dumps(coef))
    assert CostModel.load(str(tmp_path / "p.json")) == CostModel(**coef) == CostModel.load(str(tmp_path / "bare.json"))
    (tmp_path / "bad.json").write_text("{not json")
    for bad in ("bad.json", "missing.json"):
        with pytest.raises(ValueError, match="cost-model profile"):
            CostModel.load(str(tmp_path / bad))
    assert SchedulerConfig(cost_model_path="x.json").cost_model_path == "x.json"
    with pytest.raises(ValueError, match="cost_model_path"):
        SchedulerConfig(cost_model_path=3)
    assert math.isfinite(CostModel.analytic_default().predict(Work.of([(0, 10)])))


def test_loaded_window_ends_when_fewer_than_depth_requests_remain():
    finishes = [5.0, 9.0, 2.0, 7.0]  # sorted: 2, 5, 7, 9
    reqs = [M.RequestTimes(str(i), 1.0 + i, 0, 0, [], f, 1, 1) for i, f in enumerate(finishes)]
    # depth 2: after the third finish (t=7) only one request is left.
    assert M.loaded_window(reqs, 2) == (1.0, 7.0)
    assert M.loaded_window(reqs, 1) == (1.0, 9.0)
    assert M.loaded_window(reqs, 5) is None


def test_prompt_pending_intervals_end_when_the_last_prompt_chunk_is_submitted():
    # a: arrives 0, chunks submitted at 1 and 2 (prompt 8 = 4 + 4), then decodes at 3 and 4;
    # b: arrives 1.5, one chunk at 3; c: arrives 5, chunk at 6; d: arrives 7, never scheduled in
    # these records (ends at its first scheduling, 7: no wait).
    prompt_lens = {"a": 8, "b": 4, "c": 4, "d": 4}
    steps = [(1.0, [("a", 0, 4, False)]), (2.0, [("a", 4, 4, True)]), (3.0, [("a", 8, 1, True), ("b", 0, 4, True)]),
             (4.0, [("a", 9, 1, True)]), (6.0, [("c", 0, 4, True)])]
    records = [StepRecord(i, t, tuple(seqs), (i,)) for i, (t, seqs) in enumerate(steps)]
    arrivals = {"a": 0.0, "b": 1.5, "c": 5.0, "d": 7.0}
    reqs = [M.RequestTimes(rid, a, a, a + 9, [], 20.0, prompt_lens[rid], 1) for rid, a in arrivals.items()]
    assert M.prompt_pending_intervals(reqs, records, prompt_lens) == [(0.0, 3.0), (5.0, 6.0)]
    assert M.prompt_pending_intervals([], records, prompt_lens) == []


def test_bubble_in_intervals_counts_compute_inside_each():
    spans = [M.StageSpan(0, 0.0, 0.0, 2.0), M.StageSpan(1, 2.0, 2.5, 5.5), M.StageSpan(2, 6.0, 6.0, 7.0)]
    tl = M.StageTimeline(stage=0, rank=0, spans=spans)
    # [1, 3] holds 1 (1..2) + 0.5 (2.5..3); [5, 8] holds 0.5 (5..5.5) + 1 (6..7): 3 of 5 seconds
    assert M.bubble_in_intervals(tl, [(1.0, 3.0), (5.0, 8.0)]) == pytest.approx(1 - 3 / 5)
    # a span covering several intervals counts in each
    long = M.StageTimeline(stage=0, rank=0, spans=[M.StageSpan(0, 0.0, 0.0, 10.0)])
    assert M.bubble_in_intervals(long, [(1.0, 2.0), (4.0, 6.0)]) == pytest.approx(0.0)
    assert M.bubble_in_intervals(tl, []) is None
    assert M.bubble_in_intervals(tl, [(4.0, 4.0)]) is None
    with pytest.raises(ValueError, match="sorted and disjoint"):
        M.bubble_in_intervals(tl, [(5.0, 8.0), (1.0, 3.0)])


def test_bubble_in_window_counts_only_compute_inside_it():
    spans = [M.StageSpan(0, 0.0, 0.0, 2.0), M.StageSpan(1, 2.0, 3.0, 4.0), M.StageSpan(2, 4.0, 9.0, 12.0)]
    tl = M.StageTimeline(stage=0, rank=0, spans=spans)
    # window [1, 10]: busy 1 (1..2) + 1 (3..4) + 1 (9..10) = 3 of 9 seconds
    assert M.bubble_in_window(tl, 1.0, 10.0) == pytest.approx(1 - 3 / 9)
    assert M.bubble_in_window(tl, 5.0, 5.0) is None
