"""`bench_peers --workload sharegpt` on CPU: prompt and output lengths come from the ShareGPT
trace (read here with csv, independently of runtime/bench/workload.py), capped to the model's length,
and pipeserve makes each request's own output length (tiny model)."""

from __future__ import annotations

import csv
import json
import random
import shutil

import pytest

from tools.bench_peers import (
    MAX_MODEL_LEN,
    cap_lengths,
    make_prompts,
    make_requests,
    outputs_label,
    parse_args,
    run_pipeserve,
)
from pipeserve.runtime.bench.prefix_workloads import MOONCAKE_NUM_ROWS
from pipeserve.runtime.bench.workload import DEFAULT_TRACE_DIR, WorkloadConfig, build_workload

pytestmark = pytest.mark.timeout(120)

VOCAB = 256  # the conftest models'
SHAREGPT_CSV = f"{DEFAULT_TRACE_DIR}/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


def sharegpt_rows() -> set[tuple[int, int]]:
    with open(SHAREGPT_CSV, newline="") as f:
        return {(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)}


def test_sharegpt_lengths_are_trace_rows_drawn_as_pipeserve_bench_draws_them():
    args = parse_args(["--workload", "sharegpt", "--num-requests", "32", "--seed", "3"])
    prompts, output_lens = make_requests(args)
    pairs = [(len(p), n) for p, n in zip(prompts, output_lens)]
    assert len(pairs) == 32 and set(pairs) <= sharegpt_rows()
    assert len(set(output_lens)) > 1  # each request its own length, not --output-len
    drawn = build_workload(WorkloadConfig(source="sharegpt", arrival="offline", num_requests=32, seed=3))
    assert pairs == [(s.prompt_len, s.output_len) for s in drawn]
    assert all(0 <= t < 50257 for p in prompts for t in p)
    assert make_requests(args) == (prompts, output_lens) and make_prompts(args) == prompts  # seeded
    other_seed = make_requests(parse_args(["--workload", "sharegpt", "--num-requests", "32", "--seed", "4"]))
    assert other_seed[1] != output_lens


def test_sharegpt_1000_requests_fit_the_model_uncut():
    prompts, output_lens = make_requests(parse_args(["--workload", "sharegpt", "--num-requests", "1000"]))
    assert len(prompts) == 1000
    assert max(len(p) + n for p, n in zip(prompts, output_lens)) <= MAX_MODEL_LEN
    assert {(len(p), n) for p, n in zip(prompts, output_lens)} <= sharegpt_rows()  # the 8k trace needs no cut
    assert "out each (mean" in outputs_label(output_lens) and outputs_label([128] * 3) == "128 out"


def test_cap_keeps_the_output_and_cuts_the_prompt():
    assert cap_lengths(100, 50, 8192) == (100, 50)
    assert cap_lengths(8141, 2000, 8192) == (6192, 2000)
    assert cap_lengths(10, 9000, 8192) == (1, 8191)


def test_pipeserve_makes_each_requests_own_output_length(tiny_model, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny_model, tmp_path / "model")  # run_pipeserve writes its tokens there
    monkeypatch.setenv("PIPESERVE_STAGE_STATS", "1")  # run_pipeserve sets it; restored after the test
    args = parse_args(["--workload", "sharegpt", "--dtype", "float32", "--max-num-batched-tokens", "64"])
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 40, 17, 9, 70)]
    output_lens = [1, 7, 3, 12, 5]
    result = run_pipeserve(str(folder), prompts, output_lens, args)
    tokens = json.loads((folder / "tokens_pipeserve.json").read_text())
    assert [len(t) for t in tokens] == output_lens
    assert result["wall_s"] > 0


def test_bench_peers_builds_the_prefix_workloads():
    uniform = make_prompts(parse_args(["--num-requests", "4"]))
    assert len(uniform) == 4 and all(128 <= len(p) <= 2048 for p in uniform)
    shared = make_prompts(parse_args(["--workload", "shared_prefix", "--num-requests", "8", "--prefix-len", "32",
                                      "--suffix-len", "4"]))
    assert len(shared) == 8 and len({tuple(p[:32]) for p in shared}) == 4
    moon = make_prompts(parse_args(["--workload", "mooncake", "--num-requests", "16", "--block-tokens", "4"]))
    tail = build_workload(WorkloadConfig(source="mooncake", arrival="offline", start=MOONCAKE_NUM_ROWS - 16,
                                         num_requests=16, block_tokens=4, max_prompt_len=2048))
    assert moon == [list(s.prompt_token_ids) for s in tail]  # the trace's last rows, as the bench builds them
