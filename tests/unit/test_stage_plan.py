import itertools
import random
from types import SimpleNamespace

import pytest

from pipeserve.parallel.stage_plan import (
    StageLayers,
    default_costs,
    model_costs,
    plan_model_stages,
    plan_stages,
)


def counts(ranges):
    return [end - start for start, end in ranges]


def check_cover(ranges, num_layers):
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a_end == b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
    assert all(end > start for start, end in ranges)


def test_even_split():
    assert plan_stages(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert plan_stages(30, 3, layer_cost=2.5) == [(0, 10), (10, 20), (20, 30)]


def test_uneven_split_is_balanced_and_puts_extras_later():
    ranges = plan_stages(30, 4)
    check_cover(ranges, 30)
    assert counts(ranges) == [7, 7, 8, 8]
    assert counts(plan_stages(10, 4)) == [2, 2, 3, 3]
    for num_layers in range(1, 40):
        for num_stages in range(1, num_layers + 1):
            c = counts(plan_stages(num_layers, num_stages))
            assert sum(c) == num_layers and max(c) - min(c) <= 1
            assert c == sorted(c)


def test_single_stage_and_one_layer_per_stage():
    assert plan_stages(5, 1, embedding_cost=3.0, head_cost=9.0) == [(0, 5)]
    assert plan_stages(4, 4, head_cost=100.0) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_head_cost_shrinks_last_stage():
    c = counts(plan_stages(30, 3, head_cost=6.0))
    assert c[-1] < c[0] and c[-1] < c[1] and sum(c) == 30
    assert max(c[0], c[1], c[2] + 6) == 12  # (36 total) / 3


def test_embedding_cost_shrinks_first_stage():
    c = counts(plan_stages(30, 3, embedding_cost=6.0))
    assert c[0] < c[1] and c[0] < c[2] and c[0] + 6 <= 12


def test_real_model_costs():
    # SmolLM2-135M: the tied 49152-token head costs about 8 layers' worth of matmuls.
    costs = default_costs(hidden_size=576, intermediate_size=1536, vocab_size=49152,
                          num_heads=9, num_kv_heads=3, head_dim=64)
    assert costs["layer_cost"] == 1.0 and costs["embedding_cost"] == 0.0
    # layer: q,o 2*576*576 + k,v 2*576*192 + mlp 3*576*1536 = 3,538,944 weights
    assert costs["head_cost"] == pytest.approx(576 * 49152 / 3_538_944)
    assert counts(plan_stages(30, 2, **costs)) == [19, 11]
    llama3_8b = default_costs(4096, 14336, 128256, 32, 8, 128)
    assert 2 < llama3_8b["head_cost"] < 3
    with pytest.raises(ValueError):
        default_costs(0, 1, 1, 1, 1, 1)


def test_moe_costs_count_active_experts():
    """Mixtral-8x7B: a token runs 2 of 8 experts, so a layer's cost is its attention, router
    and two experts' weights (not eight): the 32k-token head is worth ~1/3 layer, not ~0.09."""
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    costs = default_costs(4096, 14336, 32000, 32, 8, 128, num_experts=8, num_experts_per_tok=2)
    assert costs["head_cost"] == pytest.approx(4096 * 32000 / (attention + 4096 * 8 + 2 * expert))
    assert 0.3 < costs["head_cost"] < 0.35
    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=32000, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2)
    assert model_costs(config) == costs
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        default_costs(4096, 14336, 32000, 32, 8, 128, num_experts=8, num_experts_per_tok=0)


def brute_force(num_layers, num_stages, layer_cost, embedding_cost, head_cost):
    """Every split, keyed by (bottleneck, sum of squared costs, counts)."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        c = [b - a for a, b in zip(bounds, bounds[1:])]
        costs = [n * layer_cost for n in c]
        costs[0] += embedding_cost
        costs[-1] += head_cost
        yield max(costs), sum(x * x for x in costs), c


def check_optimal(got, splits):
    """``got`` (counts) is the least bottleneck among ``splits`` (bottleneck, sum of squares,
    counts), then the most even (least sum of squares), then the smallest counts first."""
    best = min(s[0] for s in splits)
    mine = next(s for s in splits if s[2] == got)
    assert mine[0] == pytest.approx(best, rel=1e-12)
    optimal = [s for s in splits if s[0] <= best * (1 + 1e-12)]
    least_sq = min(s[1] for s in optimal)
    assert mine[1] == pytest.approx(least_sq, rel=1e-9)
    assert got == min(s[2] for s in optimal if s[1] <= least_sq * (1 + 1e-9))


def test_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        num_layers = rng.randint(1, 12)
        num_stages = rng.randint(1, num_layers)
        args = (rng.choice([1.0, rng.uniform(0.1, 3.0)]),
                rng.choice([0.0, rng.uniform(0, 6), float(rng.randint(0, 5))]),
                rng.choice([0.0, rng.uniform(0, 6), float(rng.randint(0, 5))]))
        got = counts(plan_stages(num_layers, num_stages, layer_cost=args[0],
                                 embedding_cost=args[1], head_cost=args[2]))
        check_optimal(got, list(brute_force(num_layers, num_stages, *args)))


def test_override():
    assert plan_stages(10, 3, override=[2, 5, 3]) == [(0, 2), (2, 7), (7, 10)]


@pytest.mark.parametrize("override", [[5, 5], [3, 3, 3, 1], [0, 5, 5], [-1, 6, 5], [4, 4, 3], [2.5, 4.5, 3]])
def test_bad_override_raises(override):
    with pytest.raises(ValueError, match="override"):
        plan_stages(10, 3, override=override)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((3, 4), {}),
        ((3, 0), {}),
        ((3, 2), {"layer_cost": 0.0}),
        ((3, 2), {"head_cost": -1.0}),
        ((3, 2), {"embedding_cost": float("nan")}),
    ],
)
def test_bad_arguments_raise(args, kwargs):
    with pytest.raises(ValueError):
        plan_stages(*args, **kwargs)


def test_large_model_is_fast():
    import time

    start = time.perf_counter()
    for num_stages in (2, 8, 64, 300):
        check_cover(plan_stages(300, num_stages, head_cost=7.3, embedding_cost=0.4), 300)
    assert time.perf_counter() - start < 2.0


def test_model_stages_from_a_config():
    from types import SimpleNamespace

    # Llama-3-8B's shape with a 50k vocabulary (the benchmarks'): the head costs 0.94 layers.
    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=50304, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    assert plan_model_stages(config, 2) == [StageLayers(0, 16), StageLayers(16, 32)]
    stages = plan_model_stages(config, 2, override=[17, 15])
    assert stages == [StageLayers(0, 17), StageLayers(17, 32)] and [s.num_layers for s in stages] == [17, 15]
    assert plan_model_stages(config, 1, override=[32]) == [StageLayers(0, 32)]
    with pytest.raises(ValueError, match="positive integers"):
        plan_model_stages(config, 2, override=[16.5, 15.5])
    with pytest.raises(ValueError, match="sums"):
        plan_model_stages(config, 1, override=[31])


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=2, stage_layers=[14.5, 15.5]), "whole layers"),
    (dict(pp=2, stage_layers=[float("inf"), 1.0]), "positive integers"),
    (dict(pp=2, stage_layers=[0, 30]), "positive"),
    (dict(pp=2, stage_layers=[30]), "entries for pp=2"),
])
def test_parallel_config_checks_stage_layers(kwargs, message):
    from pipeserve.runtime.config import ParallelConfig

    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)
    assert ParallelConfig(pp=2, stage_layers=[16, 14]).stage_layers == [16, 14]
