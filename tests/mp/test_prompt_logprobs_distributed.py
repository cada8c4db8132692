"""Prompt logprobs under real torchrun (gloo): the last stage's TP ranks run the LM head over the
prompt rows together (a collective), its driver ships the logprobs, and with pp=2 the rows
cross a stage boundary first. Checked against transformers on the same tiny Llama (float32),
with prompts prefilled in several chunks beside requests that ask for nothing."""

from __future__ import annotations

import pytest
import torch
from helpers_model import hf_logits, load_hf_reference, write_tiny_model

from pipeserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[(7 * j + 13 * i) % 250 + 3 for j in range(n)] for i, n in enumerate((29, 6, 21))]
PARAMS = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1),
          SamplingParams(temperature=0, max_tokens=5),
          SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_prompt_logprobs_match_transformers(model, layout):
    with LLM(model, device="cpu", dtype="float32", max_num_batched_tokens=12, num_kv_blocks=64,
             max_model_len=128, **layout) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    hf = load_hf_reference(model)
    assert outs[1].prompt_logprobs is None
    for out, prompt, params in zip(outs, PROMPTS, PARAMS):
        tokens = prompt + out.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(hf, tokens).double(), dim=-1)  # row i scores token i + 1
        assert out.outputs[0].token_ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()
        if params.prompt_logprobs is None:
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        entries = out.prompt_logprobs[1:] + (out.outputs[0].logprobs or [])
        for i, entry in enumerate(entries):
            row, token = ref[i], tokens[i + 1]
            k = params.prompt_logprobs if i < len(prompt) - 1 else params.logprobs
            assert list(entry)[:k] == torch.argsort(row, descending=True, stable=True)[:k].tolist()
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
                assert lp.rank == 1 + int((row > row[t]).sum())
            assert token in entry
