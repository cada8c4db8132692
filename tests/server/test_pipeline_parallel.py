"""`pipeserve serve parallel.pp=2`: the engine starts two torchrun workers (one per stage,
gloo on CPU) and the HTTP API behaves exactly as in one process, /metrics included (live busy
time and bubble fraction per stage); if the engine or a worker dies, in-flight streams end with
an error, the frontend exits 1 and every other process exits too (nothing hangs, no port is left
listening)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import zmq
from helpers_server import (
    API_KEY,
    MODEL,
    QUESTIONS,
    Server,
    chat,
    descendants,
    listening_ports,
    run_load,
    speaks_zeromq,
    streams_in_background,
    wait_gone,
    worker_ranks,
)

from pipeserve.parallel.wire import AbortRequest, AddRequest, Shutdown, StepResult, WorkerError, encode
from pipeserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    s = Server.start(tmp_path_factory.mktemp("pp2"), "parallel.pp=2")
    try:
        yield s
    finally:
        s.kill()


def check_stage_metrics(server, num_stages: int) -> None:
    """After load, /metrics has every stage's busy seconds (> 0, growing with more load) and
    its bubble fraction in [0, 1]; no figure for a stage that does not exist."""
    stages = range(num_stages)
    busy = [f"pipeserve:stage_busy_seconds_total[{s}]" for s in stages]
    bubble = [f"pipeserve:stage_bubble_fraction[{s}]" for s in stages]
    asyncio.run(run_load(server.url, 4))
    server.wait_idle(timeout_s=60)
    time.sleep(2.5)  # the last busy time rides on the stages' next heartbeat (every 1 s)
    first = server.wait_until(lambda m: all(m.get(k, 0) > 0 for k in busy) and all(k in m for k in bubble),
                              timeout_s=30)
    assert all(0.0 <= first[k] <= 1.0 for k in bubble), first
    assert f"pipeserve:stage_busy_seconds_total[{num_stages}]" not in first
    asyncio.run(run_load(server.url, 4))
    server.wait_until(lambda m: all(m[k] > first[k] for k in busy), timeout_s=30)
    assert all(0.0 <= x <= 1.0 for x in map(server.metrics().get, bubble))


def test_one_process_reports_its_stage_live(server):
    check_stage_metrics(server, 1)


def test_pp2_reports_every_stage_live(pp2):
    check_stage_metrics(pp2, 2)


def test_pp2_a_local_process_without_the_key_can_neither_read_nor_disturb(pp2):
    """The attacker knows every port the server's processes listen on (as `ss -ltn` shows them)
    but not the run's key. While clients stream, it subscribes to every ZeroMQ port, pulls from
    each (to steal deltas), and pushes forged messages: a worker failure, a result, a shutdown,
    a request of its own, garbage. The clients get exactly the answers of a quiet run, the spies
    read nothing, the server stays up and counts the refused connections."""
    quiet = asyncio.run(run_load(pp2.url, 4))
    pids = [pp2.proc.pid, *descendants(pp2.proc.pid)]
    ports = [p for p in listening_ports(pids) if p != pp2.port and speaks_zeromq(p)]
    assert len(ports) >= 4  # the engine's requests and updates; its plan and result sockets
    forged = [WorkerError(rank=1, message="forged failure"), Shutdown(reason="forged"),
              StepResult(step_id=1, request_ids=["x"], token_ids=[1]),
              AddRequest(request_id="intruder", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4)),
              AbortRequest(request_id="x")]
    ctx = zmq.Context()
    # Forged messages stay queued on sockets refused a connection: closing one with the default
    # linger would block the context's term forever (so every socket is kept, and lingers 0).
    ctx.setsockopt(zmq.LINGER, 0)
    spies, pushes = [], []
    try:
        for port in ports:
            sub, pull, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            for sock in (sub, pull, push):
                sock.connect(f"tcp://127.0.0.1:{port}")
            for msg in forged:
                push.send(encode(msg), zmq.NOBLOCK)
            push.send(b"\xc1garbage", zmq.NOBLOCK)
            spies += [sub, pull]
            pushes.append(push)
        attacked = asyncio.run(run_load(pp2.url, 4))
        assert attacked == quiet
        assert not any(spy.poll(100) for spy in spies)
        status, _, _ = pp2.request("GET", "/health", timeout_s=30.0)
        assert status == 200
        m = pp2.wait_until(lambda m: m.get("pipeserve:control_plane_rejected_total", 0) >= len(ports), timeout_s=30)
        assert m["pipeserve:num_requests_running"] == 0 and m["pipeserve:num_requests_waiting"] == 0
    finally:
        ctx.destroy(linger=0)


def test_pp2_serves_like_one_process(server, pp2):
    workers = descendants(pp2.engine_pid)
    assert len(workers) >= 3  # torchrun and its two workers
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as one, \
         openai.OpenAI(base_url=pp2.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as two:
        for q in QUESTIONS[:3]:
            kw = dict(model=MODEL, messages=chat(q), temperature=0, max_tokens=8)
            assert two.chat.completions.create(**kw).choices[0].message.content == \
                one.chat.completions.create(**kw).choices[0].message.content
    # Concurrent streams through the pipeline (several micro-batches in flight).
    single = asyncio.run(run_load(server.url, 7))
    assert asyncio.run(run_load(pp2.url, 7)) == single
    assert pp2.wait_idle(timeout_s=60)["pipeserve:kv_cache_blocks_used"] == 0

    long = {"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
    events = pp2.stream("/v1/completions", long, timeout_s=60)
    assert next(events)["choices"][0]["finish_reason"] is None
    os.kill(pp2.engine_pid, signal.SIGKILL)
    rest = list(events)  # ends (bounded by the socket timeout)
    assert "error" in rest[-1] and "engine" in rest[-1]["error"]["message"]
    assert pp2.proc.wait(timeout=60) == 1
    # Workers notice the engine is gone within parallel.liveness_timeout_s (10 s).
    assert all(wait_gone(pid, timeout_s=60) for pid in workers)


@pytest.mark.slow
def test_pp2_a_worker_killed_fails_the_clients_and_everything_exits(tmp_path):
    server = Server.start(tmp_path, "parallel.pp=2")
    try:
        tree = [server.proc.pid, *descendants(server.proc.pid)]
        ports = listening_ports(tree)
        long = {"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
        threads, results = streams_in_background(server, long, 3, timeout_s=60)
        server.wait_until(lambda m: m.get("pipeserve:generation_tokens_total", 0) >= 6, timeout_s=120)
        t0 = time.monotonic()
        os.kill(worker_ranks(tree)[1], signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
        assert time.monotonic() - t0 < 10  # the engine notices at once (gloo's peer is gone)
        for events in results:
            assert "error" in events[-1] and "worker" in events[-1]["error"]["message"], events[-2:]
        assert server.proc.wait(timeout=60) == 1
        assert all(wait_gone(pid, timeout_s=60) for pid in tree)
        assert not ports & listening_ports()
    finally:
        server.kill()
