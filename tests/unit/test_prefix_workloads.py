"""Prefix-sharing workload builders: the Mooncake trace as token ids, and the synthetic one."""

import json
from pathlib import Path

import pytest

from pipeserve.runtime.bench.prefix_workloads import (
    MOONCAKE_TRACE,
    ideal_cached_fraction,
    mooncake_requests,
    shared_prefix_requests,
)

def write_trace(tmp_path, rows) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_hash_ids_give_equal_tokens(tmp_path):
    path = write_trace(tmp_path, [
        {"timestamp": 0, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 0, "hash_ids": [3, 1]},
    ])
    a, b, c = mooncake_requests(path)
    assert len(a.prompt_token_ids) == 1000 and len(b.prompt_token_ids) == 1100
    assert a.prompt_token_ids == b.prompt_token_ids[:1000]
    assert a.prompt_token_ids[:512] != c.prompt_token_ids[:512]
    assert c.prompt_token_ids[512:] == a.prompt_token_ids[512:600]  # same id, same tokens
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (7, 3, 1)
    assert (a.arrival_time, b.arrival_time) == (0.0, 1.5)
    assert all(1000 <= t < 32000 for t in b.prompt_token_ids)
    small = mooncake_requests(path, block_tokens=16, max_output_len=2)
    assert [len(r.prompt_token_ids) for r in small] == [32, 35, 19]
    assert small[0].prompt_token_ids == small[1].prompt_token_ids[:32] and small[0].max_tokens == 2
    assert [len(r.prompt_token_ids) for r in mooncake_requests(path, max_input_len=700)] == [700, 700, 600]
    assert mooncake_requests(path, seed=1)[0].prompt_token_ids != a.prompt_token_ids


def test_ideal_fraction_counts_repeated_chains_only():
    assert ideal_cached_fraction([[1] * 9, [1] * 9], block_size=4) == pytest.approx(8 / 18)
    assert ideal_cached_fraction([[1] * 8 + [2], [3] + [1] * 8], block_size=4) == 0.0


def test_real_mooncake_trace_shares_prefixes():
    requests = mooncake_requests(MOONCAKE_TRACE, block_tokens=16, max_requests=1000)
    assert len(requests) == 1000
    # Sharing grows along the trace (~0.65 of prompt tokens over all 3,993 requests).
    assert 0.1 < ideal_cached_fraction([r.prompt_token_ids for r in requests], block_size=16) < 0.5


def test_shared_prefix_workload():
    reqs = shared_prefix_requests(num_prefixes=3, requests_per_prefix=4, prefix_len=40, suffix_len=5,
                                  max_tokens=6, seed=3)
    assert len(reqs) == 12 and all(len(r.prompt_token_ids) == 45 and r.max_tokens == 6 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:40]) for r in reqs}) == 3
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 12
    prompts = [r.prompt_token_ids for r in reqs]
    assert ideal_cached_fraction(prompts, block_size=8) == pytest.approx(9 * 40 / (12 * 45))
    with pytest.raises(ValueError):
        shared_prefix_requests(num_prefixes=0, requests_per_prefix=1, prefix_len=1, suffix_len=1, max_tokens=1)
