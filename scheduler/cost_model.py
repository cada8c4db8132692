"""Predicted time of one micro-batch, so Sarathi can fill micro-batches to equal *time*.

    t = per_token * max(num_tokens, knee_tokens) + per_attn * sum_i(q_i * ctx_i)
        + per_kv * sum_i(ctx_i) + per_seq * num_seqs + fixed

where request i has q_i tokens scheduled and ctx_i = (computed before the step) + q_i context
after it. Token-equal chunks are not time-equal: a chunk late in a long prompt attends over its
whole prefix, which the attention term charges for. Two parts of a step are bound by memory
rather than arithmetic, and get terms of their own:

- the linear layers read every weight once per step, so below ``knee_tokens`` tokens a step
  costs what ``knee_tokens`` would (decode-only steps sit there);
- attention reads each sequence's whole KV once, ``per_kv`` per context token: for a decode
  (q = 1) this dominates, and it costs tens of times what a prompt token's attention
  arithmetic does per unit of q * ctx, so one coefficient cannot fit both.

The two attention terms are means over the model's layers. A sliding-window layer
(``SlidingLayers``: Gemma 2/3's local layers, Phi-3's) lets a query at position p read its last
``window`` keys, min(p + 1, window), where a full layer reads p + 1: its share of the layers is
charged q * ctx less the keys the window hides, and reads the KV from the first query's window
on. Without sliding layers both terms are exactly sum q_i * ctx_i and sum ctx_i.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, kw_only=True, slots=True)
class SlidingLayers:
    """The model's sliding-window layers, as the work terms need them: plain values the engine
    takes from the model config (``SlidingLayers.of``), so the scheduler imports no model code."""

    window: int
    """Keys a sliding layer's query reads, itself included: min(p + 1, window) at position p."""
    layer_share: float
    """Fraction of the decoder layers that slide, in (0, 1] (Gemma 2: 1/2; Phi-3: 1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"window must be a positive int, got {self.window!r}")
        if not (isinstance(self.layer_share, (int, float)) and 0 < self.layer_share <= 1):
            raise ValueError(f"layer_share must be in (0, 1], got {self.layer_share!r}")

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> SlidingLayers | None:
        """From each decoder layer's window (None: full attention); None when no layer slides."""
        windows = {w for w in layer_windows if w is not None}
        if not windows:
            return None
        if len(windows) > 1:
            raise ValueError(f"sliding layers must share one window, got {sorted(windows)}")
        num_sliding = sum(w is not None for w in layer_windows)
        return cls(window=windows.pop(), layer_share=num_sliding / len(layer_windows))


def keys_read(num_computed_tokens: int, num_scheduled_tokens: int, window: int | None = None) -> int:
    """Keys the scheduled queries attend to, summed over them: the query at position p
    (c <= p < c + q) reads p + 1 keys, or min(p + 1, window) under a sliding window. Closed form."""
    c, q = num_computed_tokens, num_scheduled_tokens
    total = q * c + q * (q + 1) // 2  # sum of p + 1 over [c, c + q)
    if window is None or c + q <= window:
        return total
    # Queries at p >= window read window keys, p + 1 - window fewer than a full layer's: the
    # excesses run from first (the earliest such query) to c + q - window (the last).
    first = max(c, window) + 1 - window
    last = c + q - window
    return total - (last - first + 1) * (first + last) // 2


def attention_work(num_computed_tokens: int, num_scheduled_tokens: int,
                   sliding: SlidingLayers | None = None) -> float:
    """q * ctx for one request's chunk (the attention term's contribution), a mean over layers.

    q * ctx charges every query for the context up to the chunk's end (the unit ``per_attn`` is
    fitted in); the sliding layers' share is charged less the keys the window hides from each
    query, exactly as ``keys_read`` counts them. Without ``sliding``: q * ctx, an int.
    """
    c, q = num_computed_tokens, num_scheduled_tokens
    work = q * (c + q)
    if sliding is None:
        return work
    return work - sliding.layer_share * (keys_read(c, q) - keys_read(c, q, sliding.window))


def kv_tokens_read(num_computed_tokens: int, num_scheduled_tokens: int,
                   sliding: SlidingLayers | None = None) -> float:
    """Context tokens whose KV one request's chunk reads, a mean over layers: ctx in a full
    layer; a sliding layer's queries see keys from c + 1 - window on (the first query's window),
    so the max(0, c + 1 - window) before it go unread (a decode: max(0, ctx - window))."""
    c, q = num_computed_tokens, num_scheduled_tokens
    if sliding is None:
        return c + q
    return c + q - sliding.layer_share * max(0, c + 1 - sliding.window)


@dataclass(frozen=True, slots=True)
class Work:
    """The totals of a micro-batch that the cost model reads (attention terms: means over the
    model's layers; whole numbers without sliding layers)."""

    num_tokens: int = 0
    attn_work: float = 0
    """sum_i q_i * ctx_i (``attention_work``)."""
    kv_tokens: float = 0
    """sum_i ctx_i: the context tokens whose KV the step reads (``kv_tokens_read``)."""
    num_seqs: int = 0

    def plus(self, num_computed_tokens: int, num_scheduled_tokens: int,
             sliding: SlidingLayers | None = None) -> Work:
        """These totals with one more sequence's chunk."""
        c, q = num_computed_tokens, num_scheduled_tokens
        return Work(self.num_tokens + q, self.attn_work + attention_work(c, q, sliding),
                    self.kv_tokens + kv_tokens_read(c, q, sliding), self.num_seqs + 1)

    @classmethod
    def of(cls, seqs: Iterable[tuple[int, int]], sliding: SlidingLayers | None = None) -> Work:
        """Totals of (computed before the step, scheduled) per sequence."""
        work = cls()
        for computed, q in seqs:
            work = work.plus(computed, q, sliding)
        return work


Sample = tuple[Work, float]  # (a micro-batch's totals, its measured seconds)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    per_token: float
    """Seconds per scheduled token (linear layers, MLP, embedding) above ``knee_tokens``."""
    per_attn: float
    """Seconds per unit of attention work q_i * ctx_i (a prompt chunk's arithmetic)."""
    per_seq: float
    """Seconds per sequence in the micro-batch (metadata, sampling, per-sequence kernels)."""
    fixed: float
    """Seconds per micro-batch regardless of content (launch and communication overhead)."""
    per_kv: float = 0.0
    """Seconds per context token whose KV the step reads (a decode's attention)."""
    knee_tokens: float = 0.0
    """Below this many tokens the linear layers cost what this many do: they are bound by
    reading the weights, not by arithmetic. 0: linear all the way down."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")

    def predict(self, work: Work) -> float:
        """Predicted seconds of a micro-batch with these totals."""
        return (
            self.per_token * max(work.num_tokens, self.knee_tokens)
            + self.per_attn * work.attn_work
            + self.per_kv * work.kv_tokens
            + self.per_seq * work.num_seqs
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
        """Profiles written before ``per_kv`` and ``knee_tokens`` existed load with them at 0."""
        names = {f.name for f in fields(cls)}
        required = {"per_token", "per_attn", "per_seq", "fixed"}
        if not required <= set(data) <= names:
            raise ValueError(f"cost model keys must be {sorted(required)} and optionally "
                             f"{sorted(names - required)}, got {sorted(data)}")
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
    def fit(cls, samples: Sequence[Sample], *, memory_terms: bool = True) -> CostModel:
        """Fit to measured (Work, seconds) samples, minimizing the squared *relative* error (a
        decode step's 5 ms counts as much as a prompt step's 20 ms).

        ``knee_tokens`` is chosen among candidates (``_knee_candidates``), the rest solved by least
        squares at each. ``memory_terms=False`` fits the three-feature model (no
        ``per_kv``, no knee), for comparison.

        No coefficient may be negative: a negative one makes the predicted time *fall* as work
        is added, which breaks the chunk-size search (it assumes time grows with tokens) and
        can predict negative times. A negative coefficient is fixed at 0 and the others are
        refitted without it (repeated until none is negative), which fits better than just
        clamping it afterwards.
        """
        if not samples:
            raise ValueError("no samples to fit")
        if any(not (t > 0) for _, t in samples):
            raise ValueError("every sample needs a positive time")
        best: tuple[float, CostModel] | None = None
        failure: ValueError | None = None
        for knee in cls._knee_candidates(samples) if memory_terms else [0.0]:
            try:
                model = cls._fit_at(samples, knee, memory_terms)
            except ValueError as e:  # (e.g. no sample above this knee: per_token undetermined)
                failure = failure or e
                continue
            error = sum((model.predict(w) / t - 1) ** 2 for w, t in samples)
            if best is None or error < best[0]:
                best = (error, model)
        if best is None:
            assert failure is not None
            raise failure
        return best[1]

    @classmethod
    def _knee_candidates(cls, samples: Sequence[Sample]) -> list[float]:
        """0, and for each split of the samples' token counts into those at or below the knee
        and those above, the knee that fits best: with the split fixed the model is linear in
        (per_token, per_token * knee, ...), so least squares gives per_token * knee too; the
        knee is then kept within the split's interval."""
        counts = sorted({w.num_tokens for w, _ in samples})
        knees = [0.0]
        for lo, hi in zip(counts, counts[1:]):
            rows = [(w.num_tokens / t if w.num_tokens > lo else 0.0, w.attn_work / t, w.num_seqs / t, 1.0 / t,
                     w.kv_tokens / t, 1.0 / t if w.num_tokens <= lo else 0.0) for w, t in samples]
            try:
                coef = _least_squares(rows, [1.0] * len(rows), [0, 1, 2, 3, 4, 5])
            except ValueError:
                continue
            if coef[0] > 0:
                knees.append(min(max(coef[5] / coef[0], lo), hi))
        return knees

    @classmethod
    def _fit_at(cls, samples: Sequence[Sample], knee: float, memory_terms: bool) -> CostModel:
        # Each row divided by its time: least squares then minimizes the relative error.
        rows = [(max(w.num_tokens, knee) / t, w.attn_work / t, w.num_seqs / t, 1.0 / t, w.kv_tokens / t)
                for w, t in samples]
        ys = [1.0] * len(samples)
        active = [0, 1, 2, 3, 4] if memory_terms else [0, 1, 2, 3]
        while True:
            coef = _least_squares(rows, ys, active)
            negative = [j for j in active if coef[j] < 0]
            if not negative:
                break
            active.remove(min(negative, key=coef.__getitem__))
        return cls(per_token=coef.get(0, 0.0), per_attn=coef.get(1, 0.0), per_seq=coef.get(2, 0.0),
                   fixed=coef.get(3, 0.0), per_kv=coef.get(4, 0.0), knee_tokens=float(knee))


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


_COLUMN_NAMES = ("num_tokens", "attn_work", "num_seqs", "constant", "kv_tokens", "knee floor")


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
                " (collinear features); vary num_tokens, attn_work, kv_tokens and num_seqs independently"
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
