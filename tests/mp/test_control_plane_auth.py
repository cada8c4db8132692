"""The control plane against a local attacker: a process that knows the engine's ports (as
`ss -ltn` shows them to anyone on the node) but not the run's key. Real sockets on 127.0.0.1:
it cannot subscribe to plans, inject a message, or replay the bytes of a real worker's
connection; a member's garbage frame is dropped; every refusal is counted; the real worker
goes on being served."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import pytest
import zmq

from pipeserve.parallel.auth import KEY_ENV, KEY_FILE_ENV, RunKey, remove_key_file, secure_client, write_key_file
from pipeserve.parallel.transport import EngineChannel, TransportConfig, WorkerChannel
from pipeserve.parallel.wire import Heartbeat, SeqPlan, Shutdown, StepPlan, StepResult, WorkerError, encode

pytestmark = pytest.mark.timeout(60)


def config() -> TransportConfig:
    return TransportConfig(heartbeat_interval_s=0.2, liveness_timeout_s=5.0, handshake_timeout_s=10.0,
                           send_timeout_s=2.0)


def plan(step_id: int) -> StepPlan:
    seq = SeqPlan(request_id="r", num_computed_tokens=0, num_scheduled_tokens=2, new_token_ids=[1, 2],
                  block_table=[0], needs_sample=False, sampling=None)
    return StepPlan(step_id=step_id, seqs=[seq])


class Run:
    """An engine and one real worker (rank 0 of 1) that has shaken hands with it."""

    def __init__(self, result_endpoint: str | None = None) -> None:
        self.key = RunKey.generate()
        self.engine = EngineChannel(config(), world_size=1, key=self.key)
        self.worker = WorkerChannel(config(), rank=0, world_size=1, stage=0, tp_rank=0,
                                    plan_endpoint=self.engine.plan_endpoint,
                                    result_endpoint=result_endpoint or self.engine.result_endpoint, key=self.key)
        shaking = threading.Thread(target=self.worker.handshake, daemon=True)
        shaking.start()
        self.engine.handshake()
        shaking.join(timeout=10)

    def round_trip(self, step_id: int) -> None:
        """A plan reaches the worker unchanged and its result comes back, nothing else."""
        self.engine.send_plan(plan(step_id))
        got = self.worker.recv_plan(timeout_s=5.0)
        assert got == plan(step_id)
        self.worker.send(StepResult(step_id=step_id, request_ids=["r"], token_ids=[7]))
        assert self.engine.recv(timeout_s=5.0) == StepResult(step_id=step_id, request_ids=["r"], token_ids=[7])

    def close(self) -> None:
        self.worker.close(linger_s=0)
        self.engine.close()


@pytest.fixture
def run():
    r = Run()
    try:
        yield r
    finally:
        r.close()


def wait_rejected(engine: EngineChannel, at_least: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := engine.num_rejected) < at_least:
        assert time.monotonic() < deadline, f"{n} refusals counted, expected {at_least}"
        time.sleep(0.05)
    return n


def test_a_process_without_the_key_reads_nothing_and_injects_nothing(run):
    ctx = zmq.Context()
    stranger = RunKey.generate()
    try:
        spies = []
        for keyed in (False, True):  # plain ZeroMQ; CURVE with its own key and the engine's public key
            sub, pull = ctx.socket(zmq.SUB), ctx.socket(zmq.PULL)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            for sock, endpoint in ((sub, run.engine.plan_endpoint), (pull, run.engine.plan_endpoint),
                                   (pull, run.engine.result_endpoint)):
                if keyed:
                    secure_client(sock, stranger)
                    sock.curve_serverkey = run.key.public
                sock.connect(endpoint)
            spies += [sub, pull]
            push = ctx.socket(zmq.PUSH)
            if keyed:
                secure_client(push, stranger)
                push.curve_serverkey = run.key.public
            push.connect(run.engine.result_endpoint)
            for forged in (WorkerError(rank=0, message="forged failure"), Shutdown(reason="forged"),
                           StepResult(step_id=99, request_ids=["r"], token_ids=[666]),
                           Heartbeat(rank=0, t=0.0)):
                push.send(encode(forged), zmq.NOBLOCK)  # queued: it never gets a connection to leave on
            push.send(b"\x93garbage", zmq.NOBLOCK)
            spies.append(push)
        for step in range(5):
            run.round_trip(step)
        assert run.engine.recv(timeout_s=0.5) is None  # nothing forged arrived
        for spy in spies:
            if spy.type in (zmq.SUB, zmq.PULL):
                assert not spy.poll(200), "a spy read a frame"
        assert wait_rejected(run.engine, at_least=4) >= 4  # each refused connection attempt is counted
        assert run.engine.num_malformed == 0 and not run.engine.check_liveness()
    finally:
        ctx.destroy(linger=0)


def test_a_members_garbage_frame_is_dropped_and_counted(run):
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        secure_client(push, run.key)  # a process of the run itself, gone wrong
        push.connect(run.engine.result_endpoint)
        push.send(b"\xc1 not msgpack")
        deadline = time.monotonic() + 5.0
        while run.engine.num_malformed == 0:
            assert time.monotonic() < deadline
            run.engine.recv(timeout_s=0.05)
        run.round_trip(1)  # and the engine is none the worse
        assert run.engine.num_malformed == 1
    finally:
        ctx.destroy(linger=0)


class RecordingProxy:
    """A TCP relay in front of the engine's result port that keeps what each client sent."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent: list[bytearray] = []
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            record = bytearray()
            self.sent.append(record)
            threading.Thread(target=self._pipe, args=(client, upstream, record), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, None), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if record is not None:
                    record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closing = True
        self.listener.close()


def test_replayed_bytes_of_a_real_connection_are_refused():
    key = RunKey.generate()
    engine = EngineChannel(config(), world_size=1, key=key)
    proxy = RecordingProxy(int(engine.result_endpoint.rsplit(":", 1)[1]))
    run = None
    try:
        # A real worker whose results go through the relay, so its bytes can be replayed.
        run = Run.__new__(Run)
        run.key, run.engine = key, engine
        run.worker = WorkerChannel(config(), rank=0, world_size=1, stage=0, tp_rank=0,
                                   plan_endpoint=engine.plan_endpoint,
                                   result_endpoint=f"tcp://127.0.0.1:{proxy.port}", key=key)
        shaking = threading.Thread(target=run.worker.handshake, daemon=True)
        shaking.start()
        engine.handshake()
        shaking.join(timeout=10)
        for step in range(3):
            run.round_trip(step)
        recorded = [bytes(r) for r in proxy.sent if len(r) > 64]
        assert recorded, "the relay saw the worker's connections"
        before = engine.num_rejected
        for data in recorded:  # the attacker replays every captured connection, byte for byte
            with socket.create_connection(("127.0.0.1", int(engine.result_endpoint.rsplit(":", 1)[1]))) as s:
                s.settimeout(2.0)
                try:
                    s.sendall(data)
                    time.sleep(0.2)
                except OSError:
                    pass  # the engine hung up on it: refused
        assert engine.recv(timeout_s=0.5) is None  # no Hello, result or heartbeat replayed
        assert wait_rejected(engine, at_least=before + 1) > before
        run.round_trip(10)
    finally:
        if run is not None and hasattr(run, "worker"):
            run.worker.close(linger_s=0)
        proxy.close()
        engine.close()


def test_the_key_travels_in_the_environment_or_a_private_file():
    key = RunKey.generate()
    assert RunKey.from_env({KEY_ENV: key.secret.decode()}) == key
    assert RunKey.from_env({}) is None
    assert key.secret.decode() not in repr(key)
    path = write_key_file(key)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert RunKey.from_env({KEY_FILE_ENV: path}) == key
    finally:
        remove_key_file(path)
    assert not os.path.exists(os.path.dirname(path))
    with pytest.raises(ValueError, match="cannot read the control key file"):
        RunKey.from_env({KEY_FILE_ENV: path})
    for bad in ("short", "x" * 41):
        with pytest.raises(ValueError, match=KEY_ENV):
            RunKey.from_env({KEY_ENV: bad})
