"""Prompt logprobs and full-vocabulary logprob ranks, offline, against transformers on the same
tiny random Llama (float32): prompts prefilled in several chunks, batches that mix requests with
and without prompt logprobs, the prefix cache on, preemption; on a GPU (marked), through CUDA
graphs and token feedback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_model import hf_logits, load_hf_reference

from pipeserve import LLM, SamplingParams
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.engine.outputs import Logprob
from pipeserve.scheduler import SchedulerConfig

ATOL = 1e-5
"""|Δ logprob| allowed against transformers on the CPU (float32 both, the same weights)."""


@pytest.fixture(scope="module")
def hf(tiny_model):
    return load_hf_reference(Path(tiny_model))


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * j + 13 * salt) % 250 + 3 for j in range(length)]


def reference(hf, token_ids: list[int]) -> torch.Tensor:
    """[len, V] float64 log-softmax of transformers' logits: row i scores token i + 1."""
    return torch.log_softmax(hf_logits(hf, token_ids).double(), dim=-1)


def assert_position_matches(entry: dict[int, Logprob], ref_row: torch.Tensor, token: int, k: int,
                            atol: float = ATOL) -> None:
    """One position: the token itself and the reference's top k (in order, up to values within
    ``atol``), logprobs within ``atol``, ranks as the reference counts them (1 + the tokens with a
    larger logprob, up to those within ``atol``), decoded text."""
    assert token in entry and len(entry) == k + (token not in list(entry)[:k])
    top = ref_row.sort(descending=True).values[:k]
    assert ref_row[list(entry)[:k]].tolist() == pytest.approx(top.tolist(), abs=2 * atol)
    for t, lp in entry.items():
        assert isinstance(lp, Logprob) and lp.decoded_token == f"t{t}"
        assert lp.logprob == pytest.approx(ref_row[t].item(), abs=atol)
        fewest, most = (1 + int((ref_row > ref_row[t] + d).sum()) for d in (atol, -atol))
        assert fewest <= lp.rank <= most, (t, lp.rank, fewest, most)


def assert_prompt_logprobs(hf, prompt: list[int], prompt_logprobs, k: int, atol: float = ATOL) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    ref = reference(hf, prompt)
    for i in range(1, len(prompt)):
        assert_position_matches(prompt_logprobs[i], ref[i - 1], prompt[i], k, atol)


def tiny_llm(model: str, **overrides) -> LLM:
    """The engine on the tiny model; a 16-token budget prefills a prompt in chunks of 16."""
    kwargs = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64, max_model_len=256)
    return LLM(model, **(kwargs | overrides))


@pytest.mark.parametrize("max_num_seqs", [128, 3])
def test_chunked_prompts_in_a_mixed_batch_match_transformers(tiny_model, hf, max_num_seqs):
    """A 16-token budget: the 37- and 33-token prompts span three chunks, sharing micro-batches
    with requests that ask for nothing (their rows never reach the LM head) and with decodes.
    With 3 sequences a step, the LM head takes a chunk's prompt rows 3 at a time."""
    prompts = [prompt_of(37), prompt_of(5, 1), prompt_of(1, 2), prompt_of(33, 3), prompt_of(17, 4)]
    params = [
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5),
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=2),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    with tiny_llm(tiny_model, max_num_seqs=max_num_seqs) as llm:
        outs = llm.generate(prompts, params)
        plain = llm.generate(prompts, [p.clone(prompt_logprobs=None) for p in params])
    for out, prompt, p in zip(outs, prompts, params):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert outs[2].prompt_logprobs == [None]  # a one-token prompt: nothing before its token
    # Asking for them changes no output.
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_sampled_tokens_are_ranked_over_the_whole_vocabulary(tiny_model, hf):
    """Tokens sampled at a high temperature often fall outside the top k: their rank is still
    the reference's (1 + the tokens with a larger logprob), as is every top token's."""
    prompt = prompt_of(20, 5)
    params = SamplingParams(temperature=2.0, seed=3, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with tiny_llm(tiny_model) as llm:
        (out,) = llm.generate([prompt], params)
    c = out.outputs[0]
    ref = reference(hf, prompt + c.token_ids)
    for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert_position_matches(entry, ref[len(prompt) - 1 + j], token, 2)
    assert sum(entry[t].rank > 2 for t, entry in zip(c.token_ids, c.logprobs)) >= 5
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 1)


def test_prefix_cache_serves_none_of_a_scored_prompt(tiny_model, hf):
    """With the prefix cache on and the prompt's blocks cached, a request asking for prompt
    logprobs computes its whole prompt (every position answered) while a plain one beside it
    starts from the cached prefix."""
    shared = prompt_of(40, 6)
    with tiny_llm(tiny_model, max_num_batched_tokens=32, enable_prefix_caching=True, block_size=8) as llm:
        llm.generate([shared], SamplingParams(temperature=0, max_tokens=1))  # caches the prefix
        scored, plain = llm.generate([shared + [5, 6], shared + [7]], [
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), SamplingParams(temperature=0, max_tokens=2)])
    assert scored.metrics.num_cached_tokens == 0 and plain.metrics.num_cached_tokens == 40
    assert_prompt_logprobs(hf, shared + [5, 6], scored.prompt_logprobs, 2)


def test_preempted_prompts_keep_every_position_once(tiny_model, hf):
    """A KV pool so small that requests are preempted and recompute their prompts: each
    position's logprobs are still there once, equal to the reference."""
    prompts = [prompt_of(30, i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    with tiny_llm(tiny_model, max_num_batched_tokens=8, block_size=4, num_kv_blocks=16, max_model_len=64) as llm:
        outs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 2)


def test_n_sequences_share_the_prompts_logprobs(tiny_model, hf):
    prompt = prompt_of(12, 7)
    with tiny_llm(tiny_model) as llm:
        (out,) = llm.generate([prompt], SamplingParams(n=2, seed=1, max_tokens=3, prompt_logprobs=1))
    assert len(out.outputs) == 2
    assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prompt_logprobs_through_cuda_graphs_and_token_feedback(tiny_model, hf):
    """On a GPU (float32): prompt chunks share mixed-bucket CUDA graph replays with decodes, the
    prompt rows' LM head runs after the replay, and with token feedback (the default) a step's
    sampled ids stay on the device while its prompt logprobs come back with the result."""
    prompts = [prompt_of(n, i) for i, n in enumerate((45, 3, 70, 12, 33, 1, 58, 20))]
    params = [SamplingParams(temperature=0 if i % 2 else 1.2, seed=i, max_tokens=12, ignore_eos=True,
                             logprobs=3 if i % 3 == 0 else None, prompt_logprobs=(None, 2, 0, 5)[i % 4])
              for i in range(len(prompts))]
    config = EngineConfig(model=tiny_model, device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256,
                          cuda_graph_max_batch=64, cuda_graph_max_tokens=256,
                          scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16))
    with LLM.from_config(config) as llm:
        outs = llm.generate(prompts, params)
        graphs = llm.engine.executor.worker.runner.cuda_graphs
        assert graphs is not None and graphs.num_mixed_replays > 0
    atol = 2e-3  # the GPU's float32 matmuls may round through TF32
    for out, prompt, p in zip(outs, prompts, params):
        assert (out.prompt_logprobs is None) == (p.prompt_logprobs is None)
        if p.prompt_logprobs is not None:
            assert_prompt_logprobs(hf, prompt, out.prompt_logprobs, p.prompt_logprobs, atol)
        c = out.outputs[0]
        if p.logprobs is not None:
            ref = reference(hf, prompt + c.token_ids)
            for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
                assert_position_matches(entry, ref[len(prompt) - 1 + j], token, p.logprobs, atol)
