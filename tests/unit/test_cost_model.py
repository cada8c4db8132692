import json
import random

import pytest

from pipeserve.scheduler import CostModel
from pipeserve.scheduler.cost_model import SlidingLayers, Work, attention_work, keys_read, kv_tokens_read

TRUE = dict(per_token=7e-5, per_attn=3e-9, per_seq=4e-6, fixed=2e-3)
# The roofline's shape: weight reads floor the linear layers below 64 tokens, decodes read KV.
MEMORY = dict(TRUE, per_kv=4e-8, knee_tokens=64.0)


def formula(coef, w: Work) -> float:
    """The cost model written out independently of CostModel.predict."""
    return (coef["per_token"] * max(w.num_tokens, coef.get("knee_tokens", 0.0)) + coef["per_attn"] * w.attn_work
            + coef.get("per_kv", 0.0) * w.kv_tokens + coef["per_seq"] * w.num_seqs + coef["fixed"])


def random_batch(rng: random.Random) -> list[tuple[int, int]]:
    """A micro-batch as (computed before, scheduled) per sequence: decodes and maybe a chunk."""
    seqs = [(rng.randint(16, 4000), 1) for _ in range(rng.randint(0, 64))]
    if rng.random() < 0.7 or not seqs:
        seqs.append((rng.choice([0, rng.randint(1, 3000)]), rng.randint(1, 1024)))
    return seqs


def synthetic_samples(coef, n=80, seed=0):
    rng = random.Random(seed)
    return [(w, formula(coef, w)) for w in (Work.of(random_batch(rng)) for _ in range(n))]


def test_work_totals_match_their_definitions():
    seqs = [(10, 4), (99, 1), (0, 7)]
    w = Work.of(seqs)
    assert (w.num_tokens, w.num_seqs) == (12, 3)
    assert w.attn_work == 4 * 14 + 1 * 100 + 7 * 7 == sum(attention_work(c, q) for c, q in seqs)
    assert w.kv_tokens == 14 + 100 + 7
    assert Work().plus(10, 4).plus(99, 1).plus(0, 7) == w


@pytest.mark.parametrize("coef", [TRUE, MEMORY], ids=["linear", "memory-terms"])
def test_fit_recovers_generating_coefficients(coef):
    fitted = CostModel.fit(synthetic_samples(coef)).to_dict()
    for name, value in coef.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name


def test_three_feature_fit_leaves_out_the_memory_terms():
    fitted = CostModel.fit(synthetic_samples(TRUE), memory_terms=False)
    assert fitted.per_kv == fitted.knee_tokens == 0.0
    assert fitted.per_attn == pytest.approx(TRUE["per_attn"], rel=1e-6)
    # On data with decode KV reads it cannot fit them: the full model's error is far below its own.
    samples = synthetic_samples(MEMORY, seed=3)

    def worst(model):
        return max(abs(model.predict(w) / t - 1) for w, t in samples)

    assert worst(CostModel.fit(samples)) < 1e-6 < 0.05 < worst(CostModel.fit(samples, memory_terms=False))


def test_fit_clamps_negative_coefficient_and_refits_the_rest():
    # Data generated with a negative per-seq slope: the fit must not go below 0, and the
    # remaining coefficients must still explain the data they can.
    coef = dict(TRUE, per_seq=-1e-6)
    fitted = CostModel.fit(synthetic_samples(coef, seed=1))
    assert fitted.per_seq == 0.0
    assert min(fitted.to_dict().values()) >= 0.0
    assert fitted.per_attn == pytest.approx(TRUE["per_attn"], rel=0.05)


def test_fit_rejects_collinear_samples():
    samples = [(Work(num_tokens=n, num_seqs=1), 1e-3 + 1e-4 * n) for n in range(1, 20)]
    with pytest.raises(ValueError):
        CostModel.fit(samples)
    with pytest.raises(ValueError):
        CostModel.fit([])
    with pytest.raises(ValueError, match="positive"):
        CostModel.fit([(Work.of([(0, 4)]), 0.0)])


def test_predict_matches_formula():
    model = CostModel(**MEMORY)
    for seqs in ([(0, 100), (5000, 1), (20, 1)], [(3000, 1)] * 8, []):
        w = Work.of(seqs)
        assert model.predict(w) == pytest.approx(formula(MEMORY, w), rel=1e-12)
    default = CostModel.analytic_default()
    assert default.predict(Work()) == default.fixed > 0


def test_below_the_knee_tokens_cost_the_same():
    model = CostModel(**MEMORY)
    assert model.predict(Work(num_tokens=10)) == model.predict(Work(num_tokens=64)) < model.predict(Work(num_tokens=65))


def test_attention_work_is_q_times_context():
    assert attention_work(num_computed_tokens=10, num_scheduled_tokens=4) == 4 * 14
    assert attention_work(num_computed_tokens=99, num_scheduled_tokens=1) == 100


# ---- sliding-window layers ----------------------------------------------------------------------


def keys_read_per_position(c: int, q: int, window: int | None) -> int:
    return sum(p + 1 if window is None else min(p + 1, window) for p in range(c, c + q))


@pytest.mark.parametrize("regime", ["c+q<=W", "c<W<c+q", "c>=W"])
def test_keys_read_closed_form_matches_the_per_position_sum(regime):
    rng = random.Random(regime)
    for _ in range(300):
        window = rng.randint(1, 600)
        if regime == "c+q<=W":
            c = rng.randint(0, window - 1)
            q = rng.randint(1, window - c)
        elif regime == "c<W<c+q":
            c = rng.randint(0, window - 1)
            q = rng.randint(window - c + 1, window - c + 700)
        else:
            c = rng.randint(window, window + 2000)
            q = rng.randint(1, 700)
        assert keys_read(c, q, window) == keys_read_per_position(c, q, window), (c, q, window)
        assert keys_read(c, q) == keys_read_per_position(c, q, None), (c, q)
    assert keys_read(0, 1, 1) == 1 and keys_read(5, 1, 1) == 1 and keys_read(5, 3, 1) == 3


def layer_work(c: int, q: int, window: int | None) -> tuple[int, int]:
    """One layer's (attention work, KV tokens read) from the keys each query may see: q * ctx
    charges every query the whole context; a window hides keys k <= p - window from query p."""
    ctx = c + q
    hidden = [[k for k in range(ctx) if window is not None and k <= p - window] for p in range(c, ctx)]
    read = {k for p in range(c, ctx) for k in range(p + 1) if window is None or k > p - window}
    return sum(ctx - len(h) for h in hidden), len(read)


def test_windowed_work_totals_are_the_layers_mean():
    """A Gemma-like stack (3 sliding layers of window 16, 1 full) against a per-layer, per-key
    count: chunks before, across and past the window, and decodes at either side of it."""
    windows = [16, None, 16, 16]
    sliding = SlidingLayers.of(windows)
    assert sliding == SlidingLayers(window=16, layer_share=0.75)
    seqs = [(0, 10), (4, 30), (40, 7), (15, 1), (16, 1), (90, 1), (0, 1)]
    for c, q in seqs:
        per_layer = [layer_work(c, q, w) for w in windows]
        assert attention_work(c, q, sliding) == pytest.approx(sum(a for a, _ in per_layer) / 4, rel=1e-12)
        assert kv_tokens_read(c, q, sliding) == pytest.approx(sum(b for _, b in per_layer) / 4, rel=1e-12)
    w = Work.of(seqs, sliding)
    assert (w.num_tokens, w.num_seqs) == (51, 7)
    assert w.attn_work == pytest.approx(sum(sum(layer_work(c, q, x)[0] for x in windows) / 4 for c, q in seqs))
    assert w.kv_tokens == pytest.approx(sum(sum(layer_work(c, q, x)[1] for x in windows) / 4 for c, q in seqs))
    assert w.attn_work < Work.of(seqs).attn_work and w.kv_tokens < Work.of(seqs).kv_tokens
    # A decode past the window reads the window's KV on the sliding layers: 90 + 1 on the full one.
    assert kv_tokens_read(90, 1, sliding) == 0.25 * 91 + 0.75 * 16


def test_no_window_or_one_that_never_binds_keeps_the_full_attention_numbers():
    seqs = [(10, 4), (99, 1), (0, 7)]
    assert SlidingLayers.of([None] * 4) is None and SlidingLayers.of([]) is None
    assert Work.of(seqs, None) == Work.of(seqs) == Work(12, 4 * 14 + 100 + 49, 14 + 100 + 7, 3)
    assert isinstance(Work.of(seqs).attn_work, int) and isinstance(Work.of(seqs).kv_tokens, int)
    assert Work.of(seqs, SlidingLayers(window=100, layer_share=0.5)) == Work.of(seqs)  # every ctx <= 100


def test_sliding_layers_validate():
    with pytest.raises(ValueError, match="one window"):
        SlidingLayers.of([16, None, 32])
    for bad in (dict(window=0, layer_share=0.5), dict(window=1.5, layer_share=0.5),
                dict(window=8, layer_share=0.0), dict(window=8, layer_share=1.5)):
        with pytest.raises(ValueError, match="window|layer_share"):
            SlidingLayers(**bad)


def test_dict_round_trip_through_json():
    model = CostModel(**MEMORY)
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_from_dict_and_fields_validate():
    # A profile from before the memory terms loads with them at 0.
    assert CostModel.from_dict(TRUE) == CostModel(**TRUE, per_kv=0.0, knee_tokens=0.0)
    with pytest.raises(ValueError):
        CostModel.from_dict({"per_token": 1.0})
    with pytest.raises(ValueError):
        CostModel.from_dict(dict(TRUE, extra=1.0))
    with pytest.raises(ValueError):
        CostModel(**dict(TRUE, fixed=-1.0))
    with pytest.raises(ValueError):
        CostModel(**dict(TRUE, per_attn=float("nan")))
    with pytest.raises(ValueError):
        CostModel(**dict(MEMORY, knee_tokens=-1.0))
