"""Sampler against a float64 NumPy reference of temperature -> top-k -> top-p -> min-p."""

import numpy as np
import pytest
import torch

from pipeserve.runtime.worker.sampler import Sampler, SamplerOutput, _filtered_probs, make_generator
from pipeserve.scheduler.sampling_params import SamplingParams

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
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        drop = order[mass_before >= p.top_p]
        probs[drop] = 0.0
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def ref_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


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
    num_outside_top_k = 0
    for row, (p, lp) in enumerate(zip(params, out.logprobs)):
        if p.logprobs is None:
            assert lp is None
            continue
        token_id = int(out.token_ids[row])
        top_ids = list(lp)[: p.logprobs]
        np.testing.assert_array_equal(top_ids, np.argsort(-ref[row], kind="stable")[: p.logprobs])
        assert token_id in lp
        assert len(lp) == p.logprobs + (token_id not in top_ids)
        num_outside_top_k += token_id not in top_ids
        for token, value in lp.items():
            assert value == pytest.approx(ref[row, token], abs=1e-4)
    assert num_outside_top_k > 10


def test_logprobs_are_raw_not_tempered():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0.3, top_k=1, logprobs=4)], [None])
    ref = ref_log_softmax(logits.numpy())[0]
    assert out.token_ids.tolist() == [0]
    assert list(out.logprobs[0].values()) == pytest.approx(ref.tolist(), abs=1e-5)


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
