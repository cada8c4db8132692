import random

import msgspec
import pytest

from pipeserve.parallel import wire
from pipeserve.scheduler import SamplingParams
from pipeserve.parallel.wire import (
    WIRE_VERSION,
    BlockTableDiffer,
    BlockTableMirror,
    Heartbeat,
    Hello,
    Ready,
    SeqPlan,
    Shutdown,
    StepPlan,
    StepResult,
    WireError,
    WorkerError,
    decode,
    encode,
)


def make_sampling(**kw) -> SamplingParams:
    defaults = dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=1234, logprobs=3)
    return SamplingParams(**(defaults | kw))


def make_seq(request_id="r0", *, num_tokens=3, **kw) -> SeqPlan:
    fields = dict(request_id=request_id, num_computed_tokens=5, num_scheduled_tokens=num_tokens,
                  new_token_ids=list(range(100, 100 + num_tokens)), block_table=[7, 8],
                  needs_sample=True, sampling=make_sampling())
    return SeqPlan(**(fields | kw))


ALL_MESSAGES = [
    Hello(rank=3, world_size=4, stage=1, tp_rank=1, pid=4242, hostname="node-ä"),
    Ready(session="abc123", world_size=4),
    StepPlan(
        step_id=17,
        seqs=[
            make_seq("prefill", num_tokens=4),
            make_seq("decode", num_tokens=1, block_table=None, block_table_diff=[],
                     sampling=make_sampling(seed=None, logprobs=None, temperature=0.0)),
            make_seq("chunk", needs_sample=False, sampling=None, block_table=None,
                     block_table_diff=[9, 10]),
            make_seq("scored", needs_sample=False, sampling=make_sampling(prompt_logprobs=2),
                     prompt_logprob_targets=[101, 102, 7]),
        ],
        freed=["old-1", "old-2"],
        shutdown=True,
    ),
    StepPlan(step_id=0, seqs=[]),
    StepResult(step_id=17, request_ids=["a", "b"], token_ids=[5, 6],
               logprobs=wire.LogprobRows(num_top=1, token_ids=[9, 5, 6, 6], logprobs=[-0.1, -2.5, -0.01, -0.01],
                                         ranks=[1, 2, 1, 1]),
               prompt_logprobs=[wire.PromptLogprobs(request_id="c", start=1, rows=wire.LogprobRows(
                   num_top=0, token_ids=[4, 8], logprobs=[-3.5, -0.25], ranks=[40, 1]))],
               stage_times=[0.01, 0.02]),
    StepResult(step_id=18, request_ids=[], token_ids=[], error="CUDA OOM on stage 1"),
    Heartbeat(rank=-1, t=1.7e9),
    Heartbeat(rank=3, t=1.7e9, stage_busy=wire.StageBusy(stage=1, busy_s=12.5)),
    Shutdown(reason="SIGTERM"),
    wire.AddRequest(request_id="r1", prompt_token_ids=[1, 2, 3], prompt="hi",
                    params=SamplingParams(temperature=0.5, stop=["\n"], seed=3)),
    wire.AbortRequest(request_id="r1"),
    wire.RequestUpdate(request_id="r1", token_ids=[4, 5], text="ab", finish_reason="stop",
                       stop_reason="\n", logprobs=[{4: (-0.1, 1)}, {5: (-0.2, 1), 6: (-1.5, 2)}],
                       prompt_logprobs=[None, {7: (-2.0, 3), 3: (-0.5, 1)}]),
    WorkerError(rank=2, message="Traceback ..."),
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg) and back == msg
    assert back.version == WIRE_VERSION


def test_every_message_type_is_covered():
    covered = {type(m) for m in ALL_MESSAGES}
    assert covered == set(wire.Message.__args__)


def test_version_is_on_the_wire():
    raw = msgspec.msgpack.decode(encode(Shutdown(reason="x")))
    assert raw == {"type": "Shutdown", "version": WIRE_VERSION, "reason": "x"}


def _reencoded(msg, **changes) -> bytes:
    raw = msgspec.msgpack.decode(encode(msg)) | changes
    return msgspec.msgpack.encode(raw)


def test_version_mismatch_raises():
    with pytest.raises(WireError, match=f"wire version {WIRE_VERSION + 1}"):
        decode(_reencoded(Heartbeat(rank=0, t=1.0), version=WIRE_VERSION + 1))


def test_version_reported_even_when_schema_changed():
    # A future version whose fields no longer validate must still be reported as a version error.
    data = _reencoded(StepPlan(step_id=1, seqs=[]), version=99, step_id="uuid-like")
    with pytest.raises(WireError, match="wire version 99"):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        b"not msgpack at all",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "NoSuchMessage", "version": WIRE_VERSION}),
        msgspec.msgpack.encode({"type": "Heartbeat", "version": WIRE_VERSION, "rank": "zero",
                                "t": 1.0}),
        msgspec.msgpack.encode({"type": "Shutdown", "version": WIRE_VERSION}),  # missing field
        encode(Heartbeat(rank=0, t=1.0))[:-3],  # truncated
    ],
)
def test_malformed_bytes_raise_wire_error(data):
    with pytest.raises(WireError):
        decode(data)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


def test_invariants_checked_on_construction_and_decode():
    with pytest.raises(ValueError, match="new_token_ids"):
        make_seq(num_tokens=2, new_token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        make_seq(block_table=[1], block_table_diff=[2])
    with pytest.raises(ValueError, match="exactly one"):
        make_seq(block_table=None)
    with pytest.raises(ValueError, match="sampling"):
        make_seq(needs_sample=True, sampling=None)
    with pytest.raises(ValueError, match="length"):
        StepResult(step_id=0, request_ids=["a"], token_ids=[])
    with pytest.raises(ValueError, match="prompt_logprobs"):  # targets need sampling.prompt_logprobs
        make_seq(needs_sample=False, prompt_logprob_targets=[1])
    with pytest.raises(ValueError, match="4 prompt_logprob_targets for 3"):
        make_seq(sampling=make_sampling(prompt_logprobs=0), prompt_logprob_targets=[1, 2, 3, 4])
    rows = wire.LogprobRows(num_top=1, token_ids=[3, 4], logprobs=[-0.5, -1.0], ranks=[1, 2])
    with pytest.raises(ValueError, match="logprobs and request_ids"):
        StepResult(step_id=0, request_ids=["a", "b"], token_ids=[4, 5], logprobs=rows)
    with pytest.raises(ValueError, match="rows of num_top"):
        wire.LogprobRows(num_top=2, token_ids=[3, 4], logprobs=[-0.5, -1.0], ranks=[1, 2])
    good = msgspec.msgpack.decode(encode(StepPlan(step_id=1, seqs=[make_seq(num_tokens=2)])))
    good["seqs"][0][3] = [1]  # new_token_ids no longer matches num_scheduled_tokens
    with pytest.raises(WireError, match="new_token_ids"):
        decode(msgspec.msgpack.encode(good))


def test_logprob_rows_entry_keeps_the_top_asked_for_then_the_own_token():
    # Two rows of num_top = 2: the own token outside the top (rank 7), then among it (rank 1).
    rows = wire.LogprobRows(num_top=2, token_ids=[9, 5, 3, 9, 5, 9], logprobs=[-0.1, -0.2, -4.0, -0.3, -0.4, -0.3],
                            ranks=[1, 2, 7, 1, 2, 1])
    assert rows.num_rows == 2
    assert rows.entry(0, 2) == {9: (-0.1, 1), 5: (-0.2, 2), 3: (-4.0, 7)}
    assert list(rows.entry(0, 1)) == [9, 3] and rows.entry(0, 0) == {3: (-4.0, 7)}
    assert rows.entry(1, 2) == {9: (-0.3, 1), 5: (-0.4, 2)}


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        Shutdown(reason="a").reason = "b"


def test_no_pickle_in_parallel_package():
    import pathlib

    for path in pathlib.Path(wire.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "_pyobj" not in text, path.name


def test_wire_and_transport_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, pipeserve.parallel.wire, pipeserve.parallel.transport; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# --- block tables: engine-side differ, worker-side mirror ---------------------------------


def _seq_for(request_id: str, full, diff) -> SeqPlan:
    return make_seq(request_id, block_table=full, block_table_diff=diff)


def test_differ_sends_full_then_diffs():
    differ, mirror = BlockTableDiffer(), BlockTableMirror()
    assert differ.plan_for("a", [1, 2]) == ([1, 2], None)
    assert differ.plan_for("a", [1, 2]) == (None, [])
    assert differ.plan_for("a", [1, 2, 3, 4]) == (None, [3, 4])
    differ.forget("a")  # preempted: restarts on new blocks
    assert differ.plan_for("a", [9]) == ([9], None)
    assert mirror.apply(_seq_for("a", [1, 2], None)) == [1, 2]
    assert mirror.apply(_seq_for("a", None, [3, 4])) == [1, 2, 3, 4]
    assert mirror.apply(_seq_for("a", [9], None)) == [9]  # full replaces


def test_differ_resends_full_when_table_does_not_extend():
    differ = BlockTableDiffer()
    differ.plan_for("a", [1, 2, 3])
    assert differ.plan_for("a", [1, 2]) == ([1, 2], None)  # shrank
    assert differ.plan_for("a", [1, 5, 6]) == ([1, 5, 6], None)  # last sent block changed


def test_mirror_rejects_diff_for_unknown_request():
    with pytest.raises(WireError, match="unknown request"):
        BlockTableMirror().apply(_seq_for("ghost", None, [1]))


def test_mirror_apply_plan_frees_first():
    mirror = BlockTableMirror()
    mirror.apply(_seq_for("a", [1], None))
    mirror.apply(_seq_for("b", [2], None))
    plan = StepPlan(step_id=1, seqs=[_seq_for("a", [5], None)], freed=["a", "b", "never-seen"])
    assert mirror.apply_plan(plan) == [[5]]
    assert "a" in mirror and "b" not in mirror and len(mirror) == 1


def test_differ_and_mirror_stay_in_sync_over_random_history():
    rng = random.Random(20240601)
    differ, mirror = BlockTableDiffer(), BlockTableMirror()
    truth: dict[str, list[int]] = {}  # the engine's block tables
    finished: list[str] = []  # freed in the next plan
    next_block = 0

    def new_blocks(n: int) -> list[int]:
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    for step in range(3000):
        op = rng.random()
        if op < 0.1 or not truth:  # admit
            truth[f"req-{step}"] = new_blocks(rng.randint(1, 4))
        elif op < 0.17:  # finish
            rid = rng.choice(sorted(truth))
            del truth[rid]
            differ.forget(rid)
            finished.append(rid)
        elif op < 0.22:  # preempt by recompute: same id, restarts on new blocks
            rid = rng.choice(sorted(truth))
            differ.forget(rid)
            truth[rid] = new_blocks(rng.randint(1, 3))
        else:  # decode/chunk growth
            rid = rng.choice(sorted(truth))
            truth[rid].extend(new_blocks(rng.choice([0, 0, 0, 1, 2])))
        scheduled = rng.sample(sorted(truth), k=min(len(truth), rng.randint(1, 5)))
        seqs = [_seq_for(r, *differ.plan_for(r, truth[r])) for r in scheduled]
        plan = decode(encode(StepPlan(step_id=step, seqs=seqs, freed=finished)))
        finished = []
        assert mirror.apply_plan(plan) == [truth[r] for r in scheduled], f"step {step}"
    mirror.apply_plan(StepPlan(step_id=-1, seqs=[], freed=finished))
    assert len(mirror) == sum(r in mirror for r in truth)  # finished ones never linger
