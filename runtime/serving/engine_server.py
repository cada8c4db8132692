"""The engine as its own process, serving the HTTP frontend over ZeroMQ.

    python -m pipeserve.runtime.serving.engine_server     (started by the HTTP frontend)

It binds two loopback sockets (requests in: PULL; updates out: PUSH; CURVE servers that admit
only the run's key, from ``PIPESERVE_CONTROL_KEY``), builds the engine (which
starts its workers: in this process for one device, else a torchrun, or under an outer torchrun
rank 0's worker), prints one JSON line once it is ready to serve, with its endpoints and what
the frontend needs to validate requests (max_model_len, vocab size, KV blocks), then loops:
take requests and aborts → step → send outputs.

Keeping the engine out of the frontend's process means scheduling never competes with HTTP,
detokenization or stage 0's kernel launches for the GIL.

Streaming requests (``AddRequest.stream``) get one ``StreamDelta`` per step that adds output,
all deltas of a step in one ``StreamUpdates``; the others one ``RequestUpdate`` at the end.
The engine also publishes ``EngineStats`` (queue, KV, and per stage its busy seconds beside the
engine's active seconds, both cumulative, for the frontend's bubble fraction) every
``PIPESERVE_STATS_INTERVAL_S`` seconds and whenever it goes idle. SIGTERM drains: new requests
are refused, running ones finish, then the process exits 0. The engine exits by itself when its
parent (the frontend) dies.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import zmq

from pipeserve.parallel.auth import KEY_ENV, Guard, RunKey
from pipeserve.parallel.wire import (
    AbortRequest,
    AddRequest,
    EngineStats,
    RequestTimings,
    RequestUpdate,
    Shutdown,
    StreamDelta,
    StreamUpdates,
    WireError,
    decode,
    encode,
)
from pipeserve.runtime.config import engine_config_from_dict
from pipeserve.runtime.engine.llm_engine import LLMEngine
from pipeserve.runtime.engine.executor import WorkerFailure
from pipeserve.runtime.engine.outputs import RequestOutput, RequestOutputKind
from pipeserve.runtime.heap import freeze_start_up_heap
from pipeserve.scheduler.sampling_params import SamplingParams


def update_of(out: RequestOutput) -> RequestUpdate:
    c = out.outputs[0]
    return RequestUpdate(
        request_id=out.request_id, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
        stop_reason=c.stop_reason, logprobs=c.logprobs, prompt_logprobs=out.prompt_logprobs, error=out.error,
        timings=timings_of(out) if out.finished else None,
    )


def timings_of(out: RequestOutput) -> RequestTimings | None:
    m = out.metrics
    if m is None:
        return None
    since = lambda t: None if t is None else t - m.arrival_time  # noqa: E731
    finished = m.finished_time if m.finished_time is not None else time.monotonic()
    gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
    return RequestTimings(queue_s=since(m.first_scheduled_time), ttft_s=since(m.first_token_time),
                          e2e_s=finished - m.arrival_time, tbt_s=gaps,
                          num_prompt_tokens=len(out.prompt_token_ids),
                          num_output_tokens=len(out.outputs[0].token_ids), num_cached_tokens=m.num_cached_tokens)


class _Stream:
    """How much of one streaming request's output has been sent."""

    __slots__ = ("num_tokens", "text_len", "holdback")

    def __init__(self, params: SamplingParams) -> None:
        self.num_tokens = 0
        self.text_len = 0
        # A stop string may begin in the last len(stop) - 1 characters: they are sent only once
        # the request finishes (or they fall further back), so sent text is never cut.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def delta(self, out: RequestOutput) -> StreamDelta | None:
        c = out.outputs[0]
        end = len(c.text) if out.finished else max(self.text_len, len(c.text) - self.holdback)
        text = c.text[self.text_len:end]
        new_ids = c.token_ids[self.num_tokens:]
        if not out.finished and not new_ids and not text:
            return None
        logprobs = None if c.logprobs is None else c.logprobs[self.num_tokens:]
        prompt_logprobs = out.prompt_logprobs if self.num_tokens == 0 else None  # with the first delta
        self.num_tokens, self.text_len = len(c.token_ids), max(self.text_len, end)
        return StreamDelta(
            request_id=out.request_id, token_ids=new_ids, text=text, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason, error=out.error,
            timings=timings_of(out) if out.finished else None,
        )


class EngineServer:
    def __init__(self, engine: LLMEngine, requests: zmq.Socket, updates: zmq.Socket, *, guard: Guard,
                 stats_interval_s: float | None = None) -> None:
        """`guard`: the sockets' CURVE server side; `stats_interval_s`: publish EngineStats that
        often (None: never)."""
        self.engine, self.requests, self.updates = engine, requests, updates
        self.guard = guard
        self.stats_interval_s = stats_interval_s
        self._num_malformed = 0
        self._failed: str | None = None
        self._stop = False
        self._draining = False
        self._streams: dict[str, _Stream] = {}
        self._parent = os.getppid()
        self._active_s = 0.0  # wall time with unfinished requests, cumulative
        self._active_since: float | None = None
        self._last_stats = 0.0

    def drain(self, *_) -> None:
        """Refuse new requests; exit the loop once the running ones have finished."""
        self._draining = True

    def serve(self) -> None:
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            self._take_messages(timeout_ms=0 if busy else 50)
            if self._stop or os.getppid() != self._parent:
                break  # told to, or orphaned: nobody is left to read our outputs
            if not self.engine.has_unfinished_requests():
                self._clock(active=False)
                if self._draining:
                    break
                self.engine.executor.idle()
                self._publish_stats(force=busy)  # just went idle: report the freed KV now
                continue
            self._clock(active=True)
            self._send_outputs(self.engine.step())
            self._publish_stats()
        self._publish_stats(force=True)

    def _clock(self, *, active: bool) -> None:
        """Adds the time since the previous clock reading to ``_active_s`` if the engine had work then."""
        now = time.monotonic()
        if self._active_since is not None:
            self._active_s += now - self._active_since
        self._active_since = now if active else None

    def _active_until(self, now: float) -> float:
        running = now - self._active_since if self._active_since is not None else 0.0
        return self._active_s + running

    def _take_messages(self, timeout_ms: int) -> None:
        while self.requests.poll(timeout_ms):
            timeout_ms = 0
            try:
                msg = decode(self.requests.recv())
            except WireError as e:
                self._num_malformed += 1
                print(f"engine: dropped a malformed message: {e}", file=sys.stderr)
                continue
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequest):
                self._abort(msg.request_id)
            elif isinstance(msg, Shutdown):
                self._stop = True
                return

    def _add(self, msg: AddRequest) -> None:
        try:
            if self._draining:
                raise ValueError("the server is shutting down")
            params = msg.params
            prompt = msg.prompt if msg.prompt is not None and not msg.prompt_token_ids else msg.prompt_token_ids
            # A non-streaming request is sent once, at the end: the engine need not build the
            # output of every token.
            kind = RequestOutputKind.CUMULATIVE if msg.stream else RequestOutputKind.FINAL_ONLY
            self.engine.add_request(msg.request_id, prompt, params, output_kind=kind)
        except (ValueError, TypeError) as e:
            self._send(RequestUpdate(request_id=msg.request_id, token_ids=[], text="",
                                     finish_reason="error", error=str(e)))
            return
        if msg.stream:
            self._streams[msg.request_id] = _Stream(params)

    def _abort(self, request_id: str) -> None:
        if self.engine.abort_request(request_id):
            self._send_outputs([self.engine.take_aborted(request_id)])

    def _send_outputs(self, outs: list[RequestOutput]) -> None:
        deltas = []
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                if out.finished:
                    self._send(update_of(out))
                continue
            if (d := stream.delta(out)) is not None:
                deltas.append(d)
            if out.finished:
                del self._streams[out.request_id]
        if deltas:
            self._send(StreamUpdates(deltas=deltas))

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.stats_interval_s is None or (not force and now - self._last_stats < self.stats_interval_s):
            return
        sched = self.engine.scheduler
        self._send(EngineStats(
            num_waiting=sched.num_waiting, num_running=sched.num_running,
            num_kv_blocks=self.engine.state.num_kv_blocks,
            num_free_kv_blocks=sched.block_manager.num_free_blocks,
            stage_busy_s=self.engine.executor.stage_busy_seconds(), active_s=self._active_until(now),
            draining=self._draining,
            num_rejected=self.guard.num_rejected + self._num_malformed + self.engine.executor.num_rejected(),
            failed=self._failed, num_preemptions=sched.num_preemptions,
            num_prefix_cache_queries=sched.prefix_cache_stats.num_prompt_tokens,
            num_prefix_cache_hits=sched.prefix_cache_stats.num_cached_prompt_tokens,
        ))
        self._last_stats = now

    def _send(self, msg) -> None:
        self.updates.send(encode(msg))

    def fail_all(self, message: str) -> None:
        """Every request still known ends with finish_reason "error" (the workers failed), and
        the frontend learns that the engine is failing before it has reaped its workers."""
        self._failed = message
        for rid in list(self.engine._requests):
            if rid in self._streams:
                delta = StreamDelta(request_id=rid, token_ids=[], text="", finish_reason="error", error=message)
                self._send(StreamUpdates(deltas=[delta]))
            else:
                self._send(RequestUpdate(request_id=rid, token_ids=[], text="", finish_reason="error",
                                         error=message))
        self._publish_stats(force=True)


def main() -> int:
    config = engine_config_from_dict(json.loads(os.environ["PIPESERVE_ENGINE_CONFIG"]))
    key = RunKey.from_env()
    if key is None:
        raise SystemExit(f"engine: no control key ({KEY_ENV}); the HTTP frontend starts this process")
    ctx = zmq.Context()
    guard = Guard(ctx, key)
    requests, updates = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (requests, updates):
        sock.setsockopt(zmq.LINGER, 1000)
        guard.serve(sock)
    # The frontend bounds what it has in flight; never block the engine loop on a send.
    updates.setsockopt(zmq.SNDHWM, 0)
    # Its one client (the frontend) runs on this host: loopback, even where the workers'
    # sockets face the network (parallel.host across nodes).
    host = "tcp://127.0.0.1"
    endpoints = {
        "requests": f"{host}:{requests.bind_to_random_port(host)}",
        "updates": f"{host}:{updates.bind_to_random_port(host)}",
    }
    # Ctrl-C in a terminal reaches the frontend, which drains and then shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = LLMEngine(config)
    freeze_start_up_heap()  # this process serves until it exits (one device's worker included)
    interval = float(os.environ.get("PIPESERVE_STATS_INTERVAL_S", "0.5"))
    server = EngineServer(engine, requests, updates, stats_interval_s=interval, guard=guard)
    signal.signal(signal.SIGTERM, server.drain)
    print(json.dumps(dict(endpoints, **_serving_info(engine))), flush=True)
    code = 0
    try:
        server.serve()
    except WorkerFailure as e:
        server.fail_all(str(e))
        print(f"engine: {e}", file=sys.stderr)
        code = 1
    finally:
        engine.close()
        guard.close()
        requests.close()
        updates.close()
    return code


def _serving_info(engine: LLMEngine) -> dict:
    """What the frontend needs to check requests exactly as the engine will."""
    return {
        "max_model_len": engine.state.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "eos_token_ids": list(engine.state.eos_token_ids),
        "num_kv_blocks": engine.state.num_kv_blocks,
        "block_size": engine.config.block_size,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    sys.exit(main())
