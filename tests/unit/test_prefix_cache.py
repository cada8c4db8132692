"""Prefix caching: chained block hashes, reference counts, LRU eviction, in-flight protection,
and whole runs against a fake paged KV that checks every cache hit reads the right tokens."""

from collections import deque
from types import SimpleNamespace

import pytest

from pipeserve.scheduler import BlockManager, Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerLimits
from pipeserve.scheduler.prefix_cache import PrefixCache, hash_block, hash_blocks

BS = 4

# ---- cheap builders ---------------------------------------------------------------------------


def req(rid: str, tokens, **kw) -> Request:
    return Request(rid, list(tokens), **kw)


def shared_prefix_requests(num: int, prefix_len: int, suffix_len: int, *, num_prefixes: int = 1) -> list[Request]:
    """``num`` requests over ``num_prefixes`` prompts' worth of shared prefix, each with its own
    suffix (suffix lengths vary so that some prompts end on a block boundary)."""
    out = []
    for i in range(num):
        p = i % num_prefixes
        prefix = [(31 * p + 7 * j) % 89 + 1 for j in range(prefix_len)]
        suffix = [(13 * i + 5 * j) % 97 + 1 for j in range(suffix_len + i % 3)]
        out.append(Request(f"r{i}", prefix + suffix, arrival_time=float(i)))
    return out


def make_scheduler(*, num_blocks=64, max_model_len=64, caching=True, grouping=False, **config) -> Scheduler:
    cfg = SchedulerConfig(enable_prefix_caching=caching, prefix_grouping=grouping, **config)
    return Scheduler(cfg, limits=SchedulerLimits(max_model_len=max_model_len), num_blocks=num_blocks, block_size=BS,
                     clock=lambda: 0.0, debug_checks=True)


def fill(bm: BlockManager, r: Request) -> list[int]:
    """Admit ``r`` with its cache hit and compute all its tokens (one completed chunk)."""
    hit = bm.cached_prefix(r)
    table = bm.allocate(r.request_id, r.num_tokens, hit)
    bm.note_scheduled(r, r.num_tokens)
    bm.commit(r, r.num_tokens)
    return table


# ---- a fake engine: micro-batches run in order against a fake paged KV --------------------------


def fake_next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % 997 + 1


def execute(out, kv: dict, bm: BlockManager) -> dict[str, int]:
    """Write each chunk's tokens into its slots, then read the whole context back: a cache hit
    on a block holding other tokens (stale, evicted, unwritten) fails here."""
    sampled = {}
    for s in out.scheduled:
        tokens, table = s.request.all_token_ids, s.block_table
        for p in range(s.num_computed_tokens, s.context_len):
            kv[table[p // BS], p % BS] = tokens[p]
        if s.needs_sample and not s.request.is_finished:
            context = [kv.get((table[p // BS], p % BS)) for p in range(s.context_len)]
            assert context == tokens[: s.context_len], f"{s.request_id} read wrong KV"
            sampled[s.request_id] = fake_next_token(context)
    return sampled


def drive(sched: Scheduler, requests, *, num_outputs: int, depth: int = 1, max_steps: int = 20_000) -> dict:
    """schedule → up to ``depth`` micro-batches in flight → update, until all finish."""
    for r in requests:
        sched.add_request(r)
    bm = sched.block_manager
    kv, inflight, stats = {}, deque(), {"steps": 0, "preemptions": 0}
    for step in range(max_steps):
        if not sched.has_unfinished_requests() and not inflight:
            stats["steps"] = step
            return stats
        out = sched.schedule()
        stats["preemptions"] += len(out.preempted)
        assert inflight or not out.is_empty, "scheduler stalled with nothing in flight"
        for s in out.scheduled:  # a chunk never writes into a block someone can hit
            for b in {s.block_table[p // BS] for p in range(s.num_computed_tokens, s.context_len)}:
                assert not bm.cache or not bm.cache.is_cached(b), f"{s.request_id} writes cached block {b}"
        if not out.is_empty:
            inflight.append(out)
        if inflight and (len(inflight) >= depth or out.is_empty):
            done = inflight.popleft()
            for r in sched.update(done, execute(done, kv, bm)):
                if not r.is_finished and r.num_output_tokens >= num_outputs:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
    raise AssertionError(f"not finished after {max_steps} steps")


def reference_outputs(requests, num_outputs: int) -> dict[str, list[int]]:
    out = {}
    for r in requests:
        tokens = list(r.prompt_token_ids)
        for _ in range(num_outputs):
            tokens.append(fake_next_token(tokens))
        out[r.request_id] = tokens[r.num_prompt_tokens :]
    return out


def assert_no_leak(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


# ---- hashing ----------------------------------------------------------------------------------


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # the partial third block has no key
    assert a == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] == hash_block(None, [1, 2, 3, 4]) and a[1] == hash_block(a[0], [5, 6, 7, 8])
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert b[0] != a[0] and b[1] != a[1], "same block after a different prefix: different key"
    assert hash_blocks([5, 6, 7, 8], BS)[0] != a[1]
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 4, 0])


# ---- the content index and its LRU ------------------------------------------------------------


def test_prefix_cache_lru_order_and_duplicates():
    cache = PrefixCache()
    keys = hash_blocks(list(range(12)), BS)
    for block, key in zip((5, 6, 7), keys):
        assert cache.register(block, key)
    assert not cache.register(9, keys[0]), "a second block with the same content is not indexed"
    assert cache.match(keys) == [5, 6, 7] and cache.match([keys[1]]) == [6]
    for block in (7, 6, 5):  # parked tail first
        cache.park(block)
    cache.unpark(6)  # a hit
    cache.park(6)
    assert cache.evictable_blocks() == [7, 5, 6]
    assert cache.evict() == 7 and cache.match(keys) == [5, 6]
    assert cache.num_evictions == 1 and cache.num_cached == 2
    cache.check_invariants()


# ---- the block manager with caching -----------------------------------------------------------


def test_hit_shares_blocks_with_reference_counts():
    bm = BlockManager(16, BS, enable_caching=True)
    a = req("a", range(1, 11))  # 10 tokens: 2 full blocks + 2
    table_a = fill(bm, a)
    b = req("b", list(range(1, 9)) + [50, 51, 52])
    hit = bm.cached_prefix(b)
    assert hit == table_a[:2]
    table_b = bm.allocate("b", b.num_tokens, hit)
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert [bm.ref_count(x) for x in table_a] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    bm.check_invariants()
    bm.free("a")
    assert [bm.ref_count(x) for x in table_a] == [1, 1, 0] and bm.num_cached_free_blocks == 0
    bm.free("b")
    # The full blocks stay cached (free but indexed); the partial ones are plain free.
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 16 and bm.num_used_blocks == 0
    bm.check_invariants()


def test_hit_always_leaves_a_token_to_compute():
    bm = BlockManager(16, BS, enable_caching=True)
    fill(bm, req("a", range(1, 13)))  # 3 full blocks
    bm.free("a")
    assert len(bm.cached_prefix(req("same", range(1, 13)))) == 2  # not the block of the last token
    assert len(bm.cached_prefix(req("longer", range(1, 14)))) == 3
    assert bm.cached_prefix(req("short", range(1, 4))) == []


def test_hit_on_cached_free_block_counts_against_the_pool():
    bm = BlockManager(4, BS, enable_caching=True)
    fill(bm, req("a", range(1, 13)))  # 3 full blocks, all committed
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 3
    b = req("b", list(range(1, 13)) + [77] * 8)  # 20 tokens: hits 3 blocks, needs 2 more
    hit = bm.cached_prefix(b)
    assert len(hit) == 3
    assert not bm.can_allocate(20, hit)  # 1 plain free block: reviving the hits leaves 1
    assert bm.can_allocate(16, hit)
    bm.allocate("b", 16, hit)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_lru_evicts_tails_first_and_oldest_prefix_first():
    bm = BlockManager(6, BS, enable_caching=True)
    old = req("old", range(1, 10))  # 2 full blocks + 1
    new = req("new", range(50, 59))
    t_old, t_new = fill(bm, old), fill(bm, new)
    bm.free("old")
    bm.free("new")
    assert bm.cache.evictable_blocks() == [t_old[1], t_old[0], t_new[1], t_new[0]]
    # 2 plain free blocks, then the old prefix's tail goes first.
    bm.allocate("x", 3 * BS)
    assert bm.cache.num_evictions == 1
    assert len(bm.cached_prefix(req("o2", range(1, 10)))) == 1  # head survives
    assert len(bm.cached_prefix(req("n2", range(50, 59)))) == 2
    bm.check_invariants()


def test_duplicate_computation_is_not_indexed_and_frees_plainly():
    bm = BlockManager(8, BS, enable_caching=True)
    a, b = req("a", range(1, 7)), req("b", range(1, 7))
    bm.allocate("a", 6)
    bm.allocate("b", 6)  # admitted before a's block was computed: no hit
    for r in (a, b):
        bm.note_scheduled(r, 6)
    bm.commit(a, 6)
    bm.commit(b, 6)
    assert bm.cached_prefix(req("c", range(1, 7))) == bm.block_table("a")[:1]
    bm.free("b")
    assert bm.num_cached_free_blocks == 0
    bm.check_invariants()


def test_pending_keys_track_in_flight_chunks():
    bm = BlockManager(8, BS, enable_caching=True)
    a = req("a", range(1, 14))
    waiting = req("w", list(range(1, 13)) + [99, 98])
    bm.allocate("a", 8)
    bm.note_scheduled(a, 8)  # blocks 0 and 1 in flight
    assert bm.prefix_in_progress(waiting, 0)
    bm.commit(a, 8)
    assert not bm.prefix_in_progress(waiting, 2)
    assert len(bm.cached_prefix(waiting)) == 2
    bm.append("a", 13)
    bm.note_scheduled(a, 13)
    assert bm.prefix_in_progress(waiting, 2)
    bm.check_invariants()
    bm.free("a")  # preempted or aborted: its unfinished blocks are no longer pending
    assert not bm.prefix_in_progress(waiting, 2)
    bm.check_invariants()


def test_invariant_check_catches_a_bad_refcount():
    bm = BlockManager(4, BS, enable_caching=True)
    bm.allocate("a", 5)
    bm._ref[bm.block_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_invariants()


def test_caching_off_never_hits():
    bm = BlockManager(8, BS)
    fill(bm, req("a", range(1, 10)))
    bm.free("a")
    assert bm.cached_prefix(req("b", range(1, 10))) == [] and bm.num_cached_free_blocks == 0
    bm.check_invariants()


# ---- the scheduler --------------------------------------------------------------------------------


def test_block_is_cached_only_after_its_chunk_completes():
    sched = make_scheduler(max_num_batched_tokens=64)
    r0, r1, r2 = shared_prefix_requests(3, prefix_len=12, suffix_len=2)
    sched.add_request(r0)
    first = sched.schedule()
    sched.add_request(r1)
    second = sched.schedule()  # r0's chunk is still in flight: r1 must compute it all
    assert [(s.request_id, s.num_computed_tokens) for s in second.scheduled] == [("r1", 0)]
    sched.update(first, {"r0": 5})
    sched.add_request(r2)
    third = sched.schedule()
    (s,) = [s for s in third.scheduled if s.request_id == "r2"]
    assert s.num_computed_tokens == 12 and s.block_table[:3] == first.scheduled[0].block_table[:3]
    stats = sched.prefix_cache_stats
    assert stats.num_cached_prompt_tokens == 12 and stats.num_prompt_tokens == 14 + 15 + 16


def test_hit_with_chunked_prefill_continues_after_the_prefix():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    r0, r1 = shared_prefix_requests(2, prefix_len=20, suffix_len=6)
    sched.add_request(r0)
    outs = []
    while not r0.awaiting_token:
        outs.append(sched.schedule())
    for o in outs[:-1]:
        sched.update(o, {})
    sched.add_request(r1)
    out = sched.schedule()  # r0's last chunk is in flight; the earlier ones are cached
    (s,) = out.scheduled
    assert s.request_id == "r1" and s.num_computed_tokens == 20 and s.num_scheduled_tokens == 7


@pytest.mark.parametrize("grouping", [False, True])
def test_skip_reading_prefix_cache_computes_the_whole_prompt(grouping):
    """A request that skips reading the cache (prompt logprobs) starts at 0 over a cached prefix,
    is never held for a prefix in flight, and still caches its own blocks for the others."""
    sched = make_scheduler(grouping=grouping, max_num_batched_tokens=64)
    r0, r1, r2 = shared_prefix_requests(3, prefix_len=12, suffix_len=2)
    skipper = req("skip", r1.prompt_token_ids, arrival_time=1.0, skip_reading_prefix_cache=True)
    sched.add_request(r0)
    sched.add_request(skipper)  # r0's prefix is in flight: grouping would hold a plain request
    first = sched.schedule()
    assert [(s.request_id, s.num_computed_tokens) for s in first.scheduled] == [("r0", 0), ("skip", 0)]
    sched.update(first, {"r0": 5, "skip": 6})
    assert sched.block_manager.cached_prefix(skipper) == []
    skipper2 = req("skip2", r2.prompt_token_ids, arrival_time=2.0, skip_reading_prefix_cache=True)
    sched.add_request(skipper2)
    sched.add_request(r2)
    second = sched.schedule()
    starts = {s.request_id: s.num_computed_tokens for s in second.scheduled}
    assert (starts["skip2"], starts["r2"]) == (0, 12)  # the plain request hits the cached prefix
    assert sched.prefix_cache_stats.num_cached_prompt_tokens == 12


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "faster_transformer"])
def test_shared_prefixes_finish_with_reference_outputs(policy, depth):
    requests = shared_prefix_requests(12, prefix_len=18, suffix_len=3, num_prefixes=3)
    sched = make_scheduler(policy=policy, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=6)
    drive(sched, requests, num_outputs=5, depth=depth)
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(requests, 5)
    # Plain caching may compute a prefix twice while its first computation is in flight (the
    # prefix-grouping tests show the hold that prevents it); it still hits.
    assert sched.prefix_cache_stats.num_cached_prompt_tokens > 0
    assert_no_leak(sched)


@pytest.mark.parametrize("depth", [1, 3])
def test_tiny_pool_evicts_and_preempts_with_reference_outputs(depth):
    requests = shared_prefix_requests(10, prefix_len=10, suffix_len=4, num_prefixes=3)
    sched = make_scheduler(
        num_blocks=9, max_model_len=32, max_num_batched_tokens=8,
    )
    stats = drive(sched, requests, num_outputs=9, depth=depth)
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(requests, 9)
    assert stats["preemptions"] > 0, "the pool was meant to run out"
    cache_stats = sched.prefix_cache_stats
    assert cache_stats.num_evictions > 0 and cache_stats.num_cached_tokens > 0
    assert_no_leak(sched)


def test_preempted_request_restarts_from_its_own_cached_blocks():
    # r1 computes 12 tokens, decodes, and is preempted; its full blocks stay cached, so its
    # restart hits them instead of recomputing the prompt.
    sched = make_scheduler(num_blocks=8, max_model_len=32, max_num_batched_tokens=32)
    r0 = req("r0", [3] * 16)
    r1 = req("r1", [4] * 12)
    sched.add_request(r0)
    sched.add_request(r1)
    s1 = sched.schedule()
    sched.update(s1, {"r0": 1, "r1": 2})
    r0_table = sched.block_manager.block_table("r0")
    while r1.status is RequestStatus.RUNNING:  # r0 grows until r1 must yield its blocks
        out = sched.schedule()
        sched.update(out, {s.request_id: 1 for s in out.scheduled if s.needs_sample})
    assert r1.status is RequestStatus.PREEMPTED and sched.block_manager.num_cached_free_blocks >= 1
    sched.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.request_id == "r1" and s.num_computed_tokens > 0 and s.num_computed_tokens % BS == 0
    assert not set(s.block_table) & set(r0_table[4:])
    assert sched.prefix_cache_stats.num_cached_tokens == s.num_computed_tokens


def test_aborted_in_flight_chunk_is_never_cached():
    sched = make_scheduler(max_num_batched_tokens=64)
    r0, r1 = shared_prefix_requests(2, prefix_len=12, suffix_len=2)
    sched.add_request(r0)
    out = sched.schedule()
    sched.abort_request("r0")
    sched.update(out, {"r0": 1})  # its result comes back after the abort
    assert sched.block_manager.num_cached_free_blocks == 0
    sched.add_request(r1)
    assert sched.schedule().scheduled[0].num_computed_tokens == 0
    sched.block_manager.check_invariants()


def test_waiting_head_not_admitted_counts_nothing_computed():
    sched = make_scheduler(num_blocks=8, max_model_len=32, max_num_batched_tokens=32, max_num_seqs=1)
    r0, r1 = shared_prefix_requests(2, prefix_len=12, suffix_len=2)
    sched.add_request(r0)
    sched.update(sched.schedule(), {"r0": 1})
    sched.add_request(r1)
    out = sched.schedule()  # max_num_seqs=1: only r0's decode; r1 peeked (hit) but not admitted
    assert [s.request_id for s in out.scheduled] == ["r0"]
    assert r1.status is RequestStatus.WAITING and r1.num_computed_tokens == 0


def test_config_validation():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        SchedulerConfig(prefix_grouping=True)
    with pytest.raises(ValueError, match="bool"):
        SchedulerConfig(enable_prefix_caching=1)


# ---- prefix grouping: admission by in-flight prefix and by KV memory -----------------------------


def with_max_tokens(requests, max_tokens: int):
    for r in requests:
        r.sampling_params = SimpleNamespace(max_tokens=max_tokens)
    return requests


def test_grouping_holds_a_request_until_its_prefix_is_cached():
    sched = make_scheduler(grouping=True, max_num_batched_tokens=64)
    r0, r1 = with_max_tokens(shared_prefix_requests(2, prefix_len=12, suffix_len=2), 4)
    sched.add_request(r0)
    sched.add_request(r1)
    first = sched.schedule()
    assert [s.request_id for s in first.scheduled] == ["r0"]  # r1 waits for r0's prefix
    assert sched.schedule().is_empty
    assert sched._admission_gate.num_held_for_prefix >= 2
    sched.update(first, {"r0": 1})
    (s1, s2) = sched.schedule().scheduled
    assert (s2.request_id, s2.num_computed_tokens) == ("r1", 12)


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "faster_transformer"])
def test_grouping_admits_by_projected_kv_and_never_preempts(policy):
    # 6 requests of 14-16 prompt tokens + 10 outputs need 6-7 blocks each; 16 blocks hold two
    # at a time beside the shared prefix. Plain caching admits more and must preempt.
    def run(grouping: bool):
        requests = with_max_tokens(shared_prefix_requests(6, prefix_len=12, suffix_len=2), 10)
        sched = make_scheduler(
            policy=policy, grouping=grouping, num_blocks=16, max_model_len=32, max_num_batched_tokens=32
        )
        stats = drive(sched, requests, num_outputs=10, depth=2)
        assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(requests, 10)
        assert_no_leak(sched)
        return stats["preemptions"], sched

    plain_preemptions, _ = run(False)
    grouped_preemptions, sched = run(True)
    assert grouped_preemptions == 0
    if policy != "faster_transformer":  # it admits a whole batch only when nothing runs
        assert plain_preemptions > 0 and sched._admission_gate.num_held_for_memory > 0


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "faster_transformer"])
def test_grouping_computes_each_shared_prefix_once(policy, depth):
    requests = shared_prefix_requests(12, prefix_len=18, suffix_len=3, num_prefixes=3)
    requests = with_max_tokens(sorted(requests, key=lambda r: int(r.request_id[1:]) % 3), 5)
    sched = make_scheduler(
        policy=policy, grouping=True, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=6
    )
    stats = drive(sched, requests, num_outputs=5, depth=depth)
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(requests, 5)
    # 3 prefixes of 18 tokens: 4 full blocks each, computed by the first of their 4 requests.
    assert sched.prefix_cache_stats.num_cached_prompt_tokens == 9 * 16
    assert stats["preemptions"] == 0
    assert_no_leak(sched)
