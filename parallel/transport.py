"""ZeroMQ control plane between the engine and the workers: handshake, plans, liveness.

Sockets (LINGER 0, except that a closing worker gives its last results a bounded moment to
leave; every receive polls with a timeout and every send has a timeout: nothing blocks
forever):

- engine PUB  (``plan_endpoint``)   → every worker's SUB: ``Ready``, ``StepPlan``, ``Shutdown``
  under topic ``P``; the engine's own ``Heartbeat`` under topic ``H``.
- engine PULL (``result_endpoint``) ← every worker's PUSH: ``Hello``, ``StepResult``,
  ``WorkerError``, and ``Heartbeat`` from each worker's heartbeat thread (own PUSH socket);
  a stage's TP rank 0 puts its busy time on its heartbeats (``EngineChannel.stage_busy_s``);
  a worker's results may also leave from its sender thread (own PUSH socket,
  ``WorkerChannel.send_later``), so a result waiting for the device holds up no plan.

Handshake. PUB silently drops what it publishes before a subscriber's subscription has
arrived, so the engine publishes ``Ready`` every ~50 ms, and a worker sends ``Hello`` only
after its SUB socket has received one. Hence when ``EngineChannel.handshake()`` returns (a
``Hello`` from every rank) every worker's subscription is live, and PUB/SUB over TCP delivers
the plans that follow to all of them, in order. The plan socket never drops silently either:
it is set to block (bounded) instead when a worker falls behind by a whole high-water mark.
A worker waiting for ``Ready`` leaves at once when the engine publishes ``Shutdown`` instead
(it stopped during start-up: ``EngineShutdown``) or when the process that started the worker
(torchrun, or the engine) has exited (``LauncherGone``), not at the handshake's timeout.

Authentication. Every socket speaks CURVE with the run's key (``parallel.auth``): the engine's
two sockets are servers that admit only holders of that key, so no other process can read a
plan or send a message; what fails the handshake is counted (``num_rejected``), and a frame
from a member that does not decode is dropped and counted (``num_malformed``).

Liveness. Each worker runs a thread that pushes a ``Heartbeat`` every
``heartbeat_interval_s`` and watches the engine's heartbeats on its own SUB socket (topic
``H`` only), so a worker stuck in a collective still learns that the engine died
(``on_engine_lost``). The engine publishes its heartbeat from ``send_plan``/``recv``/``tick``.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from pipeserve.parallel.auth import Guard, RunKey, secure_client
from pipeserve.parallel.wire import (
    ENGINE_RANK,
    Heartbeat,
    Hello,
    Message,
    Ready,
    Shutdown,
    StageBusy,
    StepPlan,
    StepResult,
    WireError,
    WorkerError,
    decode,
    encode,
)

_PLAN_TOPIC = b"P"
_HEARTBEAT_TOPIC = b"H"
_READY_INTERVAL_S = 0.05
_POLL_SLICE_S = 0.05  # longest a background thread waits before it checks for stop
_FAILED_WORDS_S = 0.5  # how long the engine waits for a failed worker's WorkerError
# Messages a slow subscriber may have queued before the engine blocks (never drops) on it;
# the pipeline keeps at most `pp` plans in flight, so reaching this means a stuck worker.
_HIGH_WATER_MARK = 10_000
ALL_INTERFACES = ("0.0.0.0", "*", "::", "")
"""Host values that mean every interface of the machine."""


class TransportError(RuntimeError):
    """The control plane failed: a peer misbehaved, or a send could not complete."""


class TransportTimeout(TransportError, TimeoutError):
    """A bounded wait of the control plane ran out."""


class EngineShutdown(TransportError):
    """The engine shut down before its handshake with this worker: nothing to serve."""


class LauncherGone(TransportError):
    """The process that started this worker exited while the worker waited for the engine."""


_PARENT_CHECK_S = 0.5  # how often a worker waiting for Ready looks for its parent


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """Where the engine binds and how fast both sides give up on each other."""

    host: str = "127.0.0.1"
    """Address the engine binds. Loopback by default: only a run across nodes needs more."""

    advertise_host: str | None = None
    """Address workers connect to (multi-node: the engine node's name or IP). Defaults to
    ``host``, or to this machine's hostname when ``host`` is a wildcard."""

    allow_all_interfaces: bool = False
    """Permit a wildcard ``host`` ("0.0.0.0", "*", "::"), which offers the control plane's
    ports (authenticated, encrypted) to every network the machine is on."""

    plan_port: int = 0
    """TCP port of the plan PUB socket; 0 picks a free one."""

    result_port: int = 0
    """TCP port of the PULL socket for everything workers send; 0 picks a free one."""

    heartbeat_interval_s: float = 1.0
    """Period of heartbeats, both directions."""

    liveness_timeout_s: float = 10.0
    """A peer silent for this long counts as dead."""

    handshake_timeout_s: float = 60.0
    """Longest wait for every worker (engine side) or for the engine (worker side) to show up.
    Workers should handshake before loading weights: heartbeats cover the loading time."""

    send_timeout_s: float = 30.0
    """Longest a send may block on a peer that stopped reading before raising."""

    def __post_init__(self) -> None:
        if self.host in ALL_INTERFACES and not self.allow_all_interfaces:
            raise ValueError(
                f"host={self.host!r} offers the control plane on every interface; bind a "
                "specific address or set allow_all_interfaces=True"
            )
        for name in ("plan_port", "result_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("heartbeat_interval_s", "liveness_timeout_s", "handshake_timeout_s",
                     "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("liveness_timeout_s must exceed heartbeat_interval_s")


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


def _advertised(config: TransportConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    return socket.gethostname() if config.host in ALL_INTERFACES else config.host


def _make_socket(ctx: zmq.Context, kind: int, *, send_timeout_s: float | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # harmless for IPv4; needed to reach "::1"-style hosts
    sock.setsockopt(zmq.SNDHWM, _HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, _HIGH_WATER_MARK)
    if send_timeout_s is not None:
        sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
    return sock


def _send(sock: zmq.Socket, frames: list[bytes], what: str) -> None:
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        raise TransportTimeout(f"{what}: the peer stopped reading (send timed out)") from None


def _poll(sock: zmq.Socket, timeout_s: float) -> bool:
    return bool(sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))


class EngineChannel:
    """The engine's end: publishes plans to every worker, collects what workers send.

    Workers treat an engine silent for ``liveness_timeout_s`` as dead, so the engine loop
    must call ``send_plan``, ``recv`` or ``tick`` more often than that (each publishes the
    engine heartbeat when it is due).
    """

    def __init__(self, config: TransportConfig, world_size: int, *, key: RunKey) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self.key = key
        self.session = uuid.uuid4().hex
        self.hellos: dict[int, Hello] = {}
        self.num_malformed = 0
        """Frames from an authenticated peer that did not decode (dropped)."""
        self._ctx = zmq.Context()
        self._guard = Guard(self._ctx, key)
        self._pub = _make_socket(self._ctx, zmq.PUB, send_timeout_s=config.send_timeout_s)
        self._pub_lock = threading.Lock()
        self._stopping = threading.Event()
        self._beat_thread: threading.Thread | None = None
        # Block (bounded by SNDTIMEO) rather than silently drop a plan for a slow worker.
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pull = _make_socket(self._ctx, zmq.PULL)
        self._guard.serve(self._pub)
        self._guard.serve(self._pull)
        try:
            plan_port = self._bind(self._pub, config.plan_port)
            result_port = self._bind(self._pull, config.result_port)
        except zmq.ZMQError:
            self.close()
            raise
        host = _tcp(_advertised(config))
        self.plan_endpoint = f"{host}:{plan_port}"
        self.result_endpoint = f"{host}:{result_port}"
        self._inbox: deque[Message] = deque()
        self._last_seen = {rank: time.monotonic() for rank in range(world_size)}
        self._last_heartbeat = 0.0
        self._result_rank: int | None = None  # known after the handshake
        self.stage_busy_s: dict[int, float] = {}
        """Stage → its busy seconds so far, from the latest heartbeat of its TP rank 0."""

    @property
    def num_rejected(self) -> int:
        """Connections refused so far: they did not prove they hold the run's key."""
        return self._guard.num_rejected

    def worker_env(self) -> dict[str, str]:
        """What a worker's environment needs to reach this engine: its endpoints and the key."""
        return dict(self.key.env(), PIPESERVE_PLAN_ENDPOINT=self.plan_endpoint,
                    PIPESERVE_RESULT_ENDPOINT=self.result_endpoint)

    def _bind(self, sock: zmq.Socket, port: int) -> int:
        address = _tcp(self.config.host)
        if port == 0:
            return sock.bind_to_random_port(address)
        sock.bind(f"{address}:{port}")
        return port

    def handshake(self, failed: Callable[[], str | None] | None = None) -> dict[int, Hello]:
        """Wait until every rank has said ``Hello``; return the hellos by rank.

        Raises ``TransportTimeout`` naming the missing ranks after ``handshake_timeout_s``,
        and ``TransportError`` if a worker reports an error or a wrong world size, or if
        ``failed()`` (polled while waiting, e.g. "did the worker processes exit?") returns a
        reason.
        """
        deadline = time.monotonic() + self.config.handshake_timeout_s
        ready = [_PLAN_TOPIC, encode(Ready(session=self.session, world_size=self.world_size))]
        next_ready = 0.0
        while len(self.hellos) < self.world_size:
            if failed is not None and (reason := failed()):
                # A worker that failed while loading says why before it exits: prefer its words.
                _poll(self._pull, _FAILED_WORDS_S)
                self._drain()
                self._take_hellos()  # raises on a WorkerError
                raise TransportError(f"workers failed during start-up: {reason}")
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(self.world_size)) - set(self.hellos))
                raise TransportTimeout(
                    f"handshake timed out after {self.config.handshake_timeout_s:g}s: "
                    f"no Hello from rank(s) {missing} of {self.world_size}"
                )
            if now >= next_ready:
                self._publish(ready, "publish Ready")
                next_ready = now + _READY_INTERVAL_S
            self.tick()  # workers that are already through watch for engine heartbeats
            if _poll(self._pull, min(next_ready, deadline) - now):
                self._drain()
                self._take_hellos()
        self._result_rank = self._find_result_rank()
        return dict(self.hellos)

    def _take_hellos(self) -> None:
        """Accept the ``Hello``s in the inbox; fail fast on a ``WorkerError``; keep the rest."""
        kept: deque[Message] = deque()
        for msg in self._inbox:
            if isinstance(msg, Hello):
                self._accept_hello(msg)
            elif isinstance(msg, WorkerError):
                raise TransportError(f"rank {msg.rank} failed during start-up: {msg.message}")
            else:
                kept.append(msg)
        self._inbox = kept

    def _accept_hello(self, hello: Hello) -> None:
        if hello.world_size != self.world_size or not 0 <= hello.rank < self.world_size:
            raise TransportError(
                f"Hello from rank {hello.rank} with world_size {hello.world_size}; "
                f"the engine expects {self.world_size} ranks"
            )
        self.hellos[hello.rank] = hello

    def _find_result_rank(self) -> int | None:
        """The rank that sends ``StepResult``s (last stage, TP rank 0), which carry no rank."""
        last_stage = max(hello.stage for hello in self.hellos.values())
        ranks = [h.rank for h in self.hellos.values() if h.stage == last_stage and h.tp_rank == 0]
        return min(ranks, default=None)

    def _read(self) -> Message | None:
        """Decode one pending message and note that its sender is alive (None: malformed, dropped)."""
        try:
            msg = decode(self._pull.recv(zmq.NOBLOCK))
        except WireError:
            self.num_malformed += 1
            return None
        rank = self._result_rank if isinstance(msg, StepResult) else getattr(msg, "rank", None)
        if rank in self._last_seen:
            self._last_seen[rank] = time.monotonic()
        if isinstance(msg, Heartbeat) and msg.stage_busy is not None:
            self.stage_busy_s[msg.stage_busy.stage] = msg.stage_busy.busy_s
        return msg

    def send_plan(self, plan: StepPlan | Shutdown) -> None:
        """Publish one plan (or a ``Shutdown``) to every worker."""
        self._publish([_PLAN_TOPIC, encode(plan)], "publish plan")
        self.tick()

    def _publish(self, frames: list[bytes], what: str) -> None:
        # The heartbeat thread shares the PUB socket: the lock serializes every use of it
        # (and is the memory barrier ZeroMQ asks for when a socket changes threads).
        with self._pub_lock:
            _send(self._pub, frames, what)

    def tick(self) -> None:
        """Publish the engine heartbeat if one is due; an idle engine loop calls this."""
        with self._pub_lock:
            now = time.monotonic()
            if now - self._last_heartbeat >= self.config.heartbeat_interval_s:
                beat = Heartbeat(rank=ENGINE_RANK, t=time.time())
                _send(self._pub, [_HEARTBEAT_TOPIC, encode(beat)], "publish heartbeat")
                self._last_heartbeat = now

    def start_heartbeats(self) -> None:
        """Keep publishing the engine heartbeat from a thread, so workers stay up while the
        process that owns the engine does something else (a user script between generate
        calls, a long model load); it stops at close()."""
        if self._beat_thread is not None:
            return

        def beat() -> None:
            while not self._stopping.wait(self.config.heartbeat_interval_s / 2):
                try:
                    self.tick()
                except (TransportError, zmq.ZMQError):
                    return

        self._beat_thread = threading.Thread(target=beat, name="pipeserve-engine-heartbeat", daemon=True)
        self._beat_thread.start()

    def recv(self, timeout_s: float) -> Message | None:
        """Next message from any worker, or ``None`` after ``timeout_s``.

        Heartbeats are consumed here (they only feed ``check_liveness``); the engine heartbeat
        keeps going while this waits.
        """
        deadline = time.monotonic() + timeout_s
        while not self._inbox:
            self.tick()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            wait = min(remaining, self.config.heartbeat_interval_s)
            if _poll(self._pull, wait):
                self._drain()
        return self._inbox.popleft()

    def _drain(self) -> None:
        """Read everything pending without waiting."""
        while self._pull.poll(0, zmq.POLLIN):
            msg = self._read()
            if msg is not None and not isinstance(msg, Heartbeat):
                self._inbox.append(msg)

    def check_liveness(self) -> list[int]:
        """Ranks whose last message (of any kind) is older than ``liveness_timeout_s``."""
        self._drain()  # count heartbeats queued while the engine was busy
        cutoff = time.monotonic() - self.config.liveness_timeout_s
        return [rank for rank, seen in self._last_seen.items() if seen < cutoff]

    def close(self) -> None:
        """Close both sockets without waiting for unsent messages."""
        self._stopping.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=5.0)
        self._guard.close()
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


class WorkerChannel:
    """A worker's end: receives plans, sends results, heartbeats, and watches the engine.

    ``on_engine_lost`` (optional) is called once, from the heartbeat thread, when the engine
    has been silent for ``liveness_timeout_s``; a worker blocked in a collective can use it to
    exit (e.g. ``os._exit``). ``engine_alive()`` reports the same condition to a polling loop.
    What its ``Hello`` and heartbeats report once it has loaded comes with ``loaded``.
    ``parent_pid``: the process
    that started this one, as it was when this process began (default: the parent now); once
    this process's parent is another, the handshake gives up (``LauncherGone``).
    """

    def __init__(
        self,
        config: TransportConfig,
        *,
        rank: int,
        world_size: int,
        stage: int,
        tp_rank: int,
        plan_endpoint: str,
        result_endpoint: str,
        key: RunKey,
        on_engine_lost: Callable[[], None] | None = None,
        parent_pid: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.config = config
        self.hello = Hello(rank=rank, world_size=world_size, stage=stage, tp_rank=tp_rank,
                           pid=os.getpid(), hostname=socket.gethostname())
        self.plan_endpoint = plan_endpoint
        self.result_endpoint = result_endpoint
        self.key = key
        self.session: str | None = None
        self._on_engine_lost = on_engine_lost
        self._busy_s: Callable[[], float] | None = None
        # torchrun or the engine; another parent later: it has exited
        self._parent = os.getppid() if parent_pid is None else parent_pid
        self._ctx = zmq.Context()
        self._sub = self._client(zmq.SUB, plan_endpoint, subscribe=_PLAN_TOPIC)
        self._push = self._client(zmq.PUSH, result_endpoint, send_timeout_s=config.send_timeout_s)
        self._engine_seen = time.monotonic()  # written by both threads; a float store is atomic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sends: queue.SimpleQueue[Callable[[], Message] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._sender_error: Exception | None = None
        self._watcher: threading.Thread | None = None
        self._watch_stop = threading.Event()

    @property
    def rank(self) -> int:
        return self.hello.rank

    def watch_start_up(self, on_shutdown: Callable[[str], None]) -> None:
        """Until ``handshake``, read the engine's messages from a thread while this process does
        something else (loads its model), and call ``on_shutdown(reason)`` on a ``Shutdown``:
        an engine that stops during start-up sends one, and a subscription made only for the
        handshake, after a load of minutes, would come too late for it. ``on_shutdown`` is
        expected to end the process (a worker inside a collective cannot be interrupted);
        copies of ``Ready`` read meanwhile are dropped (the engine repeats it until every rank
        has said Hello)."""
        assert self._watcher is None and self.session is None, "watch_start_up before the handshake, once"

        def watch() -> None:
            while not self._watch_stop.is_set():
                if _poll(self._sub, _POLL_SLICE_S) and isinstance(msg := self._read(), Shutdown):
                    on_shutdown(msg.reason)
                    return

        self._watcher = threading.Thread(target=watch, name=f"pipeserve-start-up-{self.rank}", daemon=True)
        self._watcher.start()

    def loaded(self, *, num_kv_blocks: int, busy_s: Callable[[], float] | None = None) -> None:
        """What this rank reports, known once it has loaded: its KV blocks (in its ``Hello``)
        and, a stage's TP rank 0, ``busy_s``, called from the heartbeat thread for the stage's
        busy seconds so far, which every heartbeat then carries. Before ``handshake``."""
        self.hello = msgspec.structs.replace(self.hello, num_kv_blocks=num_kv_blocks)
        self._busy_s = busy_s

    def _stop_watching(self) -> None:
        """The start-up watcher hands the subscription back (sockets may change threads once
        the one leaving is done with them)."""
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def _client(self, kind: int, endpoint: str, *, subscribe: bytes | None = None,
                send_timeout_s: float | None = None) -> zmq.Socket:
        sock = _make_socket(self._ctx, kind, send_timeout_s=send_timeout_s)
        try:
            secure_client(sock, self.key)
            if subscribe is not None:
                sock.setsockopt(zmq.SUBSCRIBE, subscribe)
            sock.connect(endpoint)
        except BaseException:
            sock.close(linger=0)  # an open socket would hold the context's term() forever
            raise
        return sock

    def handshake(self) -> str:
        """Wait for the engine's ``Ready``, answer ``Hello``, start heartbeats; return the session.

        Raises ``TransportTimeout`` after ``handshake_timeout_s`` without a ``Ready``,
        ``EngineShutdown`` on a ``Shutdown`` before it, ``LauncherGone`` once the process that
        started this one has exited.
        """
        self._stop_watching()
        ready = self._wait_ready(time.monotonic() + self.config.handshake_timeout_s)
        if ready.world_size != self.hello.world_size:
            message = (f"engine expects {ready.world_size} ranks, rank {self.rank} was started "
                       f"with world_size {self.hello.world_size}")
            self.send(WorkerError(rank=self.rank, message=message))  # engine fails fast too
            raise TransportError(message)
        self.session = ready.session
        _send(self._push, [encode(self.hello)], "send Hello")
        self._engine_seen = time.monotonic()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"pipeserve-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()
        return ready.session

    def _wait_ready(self, deadline: float) -> Ready:
        while True:
            if os.getppid() != self._parent:
                raise LauncherGone(f"rank {self.rank}: the process that started it (pid {self._parent}) "
                                   "exited before the engine's Ready")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeout(
                    f"rank {self.rank}: no Ready from the engine at {self.plan_endpoint} "
                    f"within {self.config.handshake_timeout_s:g}s"
                )
            if not _poll(self._sub, min(remaining, _PARENT_CHECK_S)):
                continue
            msg = self._read()
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, Shutdown):
                raise EngineShutdown(f"rank {self.rank}: the engine shut down before its Ready ({msg.reason})")

    def _read(self) -> Message:
        _topic, payload = self._sub.recv_multipart(zmq.NOBLOCK)
        self._engine_seen = time.monotonic()
        return decode(payload)

    def recv_plan(self, timeout_s: float) -> StepPlan | Shutdown | None:
        """Next plan or ``Shutdown`` from the engine, or ``None`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if not _poll(self._sub, remaining):
                return None
            msg = self._read()
            if isinstance(msg, (StepPlan, Shutdown)):
                return msg
            # Late Ready copies (published until the last worker said Hello) are skipped.

    def send(self, msg: Message) -> None:
        """Send a message (``StepResult``, ``WorkerError``, ...) to the engine."""
        _send(self._push, [encode(msg)], f"rank {self.rank}: send {type(msg).__name__}")

    def send_later(self, make: Callable[[], Message]) -> None:
        """Sends ``make()`` to the engine from this channel's sender thread, in the order given.
        ``make`` may block (a result whose sampled ids are still on their way from the device)
        while the calling thread goes on to the next plan. A ``make`` or send that fails sends
        the engine a ``WorkerError`` instead (so it does not wait for a result that will never
        come) and stops the sender; this method, ``check_sender`` and ``flush_sends`` then
        raise that error."""
        self.check_sender()
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name=f"pipeserve-sender-{self.rank}", daemon=True)
            self._sender.start()
        self._sends.put(make)

    def check_sender(self) -> None:
        """Raises ``TransportError`` once the sender thread has failed or died; an idle worker
        loop calls this, so a sender that could not even tell the engine still ends the run."""
        if self._sender_error is not None:
            raise TransportError(f"rank {self.rank}: sending a result failed: "
                                 f"{type(self._sender_error).__name__}: {self._sender_error}")
        if self._sender is not None and not self._sender.is_alive():
            raise TransportError(f"rank {self.rank}: the result sender stopped")

    def flush_sends(self, timeout_s: float = 60.0) -> None:
        """Waits until everything given to ``send_later`` has left, and stops the sender thread
        (a later ``send_later`` starts another). A sender still busy after ``timeout_s`` (a
        result whose device never finishes) is left running, and ``TransportTimeout`` raised."""
        sender = self._sender
        if sender is not None:
            self._sends.put(None)
            sender.join(timeout=timeout_s)
            if sender.is_alive():  # kept: close() must not wait for its socket
                raise TransportTimeout(f"rank {self.rank}: results not sent within {timeout_s:g}s")
            self._sender = None
        self.check_sender()

    def _send_loop(self) -> None:
        # zmq sockets are not thread-safe: this thread creates, uses and closes its own.
        push = None
        try:
            push = self._client(zmq.PUSH, self.result_endpoint, send_timeout_s=self.config.send_timeout_s)
            while (make := self._sends.get()) is not None:
                if self._sender_error is not None:
                    continue  # the engine has been told; drain until stopped
                try:
                    _send(push, [encode(make())], f"rank {self.rank}: send result")
                except Exception as e:
                    self._sender_error = e
                    error = WorkerError(rank=self.rank, message=f"{type(e).__name__}: {e}")
                    try:
                        push.send(encode(error), zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # the engine is not reading: its liveness check ends the run
        except BaseException as e:  # no socket: the worker's loop raises it (check_sender)
            self._sender_error = e
        finally:
            if push is not None:
                push.close(linger=1000)  # the last results get a bounded moment to leave

    def engine_alive(self) -> bool:
        """False once the engine has sent nothing (plan or heartbeat) for ``liveness_timeout_s``."""
        return time.monotonic() - self._engine_seen < self.config.liveness_timeout_s

    def _heartbeat_loop(self) -> None:
        # zmq sockets are not thread-safe: this thread creates, uses and closes its own.
        push = self._client(zmq.PUSH, self.result_endpoint)
        sub = self._client(zmq.SUB, self.plan_endpoint, subscribe=_HEARTBEAT_TOPIC)
        try:
            self._beat_until_stopped(push, sub)
        finally:
            push.close(linger=0)
            sub.close(linger=0)

    def _beat_until_stopped(self, push: zmq.Socket, sub: zmq.Socket) -> None:
        next_beat = 0.0
        lost_reported = False
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._beat(push)
                next_beat = now + self.config.heartbeat_interval_s
            if _poll(sub, min(_POLL_SLICE_S, next_beat - now)):
                while sub.poll(0, zmq.POLLIN):
                    sub.recv_multipart(zmq.NOBLOCK)  # content is irrelevant: arrival is the signal
                self._engine_seen = time.monotonic()
            if not lost_reported and not self.engine_alive() and self._on_engine_lost:
                lost_reported = True
                self._on_engine_lost()

    def _beat(self, push: zmq.Socket) -> None:
        busy = None
        if self._busy_s is not None:
            busy = StageBusy(stage=self.hello.stage, busy_s=self._busy_s())
        try:
            push.send(encode(Heartbeat(rank=self.rank, t=time.time(), stage_busy=busy)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # engine not reading: a queued-up heartbeat would say nothing new

    def close(self, linger_s: float = 1.0) -> None:
        """Stop the heartbeat and sender threads and close the sockets.

        Messages already sent (typically a final ``WorkerError``) get up to ``linger_s`` to
        leave; a dead engine therefore delays exit by at most that much. A sender thread still
        waiting for a result after that is left behind, with the context unterminated, rather
        than waited for.
        """
        self._stop.set()
        self._stop_watching()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        sender = self._sender
        if sender is not None:
            self._sends.put(None)
            sender.join(timeout=linger_s + 1.0)  # (a make() stuck on a hung device: left behind)
        self._sub.close(linger=0)
        self._push.close(linger=int(linger_s * 1000))
        threads = [t for t in (self._thread, sender) if t is not None]
        if not any(t.is_alive() for t in threads):
            self._ctx.term()
