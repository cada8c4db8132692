"""A client that hangs up, and an explicit cancel, stop generation and free the KV blocks."""

from __future__ import annotations

import json
import socket
import time

import pytest
from helpers_server import sse_events

pytestmark = pytest.mark.timeout(300)

LONG = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0}


def aborted(server) -> float:
    return server.metrics().get("pipeserve:request_success_total[abort]", 0.0)


def raw_post(server, path: str, body: dict) -> socket.socket:
    """Sends a request on a bare socket (to hang up at will)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kv_used(server) -> float:
    return server.metrics()["pipeserve:kv_cache_blocks_used"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_frees_kv(server, stream):
    server.wait_idle()
    before, tokens_before = aborted(server), server.metrics()["pipeserve:generation_tokens_total"]
    sock = raw_post(server, "/v1/completions", dict(LONG, stream=stream))
    try:
        if stream:
            received = b""
            while b"data: " not in received:  # generating (the socket timeout bounds this)
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream"
                received += chunk
        else:
            wait_for(lambda: kv_used(server) > 0, 60, "the request to hold KV blocks")
    finally:
        sock.close()
    wait_for(lambda: aborted(server) == before + 1, 30, "the abort")
    m = server.wait_idle(timeout_s=30)
    assert m["pipeserve:kv_cache_blocks_used"] == 0
    assert m["pipeserve:generation_tokens_total"] - tokens_before < LONG["max_tokens"]  # stopped early


def test_cancel_route_frees_kv(server):
    server.wait_idle()
    conn = server.connection(timeout_s=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(dict(LONG, stream=True)), headers=server.headers())
        resp = conn.getresponse()
        events = sse_events(resp)
        first = next(events)
        # The gauge follows the engine's periodic stats, which may come after the first token.
        wait_for(lambda: kv_used(server) > 0, 30, "the request to hold KV blocks")
        status, r = server.post(f"/v1/requests/{first['id']}/cancel", {})
        assert status == 200 and r["cancelled"] is True
        rest = list(events)
    finally:
        conn.close()
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(e["choices"][0]["text"]) for e in rest[:-1]) < 400 * 4
    assert server.wait_idle(timeout_s=30)["pipeserve:kv_cache_blocks_used"] == 0
    status, r = server.post(f"/v1/requests/{first['id']}/cancel", {})
    assert status == 404 and "error" in r


def test_many_clients_hanging_up_mid_stream_free_everything(server):
    """24 streams, each client gone after 1 to 3 events: every one is aborted, and nothing runs,
    waits or holds a KV block a moment later."""
    server.wait_idle()
    before = aborted(server)
    socks = [raw_post(server, "/v1/completions", dict(LONG, stream=True)) for _ in range(24)]
    try:
        for i, sock in enumerate(socks):
            received = b""
            while received.count(b"data: ") < 1 + i % 3:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream"
                received += chunk
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: aborted(server) == before + 24, 30, "24 aborts")
    m = server.wait_idle(timeout_s=30)
    assert m["pipeserve:kv_cache_blocks_used"] == 0 and m["pipeserve:num_requests_waiting"] == 0
