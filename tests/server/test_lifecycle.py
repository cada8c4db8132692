"""Overload and shutdown on a server of its own: past the queue limit → 429 + Retry-After;
SIGTERM → stop accepting, finish what is in flight, exit 0 (engine included)."""

from __future__ import annotations

import json
import socket

import pytest
from helpers_server import Server, streams_in_background, wait_gone

pytestmark = pytest.mark.timeout(400)

# One running sequence, one waiting: the third concurrent one is over the limit.
SMALL = ["scheduler.max_num_seqs=1", "server.max_queue_depth=1", "server.retry_after_s=2"]
LONG = {"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    s = Server.start(tmp_path_factory.mktemp("small"), *SMALL)
    try:
        yield s
    finally:
        s.kill()


def open_stream(server, body: dict) -> socket.socket:
    """A streaming request whose response has started (status line and headers read)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=60)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
                 "Content-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "connection closed"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def test_queue_limit_answers_429_with_retry_after(small):
    held = [open_stream(small, LONG) for _ in range(2)]
    try:
        status, headers, data = small.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 429, data
        assert headers.get("retry-after", headers.get("Retry-After")) == "2"
        assert json.loads(data)["error"]["code"] == "server_overloaded"
        assert small.request("GET", "/health")[0] == 200  # overloaded is not unhealthy
    finally:
        for sock in held:
            sock.close()
    assert small.wait_idle(timeout_s=60)["pipeserve:kv_cache_blocks_used"] == 0
    status, r = small.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and r["usage"]["completion_tokens"] == 2


def test_sigterm_drains_in_flight_requests_and_exits_0(small):
    body = {"prompt": "Count to ten:", "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True}
    threads, results = streams_in_background(small, body, 2)
    small.wait_until(lambda m: m.get("pipeserve:num_requests_in_flight", 0) == 2, timeout_s=60)
    code = small.terminate(timeout_s=120)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert code == 0
    for events in results:  # both finished in full, the queued one included
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert wait_gone(small.engine_pid, timeout_s=30)
    with pytest.raises(OSError):
        socket.create_connection((small.host, small.port), timeout=5).close()

