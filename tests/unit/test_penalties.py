"""Logits processing (runtime/worker/penalties.py) against a NumPy reference written from the
OpenAI/vLLM formulas, the token history through plans (chunked prefill, fed decodes,
preemption), and SamplingParams' validation of the new fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.runtime.worker.penalties import TokenHistory, process_logits
from pipeserve.runtime.worker.sampler import Sampler
from pipeserve.scheduler import SamplingParams

V = 64


def reference(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """One row, in vLLM v1's order: allowed_token_ids, bad words, logit_bias, repetition
    penalty (prompt and output), frequency and presence penalties (output)."""
    x = logits.astype(np.float32).copy()
    if p.allowed_token_ids is not None:
        keep = np.zeros(V, dtype=bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -np.inf
    for word in p._bad_words_token_ids or []:
        prefix = word[:-1]
        if len(word) > len(output) + 1:
            continue
        if not prefix or output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        x[token] += np.float32(bias)
    r = np.float32(p.repetition_penalty)
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=V).astype(np.float32)
    x -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
    return x


def random_params(rng: np.random.Generator, kind: str) -> SamplingParams:
    uniform = lambda lo, hi: float(rng.uniform(lo, hi))  # noqa: E731
    ids = lambda n: [int(t) for t in rng.choice(V, size=n, replace=False)]  # noqa: E731
    fields = dict(temperature=0.0)
    if kind in ("presence", "all"):
        fields["presence_penalty"] = uniform(-2, 2)
    if kind in ("frequency", "all"):
        fields["frequency_penalty"] = uniform(-2, 2)
    if kind in ("repetition", "all"):
        fields["repetition_penalty"] = uniform(0.3, 3)
    if kind in ("bias", "all"):
        fields["logit_bias"] = {t: uniform(-100, 100) for t in ids(5)}
    if kind in ("allowed", "all"):
        fields["allowed_token_ids"] = ids(20)
    if kind in ("bad_words", "all"):
        fields["bad_words"] = ["x"]
        fields["_bad_words_token_ids"] = [ids(1), ids(2), ids(3)]
    return SamplingParams(**fields)


KINDS = ["none", "presence", "frequency", "repetition", "bias", "allowed", "bad_words", "all"]


def plan(step_id: int, seqs: list[SeqPlan], freed: list[str] = ()) -> StepPlan:
    return StepPlan(step_id=step_id, seqs=seqs, freed=list(freed))


def seq(rid: str, start: int, tokens: list[int], params: SamplingParams | None, *, num_output: int = 0,
        sample: bool = True, table: bool = True, feed_step: int = -1) -> SeqPlan:
    return SeqPlan(request_id=rid, num_computed_tokens=start, num_scheduled_tokens=len(tokens) + (feed_step >= 0),
                   new_token_ids=tokens, block_table=[0] if table else None, block_table_diff=None if table else [],
                   needs_sample=sample, sampling=params, num_output_tokens=num_output, feed_step=feed_step)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_matches_reference(seed, device):
    """Mixed rows, each with a prompt and an output that ends in the prefix of a bad word
    (restarted requests: one plan carries both, as after preemption); on the CPU and on the
    GPU (the sampler's device path)."""
    rng = np.random.default_rng(seed)
    params = [random_params(rng, kind) for kind in KINDS * 2]
    prompts, outputs, seqs = [], [], []
    for i, p in enumerate(params):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 12))).tolist()
        output = rng.integers(0, V, size=int(rng.integers(0, 20))).tolist()
        if p._bad_words_token_ids and rng.random() < 0.7:  # end on a multi-token word's prefix
            output += p._bad_words_token_ids[int(rng.integers(1, 3))][:-1]
        prompts.append(prompt)
        outputs.append(output)
        seqs.append(seq(f"r{i}", 0, prompt + output, p, num_output=len(output)))
    history = TokenHistory(torch.device(device))
    history.apply_plan(plan(0, seqs))
    rows = history.rows_of(seqs)
    logits_cpu = torch.from_numpy(rng.normal(0, 3, size=(len(params), V)).astype(np.float32))
    logits = logits_cpu.to(device)
    before = logits.clone()

    processed = process_logits(logits, params, rows)

    expected = np.stack([reference(logits_cpu[i].numpy(), p, prompts[i], outputs[i]) for i, p in enumerate(params)])
    np.testing.assert_allclose(processed.cpu().numpy(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, before), "the raw logits stay unchanged"
    out = Sampler()(logits, params, [None] * len(params), history=rows)
    assert out.token_ids.tolist() == expected.argmax(axis=1).tolist()


def test_no_processing_returns_the_same_tensor():
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0)] * 3
    assert process_logits(logits, params, None) is logits


def test_history_follows_plans_feedback_and_preemption():
    """A request's history through chunked prefill, sampling, a fed decode, a decode that
    carries its token, and a restart after preemption; each step checked against the
    reference on the tokens the engine knows."""
    p = SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.4,
                       bad_words=["x"], _bad_words_token_ids=[[5, 6, 7]])
    other = SamplingParams(temperature=0.0, presence_penalty=1.0)  # output only: tracked from its sample
    history = TokenHistory(torch.device("cpu"))
    sampler = Sampler()
    rng = np.random.default_rng(3)
    prompt = [1, 2, 3, 4, 1, 5]
    other_prompt = [9, 9, 8]
    known = list(prompt)  # what the engine knows of the request: prompt, then sampled tokens

    def step(step_id: int, seqs: list[SeqPlan], freed=(), force: int | None = None) -> list[int]:
        history.apply_plan(plan(step_id, seqs, freed))
        sampled = [s for s in seqs if s.needs_sample]
        if not sampled:
            return []
        rows = history.rows_of(sampled)
        params = [s.sampling for s in sampled]
        logits = torch.from_numpy(rng.normal(0, 3, size=(len(sampled), V)).astype(np.float32))
        if force is not None:
            logits[0, force] = 50.0
        out = sampler(logits, params, [None] * len(sampled), history=rows,
                      on_sampled=lambda ids: history.append_sampled(rows, ids))
        for i, s in enumerate(sampled):
            ctx = s.num_computed_tokens + s.num_scheduled_tokens
            mine = known if s.request_id == "a" else other_known
            prompt_len = ctx - s.num_output_tokens
            assert len(mine) == ctx
            ref = reference(logits[i].numpy(), s.sampling, mine[:prompt_len], mine[prompt_len:])
            np.testing.assert_allclose(process_logits(logits[i:i + 1], [s.sampling], rows[i:i + 1])[0].numpy(), ref,
                                       rtol=1e-5, atol=1e-5)
            assert out.token_ids[i].item() == int(ref.argmax())
        return out.token_ids.tolist()

    other_known = list(other_prompt)
    # Chunked prefill: the first chunk does not sample but carries the params (repetition).
    assert step(0, [seq("a", 0, prompt[:4], p, sample=False)]) == []
    t = step(1, [seq("a", 4, prompt[4:], p, table=False),
                 seq("b", 0, other_prompt, other)])
    known.append(t[0])
    other_known.append(t[1])
    # A fed decode: its input is the token step 1 sampled, which only the device holds.
    t = step(2, [seq("a", 6, [], p, num_output=1, table=False, feed_step=1),
                 seq("b", 3, [other_known[-1]], other, num_output=1, table=False)])
    known.append(t[0])
    other_known.append(t[1])
    # Walk into the bad word 5 6 7: its last token is banned once the output ends in 5 6.
    for step_id, token in enumerate([5, 6, 7], start=3):
        decode = seq("a", len(known) - 1, [known[-1]], p, num_output=len(known) - len(prompt), table=False)
        t = step(step_id, [decode], force=token)
        assert (t[0] == token) == (token != 7)
        known.append(t[0])
    # Preempted and recomputed: one chunk of prompt + outputs, then the decode.
    restart = list(known)
    assert step(6, [seq("a", 0, restart[:5], p, sample=False)], freed=["b"]) == []
    assert "b" not in history
    t = step(7, [seq("a", 5, restart[5:], p, num_output=len(known) - len(prompt), table=False)])
    known.append(t[0])
    step(8, [], freed=["a"])
    assert len(history) == 0


@pytest.mark.parametrize("fields, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(logit_bias={3: 100.5}), "logit_bias values must be in \\[-100, 100\\]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token ids must be >= 0"),
    (dict(logit_bias={"3": 1.0}), "logit_bias token ids must be an int"),
    (dict(logit_bias=[1]), "logit_bias must be a dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must be >= 0"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids entries must be an int"),
    (dict(bad_words="word"), "bad_words must be a list of strings"),
    (dict(bad_words=["ok", " "]), "bad_words must hold non-blank strings"),
])
def test_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_defaults_process_nothing():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words == []
    assert not p.processes_logits and not p.needs_token_history
