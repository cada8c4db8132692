"""The HTTP frontend's side of the engine: start the engine process, talk to it over ZeroMQ.

    engine = EngineProcess.spawn(config)                     # starts loading the model
    engine.wait_ready(timeout_s=600)                         # endpoints and limits
    client = AsyncEngineClient(engine)                       # in the event loop
    await client.start(on_engine_exit=...)
    client.add(request_id, prompt_ids, params, stream=True, sink=queue, index=0)
    ... queue.get() -> Delta (finish_reason set on the last one) ...
    client.abort([request_id])

Messages are the typed wire schema (msgpack, no pickle), over CURVE with the run's key (the
frontend makes it, or takes ``PIPESERVE_CONTROL_KEY``, and hands it to the engine): no other
process can read or send them. Sends never block the event loop
(the frontend bounds how many requests it has in flight); updates are read by one task that
routes each delta to the queue of the HTTP request it belongs to.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pipeserve.parallel.auth import RunKey, secure_client
from pipeserve.parallel.wire import (
    AbortRequest,
    AddRequest,
    EngineStats,
    RequestTimings,
    RequestUpdate,
    Shutdown,
    StreamUpdates,
    TokenLogprobs,
    WireError,
    decode_frontend,
    encode,
)
from pipeserve.runtime.config import EngineConfig, engine_config_to_dict
from pipeserve.scheduler import SamplingParams


@dataclass(slots=True)
class Delta:
    """New output of one sequence (``index`` = its choice index in the HTTP response)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in a sequence's first delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    timings: RequestTimings | None = None


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    """The engine (``runtime.engine_server --serve``) as a child process in its own session,
    so a terminal's Ctrl-C reaches only the frontend, which drains first."""

    def __init__(self, proc: subprocess.Popen, key: RunKey) -> None:
        self.proc = proc
        self.key = key
        self.info: dict = {}

    @classmethod
    def spawn(cls, config: EngineConfig, *, stats_interval_s: float = 0.5) -> EngineProcess:
        """Starts loading the model; `wait_ready` blocks until the engine can serve."""
        key = RunKey.from_env() or RunKey.generate()
        env = dict(os.environ, **key.env(), PIPESERVE_ENGINE_CONFIG=json.dumps(engine_config_to_dict(config)),
                   PIPESERVE_STATS_INTERVAL_S=str(stats_interval_s))
        proc = subprocess.Popen([sys.executable, "-m", "pipeserve.runtime.serving.engine_server"],
                                env=env, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        return cls(proc, key)

    def wait_ready(self, *, timeout_s: float) -> dict:
        """The engine's ready line: endpoints, max_model_len, vocab_size, KV blocks, …"""
        self.info = json.loads(_read_line(self.proc, timeout_s))
        # Whatever the engine (or its workers) print later must not fill the pipe and block it.
        threading.Thread(target=_copy_lines, args=(self.proc.stdout,), daemon=True).start()
        return self.info

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self, *, grace_s: float = 30.0) -> int | None:
        """After a Shutdown message: wait for the engine (it stops its workers), then kill."""
        return _stop(self.proc, grace_s)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.strip().startswith(b"{"):
                return line
            if not line:
                break
            sys.stdout.buffer.write(line)
        if proc.poll() is not None:
            break
    code = proc.poll()
    if code is None:
        raise EngineStartError(f"the engine was not ready after {timeout_s:g}s")
    raise EngineStartError(f"the engine process exited with code {code} before it was ready (see its log above)")


def _copy_lines(stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _stop(proc: subprocess.Popen, grace_s: float) -> int | None:
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # its session: the engine and any torchrun workers
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


class AsyncEngineClient:
    """Routes engine outputs to per-HTTP-request queues; tracks what is in flight."""

    def __init__(self, engine: EngineProcess, *, on_stats=None, on_delta=None) -> None:
        """`on_stats(EngineStats)`: each stats message; `on_delta(Delta)`: each delta (metrics)."""
        self.engine = engine
        self.on_stats, self.on_delta = on_stats, on_delta
        self.stats: EngineStats | None = None
        self.engine_error: str | None = None
        self._routes: dict[str, tuple[asyncio.Queue, int]] = {}
        self._sync_ctx = zmq.Context()
        self._requests = self._sync_ctx.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.SNDHWM, 0)  # bounded by the frontend's admission control
        self._requests.setsockopt(zmq.LINGER, 2000)
        secure_client(self._requests, engine.key)
        self._requests.connect(engine.info["requests"])
        self._async_ctx = zmq.asyncio.Context()
        self._updates = self._async_ctx.socket(zmq.PULL)
        self._updates.setsockopt(zmq.LINGER, 0)
        secure_client(self._updates, engine.key)
        self._updates.connect(engine.info["updates"])
        self._tasks: list[asyncio.Task] = []

    async def start(self, *, on_engine_exit) -> None:
        """`on_engine_exit(code)` is called once if the engine process ends."""
        self._tasks = [asyncio.create_task(self._read_updates()),
                       asyncio.create_task(self._watch_engine(on_engine_exit))]

    @property
    def num_in_flight(self) -> int:
        """Sequences sent to the engine whose last delta has not arrived."""
        return len(self._routes)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, stream: bool,
            sink: asyncio.Queue, index: int) -> None:
        if self.engine_error is not None:
            raise RuntimeError(self.engine_error)
        # Encoded before the route is registered: a message that cannot be sent leaves nothing behind.
        data = encode(AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                                 stream=stream))
        self._routes[request_id] = (sink, index)
        try:
            self._send_bytes(data)
        except BaseException:
            del self._routes[request_id]
            raise

    def abort(self, request_ids) -> None:
        """Stops the unfinished ones of these requests (the engine frees their KV blocks); each
        gets a last delta with finish_reason "abort" right away, and nothing after it."""
        for rid in request_ids:
            route = self._routes.pop(rid, None)
            if route is None:
                continue
            self._send(AbortRequest(request_id=rid))
            sink, index = route
            delta = Delta(index=index, token_ids=[], text="", finish_reason="abort")
            if self.on_delta is not None:
                self.on_delta(delta)
            sink.put_nowait(delta)

    def _send(self, msg) -> None:
        self._send_bytes(encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        try:
            self._requests.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:  # cannot happen with SNDHWM=0 and a connected peer; be loud if it does
            raise RuntimeError("the engine is not accepting messages") from None

    async def _read_updates(self) -> None:
        while True:
            data = await self._updates.recv()
            try:
                msg = decode_frontend(data)
            except WireError as e:
                print(f"frontend: dropped a malformed engine message: {e}", file=sys.stderr)
                continue
            if isinstance(msg, StreamUpdates):
                for d in msg.deltas:
                    self._deliver(d.request_id, d)
            elif isinstance(msg, RequestUpdate):
                self._deliver(msg.request_id, msg)
            elif isinstance(msg, EngineStats):
                self.stats = msg
                if msg.failed is not None and self.engine_error is None:
                    self.engine_error = f"the engine lost its workers: {msg.failed}"
                if self.on_stats is not None:
                    self.on_stats(msg)

    def _deliver(self, request_id: str, u) -> None:
        route = self._routes.get(request_id)
        if route is None:
            return  # aborted by us: the client is gone
        if u.finish_reason is not None:
            del self._routes[request_id]
        sink, index = route
        delta = Delta(index=index, token_ids=list(u.token_ids), text=u.text, logprobs=u.logprobs,
                      prompt_logprobs=u.prompt_logprobs, finish_reason=u.finish_reason, stop_reason=u.stop_reason,
                      error=u.error, timings=u.timings)
        if self.on_delta is not None:
            self.on_delta(delta)
        sink.put_nowait(delta)

    async def _watch_engine(self, on_engine_exit) -> None:
        while (code := self.engine.exit_code) is None:
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.2)  # let the reader deliver what the engine sent last
        self.engine_error = f"the engine process exited with code {code}"
        for rid, (sink, index) in list(self._routes.items()):
            sink.put_nowait(Delta(index=index, token_ids=[], text="", finish_reason="error",
                                  error=self.engine_error))
        self._routes.clear()
        on_engine_exit(code)

    async def close(self, *, grace_s: float = 30.0) -> int | None:
        """Asks the engine to shut down (it stops its workers) and waits for it."""
        for t in self._tasks:
            t.cancel()
        if self.engine.exit_code is None:
            try:
                self._send(Shutdown(reason="frontend shutting down"))
            except RuntimeError:
                pass
        code = await asyncio.to_thread(self.engine.stop, grace_s=grace_s)
        self._requests.close(linger=0)
        self._updates.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        return code
