"""Which decoder layers each pipeline stage holds: a pure function of layer counts and costs.

A micro-batch moves through the pipeline at the pace of its slowest stage, so the split
minimizes the largest per-stage cost. Stage 0 also runs the embedding and the last stage the
final norm, LM head and sampling; with a large vocabulary the head costs several layers, and
the last stage gets correspondingly fewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def plan_stages(
    num_layers: int,
    num_stages: int,
    *,
    layer_cost: float = 1.0,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    override: list[int] | None = None,
) -> list[tuple[int, int]]:
    """Split layers ``0..num_layers`` into ``num_stages`` contiguous ``[start, end)`` ranges.

    Stage cost = its layer count × ``layer_cost``, plus ``embedding_cost`` on stage 0 and
    ``head_cost`` on the last stage. The result minimizes the largest stage cost exactly.
    Among splits with that bottleneck it takes the most even one (least sum of squared stage
    costs), and among those the one whose layer counts are lexicographically smallest, i.e.
    leftover layers go to the later stages: 30 layers on 4 stages → 7, 7, 8, 8.

    ``override`` gives the layer count of every stage explicitly and skips the search.
    Raises ``ValueError`` for impossible requests (more stages than layers, bad override).
    """
    _check_args(num_layers, num_stages, layer_cost, embedding_cost, head_cost)
    if override is not None:
        counts = _checked_override(override, num_layers, num_stages)
    else:
        extra = _extra_costs(num_stages, embedding_cost, head_cost)
        bottleneck = _min_bottleneck(num_layers, layer_cost, extra)
        counts = _most_even_split(num_layers, layer_cost, extra, bottleneck)
    return _ranges(counts)


def default_costs(
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_experts: int = 0,
    num_experts_per_tok: int = 0,
) -> dict[str, float]:
    """Relative per-token costs of a Llama-family model, as keyword arguments of ``plan_stages``.

    Costs are matmul FLOPs per token, proportional to weight counts, with one decoder layer
    = 1.0: the layer's q/k/v/o projections and gated MLP; the head's ``hidden × vocab``
    projection; the embedding is a lookup (0). Norms and attention over the context are left
    out: attention grows with the context lengths served, not with the model alone. Sliding-window
    layers (whose attention the window caps) come in a fixed pattern (Gemma 2 every other layer,
    Gemma 3 five of six, Phi-3 all), so every contiguous stage holds its layers' share of
    full-attention layers to within one.

    A mixture-of-experts layer (``num_experts`` > 0) counts its ACTIVE weights: the router and
    the ``num_experts_per_tok`` experts a token runs, not all of them (which take memory, but
    no time for that token). Its layers are then cheaper next to the head than a dense
    model's of the same width, so the head's stage gets fewer of them.
    """
    sizes = dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                 vocab_size=vocab_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    q_o = 2 * hidden_size * num_heads * head_dim
    k_v = 2 * hidden_size * num_kv_heads * head_dim
    mlp = 3 * hidden_size * intermediate_size  # gate, up, down
    if num_experts:
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {num_experts_per_tok}")
        mlp = hidden_size * num_experts + num_experts_per_tok * mlp  # router, k experts
    layer_weights = q_o + k_v + mlp
    return {"layer_cost": 1.0, "embedding_cost": 0.0, "head_cost": hidden_size * vocab_size / layer_weights}


def model_costs(config) -> dict[str, float]:
    """``default_costs`` of a model config (anything with a Llama config's shape fields; an MoE
    config's ``num_local_experts`` and ``num_experts_per_tok`` too)."""
    return default_costs(config.hidden_size, config.intermediate_size, config.vocab_size,
                         config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         num_experts=getattr(config, "num_local_experts", 0),
                         num_experts_per_tok=getattr(config, "num_experts_per_tok", 0))


@dataclass(frozen=True, slots=True)
class StageLayers:
    """A stage's decoder layers ``[start_layer, end_layer)``."""

    start_layer: int
    end_layer: int

    def __post_init__(self) -> None:
        assert 0 <= self.start_layer < self.end_layer, self

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer


def plan_model_stages(config, num_stages: int, *, override: list[int] | None = None) -> list[StageLayers]:
    """Every stage's layers for a Llama-family model ``config`` (its shape's fields): the
    override, else balanced by ``model_costs`` (``plan_stages``). ValueError for a bad override,
    fractional layer counts included."""
    ranges = plan_stages(config.num_hidden_layers, num_stages, **model_costs(config), override=override)
    return [StageLayers(start, end) for start, end in ranges]


def _check_args(num_layers: int, num_stages: int, layer_cost: float, embedding_cost: float,
                head_cost: float) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages need at least as many layers, got {num_layers}")
    if not layer_cost > 0 or not math.isfinite(layer_cost):
        raise ValueError(f"layer_cost must be finite and > 0, got {layer_cost}")
    for name, value in (("embedding_cost", embedding_cost), ("head_cost", head_cost)):
        if not value >= 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")


def _checked_override(override: list[int], num_layers: int, num_stages: int) -> list[int]:
    if len(override) != num_stages:
        raise ValueError(f"override has {len(override)} entries for {num_stages} stages")
    if any(not isinstance(n, int) or n < 1 for n in override):
        raise ValueError(f"override entries must be positive integers (whole layers), got {override}")
    if sum(override) != num_layers:
        raise ValueError(f"override sums to {sum(override)}, the model has {num_layers} layers")
    return list(override)


def _extra_costs(num_stages: int, embedding_cost: float, head_cost: float) -> list[float]:
    extra = [0.0] * num_stages
    extra[0] += embedding_cost
    extra[-1] += head_cost
    return extra


def _stage_cost(num: int, layer_cost: float, extra: float) -> float:
    # The one formula every comparison uses, so equal splits compare exactly equal.
    return num * layer_cost + extra


def _capacity(bottleneck: float, layer_cost: float, extra: float) -> int:
    """Most layers a stage can hold without its cost exceeding ``bottleneck``."""
    num = max(0, math.floor((bottleneck - extra) / layer_cost))
    # Correct the float division by the exact comparison used everywhere else.
    while _stage_cost(num + 1, layer_cost, extra) <= bottleneck:
        num += 1
    while num > 0 and _stage_cost(num, layer_cost, extra) > bottleneck:
        num -= 1
    return num


def _min_bottleneck(num_layers: int, layer_cost: float, extra: list[float]) -> float:
    """Smallest achievable maximum stage cost.

    It is the cost of some stage, so one of ``n × layer_cost + extra[s]``; a bound is feasible
    iff every stage fits >= 1 layer under it and the capacities add up to ``num_layers``.
    Binary search over the sorted candidates.
    """
    max_layers = num_layers - len(extra) + 1
    candidates = sorted({_stage_cost(n, layer_cost, e) for e in set(extra)
                         for n in range(1, max_layers + 1)})

    def feasible(bound: float) -> bool:
        caps = [_capacity(bound, layer_cost, e) for e in extra]
        return min(caps) >= 1 and sum(caps) >= num_layers

    lo, hi = 0, len(candidates) - 1
    assert feasible(candidates[hi])
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _most_even_split(num_layers: int, layer_cost: float, extra: list[float],
                     bottleneck: float) -> list[int]:
    """Layer counts within ``bottleneck`` with the least sum of squared stage costs.

    ``best[s][j]``: least sum of squares of stages ``s..`` holding layers ``j..``. Choosing
    forward, the smallest count that stays optimal wins ties, which moves layers later.
    """
    num_stages = len(extra)
    caps = [_capacity(bottleneck, layer_cost, e) for e in extra]
    best = [[math.inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[num_stages][num_layers] = 0.0
    for s in reversed(range(num_stages)):
        for j in range(num_layers):
            for n in range(1, min(caps[s], num_layers - j) + 1):
                rest = best[s + 1][j + n]
                if rest < math.inf:
                    total = _stage_cost(n, layer_cost, extra[s]) ** 2 + rest
                    best[s][j] = min(best[s][j], total)
    return _pick_counts(best, caps, layer_cost, extra, num_layers)


def _pick_counts(best: list[list[float]], caps: list[int], layer_cost: float,
                 extra: list[float], num_layers: int) -> list[int]:
    counts, j = [], 0
    for s, cap in enumerate(caps):
        target = best[s][j]
        tolerance = 1e-9 * max(1.0, target)  # sums in other orders may differ in the last bits
        for n in range(1, min(cap, num_layers - j) + 1):
            total = _stage_cost(n, layer_cost, extra[s]) ** 2 + best[s + 1][j + n]
            if total <= target + tolerance:
                break
        else:
            raise AssertionError("no optimal count found")  # best[s][j] came from some n
        counts.append(n)
        j += n
    assert j == num_layers
    return counts


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for num in counts:
        ranges.append((start, start + num))
        start += num
    return ranges
