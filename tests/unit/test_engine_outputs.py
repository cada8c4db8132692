"""LLMEngine outputs per RequestOutputKind, over the instant executor of tools/step_overhead.py."""

from tools.step_overhead import make_engine
from pipeserve.runtime.engine.outputs import RequestOutputKind


def run_to_completion(engine) -> list[list]:
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def test_final_only_returns_the_same_final_outputs_and_nothing_before():
    def engine(kind):
        return make_engine(6, 20, 5, block_size=4, prefix_caching=False, stop=[], output_kind=kind)

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


def test_cumulative_outputs_never_change_once_handed_out():
    engine = make_engine(4, 20, 5, block_size=4, prefix_caching=False, stop=[])
    first = engine.step()
    snapshot = [(o.outputs[0].token_ids.copy(), o.outputs[0].text) for o in first]
    run_to_completion(engine)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in first] == snapshot
