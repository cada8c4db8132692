"""Predicted time of one micro-batch, so Sarathi can fill micro-batches to equal *time*.

    t = per_token * num_tokens + per_attn * sum_i(q_i * ctx_i) + per_seq * num_seqs + fixed

where request i has q_i tokens scheduled and ctx_i = (computed before the step) + q_i context
after it. Token-equal chunks are not time-equal: a chunk late in a long prompt attends over its
whole prefix, which the attention term charges for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

Sample = tuple[int, int, int, float]  # (num_tokens, attn_work, num_seqs, seconds)


def attention_work(num_computed_tokens: int, num_scheduled_tokens: int) -> int:
    """q * ctx for one request's chunk (the attention term's contribution)."""
    return num_scheduled_tokens * (num_computed_tokens + num_scheduled_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    per_token: float
    """Seconds per scheduled token (linear layers, MLP, embedding)."""
    per_attn: float
    """Seconds per unit of attention work q_i * ctx_i."""
    per_seq: float
    """Seconds per sequence in the micro-batch (metadata, sampling, per-sequence kernels)."""
    fixed: float
    """Seconds per micro-batch regardless of content (launch and communication overhead)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")

    def predict(self, num_tokens: int, attn_work: int, num_seqs: int) -> float:
        """Predicted seconds of a micro-batch with these totals."""
        return (
            self.per_token * num_tokens
            + self.per_attn * attn_work
            + self.per_seq * num_seqs
            + self.fixed
        )

    @classmethod
    def analytic_default(cls) -> CostModel:
        """A rough CPU default (order of magnitude for a tiny model); profile real hardware."""
        return cls(per_token=1e-4, per_attn=2e-9, per_seq=5e-6, fixed=1e-3)

    def to_dict(self) -> dict[str, float]:
        """Plain dict for a JSON profile file."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> CostModel:
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"cost model keys must be {sorted(names)}, got {sorted(data)}")
        return cls(**{k: float(v) for k, v in data.items()})

    @classmethod
    def load(cls, path: str) -> CostModel:
        """From a JSON profile (`pipeserve profile` writes ``{"cost_model": {...}, ...}``) or a
        bare coefficient dict. ValueError for a missing or malformed file."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read cost-model profile {path!r}: {e}") from None
        if isinstance(data, dict) and "cost_model" in data:
            data = data["cost_model"]
        if not isinstance(data, dict):
            raise ValueError(f"cost-model profile {path!r} holds no coefficient dict")
        return cls.from_dict(data)

    @classmethod
    def fit(cls, samples: Sequence[Sample]) -> CostModel:
        """Least-squares fit to measured (num_tokens, attn_work, num_seqs, seconds) samples.

        No coefficient may be negative: a negative one makes the predicted time *fall* as work
        is added, which breaks the chunk-size search (it assumes time grows with tokens) and
        can predict negative times. A negative coefficient is fixed at 0 and the others are
        refitted without it (repeated until none is negative), which fits better than just
        clamping it afterwards.
        """
        if not samples:
            raise ValueError("no samples to fit")
        rows = [(float(n), float(a), float(s), 1.0) for n, a, s, _ in samples]
        ys = [float(sample[3]) for sample in samples]
        active = [0, 1, 2, 3]
        while True:
            coef = _least_squares(rows, ys, active)
            negative = [j for j in active if coef[j] < 0]
            if not negative:
                break
            active.remove(min(negative, key=coef.__getitem__))
        names = [f.name for f in fields(cls)]
        return cls(**{name: coef.get(j, 0.0) for j, name in enumerate(names)})


def _least_squares(
    rows: list[tuple[float, ...]], ys: list[float], cols: list[int]
) -> dict[int, float]:
    """Least squares over the columns ``cols`` of ``rows`` via the normal equations."""
    if not cols:
        return {}
    # Columns differ by orders of magnitude (attn_work ~1e6, the constant 1); scaling each to a
    # max of 1 keeps the normal equations well conditioned.
    scale = [max(abs(row[j]) for row in rows) for j in cols]
    for j, s in zip(cols, scale):
        if s == 0:
            raise ValueError(f"column {_COLUMN_NAMES[j]} is zero in every sample; vary it")
    k = len(cols)
    z = [[row[j] / s for j, s in zip(cols, scale)] for row in rows]
    a = [[sum(r[p] * r[q] for r in z) for q in range(k)] for p in range(k)]
    b = [sum(r[p] * y for r, y in zip(z, ys)) for p in range(k)]
    w = _solve(a, b, [_COLUMN_NAMES[j] for j in cols])
    return {j: wj / s for j, wj, s in zip(cols, w, scale)}


_COLUMN_NAMES = ("num_tokens", "attn_work", "num_seqs", "constant")


def _solve(a: list[list[float]], b: list[float], names: list[str]) -> list[float]:
    """Gaussian elimination with partial pivoting; ValueError if (nearly) singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    tol = 1e-12 * max(abs(m[i][i]) for i in range(n))
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= tol:
            raise ValueError(
                f"samples do not determine the {names[col]} coefficient"
                " (collinear features); vary num_tokens, attn_work and num_seqs independently"
            )
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
