"""LLMEngine outputs per RequestOutputKind, over a tiny random model on CPU."""

import random

import pytest

from helpers_model import write_tiny_model
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.engine.llm_engine import LLMEngine
from pipeserve.runtime.engine.outputs import RequestOutputKind
from pipeserve.scheduler import SamplingParams, SchedulerConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("engine_outputs"))


def make_engine(model: str, num_requests: int, *, output_kind=RequestOutputKind.CUMULATIVE) -> LLMEngine:
    """``num_requests`` greedy requests of 20-odd random tokens, 12 outputs each (EOS ignored)."""
    config = EngineConfig(model=model, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                          max_model_len=64, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    engine = LLMEngine(config)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), [rng.randrange(3, 256) for _ in range(20 + i)], params, output_kind=output_kind)
    return engine


def run_to_completion(engine) -> list[list]:
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def test_final_only_returns_the_same_final_outputs_and_nothing_before(model):
    def engine(kind):
        return make_engine(model, 6, output_kind=kind)

    cumulative = run_to_completion(engine(RequestOutputKind.CUMULATIVE))
    final_only = run_to_completion(engine(RequestOutputKind.FINAL_ONLY))
    assert len(cumulative) == len(final_only)
    assert all(out.finished for outs in final_only for out in outs)
    finished = {o.request_id: o for outs in cumulative for o in outs if o.finished}
    assert sorted(o.request_id for outs in final_only for o in outs) == sorted(finished)
    for out in (o for outs in final_only for o in outs):
        ref = finished[out.request_id]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text and out.outputs[0].text
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason == "length"
        assert len(out.metrics.token_times) == len(out.outputs[0].token_ids)


def test_cumulative_outputs_never_change_once_handed_out(model):
    engine = make_engine(model, 4)
    first = engine.step()
    snapshot = [(o.outputs[0].token_ids.copy(), o.outputs[0].text) for o in first]
    run_to_completion(engine)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in first] == snapshot
