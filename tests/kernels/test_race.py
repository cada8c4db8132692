"""race_max (Triton) against its NumPy reference ``race_max_reference`` (Triton's Philox uniforms
bit for bit), and the kernel's draws against softmax(logits / T).

Interpreter on CPU (float32); natively on a GPU (float32 and bfloat16 logits). Fresh random
logits every run (the seed is in every failure message); chunks smaller than the kernel's so
that a row spans several, and vocab shards raced apart and compared as ``tp_argmax`` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, NATIVE, fresh_seed, interpreter_array_warning, runs_triton  # noqa: E402

from pipeserve.kernels import race  # noqa: E402
from pipeserve.kernels.reference import philox_uniform, race_max_reference  # noqa: E402

pytestmark = interpreter_array_warning

DTYPES = [torch.float32] + ([torch.bfloat16] if NATIVE else [])


def _inputs(num_rows: int, vocab_size: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab_size, generator=gen) * 3).to(dtype)
    inv_temperature = torch.tensor([0.0, 1.0, 2.5, 0.4] * (num_rows // 4 + 1))[:num_rows]
    seeds = torch.randint(1 << 62, (num_rows,), generator=gen)
    return logits, inv_temperature, seeds


def test_philox_uniform_is_a_uniform_in_zero_one():
    u = philox_uniform(12345, np.arange(200_000, dtype=np.int32))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert not np.array_equal(u, philox_uniform(12346, np.arange(200_000, dtype=np.int32)))


@runs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_race_max_matches_reference(monkeypatch, dtype):
    seed = fresh_seed()
    monkeypatch.setattr(race, "CHUNK", 2048)  # rows of 5,000 span three chunks, the last partial
    logits, inv_t, seeds = _inputs(8, 5000, seed, dtype)
    logits[4, [17, 4021]] = 1e4  # a greedy row's tie across chunks: the first wins
    logits[5] = float("-inf")  # nothing can win: the first token, scoring -inf
    logits[6, ::2] = float("nan")  # NaN never wins
    got_v, got_i = race.race_max(logits.to(DEVICE), inv_t.to(DEVICE), seeds.to(DEVICE), vocab_start=777)
    want_v, want_i = race_max_reference(logits, inv_t, seeds, vocab_start=777)
    assert got_i.dtype == torch.int64 and got_i.cpu().tolist() == want_i.tolist(), f"seed {seed}"
    assert got_i[4].item() == 777 + 17 and got_i[5].item() == 777 and (got_i[6].item() - 777) % 2 == 1, f"seed {seed}"
    torch.testing.assert_close(got_v.cpu(), want_v, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


@runs_triton
def test_shards_race_as_the_whole_row(monkeypatch):
    """Each shard's winner, the first maximum over them taken (``tp_argmax``'s rule), is the
    whole row's winner: a token's noise depends on its global id only."""
    seed = fresh_seed()
    monkeypatch.setattr(race, "CHUNK", 1024)
    logits, inv_t, seeds = _inputs(12, 3001, seed)
    logits, inv_t, seeds = logits.to(DEVICE), inv_t.to(DEVICE), seeds.to(DEVICE)
    _, whole = race.race_max(logits, inv_t, seeds)
    for bounds in ([0, 1500, 3001], [0, 1001, 2001, 3001]):
        parts = [race.race_max(logits[:, a:b].contiguous(), inv_t, seeds, vocab_start=a)
                 for a, b in zip(bounds, bounds[1:])]
        values = torch.stack([v for v, _ in parts])  # [shards, N]
        ids = torch.stack([i for _, i in parts])
        best = values.argmax(dim=0, keepdim=True)
        assert torch.equal(ids.gather(0, best).squeeze(0), whole), f"seed {seed}, shards {bounds}"


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_race_draws_the_softmax(temperature):
    """4,000 rows of one logit vector (40 tokens, ids from 1000) with their own seeds, raced by
    the kernel on a GPU, else by its reference (the interpreter's 4,000 programs take minutes;
    the tests above tie the two): the winners' counts against softmax(logits / T) by a
    chi-square test over every token with at least 5 expected draws, the rest pooled (fixed
    seeds; the bound is above the 0.999 quantile)."""
    num_rows, vocab = 4000, 40
    gen = torch.Generator().manual_seed(int(temperature * 10))
    logits = (torch.randn(vocab, generator=gen) * 2).expand(num_rows, -1).contiguous()
    inv_t = torch.full((num_rows,), 1.0 / temperature)
    seeds = torch.randint(1 << 62, (num_rows,), generator=gen)
    race_max = race.race_max if NATIVE else race_max_reference
    _, ids = race_max(logits.to(DEVICE), inv_t.to(DEVICE), seeds.to(DEVICE), vocab_start=1000)
    counts = np.bincount(ids.cpu().numpy() - 1000, minlength=vocab)
    want = torch.softmax(logits[0].double() / temperature, dim=-1).numpy() * num_rows
    big = want >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(want[big], want[~big].sum())
    if expected[-1] < 5:  # too little pooled mass to test on its own: fold it into the largest
        top = int(np.argmax(expected[:-1]))
        observed[top] += observed[-1]
        expected[top] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    bound = dof + 4.4 * np.sqrt(2 * dof) + 10  # above the 0.999 quantile for these degrees of freedom
    assert chi2 < bound, (chi2, dof, counts, want)
