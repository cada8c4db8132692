import itertools
import random

import pytest

from pipeserve.parallel.stage_plan import (
    StageLayers,
    default_costs,
    plan_half_layers,
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


@pytest.mark.parametrize("override", [[5, 5], [3, 3, 3, 1], [0, 5, 5], [-1, 6, 5], [4, 4, 3]])
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


# --- half layers ---------------------------------------------------------------------------


def half_brute_force(num_layers, num_stages, attention_cost, mlp_cost, embedding_cost, head_cost):
    """Every split into half layers that leaves each stage an attention (an even half), keyed
    by (bottleneck, sum of squared costs, counts)."""
    units = [attention_cost, mlp_cost] * num_layers
    for cuts in itertools.combinations(range(1, 2 * num_layers), num_stages - 1):
        bounds = (0, *cuts, 2 * num_layers)
        if not all(b - a >= 2 or a % 2 == 0 for a, b in zip(bounds, bounds[1:])):
            continue
        costs = [sum(units[a:b]) for a, b in zip(bounds, bounds[1:])]
        costs[0] += embedding_cost
        costs[-1] += head_cost
        yield max(costs), sum(x * x for x in costs), [b - a for a, b in zip(bounds, bounds[1:])]


def test_half_layers_optimal_against_brute_force():
    rng = random.Random(11)
    for _ in range(300):
        num_layers = rng.randint(1, 7)
        num_stages = rng.randint(1, num_layers)
        attention = rng.choice([0.5, rng.uniform(0.05, 2.0)])
        args = (attention, rng.choice([0.5, rng.uniform(0.05, 2.0)]),
                rng.choice([0.0, rng.uniform(0, 4)]), rng.choice([0.0, rng.uniform(0, 4), float(rng.randint(0, 3))]))
        stages = plan_half_layers(num_layers, num_stages, attention_cost=args[0], mlp_cost=args[1],
                                  embedding_cost=args[2], head_cost=args[3])
        assert stages[0].start_half == 0 and stages[-1].end_half == 2 * num_layers
        assert all(a.end_half == b.start_half for a, b in zip(stages, stages[1:]))
        got = [s.end_half - s.start_half for s in stages]
        check_optimal(got, list(half_brute_force(num_layers, num_stages, *args)))


def test_half_layers_balance_a_head_worth_most_of_a_layer():
    # Llama-3-8B's shape with a 50k vocabulary (the benchmarks'): the head costs 0.94 layers.
    costs = default_costs(4096, 14336, 50304, 32, 8, 128, half_layers=True)
    assert costs["attention_cost"] + costs["mlp_cost"] == pytest.approx(1.0)
    assert costs["head_cost"] == pytest.approx(default_costs(4096, 14336, 50304, 32, 8, 128)["head_cost"])
    first, last = plan_half_layers(32, 2, **costs)
    # Whole layers: 16 / 16 + head (16.94). Half layers: 16 + layer 16's attention / the rest.
    assert (first, last) == (StageLayers(0, 33), StageLayers(33, 64))
    assert (first.start_layer, first.end_layer, first.first_mlp_only, first.last_attention_only) == (0, 17, False, True)
    assert (last.start_layer, last.end_layer, last.first_mlp_only, last.last_attention_only) == (16, 32, True, False)
    assert (first.num_attention_layers, last.num_attention_layers) == (17, 15)
    assert (first.num_layers, last.num_layers) == (16.5, 15.5)
    assert StageLayers.whole(3, 7) == StageLayers(6, 14) and StageLayers(6, 14).num_layers == 4
    assert max(16 + costs["attention_cost"], 16 - costs["attention_cost"] + costs["head_cost"]) < 16 + costs["head_cost"]


def test_half_layer_override():
    costs = dict(attention_cost=0.2, mlp_cost=0.8)
    assert plan_half_layers(4, 2, **costs, override=[2.5, 1.5]) == [StageLayers(0, 5), StageLayers(5, 8)]
    assert plan_half_layers(4, 2, **costs, override=[2, 2]) == [StageLayers(0, 4), StageLayers(4, 8)]
    for bad, message in (([2.5, 1.0], "sums"), ([2.25, 1.75], "multiples"), ([0.5, 0.0, 3.5], "multiples"),
                         ([1.5, 0.5, 2.0], "attention"), ([4], "entries")):
        with pytest.raises(ValueError, match=message):
            plan_half_layers(4, len(bad) if message != "entries" else 2, **costs, override=bad)
    with pytest.raises(ValueError, match="attention_cost"):
        plan_half_layers(4, 2, attention_cost=0.0, mlp_cost=1.0)


def test_model_stages_from_a_config():
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=50304, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    assert plan_model_stages(config, 2) == [StageLayers(0, 32), StageLayers(32, 64)]
    assert plan_model_stages(config, 2, half_layers=True) == [StageLayers(0, 33), StageLayers(33, 64)]
    assert plan_model_stages(config, 2, override=[17, 15])[0] == StageLayers(0, 34)
    assert plan_model_stages(config, 2, override=[16.5, 15.5], half_layers=True) == [StageLayers(0, 33),
                                                                                      StageLayers(33, 64)]
    assert plan_model_stages(config, 1, override=[32]) == [StageLayers(0, 64)]
    with pytest.raises(ValueError, match="half_layer_stages"):
        plan_model_stages(config, 2, override=[16.5, 15.5])
    with pytest.raises(ValueError, match="sums"):
        plan_model_stages(config, 1, override=[31])


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=2, stage_layers=[14.5, 15.5]), "half_layer_stages=true"),
    (dict(pp=2, stage_layers=[0.5, 29.25], half_layer_stages=True), "multiples of 0.5"),
    (dict(pp=2, stage_layers=[float("inf"), 1.0]), "multiples of 1"),
    (dict(pp=2, stage_layers=[0, 30]), "positive"),
    (dict(pp=2, stage_layers=[30]), "entries for pp=2"),
])
def test_parallel_config_checks_stage_layers(kwargs, message):
    from pipeserve.runtime.config import ParallelConfig

    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)
    assert ParallelConfig(pp=2, stage_layers=[16.5, 15.5], half_layer_stages=True).stage_layers == [16.5, 15.5]
