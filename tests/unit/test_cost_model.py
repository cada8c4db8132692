import json
import random

import pytest

from pipeserve.scheduler import CostModel
from pipeserve.scheduler.cost_model import attention_work

TRUE = dict(per_token=7e-5, per_attn=3e-9, per_seq=4e-6, fixed=2e-3)


def synthetic_samples(coef, n=60, seed=0):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        num_tokens = rng.randint(1, 2048)
        attn = rng.randint(0, 4_000_000)
        num_seqs = rng.randint(1, 256)
        t = (coef["per_token"] * num_tokens + coef["per_attn"] * attn
             + coef["per_seq"] * num_seqs + coef["fixed"])
        samples.append((num_tokens, attn, num_seqs, t))
    return samples


def test_fit_recovers_generating_coefficients():
    fitted = CostModel.fit(synthetic_samples(TRUE)).to_dict()
    for name, value in TRUE.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name


def test_fit_clamps_negative_coefficient_and_refits_the_rest():
    # Data generated with a negative per-seq slope: the fit must not go below 0, and the
    # remaining coefficients must still explain the data they can.
    coef = dict(TRUE, per_seq=-1e-6)
    fitted = CostModel.fit(synthetic_samples(coef, seed=1))
    assert fitted.per_seq == 0.0
    assert min(fitted.to_dict().values()) >= 0.0
    assert fitted.per_attn == pytest.approx(TRUE["per_attn"], rel=0.05)


def test_fit_rejects_collinear_samples():
    samples = [(n, 0, 1, 1e-3 + 1e-4 * n) for n in range(1, 20)]
    with pytest.raises(ValueError):
        CostModel.fit(samples)
    with pytest.raises(ValueError):
        CostModel.fit([])


def test_predict_matches_formula():
    model = CostModel(**TRUE)
    expected = 7e-5 * 100 + 3e-9 * 5000 + 4e-6 * 3 + 2e-3
    assert model.predict(100, 5000, 3) == pytest.approx(expected, rel=1e-12)
    default = CostModel.analytic_default()
    assert default.predict(0, 0, 0) == default.fixed > 0


def test_attention_work_is_q_times_context():
    assert attention_work(num_computed_tokens=10, num_scheduled_tokens=4) == 4 * 14
    assert attention_work(num_computed_tokens=99, num_scheduled_tokens=1) == 100


def test_dict_round_trip_through_json():
    model = CostModel(**TRUE)
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_from_dict_and_fields_validate():
    with pytest.raises(ValueError):
        CostModel.from_dict({"per_token": 1.0})
    with pytest.raises(ValueError):
        CostModel.from_dict(dict(TRUE, extra=1.0))
    with pytest.raises(ValueError):
        CostModel(**dict(TRUE, fixed=-1.0))
    with pytest.raises(ValueError):
        CostModel(**dict(TRUE, per_attn=float("nan")))
