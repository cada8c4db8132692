"""The HTTP edge (`_RequestGuard`) in front of a small app under a real uvicorn on 127.0.0.1:
Host header names, JSON bodies only, and a 500 that leaves the connection usable."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pipeserve.runtime.serving.api_server import ServerConfig, _RequestGuard, allowed_hosts, with_api_key_from_file

pytestmark = pytest.mark.timeout(60)


def guarded_app(rejected: list[int], config: ServerConfig) -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok():
        return JSONResponse({"ok": True})

    @app.post("/echo")
    async def echo(request: Request):
        return JSONResponse({"got": len(await request.body())})

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    app.add_middleware(_RequestGuard, allowed_hosts=allowed_hosts(config), on_reject=rejected.append)
    return app


@pytest.fixture
def served():
    """(port, rejected statuses) of a guarded app listening on 127.0.0.1."""
    rejected: list[int] = []
    config = uvicorn.Config(guarded_app(rejected, ServerConfig()), host="127.0.0.1", port=0, log_level="critical",
                            lifespan="off")
    server = uvicorn.Server(config)
    sock = config.bind_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1], rejected
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def ask(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
        headers: dict | None = None) -> tuple[int, dict]:
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_a_500_answers_and_keeps_the_connection(served):
    port, rejected = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, body = ask(conn, "GET", "/boom")
    assert status == 500 and body["error"]["type"] == "server_error" and "RuntimeError" in body["error"]["message"]
    local = conn.sock.getsockname()
    assert ask(conn, "GET", "/ok") == (200, {"ok": True})
    assert conn.sock.getsockname() == local  # the same connection served the next request
    assert rejected == [500]


def test_the_host_header_must_name_this_server(served):
    port, rejected = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", socket.gethostname()):
        assert ask(conn, "GET", "/ok", headers={"Host": host})[0] == 200, host
    for host in ("evil.example", f"rebind.example:{port}", "10.0.0.1"):  # a name a page controls; another IP
        status, body = ask(conn, "GET", "/ok", headers={"Host": host})
        assert status == 400 and body["error"]["code"] == "host_not_allowed", host
    assert rejected == [400] * 3


def test_allowed_hosts_on_every_interface_take_any_ip_but_no_foreign_name():
    wildcard = allowed_hosts(ServerConfig(host="0.0.0.0"))
    assert "0.0.0.0" in wildcard and "localhost" in wildcard
    assert allowed_hosts(ServerConfig(allowed_hosts=["*"])) is None
    assert allowed_hosts(ServerConfig(allowed_hosts=["API.example.org"])) == frozenset({"api.example.org"})
    guard = _RequestGuard(None, wildcard, lambda status: None)
    scope = {"method": "GET"}
    assert guard._refusal(scope, {b"host": b"192.168.1.7:8000"}) is None
    assert guard._refusal(scope, {b"host": b"[fe80::1]:8000"}) is None
    assert guard._refusal(scope, {b"host": b"attacker.example"}).status == 400


def test_a_body_must_be_json(served):
    port, rejected = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        status, body = ask(conn, "POST", "/echo", b'{"a": 1}', {} if ctype is None else {"Content-Type": ctype})
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", ctype
    for ctype in ("application/json", "Application/JSON; charset=utf-8"):
        assert ask(conn, "POST", "/echo", b'{"a": 1}', {"Content-Type": ctype}) == (200, {"got": 8})
    assert rejected == [415] * 4


def test_the_api_key_from_a_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("s3cret-key\nignored\n")
    assert with_api_key_from_file(ServerConfig(api_key_file=str(path))).api_key == "s3cret-key"
    assert with_api_key_from_file(ServerConfig(api_key="k")).api_key == "k"
    with pytest.raises(ValueError, match="cannot read"):
        with_api_key_from_file(ServerConfig(api_key_file=str(tmp_path / "missing")))
    path.write_text("\n")
    with pytest.raises(ValueError, match="no key"):
        with_api_key_from_file(ServerConfig(api_key_file=str(path)))
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(api_key="k", api_key_file=str(path))
