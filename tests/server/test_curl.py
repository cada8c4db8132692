"""curl, as the README tells a user to run it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from helpers_server import API_KEY

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")]


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "120", *args], capture_output=True, text=True, timeout=150)


def test_chat_completion(server):
    body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    out = curl(f"{server.url}/v1/chat/completions", "-H", "Content-Type: application/json",
               "-H", f"Authorization: Bearer {API_KEY}", "-d", json.dumps(body))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_streamed_chat(server):
    body = {"temperature": 0, "max_tokens": 12, "stream": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    out = curl("-N", f"{server.url}/v1/chat/completions", "-H", f"Authorization: Bearer {API_KEY}",
               "-H", "Content-Type: application/json", "-d", json.dumps(body))
    assert out.returncode == 0, out.stderr
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "The capital of France is Paris."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_and_auth(server):
    out = curl(f"{server.url}/v1/completions", "-H", f"Authorization: Bearer {API_KEY}",
               "-H", "Content-Type: application/json",
               "-d", '{"prompt": "The sky is", "max_tokens": 3, "temperature": 0}')
    r = json.loads(out.stdout)
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 3
    # Without the header curl says form data: refused, since a web page may send that unasked.
    out = curl("-w", " %{http_code}", f"{server.url}/v1/completions", "-H", f"Authorization: Bearer {API_KEY}",
               "-d", '{"prompt": "The sky is", "max_tokens": 3}')
    assert out.stdout.endswith(" 415") and "application/json" in out.stdout
    # No key: 401 on every route but /health.
    for path in ("/v1/models", "/metrics", "/v1/completions", "/no/such/route"):
        out = curl("-o", "/dev/null", "-w", "%{http_code}", f"{server.url}{path}")
        assert out.stdout == "401", path
    out = curl("-w", " %{http_code}", f"{server.url}/health")
    assert out.stdout.endswith(" 200")
