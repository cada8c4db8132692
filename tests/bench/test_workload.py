"""Workload loaders: the shipped traces parse, arrivals are ordered and scale, lengths clamp."""

from __future__ import annotations

import csv
import glob
import hashlib
import math
import os
import statistics

import pytest

from pipeserve import configs
from pipeserve.runtime.bench import workload as W
from pipeserve.runtime.bench.workload import WorkloadConfig, build_workload

# Row counts from configs/traces/ATTRIBUTION.md (counted independently of the loader).
ROWS = {"arxiv": 28_257, "sharegpt": 30_731, "azure_code": 8_819, "azure_conv": 19_366}


@pytest.mark.parametrize("source", sorted(ROWS))
def test_trace_row_counts(source):
    rows = (W.load_length_trace(source) if source in W.LENGTH_TRACES else W.load_timestamp_trace(source))
    assert len(rows) == ROWS[source]
    assert all(p >= 1 and o >= 0 for *_, p, o in rows)


def test_trace_files_match_their_checksums_and_carry_attribution():
    folder = W.DEFAULT_TRACE_DIR
    sums = dict(reversed(line.split()) for line in open(os.path.join(folder, "SHA256SUMS")) if line.strip())
    paths = glob.glob(os.path.join(folder, "*.csv")) + glob.glob(os.path.join(folder, "*.jsonl"))
    files = sorted(os.path.basename(p) for p in paths)
    assert files == sorted(sums)
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sums[name], name
    attribution = open(os.path.join(folder, "ATTRIBUTION.md")).read()
    assert "CC-BY-4.0" in attribution and "Splitwise" in attribution
    assert all(name in attribution for name in files)


@pytest.mark.parametrize("source", ["azure_code", "azure_conv"])
def test_azure_timestamps_are_monotone_and_match_the_file(source):
    rows = W.load_timestamp_trace(source)
    times = [t for t, _, _ in rows]
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    with open(W.trace_path(source), newline="") as f:  # a second reading of the same rows
        raw = list(csv.reader(f))[1:]
    assert [(int(p), int(o)) for _, p, o in raw[:50]] == [(p, o) for _, p, o in rows[:50]]
    # '2023-11-16 18:15:46.6805900' → seconds of the day, independently of the loader
    def seconds(text):
        hms = text.split(" ")[1]
        h, m, s = hms.split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)
    assert times[99] == pytest.approx(seconds(raw[99][0]) - seconds(raw[0][0]), abs=1e-6)


def test_trace_replay_keeps_real_gaps_and_time_scale_scales_them():
    base = WorkloadConfig(source="azure_conv", arrival="trace", num_requests=200, start=10)
    fast = WorkloadConfig(source="azure_conv", arrival="trace", num_requests=200, start=10, time_scale=0.25)
    a, b = build_workload(base), build_workload(fast)
    rows = W.load_timestamp_trace("azure_conv")[10:210]
    assert [r.arrival_s for r in a] == pytest.approx([t - rows[0][0] for t, _, _ in rows])
    assert [r.arrival_s for r in b] == pytest.approx([0.25 * r.arrival_s for r in a])
    assert [(r.prompt_len, r.output_len) for r in a] == [(p, max(o, 1)) for _, p, o in rows]


def test_with_rate_time_scales_a_trace_to_the_requested_rate():
    cfg = WorkloadConfig(source="azure_code", arrival="trace", num_requests=100)
    scaled = build_workload(cfg.with_rate(20.0))
    assert (len(scaled) - 1) / scaled[-1].arrival_s == pytest.approx(20.0)


@pytest.mark.parametrize("arrival, cv", [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_rate_arrivals_are_monotone_with_the_right_mean_and_cv(arrival, cv):
    cfg = WorkloadConfig(source="sharegpt", arrival=arrival, rate=4.0, gamma_cv=cv, num_requests=4000, seed=3)
    times = [r.arrival_s for r in build_workload(cfg)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.15)


def test_offline_puts_every_request_at_zero():
    specs = build_workload(WorkloadConfig(source="arxiv", arrival="offline", num_requests=10))
    assert [s.arrival_s for s in specs] == [0.0] * 10
    assert [s.index for s in specs] == list(range(10))


def test_length_traces_sample_rows_of_the_trace_and_clamp():
    rows = set(W.load_length_trace("arxiv"))
    specs = build_workload(WorkloadConfig(source="arxiv", arrival="offline", num_requests=300, seed=1))
    assert all((s.prompt_len, max(s.output_len, 1)) in rows or s.output_len == 1 for s in specs)
    capped = build_workload(WorkloadConfig(source="arxiv", arrival="offline", num_requests=300, seed=1,
                                           max_prompt_len=1000, max_output_len=50, min_output_len=8))
    for s, c in zip(specs, capped):
        assert c.prompt_len == min(s.prompt_len, 1000)
        assert c.output_len == min(max(s.output_len, 8), 50)
    half = build_workload(WorkloadConfig(source="arxiv", arrival="offline", num_requests=300, seed=1,
                                         length_scale=0.5))
    assert [h.prompt_len for h in half] == [max(1, round(s.prompt_len * 0.5)) for s in specs]


def test_same_seed_same_workload_other_seed_other():
    cfg = dict(source="sharegpt", arrival="poisson", rate=1.0, num_requests=50)
    assert build_workload(WorkloadConfig(**cfg, seed=5)) == build_workload(WorkloadConfig(**cfg, seed=5))
    assert build_workload(WorkloadConfig(**cfg, seed=5)) != build_workload(WorkloadConfig(**cfg, seed=6))


def test_synthetic_uniform_and_zipf_lengths():
    common = dict(arrival="offline", num_requests=4000, min_prompt_len=10, max_prompt_len=100,
                  min_output_len=1, max_output_len=20, seed=2)
    uni = build_workload(WorkloadConfig(source="uniform", **common))
    zipf = build_workload(WorkloadConfig(source="zipf", zipf_theta=1.2, **common))
    for specs in (uni, zipf):
        assert all(10 <= s.prompt_len <= 100 and 1 <= s.output_len <= 20 for s in specs)
    assert statistics.fmean(s.prompt_len for s in uni) == pytest.approx(55, rel=0.05)
    # Zipf: P(min + k) ∝ (k+1)^-theta, so P(10) / P(11) = 2^1.2
    counts = [sum(s.prompt_len == n for s in zipf) for n in (10, 11)]
    assert counts[0] / counts[1] == pytest.approx(2**1.2, rel=0.2)
    weights = [(k + 1) ** -1.2 for k in range(91)]
    assert counts[0] / len(zipf) == pytest.approx(weights[0] / sum(weights), rel=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="nope"), "workload.source"),
    (dict(arrival="trace", source="arxiv"), "timestamped"),
    (dict(arrival="poisson", rate=None), "rate"),
    (dict(source="uniform", arrival="offline"), "max_prompt_len"),
    (dict(arrival="offline", num_requests=0), "num_requests"),
    (dict(arrival="offline", max_prompt_len=4, min_prompt_len=8), "below its min"),
])
def test_bad_configs_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**kwargs)


def test_missing_trace_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="missing"):
        build_workload(WorkloadConfig(source="azure_code", arrival="trace", trace_dir=str(tmp_path)))


WORKLOAD_YAMLS = sorted(glob.glob(os.path.join(os.path.dirname(configs.__file__), "workload", "*.yaml")))


def test_the_workload_configs_are_found():
    assert len(WORKLOAD_YAMLS) >= 8, WORKLOAD_YAMLS  # (an empty list would skip the test below)


@pytest.mark.parametrize("path", WORKLOAD_YAMLS, ids=lambda p: os.path.basename(p))
def test_every_workload_config_builds(path):
    from omegaconf import OmegaConf

    specs = build_workload(WorkloadConfig(**OmegaConf.to_container(OmegaConf.load(path))))
    assert len(specs) >= 1
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and not any(math.isnan(t) for t in times)
