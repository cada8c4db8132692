"""The engine mode of tools/step_overhead.py: a real LLMEngine over an instant executor."""

from tools.step_overhead import make_engine, time_engine_steps


def test_engine_mode_keeps_every_request_running():
    engine = make_engine(8, 20, 10, block_size=4, prefix_caching=False, stop=["never said"])
    times = time_engine_steps(engine, 10)
    assert len(times["step"]) == 10
    assert engine.scheduler.num_running == 8
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == [str(i) for i in range(8)]
    assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].text for o in outputs)
