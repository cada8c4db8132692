"""Split sampling under real torchrun (gloo): the first and the last stage share the LM head in
greedy decode-only steps (parallel/split_head.py). A tiny untied Llama in float32: pp=2 gives
the same tokens with the split on and off and in one process, for a batch mixing greedy
requests (split steps), a greedy one with logprobs and seeded random ones (steps that are not
split), so the two kinds of feedback message interleave on one pair."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_model import write_tiny_checkpoint, write_tiny_model, write_word_level_tokenizer  # noqa: E402

from pipeserve import LLM, SamplingParams  # noqa: E402
from pipeserve.runtime.config import EngineConfig, ParallelConfig  # noqa: E402
from pipeserve.scheduler import SchedulerConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # The others stop early: the greedy four then decode alone, in split steps only.
    return [greedy] * 4 + [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, seed=7),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, min_tokens=4),
    ]


def _config(model: str, device: str = "cpu", **parallel) -> EngineConfig:
    return EngineConfig(model=model, device=device, dtype="float32", num_kv_blocks=128,
                        scheduler=SchedulerConfig(max_num_batched_tokens=24), parallel=ParallelConfig(**parallel))


def _run(model: str, device: str = "cpu", **parallel) -> list[tuple[list[int], list | None]]:
    prompts = [" ".join(f"t{(5 * i + j) % 250 + 3}" for j in range(4 + 5 * i)) for i in range(7)]
    with LLM.from_config(_config(model, device, **parallel)) as llm:
        outs = llm.generate(prompts, _params())
    return [(o.outputs[0].token_ids,
             None if o.outputs[0].logprobs is None else [sorted(lp) for lp in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("device, tied", [
    ("cpu", False),
    ("cpu", True),
    pytest.param("cuda", False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")]),
], ids=["cpu", "cpu-tied", "cuda"])
def test_split_sampling_matches_one_process(tmp_path, device, tied):
    """Untied, the first stage loads its half of lm_head.weight; tied, of the embedding. On CUDA
    the first stage combines on a stream of its own, the ids come back to the driver on a side
    stream, and the workers replay graphs."""
    if tied:
        model = write_tiny_checkpoint(tmp_path, "llama_tied")
        write_word_level_tokenizer(model)
        model = str(model)
    else:
        model = write_tiny_model(tmp_path / "tiny")
    one = _run(model, device)
    assert [len(tokens) for tokens, _ in one] == [12] * 4 + [5] * 3
    assert _run(model, device, pp=2, split_lm_head=True) == one
    assert _run(model, device, pp=2) == one  # (off by default)
    if device == "cpu" and not tied:  # three decode groups (split steps among them)
        assert _run(model, device, pp=2, split_lm_head=True, decode_groups=3) == one


def test_a_lone_request_does_not_wait_for_the_first_stage_to_idle(tmp_path):
    """One request decoding alone: no later plan follows its split step, so the engine tells the
    first stage to post now (wire.PostFeedback) rather than after its idle timeout; the tokens
    are those of one process."""
    model = write_tiny_model(tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "t5 t9 t11 t40 t7"
    with LLM.from_config(_config(model)) as llm:
        want = llm.generate([prompt], params)[0].outputs[0].token_ids
    with LLM.from_config(_config(model, pp=2, split_lm_head=True)) as llm:
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        posts = llm.engine.executor.num_feedback_posts
    assert got == want and len(got) == 16
    assert posts >= 14  # every decode of the lone request, once it decodes
