"""`pipeserve serve parallel.pp=2`: the engine starts two torchrun workers (one per stage,
gloo on CPU) and the HTTP API behaves exactly as in one process, /metrics included (live busy
time and bubble fraction per stage); if the engine dies, in-flight streams end with an error,
the frontend exits 1 and the workers exit too (nothing hangs)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
from helpers_server import API_KEY, MODEL, QUESTIONS, Server, chat, descendants, run_load, wait_gone

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
