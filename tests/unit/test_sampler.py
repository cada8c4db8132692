"""Sampler against a float64 NumPy reference of temperature -> top-k -> top-p -> min-p.

Seeds are fixed: every draw below is deterministic, and the distribution checks compare
empirical frequencies with the reference within several standard deviations.
"""

import numpy as np
import pytest
import torch

from pipeserve.runtime.worker import sampler as sampler_module
from pipeserve.runtime.worker.sampler import (
    Sampler,
    SamplerOutput,
    _filtered_probs,
    make_generator,
    race_inputs,
    takes_argmax,
    takes_race,
)
from pipeserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def ref_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Normalized float64 distribution of one row after the sampler's filters."""
    x = logits.astype(np.float64) / p.temperature
    if p.top_k > 0:
        kth = np.sort(x)[::-1][min(p.top_k, x.size) - 1]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        # A token's preceding mass: that of the tokens strictly more probable (ties all kept).
        descending = np.sort(probs)[::-1]
        cumulative = np.concatenate([[0.0], np.cumsum(descending)])
        num_greater = np.searchsorted(-descending, -probs, side="left")
        probs[cumulative[num_greater] >= p.top_p] = 0.0
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def ref_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def ref_rank(logits_row: np.ndarray, token: int) -> int:
    """1 + the number of tokens with a strictly larger logit (so logprob) than ``token``'s."""
    return 1 + int(np.count_nonzero(logits_row > logits_row[token]))


def random_logits(rng: np.random.Generator, num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((num_rows, vocab_size)) * 3).float()


FILTER_SETTINGS = [
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.5, top_k=5),
    dict(temperature=1.7, top_k=50),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.3, top_p=0.99),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.7, min_p=0.2),
    dict(temperature=1.2, top_k=40, top_p=0.8),
    dict(temperature=0.9, top_k=100, top_p=0.95, min_p=0.02),
    dict(temperature=2.0, top_p=0.7, min_p=0.1),
    dict(temperature=1.0, top_k=2000),  # k > V
]


@pytest.mark.parametrize("settings", FILTER_SETTINGS, ids=str)
def test_filtered_support_matches_reference(settings):
    rng = np.random.default_rng(100 + FILTER_SETTINGS.index(settings))
    logits = random_logits(rng, 6, 1000)
    params = SamplingParams(**settings)
    probs = _filtered_probs(logits, [params] * 6)
    for row in range(6):
        expected = ref_probs(logits[row].numpy(), params) > 0
        np.testing.assert_array_equal(probs[row].numpy() > 0, expected)


def test_filtered_support_heterogeneous_batch():
    """Each row keeps its own settings when rows with different ones share the batch."""
    rng = np.random.default_rng(1)
    params = [SamplingParams(**s) for s in FILTER_SETTINGS]
    logits = random_logits(rng, len(params), 500)
    rows = params[:3] + [None] + params[4:]  # None: a greedy row, left unfiltered
    probs = _filtered_probs(logits, rows)
    for row, p in enumerate(rows):
        expected = ref_probs(logits[row].numpy(), p or SamplingParams()) > 0
        np.testing.assert_array_equal(probs[row].numpy() > 0, expected, err_msg=str(p))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    rng = np.random.default_rng(2)
    logits = random_logits(rng, 16, 777)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 12 + [
        SamplingParams(temperature=0.9)
    ] * 4
    out = Sampler()(logits.to(device), params, [None] * 16)
    assert isinstance(out, SamplerOutput) and out.logprobs is None
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == "cpu"
    np.testing.assert_array_equal(out.token_ids[:12].numpy(), logits[:12].numpy().argmax(-1))


def test_takes_argmax_exactly_where_the_sampler_gives_the_argmax():
    """The rows ``takes_argmax`` accepts sample their raw logits' argmax through the sampler too,
    so ``chosen`` on that argmax is what the sampler would give; every other kind of row is
    refused: something other than the argmax, or more than the token, is asked of it."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    assert takes_argmax([greedy, SamplingParams(temperature=0.0, seed=7)], [2, 0])
    logits = random_logits(np.random.default_rng(5), 2, 64)
    logits[:, 5] = 1e3  # the stop token everywhere on top: a row short of min_tokens would not take it
    out = Sampler()(logits, [greedy] * 2, [None] * 2, num_output_tokens=[2, 3], eos_token_ids=[0])
    seen = []
    chosen = Sampler().chosen(logits.argmax(dim=-1), on_sampled=seen.append)
    assert out.token_ids.tolist() == chosen.token_ids.tolist() == [5, 5] and chosen.logprobs is None
    assert len(seen) == 1 and seen[0].tolist() == [5, 5]
    refused = [
        greedy.clone(temperature=0.7),
        greedy.clone(logprobs=0),
        greedy.clone(presence_penalty=0.5),
        greedy.clone(repetition_penalty=1.1),
        greedy.clone(logit_bias={3: 1.0}),
        greedy.clone(allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]+")),
    ]
    for params in refused:
        assert not takes_argmax([greedy, params], [2, 2]), params
    assert not takes_argmax([greedy], [1])  # short of min_tokens: its stop token is held back
    assert not takes_argmax([], [])  # nothing to sample


def test_takes_race_for_unseeded_temperature_rows_only():
    """The race (``kernels/race.py``) serves greedy rows and rows that ask for a temperature
    alone (not below RACE_MIN_TEMPERATURE), unseeded; a seeded row or any filter keeps the
    sampler's own race."""
    plain = SamplingParams(temperature=0.8)
    greedy = SamplingParams(temperature=0.0)
    assert takes_race([plain, greedy, SamplingParams()], [0, 0, 3])
    refused = [plain.clone(seed=3), plain.clone(temperature=0.005), plain.clone(top_k=20), plain.clone(top_p=0.9),
               plain.clone(min_p=0.1),
               plain.clone(logprobs=1), plain.clone(logit_bias={1: 2.0}), plain.clone(frequency_penalty=0.5)]
    for params in refused:
        assert not takes_race([plain, params], [0, 0]), params
    assert not takes_race([plain.clone(min_tokens=2)], [1]) and takes_race([plain.clone(min_tokens=2)], [2])
    assert not takes_race([], [])
    torch.manual_seed(11)
    inv_t, seeds = race_inputs([plain, greedy, SamplingParams(temperature=2.0)], torch.device("cpu"))
    assert inv_t.dtype == torch.float32 and inv_t.tolist() == pytest.approx([1.25, 0.0, 0.5])
    assert seeds.dtype == torch.int64 and seeds.shape == (3,) and len(set(seeds.tolist())) == 3
    torch.manual_seed(11)  # every TP rank, seeded alike, draws the same seeds
    assert torch.equal(race_inputs([plain] * 3, torch.device("cpu"))[1], seeds)


def draw_frequencies(logits_row, params, num_draws, seeded, device="cpu"):
    logits = logits_row.expand(num_draws, -1).contiguous().to(device)
    if seeded:
        generators = [make_generator(i, device) for i in range(num_draws)]
    else:
        torch.manual_seed(1234)
        generators = [None] * num_draws
    ids = Sampler()(logits, [params] * num_draws, generators).token_ids
    return np.bincount(ids.numpy(), minlength=logits.shape[1]) / num_draws


@pytest.mark.parametrize("seeded, num_draws", [(False, 20_000), (True, 5_000)])
def test_empirical_distribution_matches_reference(seeded, num_draws):
    logits = torch.tensor([2.0, 1.5, 1.2, 0.4, 0.3, -0.5, -1.0, -3.0])  # V = 8
    params = SamplingParams(temperature=0.7, top_p=0.9)
    expected = ref_probs(logits.numpy(), params)
    assert 2 < np.count_nonzero(expected) < 8  # top-p removes some tokens, keeps several
    freq = draw_frequencies(logits, params, num_draws, seeded)
    assert np.all(freq[expected == 0] == 0)
    assert np.abs(freq - expected).max() < (0.02 if num_draws >= 20_000 else 0.03)


def run_steps(logits_steps, layout, device="cpu"):
    """Sample each step with rows (params, seed); returns each row's token sequence."""
    generators = [make_generator(seed, device) for _, seed in layout]
    params = [p for p, _ in layout]
    seqs = [[] for _ in layout]
    for logits in logits_steps:
        ids = Sampler()(logits.to(device), params, generators).token_ids.tolist()
        for seq, token_id in zip(seqs, ids):
            seq.append(token_id)
    return seqs


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducible_alone_or_batched(device):
    rng = np.random.default_rng(3)
    num_steps, vocab_size = 20, 1000
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = run_steps(
        [random_logits(rng, 1, vocab_size) for _ in range(num_steps)], [(target, 42)], device
    )[0]

    rng = np.random.default_rng(3)
    target_logits = [random_logits(rng, 1, vocab_size) for _ in range(num_steps)]
    others = random_logits(np.random.default_rng(4), num_steps * 4, vocab_size).view(
        num_steps, 4, vocab_size
    )
    batches = [torch.cat([o[:2], t, o[2:]]) for o, t in zip(others, target_logits)]
    layout = [
        (SamplingParams(temperature=0.8, top_k=20, seed=7), 7),
        (SamplingParams(temperature=1.0), None),
        (target, 42),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=1.5, min_p=0.1), None),
    ]
    batched = run_steps(batches, layout, device)
    assert batched[2] == alone
    # A different seed, same logits: a different sequence.
    other_seed = run_steps(target_logits, [(target.clone(seed=43), 43)], device)[0]
    assert other_seed != alone


def test_seeded_rows_leave_global_generator_alone():
    """Seeded rows draw only from their own generators: the global one is left untouched."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    logits = random_logits(np.random.default_rng(5), 3, 100)
    params = [SamplingParams(seed=s) for s in (1, 2, 3)]
    Sampler()(logits, params, [make_generator(s, "cpu") for s in (1, 2, 3)])
    assert torch.equal(torch.get_rng_state(), before)
    assert make_generator(None, "cpu") is None


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_reference_and_include_sampled(device):
    rng = np.random.default_rng(6)
    num_rows, vocab_size = 64, 300
    logits = random_logits(rng, num_rows, vocab_size) / 3  # flat, so samples leave the top-k
    ks = [None, 0, 1, 3, 20]
    params = [
        SamplingParams(temperature=1.5, top_p=0.95, logprobs=ks[i % len(ks)])
        for i in range(num_rows)
    ]
    out = Sampler()(logits.to(device), params, [None] * num_rows)
    ref = ref_log_softmax(logits.numpy())
    assert out.logprobs.num_top == 20 and out.logprobs.num_rows == num_rows  # every row, the most asked for
    num_outside_top_k = 0
    for row, p in enumerate(params):
        if p.logprobs is None:
            continue
        lp = out.logprobs.entry(row, p.logprobs)
        token_id = int(out.token_ids[row])
        top_ids = list(lp)[: p.logprobs]
        np.testing.assert_array_equal(top_ids, np.argsort(-ref[row], kind="stable")[: p.logprobs])
        assert token_id in lp
        assert len(lp) == p.logprobs + (token_id not in top_ids)
        num_outside_top_k += token_id not in top_ids
        for token, (value, rank) in lp.items():
            assert value == pytest.approx(ref[row, token], abs=1e-4)
            assert rank == ref_rank(logits[row].numpy(), token)
    assert num_outside_top_k > 10


@pytest.mark.parametrize("device", DEVICES)
def test_compute_logprobs_ranks_over_the_whole_vocabulary(device, monkeypatch):
    """Any row's own token (far outside the top k too), ties sharing a rank, in CPU chunks of
    rows: ranks are 1 + the number of strictly larger logits (NumPy), logprobs the log-softmax."""
    monkeypatch.setattr(sampler_module, "_CPU_CHUNK_ELEMENTS", 3 * 500)
    rng = np.random.default_rng(21)
    logits = random_logits(rng, 9, 500)
    logits[0, [7, 8, 9]] = 40.0  # a three-way tie at the top
    logits[1, [3, 4]] = logits[1, 5].item()  # a tie around the own token, mid-vocabulary
    own = torch.tensor([8, 4, *rng.integers(0, 500, 7).tolist()])
    ids, values, ranks = sampler_module.compute_logprobs(logits.to(device), own.to(device), 3)
    ref = ref_log_softmax(logits.numpy())
    assert ids.shape == values.shape == ranks.shape == (9, 4)
    assert ids[:, 3].tolist() == own.tolist()
    for row in range(9):
        for token, value, rank in zip(ids[row].tolist(), values[row].tolist(), ranks[row].tolist()):
            assert value == pytest.approx(ref[row, token], abs=1e-4)
            assert rank == ref_rank(logits[row].numpy(), token)
    assert ranks[0].tolist() == [1, 1, 1, 1]
    assert ranks[1, 3].item() == ref_rank(logits[1].numpy(), 4) == ref_rank(logits[1].numpy(), 3)
    assert max(ranks[2:, 3].tolist()) > 100  # own tokens far down the vocabulary are ranked too


def test_logprobs_are_raw_not_tempered():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0.3, top_k=1, logprobs=4)], [None])
    ref = ref_log_softmax(logits.numpy())[0]
    assert out.token_ids.tolist() == [0]
    assert [v for v, _ in out.logprobs.entry(0, 4).values()] == pytest.approx(ref.tolist(), abs=1e-5)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 1.0]] * 4)  # argmax order: 0, 1, 2
    eos = (0,)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # short: 0, 1 banned
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # reached: free
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),  # eos not banned
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[1, 2, 4]),  # only 3 left
    ]
    out = Sampler()(
        logits, params, [None] * 4, num_output_tokens=[1, 2, 0, 0], eos_token_ids=eos
    )
    assert out.token_ids.tolist() == [2, 0, 0, 3]
    unmasked = Sampler()(logits[:3], params[:3], [None] * 3)
    assert unmasked.token_ids.tolist() == [0, 0, 0]


# The fast paths: candidates from topk grown on the CPU (256, 4096, 16384, then a full sort),
# the two-round race over blocks of 256 tokens, CPU chunks of rows. Each case below is one
# row's logits and settings; a batch mixes them.


def peaked_logits(rng: np.random.Generator, vocab_size: int) -> np.ndarray:
    """An LM-like row: the logit at rank r falls as -s * ln(r)."""
    ranks = rng.permutation(vocab_size) + 1
    return -rng.uniform(1.2, 2.4) * np.log(ranks) + 0.3 * rng.standard_normal(vocab_size)


def flat_logits(rng: np.random.Generator, vocab_size: int) -> np.ndarray:
    """Nearly uniform: top-p's nucleus holds most of the vocabulary (the full-sort fallback)."""
    return 0.3 * rng.standard_normal(vocab_size)


def tied_logits(rng: np.random.Generator, vocab_size: int, num_tied: int) -> np.ndarray:
    """Four distinct leaders, then ``num_tied`` tokens tied at 1.0 (the 5th logit), the rest
    below; shuffled."""
    row = np.concatenate([[4.0, 3.0, 2.5, 2.0], np.ones(num_tied),
                          rng.uniform(-3.0, 0.5, vocab_size - 4 - num_tied)])
    return rng.permutation(row)


def top_tie_logits(rng: np.random.Generator, vocab_size: int) -> np.ndarray:
    """Two tokens tied for the top."""
    row = rng.uniform(-2.0, 1.0, vocab_size)
    row[rng.choice(vocab_size, 2, replace=False)] = 8.0
    return row


MIXED_CASES = [  # (settings, logits of the row)
    (dict(temperature=0.0), peaked_logits),
    (dict(temperature=0.7), peaked_logits),
    (dict(top_k=5), lambda rng, v: tied_logits(rng, v, 150)),  # keeps 4 + 150 tied
    (dict(top_k=5, top_p=0.5), lambda rng, v: tied_logits(rng, v, 150)),  # in 256 candidates
    (dict(top_k=5, top_p=0.7), lambda rng, v: tied_logits(rng, v, 1200)),  # ties past them
    (dict(top_p=1e-3), peaked_logits),  # one token left
    (dict(top_p=0.2), top_tie_logits),  # the two tied leaders, nothing else
    (dict(temperature=1.5, top_p=0.99), flat_logits),
    (dict(top_p=0.9), flat_logits),
    (dict(temperature=1.3, top_p=0.95), peaked_logits),
    (dict(temperature=1.2, min_p=0.1), peaked_logits),
    (dict(min_p=0.5), flat_logits),
    (dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02), peaked_logits),
    (dict(top_k=3000), peaked_logits),  # k > V: no cut
    (dict(top_p=0.9, seed=11), peaked_logits),
]
MIXED_VOCAB = 1500  # past the first 256 candidates, and not a whole number of race blocks


def mixed_batch(seed: int) -> tuple[np.ndarray, list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    logits = np.stack([make(rng, MIXED_VOCAB) for _, make in MIXED_CASES]).astype(np.float32)
    return logits, [SamplingParams(**settings) for settings, _ in MIXED_CASES]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_filters_match_reference(device):
    logits, params = mixed_batch(20)
    rows = [None if p.is_greedy else p for p in params]
    probs = _filtered_probs(torch.from_numpy(logits).to(device), rows).double().cpu().numpy()
    for row, p in enumerate(rows):
        expected = ref_probs(logits[row], p or SamplingParams())
        np.testing.assert_array_equal(probs[row] > 0, expected > 0, err_msg=str(p))
        np.testing.assert_allclose(probs[row] / probs[row].sum(), expected, rtol=1e-4,
                                   atol=1e-7, err_msg=str(p))
    assert np.count_nonzero(ref_probs(logits[2], params[2])) == 154
    assert np.count_nonzero(ref_probs(logits[5], params[5])) == 1
    assert np.count_nonzero(ref_probs(logits[6], params[6])) == 2
    assert np.count_nonzero(ref_probs(logits[7], params[7])) > 256  # sorted in full


def ref_mass_before(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Each token's preceding mass in the reference's top-k-renormalized distribution."""
    probs = ref_probs(logits, p.clone(top_p=1.0, min_p=0.0))
    descending = np.sort(probs)[::-1]
    cumulative = np.concatenate([[0.0], np.cumsum(descending)])
    return cumulative[np.searchsorted(-descending, -probs, side="left")]


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_every_candidate_stage(device):
    """Nuclei of ~10, ~1800, ~9000 and ~19000 of 20000 tokens: on the CPU the first 256
    candidates, 4096, 16384 and the full sort resolve them; beside a top-k row of 15000, the
    first candidates are 15001. float32 sums may move the cut by a token whose preceding mass is
    within 1e-5 of top_p; nothing else may differ."""
    vocab_size = 20_000
    rng = np.random.default_rng(30)
    rows = [peaked_logits(rng, vocab_size)] + [flat_logits(rng, vocab_size) for _ in range(4)]
    logits = np.stack(rows).astype(np.float32)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.1), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0.9, top_p=0.95, min_p=0.2),
              SamplingParams(top_k=15_000, top_p=0.8)]
    for num_rows in (4, 5):
        batch = torch.from_numpy(logits[:num_rows]).to(device)
        probs = _filtered_probs(batch, params[:num_rows]).cpu().numpy()
        for row, p in enumerate(params[:num_rows]):
            expected = ref_probs(logits[row], p) > 0
            differ = (probs[row] > 0) != expected
            near_cut = np.abs(ref_mass_before(logits[row], p) - p.top_p) < 1e-5
            assert np.all(near_cut[differ]), f"{p}: {np.flatnonzero(differ & ~near_cut)}"
    sizes = [np.count_nonzero(ref_probs(row, p)) for row, p in zip(logits, params)]
    assert sizes[0] < 256 and 256 < sizes[1] < 4096 < sizes[2] < 16384 < sizes[3]
    assert 4096 < sizes[4] < 15_000


def assert_frequencies_match(token_ids: np.ndarray, expected: np.ndarray, *, what: str,
                             num_groups: int = 12, sigmas: float = 5.0) -> None:
    """Drawn ids against a reference distribution: nothing outside its support, and the mass of
    each group of tokens (runs of tokens in descending reference probability holding about
    1 / num_groups of it; a heavy token alone) within ``sigmas`` standard deviations."""
    num_draws = token_ids.size
    freq = np.bincount(token_ids, minlength=expected.size) / num_draws
    assert np.all(freq[expected == 0] == 0), f"{what}: drew a filtered-out token"
    order = np.argsort(-expected, kind="stable")
    order = order[expected[order] > 0]
    mass_before = np.cumsum(expected[order]) - expected[order]
    groups = np.minimum((mass_before * num_groups).astype(int), num_groups - 1)
    for group in np.unique(groups):
        members = order[groups == group]
        p, f = expected[members].sum(), freq[members].sum()
        tolerance = sigmas * np.sqrt(p * (1 - p) / num_draws) + 1e-9
        assert abs(f - p) <= tolerance, (
            f"{what}: a group of {members.size} has {f:.4f}, expected {p:.4f}")


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_distributions_match_reference(device):
    """Each case's rows, repeated through heterogeneous batches (several CPU chunks each), draw
    tokens with the reference's frequencies; greedy rows take the argmax."""
    logits, params = mixed_batch(21)
    num_cases, repeats, num_calls = len(params), 400, 10
    batch = torch.from_numpy(logits).repeat(repeats, 1).to(device)  # row i: case i % num_cases
    batch_params = params * repeats
    seeds = iter(range(10**6))
    generators = [make_generator(next(seeds) if p.seed is not None else None, device)
                  for p in batch_params]
    torch.manual_seed(5)
    drawn = np.stack([
        Sampler()(batch, batch_params, generators).token_ids.numpy().reshape(repeats, num_cases)
        for _ in range(num_calls)
    ])  # [calls, repeats, cases]
    for case, p in enumerate(params):
        ids = drawn[:, :, case].ravel()
        if p.is_greedy:
            assert np.all(ids == logits[case].argmax())
            continue
        assert_frequencies_match(ids, ref_probs(logits[case], p), what=str(MIXED_CASES[case][0]))


@pytest.mark.parametrize("vocab_size", [100, 700, 4096])
def test_two_round_race_draws_the_softmax(vocab_size):
    """Temperature alone: one short block, a short last block, whole blocks."""
    rng = np.random.default_rng(vocab_size)
    row = (peaked_logits(rng, vocab_size) / 2).astype(np.float32)  # flatter: many tokens drawn
    params = SamplingParams(temperature=0.8)
    num_draws = 20_000
    torch.manual_seed(6)
    logits = torch.from_numpy(row).expand(num_draws, -1).contiguous()
    ids = Sampler()(logits, [params] * num_draws, [None] * num_draws).token_ids.numpy()
    assert_frequencies_match(ids, ref_probs(row, params), what=f"V={vocab_size}", num_groups=20)


def test_seeded_row_independent_of_chunks_and_candidates(monkeypatch):
    """A seeded row's tokens depend on its seed alone: not on its chunk, its position or the
    candidate-set sizes its neighbours' settings choose."""
    vocab_size = 1000
    monkeypatch.setattr(sampler_module, "_CPU_CHUNK_ELEMENTS", 3 * vocab_size)  # 3 rows a chunk
    rng = np.random.default_rng(8)
    steps = [torch.from_numpy(flat_logits(rng, vocab_size) * 8).float() for _ in range(12)]
    target = SamplingParams(temperature=1.1, top_p=0.9, min_p=0.01, seed=99)
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=900, seed=5),  # the first candidate set becomes 901 wide
        SamplingParams(top_p=0.999),
        SamplingParams(temperature=0.5, top_k=2),
    ]

    def run(position: int, others: list[SamplingParams]) -> list[int]:
        layout = others[:position] + [target] + others[position:]
        other_rows = random_logits(np.random.default_rng(position), len(steps) * len(others),
                                   vocab_size).view(len(steps), len(others), vocab_size)
        batches = [torch.cat([o[:position], t[None], o[position:]])
                   for o, t in zip(other_rows, steps)]
        return run_steps(batches, [(p, p.seed) for p in layout])[position]

    alone = run(0, [])
    assert len(set(alone)) > 3
    layouts = [(1, neighbours), (3, neighbours), (4, neighbours * 2), (2, neighbours[2:])]
    for position, others in layouts:
        assert run(position, others) == alone, (position, others)


def test_min_tokens_masks_across_chunks(monkeypatch):
    """Rows short of min_tokens never draw EOS or their stop ids, whatever their settings; a
    masked row draws from the reference of its masked logits; the logits are left unchanged."""
    vocab_size = 600
    monkeypatch.setattr(sampler_module, "_CPU_CHUNK_ELEMENTS", 5 * vocab_size)
    rng = np.random.default_rng(9)
    row = peaked_logits(rng, vocab_size).astype(np.float32)
    top = np.argsort(-row)[:4].tolist()  # the most likely tokens: EOS and stop ids
    eos = (top[0],)
    cases = [
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[top[1]]), 0),
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[top[1]]), 3),  # reached
        (SamplingParams(top_p=0.8, min_tokens=2, stop_token_ids=[top[1], top[2]]), 1),
        (SamplingParams(top_k=3, min_tokens=2, ignore_eos=True, stop_token_ids=[top[1]]), 0),
        (SamplingParams(temperature=1.3, min_p=0.05, min_tokens=1), 0),
    ]
    repeats = 800
    params = [p for p, _ in cases] * repeats
    num_done = [n for _, n in cases] * repeats
    logits = torch.from_numpy(row).expand(len(params), -1).contiguous()
    before = logits.clone()
    torch.manual_seed(10)
    out = Sampler()(logits, params, [None] * len(params), num_output_tokens=num_done,
                    eos_token_ids=eos)
    assert torch.equal(logits, before)
    ids = out.token_ids.numpy().reshape(repeats, len(cases))
    assert np.all(ids[:, 0] == top[2]) and np.all(ids[:, 1] == top[0])
    for case in (2, 3, 4):
        p, done = cases[case]
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        masked = row.astype(np.float64)
        masked[list(banned)] = -np.inf
        assert_frequencies_match(ids[:, case], ref_probs(masked, p), what=str(p))


def test_banned_tokens_at_low_temperature_without_filters():
    """No filter, so no mask pass: banned tokens (-inf) still get probability 0, and so do
    tokens whose probability falls below float32's normals at temperature 0.2."""
    rng = np.random.default_rng(13)
    row = (peaked_logits(rng, 3000) * 3).astype(np.float32)  # a spread of ~70 logits
    banned = np.argsort(-row)[:2].tolist()
    params = SamplingParams(temperature=0.2, min_tokens=1, stop_token_ids=banned)
    probs = _filtered_probs(torch.from_numpy(row)[None], [params])[0].numpy()
    ref = ref_probs(row, params)
    assert np.all(probs[ref < 1e-38 * ref.max()] == 0) and np.count_nonzero(probs) > 1
    num_draws = 4000
    logits = torch.from_numpy(row).expand(num_draws, -1).contiguous()
    torch.manual_seed(14)
    ids = Sampler()(logits, [params] * num_draws, [None] * num_draws,
                    num_output_tokens=[0] * num_draws).token_ids.numpy()
    masked = row.astype(np.float64)
    masked[params.stop_token_ids] = -np.inf
    assert_frequencies_match(ids, ref_probs(masked, params), what="T=0.2, top two banned")


def test_logprobs_across_chunks(monkeypatch):
    """Raw logprobs from chunked rows: each row's own top tokens and log-normalizer."""
    vocab_size = 400
    monkeypatch.setattr(sampler_module, "_CPU_CHUNK_ELEMENTS", 2 * vocab_size)
    rng = np.random.default_rng(12)
    logits = random_logits(rng, 7, vocab_size)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.9, logprobs=4)
              for i in range(7)]
    out = Sampler()(logits, params, [None] * 7)
    ref = ref_log_softmax(logits.numpy())
    for row in range(7):
        lp = out.logprobs.entry(row, 4)
        assert list(lp)[:4] == np.argsort(-ref[row], kind="stable")[:4].tolist()
        for token, (value, rank) in lp.items():
            assert value == pytest.approx(ref[row, token], abs=1e-5)
            assert rank == ref_rank(logits[row].numpy(), token)
