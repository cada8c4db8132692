"""Many concurrent streaming requests through the official async client: every one completes
with the same greedy text as when it ran alone; afterwards no KV block is held and memory is
back near where it was."""

from __future__ import annotations

import asyncio

import openai
import pytest
from helpers_server import API_KEY, MODEL, QUESTIONS, chat, rss_mb, run_load


def check_load(server, num_requests: int) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        alone = {}
        for q in QUESTIONS:
            r = client.chat.completions.create(model=MODEL, messages=chat(q), temperature=0, max_tokens=8)
            alone[q] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)
    server.wait_idle()
    pids = (server.proc.pid, server.engine_pid)
    baseline = [rss_mb(p) for p in pids]
    before = server.metrics()["pipeserve:generation_tokens_total"]

    results = asyncio.run(run_load(server.url, num_requests))

    for i, got in enumerate(results):
        assert got == alone[QUESTIONS[i % len(QUESTIONS)]], (i, got)
    m = server.wait_idle(timeout_s=60)
    assert m["pipeserve:kv_cache_blocks_used"] == 0 and m["pipeserve:num_requests_in_flight"] == 0
    assert m["pipeserve:generation_tokens_total"] - before == sum(r[2] for r in results)
    after = [rss_mb(p) for p in pids]
    # Per-request state is gone: what is left is allocator caches, bounded whatever the count.
    for b, a in zip(baseline, after):
        assert a - b < 150, (baseline, after)


@pytest.mark.timeout(600)
def test_50_concurrent_streams(server):
    check_load(server, 50)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_500_concurrent_streams(server):
    check_load(server, 500)
