"""Scheduler unit tests: the sarathi policy, preemption, validation, and a simulated engine."""

from collections import deque

import pytest

from pipeserve.scheduler import (
    CostModel,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerLimits,
    SchedulerOutput,
    SlidingLayers,
    Work,
)

# ---- cheap builders ---------------------------------------------------------------------------


def make_requests(*prompt_lens: int, prefix: str = "r") -> list[Request]:
    return [
        Request(f"{prefix}{i}", [(7 * i + j) % 97 + 1 for j in range(n)], arrival_time=float(i))
        for i, n in enumerate(prompt_lens)
    ]


def make_scheduler(
    policy: str = "sarathi",
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    cost_model: CostModel | None = None,
    max_model_len: int = 64,
    sliding_layers: SlidingLayers | None = None,
    **config,
) -> Scheduler:
    cfg = SchedulerConfig(policy=policy, **config)
    return Scheduler(
        cfg,
        limits=SchedulerLimits(max_model_len=max_model_len, sliding_layers=sliding_layers),
        num_blocks=num_blocks,
        block_size=block_size,
        cost_model=cost_model,
        clock=lambda: 123.0,
        debug_checks=True,
    )


def chunks(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_scheduled_tokens) for s in output.scheduled]


def sample_all(output: SchedulerOutput, token: int = 5) -> dict[str, int]:
    return {s.request_id: token for s in output.scheduled if s.needs_sample}


# ---- a simulated engine: executes micro-batches in order against a fake paged KV ----------------


def fake_next_token(context: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % 997 + 1


def execute(output: SchedulerOutput, kv: dict, block_size: int) -> dict[str, int]:
    """Write each chunk's tokens into its KV slots, then 'attend' by reading them back."""
    sampled = {}
    for s in output.scheduled:
        tokens = s.request.all_token_ids
        for p in range(s.num_computed_tokens, s.context_len):
            kv[s.block_table[p // block_size], p % block_size] = tokens[p]
        if s.needs_sample and not s.request.is_finished:
            table = s.block_table
            context = [kv[table[p // block_size], p % block_size] for p in range(s.context_len)]
            assert context == tokens[: s.context_len], "KV read back differs: block table bug"
            sampled[s.request_id] = fake_next_token(context)
    return sampled


def drive(sched: Scheduler, requests, *, num_outputs, depth=1, max_steps=5_000) -> dict:
    """schedule → (up to ``depth`` micro-batches in flight) → update, until all finish."""
    for r in requests:
        sched.add_request(r)
    kv, inflight, stats = {}, deque(), {"steps": 0, "preemptions": 0}
    for step in range(max_steps):
        if not sched.has_unfinished_requests() and not inflight:
            stats["steps"] = step
            return stats
        out = sched.schedule()
        stats["preemptions"] += len(out.preempted)
        # Progress: with nothing in flight there is always something to run.
        assert inflight or not out.is_empty, "scheduler stalled with nothing in flight"
        awaiting = {s.request_id for o in inflight for s in o.scheduled if s.needs_sample}
        assert not awaiting & {s.request_id for s in out.scheduled}, "decode scheduled twice"
        if not out.is_empty:
            inflight.append(out)
        if inflight and (len(inflight) >= depth or out.is_empty):
            done = inflight.popleft()
            for r in sched.update(done, execute(done, kv, sched.block_manager.block_size)):
                if not r.is_finished and r.num_output_tokens >= num_outputs[r.request_id]:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
    raise AssertionError(f"not finished after {max_steps} steps")


def reference_outputs(prompt_lens, num_outputs) -> dict[str, list[int]]:
    """Greedy outputs computed directly, without any scheduler."""
    out = {}
    for r in make_requests(*prompt_lens):
        tokens = list(r.prompt_token_ids)
        for _ in range(num_outputs[r.request_id]):
            tokens.append(fake_next_token(tokens))
        out[r.request_id] = tokens[r.num_prompt_tokens :]
    return out


# ---- sarathi --------------------------------------------------------------------------------


def test_decodes_first_then_partial_prefills_then_new_prompts():
    sched = make_scheduler(max_num_batched_tokens=8)
    r0, r1, r2 = make_requests(3, 20, 4)
    sched.add_request(r0)
    sched.add_request(r1)
    s1 = sched.schedule()
    assert chunks(s1) == [("r0", 3), ("r1", 5)]
    assert [s.needs_sample for s in s1.scheduled] == [True, False]
    sched.update(s1, sample_all(s1))
    sched.add_request(r2)
    s2 = sched.schedule()
    assert chunks(s2) == [("r0", 1), ("r1", 7)]  # budget gone before r2
    assert s2.scheduled[1].num_computed_tokens == 5
    sched.update(s2, sample_all(s2))
    s3 = sched.schedule()
    assert chunks(s3) == [("r0", 1), ("r1", 7)]
    sched.update(s3, sample_all(s3))
    s4 = sched.schedule()
    assert chunks(s4) == [("r0", 1), ("r1", 1), ("r2", 4)]  # r1 now decodes
    assert s4.num_batched_tokens == 6


def test_prompt_is_chunked_within_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    (r,) = make_requests(50)
    sched.add_request(r)
    seen = []
    for _ in range(4):
        out = sched.schedule()
        (s,) = out.scheduled
        seen.append((s.num_computed_tokens, s.num_scheduled_tokens, s.needs_sample))
        assert len(s.block_table) * 4 >= s.context_len
        sched.update(out, sample_all(out))
    assert seen == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert r.output_token_ids == [5] and not r.is_prefill


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    for r in make_requests(2, 2, 2, 2, 2):
        sched.add_request(r)
    out = sched.schedule()
    assert [rid for rid, _ in chunks(out)] == ["r0", "r1", "r2"]
    assert sched.num_waiting == 2


def test_next_chunk_schedulable_before_update_when_allowed():
    sched = make_scheduler(max_num_batched_tokens=16)
    (r,) = make_requests(40)
    sched.add_request(r)
    outs = [sched.schedule() for _ in range(4)]
    assert [chunks(o) for o in outs] == [[("r0", 16)], [("r0", 16)], [("r0", 8)], []]
    assert outs[2].scheduled[0].needs_sample and r.awaiting_token
    assert r.num_inflight_chunks == 3
    for o in outs[:2]:
        assert sched.update(o, {}) == []
    assert sched.update(outs[2], {"r0": 9}) == [r]
    assert r.output_token_ids == [9] and r.num_inflight_chunks == 0


def test_decode_never_in_two_outputs_before_update():
    sched = make_scheduler()
    (r,) = make_requests(4)
    sched.add_request(r)
    prefill = sched.schedule()
    assert prefill.scheduled[0].needs_sample
    assert sched.schedule().is_empty
    sched.update(prefill, {"r0": 1})
    decode = sched.schedule()
    assert chunks(decode) == [("r0", 1)] and decode.scheduled[0].num_computed_tokens == 4
    assert sched.schedule().is_empty
    sched.update(decode, {"r0": 2})
    assert r.output_token_ids == [1, 2]


def test_preemption_evicts_latest_arrival_to_front_of_queue():
    # 4 blocks of 4 slots: two 8-token prompts fill the pool; the first decode needs a 3rd block.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    r0, r1, r2 = make_requests(8, 8, 2)
    for r in (r0, r1, r2):
        sched.add_request(r)
    s1 = sched.schedule()
    assert chunks(s1) == [("r0", 8), ("r1", 8)]
    sched.update(s1, sample_all(s1))
    s2 = sched.schedule()
    assert s2.preempted == ["r1"] and chunks(s2) == [("r0", 1)]
    assert r1.status is RequestStatus.PREEMPTED and r1.num_preemptions == 1
    assert r1.num_computed_tokens == 0 and not sched.block_manager.has("r1")
    assert r1.output_token_ids == [5]  # kept: recompute covers prompt + outputs
    assert sched._waiting[0] is r1 and sched._waiting[1] is r2
    assert sched.block_manager.num_free_blocks == 1
    sched.update(s2, sample_all(s2))
    s3 = sched.schedule()  # r1 needs 3 blocks for its 9 tokens; only 1 free: no skipping to r2
    assert chunks(s3) == [("r0", 1)]


def test_preemption_can_pick_the_request_itself():
    # r0's decode fits its blocks and goes in flight; r1 then needs a block and is the only
    # request not in flight, so it preempts itself.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    r0, r1 = make_requests(7, 8)
    sched.add_request(r0)
    sched.add_request(r1)
    s1 = sched.schedule()
    sched.update(s1, sample_all(s1))
    s2 = sched.schedule()
    assert chunks(s2) == [("r0", 1)] and s2.preempted == ["r1"]
    assert r0.status is RequestStatus.RUNNING and sched.num_running == 1


def test_no_victim_means_request_waits():
    # r1's next chunk needs a block while every other running request is in flight, and r1
    # itself has a chunk in flight, so nobody can be preempted: r1 simply waits.
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=12, max_num_batched_tokens=4)
    r0, r1 = make_requests(4, 8)
    sched.add_request(r0)
    sched.add_request(r1)
    s1 = sched.schedule()
    s2 = sched.schedule()
    assert chunks(s1) == [("r0", 4)] and chunks(s2) == [("r1", 4)]
    sched.update(s1, sample_all(s1))
    s3 = sched.schedule()
    assert chunks(s3) == [("r0", 1)] and s3.preempted == []
    assert r1.status is RequestStatus.RUNNING and r1.num_computed_tokens == 4
    sched.update(s2, {})
    s4 = sched.schedule()  # r1 no longer in flight: it is the latest arrival, so it yields
    assert s4.preempted == ["r1"] and s4.is_empty


@pytest.mark.parametrize("depth", [1, 3])
def test_tiny_pool_everything_finishes_with_reference_outputs(depth):
    prompt_lens = (9, 14, 5, 11, 7, 12)
    num_outputs = {f"r{i}": n for i, n in enumerate((6, 3, 9, 5, 8, 4))}
    sched = make_scheduler(
        num_blocks=7,
        block_size=4,
        max_model_len=28,
        max_num_batched_tokens=8,
    )
    requests = make_requests(*prompt_lens)
    stats = drive(sched, requests, num_outputs=num_outputs, depth=depth)
    assert stats["preemptions"] > 0
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(
        prompt_lens, num_outputs
    )
    assert all(r.status is RequestStatus.FINISHED_STOPPED for r in requests)
    assert sched.block_manager.num_free_blocks == 7 and not sched.has_unfinished_requests()
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", ["vllm", "orca", "faster_transformer"])
def test_every_policy_finishes_with_reference_outputs(policy, depth):
    prompt_lens = (9, 14, 5, 11, 7, 12)
    num_outputs = {f"r{i}": n for i, n in enumerate((6, 3, 9, 5, 8, 4))}
    sched = make_scheduler(policy, num_blocks=7, block_size=4, max_model_len=28, max_num_seqs=4)
    requests = make_requests(*prompt_lens)
    drive(sched, requests, num_outputs=num_outputs, depth=depth)
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(
        prompt_lens, num_outputs
    )
    assert sched.block_manager.num_free_blocks == 7


# ---- time budget --------------------------------------------------------------------------------


# Windows that change nothing: none (what a model without sliding layers passes), and one no
# context of these tests reaches (max_model_len 256).
UNBOUND_WINDOWS = [None, SlidingLayers(window=256, layer_share=0.5)]


@pytest.mark.parametrize("sliding", UNBOUND_WINDOWS, ids=["no-window", "window-never-reached"])
def test_time_budget_fills_target_and_chunks_shrink_as_prefix_grows(sliding):
    """The chunks and predicted times are bit for bit the full-attention formula's (q * ctx)."""
    model = CostModel(per_token=1e-4, per_attn=1e-6, per_seq=0.0, fixed=0.0)
    budget = 2e-3
    sched = make_scheduler(
        num_blocks=64, max_model_len=256, max_num_batched_tokens=512, time_budget_s=budget,
        cost_model=model, sliding_layers=sliding,
    )
    (r,) = make_requests(200)
    sched.add_request(r)
    sizes = []
    while not r.awaiting_token:
        out = sched.schedule()
        (s,) = out.scheduled
        q, c = s.num_scheduled_tokens, s.num_computed_tokens
        # Independent check of the formula: this chunk fits, one more token would not.
        assert 1e-4 * q + 1e-6 * q * (c + q) <= budget + 1e-15
        assert out.predicted_time == 1e-4 * q + 1e-6 * (q * (c + q))
        if not s.needs_sample:
            assert 1e-4 * (q + 1) + 1e-6 * (q + 1) * (c + q + 1) > budget
        sizes.append(q)
        assert len(sizes) < 100
    assert sizes == [17, 15, 13, 12, 11, 11, 10, 10, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 7, 6, 6, 4]


def lone_prompt_chunks(**config) -> list[int]:
    sched = make_scheduler(**{"num_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 512, **config})
    (r,) = make_requests(200)
    sched.add_request(r)
    sizes = []
    while not r.awaiting_token:
        (s,) = sched.schedule().scheduled
        sizes.append(s.num_scheduled_tokens)
    return sizes


def test_time_budget_fills_full_chunks_and_the_token_budget_keeps_sarathis():
    """48 tokens fit the budget (1 ms a token): full chunks, an 8-token remainder; the token
    budget cuts the same way (Sarathi-Serve's rule)."""
    flat = dict(time_budget_s=48e-3, cost_model=CostModel(per_token=1e-3, per_attn=0.0, per_seq=0.0, fixed=0.0))
    assert lone_prompt_chunks(**flat) == [48, 48, 48, 48, 8]
    assert lone_prompt_chunks(max_num_batched_tokens=48) == [48, 48, 48, 48, 8]


@pytest.mark.parametrize("sliding", [None, SlidingLayers(window=8, layer_share=0.75)], ids=["full", "window-8"])
def test_predicted_time_counts_every_sequence_of_the_batch(sliding):
    """The builder's running totals (tokens, q * ctx, context read, sequences) give the same
    prediction as the scheduled sequences' totals, decodes beside a chunk, knee and per_kv on."""
    model = CostModel(per_token=1e-4, per_attn=1e-7, per_kv=1e-6, per_seq=1e-5, fixed=1e-3, knee_tokens=20.0)
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=64, time_budget_s=1.0, cost_model=model,
                           sliding_layers=sliding)
    for r in make_requests(30, 12, 50):
        sched.add_request(r)
    for _ in range(12):
        out = sched.schedule()
        seqs = [(s.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled]
        assert out.predicted_time == pytest.approx(model.predict(Work.of(seqs, sliding)), rel=1e-12)
        sched.update(out, sample_all(out))
    assert any(s.num_scheduled_tokens == 1 for s in out.scheduled)  # decodes were in the batches


def brute_force_seconds(model: CostModel, c: int, q: int, layer_windows) -> float:
    """A lone chunk's predicted time from each layer's keys, per query: q * ctx charges every
    query the whole context, a window hides keys k <= p - W from the query at p; the KV read is
    the keys some query sees. Means over the layers."""
    ctx, attn, kv = c + q, 0, 0
    for w in layer_windows:
        oldest = [0 if w is None else max(0, p + 1 - w) for p in range(c, ctx)]  # first visible key
        attn += sum(ctx - k for k in oldest)
        kv += ctx - oldest[0]
    n = len(layer_windows)
    return model.per_token * q + model.per_attn * attn / n + model.per_kv * kv / n


def test_sliding_layers_fit_more_of_a_long_context_into_a_time_budget():
    """A Gemma-3-like model (five layers of six slide over 512 keys) against the same model
    with every layer full, chunking one 3,000-token prompt under the same time budget: chunks
    are equal until the window binds, larger past it, and each is the largest that a
    per-key count of its work fits."""
    model = CostModel(per_token=1e-5, per_attn=1e-8, per_kv=1e-7, per_seq=0.0, fixed=0.0)
    budget = 5e-3
    gemma = (512, 512, 512, 512, 512, None) * 2
    runs = {}
    for name, windows in (("full", (None,) * 12), ("gemma", gemma)):
        sched = make_scheduler(num_blocks=200, block_size=16, max_model_len=3200, max_num_batched_tokens=2048,
                               time_budget_s=budget, cost_model=model, sliding_layers=SlidingLayers.of(windows))
        (r,) = make_requests(3000)
        sched.add_request(r)
        chunks = []
        while not r.awaiting_token:
            (s,) = sched.schedule().scheduled
            c, q = s.num_computed_tokens, s.num_scheduled_tokens
            assert brute_force_seconds(model, c, q, windows) <= budget * (1 + 1e-12)
            if not s.needs_sample:
                assert brute_force_seconds(model, c, q + 1, windows) > budget
            chunks.append((c, q))
        runs[name] = chunks
    full, gemma = runs["full"], runs["gemma"]
    first_bound = next(i for i, (c, q) in enumerate(full) if c + q > 512)
    assert gemma[:first_bound] == full[:first_bound]
    # Past the window the sliding layers' attention stops growing with the prefix.
    late = [q for c, q in gemma if c >= 1000][:-1]
    assert min(late) > max(q for c, q in full if c >= 1000)
    assert len(gemma) < len(full)


def test_time_budget_still_caps_tokens_and_always_makes_progress():
    cheap = CostModel(per_token=1e-9, per_attn=0.0, per_seq=0.0, fixed=0.0)
    sched = make_scheduler(max_num_batched_tokens=8, time_budget_s=1.0, cost_model=cheap)
    sched.add_request(make_requests(30)[0])
    assert chunks(sched.schedule()) == [("r0", 8)]
    slow = CostModel(per_token=0.0, per_attn=0.0, per_seq=0.0, fixed=1.0)
    sched = make_scheduler(time_budget_s=0.5, cost_model=slow)
    for r in make_requests(30, 3):
        sched.add_request(r)
    out = sched.schedule()
    assert chunks(out) == [("r0", 1)] and out.predicted_time == 1.0


# ---- lifecycle and validation -----------------------------------------------------------------


def test_abort_waiting_running_and_in_flight():
    sched = make_scheduler(max_num_batched_tokens=8)
    r0, r1, r2 = make_requests(4, 20, 3)
    for r in (r0, r1, r2):
        sched.add_request(r)
    out = sched.schedule()  # r0 whole (awaiting), r1 partial; r2 waits
    assert chunks(out) == [("r0", 4), ("r1", 4)]
    assert sched.abort_request("r0") and sched.abort_request("r1") and sched.abort_request("r2")
    assert not sched.abort_request("r0") and not sched.abort_request("nope")
    assert r0.status is RequestStatus.FINISHED_ABORTED and r0.is_finished
    assert sched.update(out, {"r0": 1}) == [] and r0.output_token_ids == []
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()
    assert sched.get_request("r1") is None


def test_update_requires_a_token_for_each_live_sample():
    sched = make_scheduler()
    sched.add_request(make_requests(4)[0])
    out = sched.schedule()
    with pytest.raises(ValueError, match="r0"):
        sched.update(out, {})


def test_request_reaching_max_model_len_finishes_with_length():
    # As in vLLM, prompt + outputs never exceed max_model_len.
    sched = make_scheduler(max_model_len=8)
    (r,) = make_requests(6)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.update(out, {"r0": 3}) == [r] and not r.is_finished
    out = sched.schedule()
    assert sched.update(out, {"r0": 4}) == [r]
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 8
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.finish_request("r0", RequestStatus.FINISHED_STOPPED)  # already gone


def test_request_accounting_properties():
    (r,) = make_requests(5)
    assert r.is_prefill and r.num_remaining_tokens == 5 and r.status is RequestStatus.WAITING
    r.num_computed_tokens = 5
    r.output_token_ids.append(8)
    assert not r.is_prefill and r.num_tokens == 6 and r.num_remaining_tokens == 1
    assert r.all_token_ids == r.prompt_token_ids + [8]
    r.num_computed_tokens = 0  # preempted: recompute prompt + outputs
    assert r.is_prefill
    assert not RequestStatus.PREEMPTED.is_finished and RequestStatus.FINISHED_ERROR.is_finished


def test_add_request_validation():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", []))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_requests(17)[0])
    sched.add_request(make_requests(16)[0])
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_requests(3)[0])
    with pytest.raises(ValueError):
        sched.finish_request("r0", RequestStatus.RUNNING)


def test_constructor_validation():
    with pytest.raises(ValueError, match="KV blocks"):
        make_scheduler(num_blocks=3, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="cost_model"):
        make_scheduler(time_budget_s=0.01)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "fifo"},
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": -1},
        {"time_budget_s": 0.0},
        {"time_budget_s": 0.01, "policy": "vllm"},
        {"balance_decodes": 1},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_limits_validation():
    with pytest.raises(ValueError):
        SchedulerLimits(max_model_len=1.5)
    with pytest.raises(ValueError, match="sliding_layers"):
        SchedulerLimits(max_model_len=64, sliding_layers=16)
