"""The ZeroMQ control plane across real processes ("spawn") and real sockets on 127.0.0.1."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from zmq.utils import z85

from pipeserve.parallel.auth import RunKey
from pipeserve.parallel.transport import (
    EngineChannel,
    EngineShutdown,
    TransportConfig,
    TransportError,
    TransportTimeout,
    WorkerChannel,
)
from pipeserve.parallel.wire import SeqPlan, Shutdown, StepPlan, StepResult, WorkerError

# The same key in every spawned process (the run's key; the attacker tests make their own).
KEY = RunKey.from_secret(z85.encode(bytes(range(32))))
LIVENESS_S = 2.0
EXIT_SHUTDOWN, EXIT_ENGINE_LOST, EXIT_LOST_NO_CALLBACK, EXIT_LOST_BY_MISTAKE = 0, 3, 4, 5

pytestmark = pytest.mark.timeout(30)


def fast_config(**kw) -> TransportConfig:
    base = dict(heartbeat_interval_s=0.2, liveness_timeout_s=LIVENESS_S,
                handshake_timeout_s=20.0, send_timeout_s=5.0)
    return TransportConfig(**(base | kw))


# --- child process bodies (module level so "spawn" can import them) -----------------------


def echo_worker(rank, world_size, plan_endpoint, result_endpoint, delay_s=0.0, connected=None,
                busy_s=0.0):
    """Handshake, then answer every plan with a StepResult naming this rank; exit code tells why.

    ``busy_s``: time spent right after the handshake without reading plans (loading weights).
    """
    time.sleep(delay_s)
    lost = threading.Event()
    channel = WorkerChannel(fast_config(), rank=rank, world_size=world_size, stage=rank,
                            tp_rank=0, plan_endpoint=plan_endpoint,
                            result_endpoint=result_endpoint, on_engine_lost=lost.set, key=KEY)
    try:
        if connected is not None:
            connected.set()
        channel.handshake()
        time.sleep(busy_s)
        while channel.engine_alive():
            msg = channel.recv_plan(timeout_s=0.1)
            if isinstance(msg, Shutdown):
                sys.exit(EXIT_LOST_BY_MISTAKE if lost.is_set() else EXIT_SHUTDOWN)
            if isinstance(msg, StepPlan):
                channel.send(StepResult(step_id=msg.step_id, request_ids=[str(rank)],
                                        token_ids=[rank]))
        sys.exit(EXIT_ENGINE_LOST if lost.wait(1.0) else EXIT_LOST_NO_CALLBACK)
    finally:
        channel.close()


def engine_main(world_size, endpoints, handshake_done, run_s=30.0):
    """An engine that hands out its endpoints, handshakes, then idles (heartbeating)."""
    engine = EngineChannel(fast_config(), world_size, key=KEY)
    try:
        endpoints.put((engine.plan_endpoint, engine.result_endpoint))
        engine.handshake()
        handshake_done.set()
        deadline = time.monotonic() + run_s
        while time.monotonic() < deadline:
            engine.recv(timeout_s=0.1)
    finally:
        engine.close()


# --- helpers --------------------------------------------------------------------------------

CTX = mp.get_context("spawn")


def start(target, *args, **kwargs) -> mp.Process:
    proc = CTX.Process(target=target, args=args, kwargs=kwargs, daemon=True)
    proc.start()
    return proc


def stop_all(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
        proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=3)


def make_plan(step_id: int) -> StepPlan:
    seq = SeqPlan(request_id=f"r{step_id}", num_computed_tokens=step_id, num_scheduled_tokens=1,
                  new_token_ids=[step_id], block_table_diff=[], needs_sample=False, sampling=None)
    return StepPlan(step_id=step_id, seqs=[seq])


def collect_results(engine, count, timeout_s) -> dict[int, list[int]]:
    """step ids echoed back, per rank, in arrival order."""
    by_rank: dict[int, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while sum(map(len, by_rank.values())) < count:
        assert time.monotonic() < deadline, f"only got {by_rank}"
        msg = engine.recv(timeout_s=0.2)
        if isinstance(msg, StepResult):
            by_rank.setdefault(msg.token_ids[0], []).append(msg.step_id)
    return by_rank


# --- tests ----------------------------------------------------------------------------------


def test_staggered_workers_handshake_and_receive_every_plan_in_order():
    engine = EngineChannel(fast_config(), world_size=3, key=KEY)
    procs = []
    try:
        for rank, delay_s in enumerate((0.0, 0.3, 0.8)):
            procs.append(start(echo_worker, rank, 3, engine.plan_endpoint,
                               engine.result_endpoint, delay_s))
        hellos = engine.handshake()
        assert sorted(hellos) == [0, 1, 2]
        assert {h.pid for h in hellos.values()} == {p.pid for p in procs}
        for step_id in range(20):  # back to back: nothing may be dropped or reordered
            engine.send_plan(make_plan(step_id))
        by_rank = collect_results(engine, 60, timeout_s=10)
        assert by_rank == {rank: list(range(20)) for rank in range(3)}
        assert engine.check_liveness() == []
        engine.send_plan(Shutdown(reason="test done"))
        for proc in procs:
            proc.join(timeout=5)
            assert proc.exitcode == EXIT_SHUTDOWN
    finally:
        stop_all(procs)
        engine.close()


def test_killed_worker_is_reported_by_check_liveness():
    engine = EngineChannel(fast_config(), world_size=2, key=KEY)
    procs = []
    try:
        procs = [start(echo_worker, rank, 2, engine.plan_endpoint, engine.result_endpoint)
                 for rank in range(2)]
        engine.handshake()
        engine.send_plan(make_plan(0))
        collect_results(engine, 2, timeout_s=5)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not (dead := engine.check_liveness()):
            assert time.monotonic() - killed_at < LIVENESS_S + 1.0, "death not noticed"
            engine.recv(timeout_s=0.05)
        assert dead == [1]
        assert time.monotonic() - killed_at <= LIVENESS_S + 0.5
    finally:
        stop_all(procs)
        engine.close()


def test_worker_exits_by_itself_when_engine_is_killed():
    endpoints, handshake_done = CTX.Queue(), CTX.Event()
    procs = []
    try:
        procs.append(start(engine_main, 1, endpoints, handshake_done))
        plan_endpoint, result_endpoint = endpoints.get(timeout=15)
        worker = start(echo_worker, 0, 1, plan_endpoint, result_endpoint)
        procs.append(worker)
        assert handshake_done.wait(timeout=15)
        time.sleep(0.5)  # a few engine heartbeats reach the worker
        assert worker.is_alive()
        os.kill(procs[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        worker.join(timeout=LIVENESS_S + 4.0)
        assert worker.exitcode == EXIT_ENGINE_LOST, "worker did not notice the engine's death"
        # Detection happens at LIVENESS_S; the rest is the worker closing its sockets and exiting.
        assert time.monotonic() - killed_at < LIVENESS_S + 3.0
    finally:
        stop_all(procs)


def test_handshake_timeout_names_missing_rank_and_keeps_early_workers_alive():
    # Longer than the liveness timeout: rank 0, busy right after its handshake, must keep
    # hearing engine heartbeats while the engine still waits for rank 1.
    engine = EngineChannel(fast_config(handshake_timeout_s=LIVENESS_S + 1.0), world_size=2, key=KEY)
    connected = CTX.Event()
    procs = []
    try:
        procs.append(start(echo_worker, 0, 2, engine.plan_endpoint, engine.result_endpoint,
                           connected=connected, busy_s=LIVENESS_S + 1.0))
        assert connected.wait(timeout=15)  # rank 0 is up; rank 1 never comes
        with pytest.raises(TransportTimeout, match=r"rank\(s\) \[1\] of 2"):
            engine.handshake()
        assert sorted(engine.hellos) == [0]
        engine.send_plan(Shutdown(reason="handshake failed"))
        procs[0].join(timeout=5)
        assert procs[0].exitcode == EXIT_SHUTDOWN
    finally:
        stop_all(procs)
        engine.close()


def test_worker_handshake_times_out_without_engine():
    channel = WorkerChannel(fast_config(handshake_timeout_s=0.3), rank=0, world_size=1, stage=0,
                            tp_rank=0, plan_endpoint="tcp://127.0.0.1:9",
                            result_endpoint="tcp://127.0.0.1:9", key=KEY)
    try:
        started = time.monotonic()
        with pytest.raises(TransportTimeout, match="no Ready"):
            channel.handshake()
        assert time.monotonic() - started < 2.0
        assert channel.recv_plan(timeout_s=0.05) is None
    finally:
        channel.close()


def test_a_worker_waiting_for_ready_leaves_on_shutdown():
    """The engine stops during start-up (its Shutdown, no Ready): the waiting worker leaves at
    once, not at its handshake timeout."""
    engine = EngineChannel(fast_config(), world_size=1, key=KEY)
    channel = WorkerChannel(fast_config(handshake_timeout_s=20.0), rank=0, world_size=1, stage=0, tp_rank=0,
                            plan_endpoint=engine.plan_endpoint, result_endpoint=engine.result_endpoint, key=KEY)
    outcome = []
    waiting = threading.Thread(target=lambda: outcome.append(_raised(channel.handshake)), daemon=True)
    try:
        waiting.start()
        started = time.monotonic()
        while waiting.is_alive() and time.monotonic() - started < 5.0:  # until its subscription is live
            engine.send_plan(Shutdown(reason="stopped during start-up"))
            waiting.join(timeout=0.1)
        assert outcome and isinstance(outcome[0], EngineShutdown), outcome
        assert "stopped during start-up" in str(outcome[0])
        assert time.monotonic() - started < 5.0
    finally:
        channel.close()
        engine.close()


def test_a_worker_watching_start_up_hands_its_subscription_to_the_handshake():
    """A worker subscribed while it loads (``watch_start_up``), the engine already publishing its
    Ready: the handshake takes the subscription over and completes, the Hello carries what the
    worker reported once loaded, and nothing took the Ready copies for a Shutdown."""
    engine = EngineChannel(fast_config(), world_size=1, key=KEY)
    channel = WorkerChannel(fast_config(), rank=0, world_size=1, stage=0, tp_rank=0, key=KEY,
                            plan_endpoint=engine.plan_endpoint, result_endpoint=engine.result_endpoint)
    stopped, hellos = [], []
    try:
        channel.watch_start_up(stopped.append)
        engine_side = threading.Thread(target=lambda: hellos.append(engine.handshake()), daemon=True)
        engine_side.start()
        time.sleep(0.5)  # "loading" while the engine repeats its Ready
        channel.loaded(num_kv_blocks=77)
        channel.handshake()
        engine_side.join(timeout=10)
        assert hellos and hellos[0][0].num_kv_blocks == 77 and stopped == []
    finally:
        channel.close()
        engine.close()


# A worker that subscribes (``watch_start_up``) and then "loads" for ever; the engine's
# endpoints are its arguments.
_LOADING_WORKER = """
import os, sys, time
from zmq.utils import z85
from pipeserve.parallel.auth import RunKey
from pipeserve.parallel.transport import TransportConfig, WorkerChannel

def stopped(reason):
    print("left: " + reason, flush=True)
    os._exit(0)

channel = WorkerChannel(TransportConfig(handshake_timeout_s=60.0), rank=0, world_size=1, stage=0, tp_rank=0,
                        plan_endpoint=sys.argv[1], result_endpoint=sys.argv[2],
                        key=RunKey.from_secret(z85.encode(bytes(range(32)))))
channel.watch_start_up(stopped)
print("loading", flush=True)
while True:
    time.sleep(1)
"""


def test_a_worker_still_loading_leaves_on_shutdown():
    """The engine stops while a worker still loads (under an outer torchrun nothing else would
    end it): the worker, subscribed before it loaded, leaves on the Shutdown at once (exit 0,
    naming the reason), not after loading and its handshake's timeout."""
    engine = EngineChannel(fast_config(), world_size=1, key=KEY)
    worker = subprocess.Popen([sys.executable, "-c", _LOADING_WORKER, engine.plan_endpoint, engine.result_endpoint],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "loading"
        started = time.monotonic()
        while worker.poll() is None and time.monotonic() - started < 10.0:  # until its subscription is live
            engine.send_plan(Shutdown(reason="stopped while rank 0 loaded"))
            time.sleep(0.1)
        assert worker.wait(timeout=5) == 0
        assert worker.stdout.readline().strip() == "left: stopped while rank 0 loaded"
    finally:
        worker.kill()
        engine.close()


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 (the test inspects it)
        return e
    return None


# A worker waiting for an engine that never comes (nothing listens at port 9), and the process
# that starts it and prints its pid; the worker notes its parent first, "loads" until the file
# named second exists, then waits for the engine and writes why it left to the file named last.
_WAITING_WORKER = """
import os, sys, time
from zmq.utils import z85
from pipeserve.parallel.auth import RunKey
from pipeserve.parallel.transport import LauncherGone, TransportConfig, WorkerChannel
parent = os.getppid()
print("loading", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
channel = WorkerChannel(TransportConfig(handshake_timeout_s=60.0), rank=0, world_size=1, stage=0, tp_rank=0,
                        plan_endpoint="tcp://127.0.0.1:9", result_endpoint="tcp://127.0.0.1:9",
                        key=RunKey.from_secret(z85.encode(bytes(range(32)))), parent_pid=parent)
print("waiting", flush=True)
try:
    channel.handshake()
except LauncherGone as e:
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(e))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])  # whole, for the test that polls for it
    sys.exit(7)
finally:
    channel.close()
"""
_LAUNCHER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(worker.pid, flush=True)
worker.wait()
"""


@pytest.mark.parametrize("killed_while", ["waiting", "loading"])
def test_a_worker_whose_launcher_dies_leaves_the_handshake(tmp_path, killed_while):
    """torchrun killed while its workers wait for the engine's Ready (the engine stopped during
    start-up), or while they still load: they leave within a second of the handshake's start,
    not after its timeout (60 s here), so no orphan holds a Slurm job."""
    loaded, marker = tmp_path / "loaded", tmp_path / "left"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WAITING_WORKER, str(loaded), str(marker)],
                                stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "loading"
        if killed_while == "waiting":
            loaded.touch()
            assert launcher.stdout.readline().strip() == "waiting"  # the worker is in its handshake
        launcher.kill()
        launcher.wait(timeout=5)
        loaded.touch()
        deadline = time.monotonic() + 10.0
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the orphaned worker is still waiting for the engine"
        assert f"pid {launcher.pid}) exited before the engine's Ready" in marker.read_text()
    finally:
        launcher.kill()
        try:
            os.kill(worker_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_world_size_mismatch_is_rejected():
    engine = EngineChannel(fast_config(handshake_timeout_s=10), world_size=1, key=KEY)
    procs = []
    try:
        procs.append(start(echo_worker, 1, 2, engine.plan_endpoint, engine.result_endpoint))
        started = time.monotonic()
        with pytest.raises(TransportError, match="rank 1 failed during start-up.*world_size 2"):
            engine.handshake()
        assert time.monotonic() - started < 8.0  # the worker's WorkerError, not the timeout
    finally:
        stop_all(procs)
        engine.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::"])
def test_all_interfaces_needs_explicit_opt_in(host):
    with pytest.raises(ValueError, match="allow_all_interfaces"):
        TransportConfig(host=host)
    assert TransportConfig(host=host, allow_all_interfaces=True).host == host


@pytest.mark.parametrize(
    "kwargs",
    [
        {"plan_port": -1},
        {"result_port": 70000},
        {"heartbeat_interval_s": 0},
        {"liveness_timeout_s": 0.5, "heartbeat_interval_s": 1.0},
        {"handshake_timeout_s": -1},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        TransportConfig(**kwargs)


def test_endpoints_are_loopback_and_fixed_ports_are_honoured():
    engine = EngineChannel(TransportConfig(), world_size=1, key=KEY)
    try:
        assert engine.plan_endpoint.startswith("tcp://127.0.0.1:")
        assert engine.result_endpoint.startswith("tcp://127.0.0.1:")
        assert engine.plan_endpoint != engine.result_endpoint
        port = int(engine.plan_endpoint.rsplit(":", 1)[1])
    finally:
        engine.close()
    fixed = EngineChannel(TransportConfig(plan_port=port), world_size=1, key=KEY)
    try:
        assert fixed.plan_endpoint.endswith(f":{port}")
    finally:
        fixed.close()


def test_heartbeats_carry_stage_busy_time():
    engine = EngineChannel(fast_config(), world_size=2, key=KEY)
    busy = [0.0]
    workers = [WorkerChannel(fast_config(), rank=rank, world_size=2, stage=rank, tp_rank=0,
                             plan_endpoint=engine.plan_endpoint, result_endpoint=engine.result_endpoint, key=KEY)
               for rank in range(2)]
    for rank, w in enumerate(workers):
        w.loaded(num_kv_blocks=0, busy_s=(lambda: busy[0]) if rank == 1 else None)
    threads = [threading.Thread(target=w.handshake, daemon=True) for w in workers]
    try:
        for t in threads:
            t.start()
        engine.handshake()
        for t in threads:
            t.join(timeout=5)
        busy[0] = 2.5  # the next heartbeat of stage 1 carries it
        deadline = time.monotonic() + 5.0
        while engine.stage_busy_s.get(1) != 2.5:
            assert time.monotonic() < deadline, engine.stage_busy_s
            engine.recv(timeout_s=0.05)
        assert 0 not in engine.stage_busy_s  # a worker without busy_s reports none
    finally:
        for w in workers:
            w.close()
        engine.close()


def _handshaken(world_size=1):
    engine = EngineChannel(fast_config(), world_size=world_size, key=KEY)
    worker = WorkerChannel(fast_config(), rank=0, world_size=world_size, stage=0, tp_rank=0,
                           plan_endpoint=engine.plan_endpoint, result_endpoint=engine.result_endpoint, key=KEY)
    t = threading.Thread(target=worker.handshake, daemon=True)
    t.start()
    engine.handshake()
    t.join(timeout=5)
    return engine, worker


def test_send_later_leaves_the_worker_free_for_the_next_plan_and_keeps_order():
    """A result still waiting (its ids on their way from the device) goes out from the sender
    thread once ready; meanwhile the worker's own thread receives the next plan."""
    engine, worker = _handshaken()
    device_done = threading.Event()

    def waiting_result():
        assert device_done.wait(10.0)
        return StepResult(step_id=0, request_ids=["a"], token_ids=[7])

    try:
        worker.send_later(waiting_result)
        worker.send_later(lambda: StepResult(step_id=1, request_ids=["a"], token_ids=[8]))
        engine.send_plan(make_plan(2))
        assert isinstance(worker.recv_plan(timeout_s=5.0), StepPlan)  # not held up by step 0
        assert engine.recv(timeout_s=0.2) is None  # nothing left before step 0 is ready
        device_done.set()
        got = []
        deadline = time.monotonic() + 5.0
        while len(got) < 2:
            assert time.monotonic() < deadline, got
            if isinstance(msg := engine.recv(timeout_s=0.1), StepResult):
                got.append((msg.step_id, msg.token_ids))
        assert got == [(0, [7]), (1, [8])]
        worker.flush_sends()
        worker.send_later(lambda: StepResult(step_id=3, request_ids=[], token_ids=[]))  # a new sender
        worker.flush_sends()
        while not isinstance(msg := engine.recv(timeout_s=1.0), StepResult):
            assert msg is not None
        assert msg.step_id == 3
    finally:
        worker.close()
        engine.close()


def test_a_result_that_fails_reaches_the_engine_as_a_worker_error():
    engine, worker = _handshaken()

    def failing():
        raise RuntimeError("CUDA error: an illegal memory access")

    try:
        worker.send_later(failing)
        worker.send_later(lambda: StepResult(step_id=1, request_ids=[], token_ids=[]))  # dropped
        while (msg := engine.recv(timeout_s=5.0)) is not None and not isinstance(msg, WorkerError):
            pass
        assert isinstance(msg, WorkerError) and "illegal memory access" in msg.message
        with pytest.raises(TransportError, match="sending a result failed: RuntimeError"):
            worker.flush_sends()
        with pytest.raises(TransportError, match="illegal memory access"):
            worker.send_later(lambda: StepResult(step_id=2, request_ids=[], token_ids=[]))
        assert engine.recv(timeout_s=0.3) is None  # nothing after the error
    finally:
        worker.close()
        engine.close()


def test_a_sender_that_cannot_start_fails_the_worker_loop():
    """A sender thread whose socket cannot be made (here: a malformed endpoint) cannot tell
    the engine; the worker's loop learns it from check_sender and fails instead of leaving the
    engine waiting for the result."""
    engine, worker = _handshaken()
    try:
        worker.result_endpoint = "tcp://no such host"
        worker.send_later(lambda: StepResult(step_id=0, request_ids=[], token_ids=[]))
        deadline = time.monotonic() + 5.0
        while True:
            try:
                worker.check_sender()
            except TransportError as e:
                assert "sending a result failed" in str(e)
                break
            assert time.monotonic() < deadline, "the sender's failure went unnoticed"
            time.sleep(0.01)
        with pytest.raises(TransportError):
            worker.send_later(lambda: StepResult(step_id=1, request_ids=[], token_ids=[]))
    finally:
        worker.close()
        engine.close()


def test_a_result_stuck_on_its_device_does_not_hang_shutdown():
    """flush_sends gives up on a result that never becomes ready, and close() leaves that
    thread behind rather than waiting for it (nothing else would end the process)."""
    engine, worker = _handshaken()
    device_hung = threading.Event()
    try:
        worker.send_later(lambda: device_hung.wait(30.0) and StepResult(step_id=0, request_ids=[], token_ids=[]))
        with pytest.raises(TransportTimeout, match="results not sent within 0.2s"):
            worker.flush_sends(timeout_s=0.2)
        started = time.monotonic()
        worker.close(linger_s=0.1)
        assert time.monotonic() - started < 3.0
    finally:
        device_hung.set()
        engine.close()
