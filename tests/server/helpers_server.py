"""A real `pipeserve serve` process for the server tests, and a tiny HTTP client.

Every wait is bounded; `Server.kill()` (called from fixtures' finally blocks) leaves no process
behind: the frontend, and the engine (its own session, with any torchrun workers).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import openai
from helpers_net import descendants, listening_sockets  # noqa: F401 (descendants: for the tests)

PIPESERVE = [sys.executable, "-m", "pipeserve.launch.cli"]
API_KEY = "test-key-0123"
COMMON = [
    "server.port=0", "server.log_level=warning", "server.stats_interval_s=0.2", "server.body_timeout_s=3",
    "engine.device=cpu", "engine.dtype=float32", "engine.num_kv_blocks=256", "engine.max_model_len=512",
]
MODEL = "SmolLM2-135M-Instruct"
_READY = re.compile(r"pipeserve: serving (\S+) on (https?://\S+) \(engine pid (\d+)\)")


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, engine_pid: int, api_key: str | None) -> None:
        self.proc, self.url, self.engine_pid, self.api_key = proc, url, engine_pid, api_key
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.stdout: list[str] = []
        self.run_dir = None  # where stderr.txt is
        self.ssl_context = None  # for an https:// server: an ssl.SSLContext that trusts its certificate

    @classmethod
    def start(cls, run_dir, *overrides: str, api_key: str | None = API_KEY, timeout_s: float = 300.0) -> Server:
        args = [*PIPESERVE, "serve", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
        if api_key is not None:
            args.append(f"--api-key={api_key}")
        stderr = open(os.path.join(run_dir, "stderr.txt"), "wb") if os.path.isdir(run_dir) else None
        # One intra-op thread: on a small shared CPU box, OpenMP threads spinning against other
        # processes make a step 10-20x slower (the engine and the tests share the cores).
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("PIPESERVE_TEST_OMP_THREADS", "1"))
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                start_new_session=True)
        lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:  # keep reading: a full pipe would block the server
            for line in proc.stdout:
                lines.append(line)
                if _READY.search(line):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                _kill_group(proc.pid)
                raise RuntimeError(f"server did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}"
                                   f"\n{_tail(run_dir)}")
        m = next(_READY.search(x) for x in lines if _READY.search(x))
        server = cls(proc, m.group(2), int(m.group(3)), api_key)
        server.stdout, server.run_dir = lines, run_dir
        return server

    # ---- HTTP --------------------------------------------------------------------------------

    def headers(self, extra: dict | None = None) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h | (extra or {})

    def connection(self, timeout_s: float = 120.0) -> http.client.HTTPConnection:
        if self.url.startswith("https://"):
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.ssl_context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def request(self, method: str, path: str, body=None, *, headers: dict | None = None,
                timeout_s: float = 120.0) -> tuple[int, dict, bytes]:
        """(status, headers, body); `body` may be a dict (sent as JSON) or raw bytes."""
        conn = self.connection(timeout_s)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            conn.request(method, path, body=data, headers=self.headers() if headers is None else headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def post(self, path: str, body, **kw) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body, **kw)
        return status, json.loads(data)

    def stream(self, path: str, body: dict, *, timeout_s: float = 120.0):
        """Yields each SSE `data:` payload (parsed JSON, or the string "[DONE]")."""
        conn = self.connection(timeout_s)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers=self.headers())
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            yield from sse_events(resp)
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels other than `stage`, `finished_reason` dropped)."""
        status, _, data = self.request("GET", "/metrics", timeout_s=30.0)
        assert status == 200
        out: dict[str, float] = {}
        for line in data.decode().splitlines():
            if line.startswith("#") or not line:
                continue
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            for label in ("stage", "finished_reason", "status"):
                if m := re.search(label + r'="([^"]*)"', name):
                    key += f"[{m.group(1)}]"
            out[key] = float(value)
        return out

    def wait_until(self, predicate, timeout_s: float = 60.0) -> dict[str, float]:
        """Polls /metrics until `predicate(metrics)` holds; returns the metrics then."""
        deadline = time.monotonic() + timeout_s
        while not predicate(m := self.metrics()):
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met after {timeout_s}s: {m}")
            time.sleep(0.1)
        return m

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Waits until nothing runs, waits or holds a KV block; returns the metrics then."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            busy = [k for k in ("pipeserve:num_requests_running", "pipeserve:num_requests_waiting",
                                "pipeserve:num_requests_in_flight", "pipeserve:kv_cache_blocks_used") if m.get(k)]
            if not busy:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout_s}s: {[(k, m[k]) for k in busy]}")
            time.sleep(0.2)

    # ---- lifetime ----------------------------------------------------------------------------

    def terminate(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (drain), then the exit code; killed if it does not exit in time."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        for pid in (self.proc.pid, self.engine_pid):
            _kill_group(pid)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def engine_alive(self) -> bool:
        return pid_alive(self.engine_pid)


SIGNAL_MODES = ("server", "group", "every process")


def signal_server(server: Server, how: str, sig: int = signal.SIGTERM) -> None:
    """`sig` to the server process alone, to its process group, or to every process of its tree
    at once (what Slurm does on `scancel` and at the time limit)."""
    if how == "server":
        os.kill(server.proc.pid, sig)
    elif how == "group":
        os.killpg(server.proc.pid, sig)  # its own session: the frontend's group
    else:  # "every process": the frontend, the engine, torchrun and the workers, at once
        assert how == "every process", how
        for pid in [server.proc.pid, *descendants(server.proc.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


# ---- concurrent streams through the official async client -----------------------------------

QUESTIONS = ["What is the capital of France?", "Name a planet.", "What do bees make?", "Count to three.",
             "What is 2 + 2?", "Name a color.", "Who wrote Hamlet?"]


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


async def one_stream(client: openai.AsyncOpenAI, q: str) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=chat(q), temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    text, reason, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, reason, usage


async def run_load(url: str, num_requests: int) -> list[tuple[str, str | None, int]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=600) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(one_stream(client, QUESTIONS[i % len(QUESTIONS)]) for i in range(num_requests))),
            timeout=900)



def streams_in_background(server, body: dict, num_streams: int, timeout_s: float = 120.0):
    """Starts `num_streams` streaming /v1/completions requests, each read on its own thread;
    returns (the threads, each stream's events as they arrive)."""
    results: list[list] = [[] for _ in range(num_streams)]

    def consume(i: int) -> None:
        for event in server.stream("/v1/completions", body, timeout_s=timeout_s):
            results[i].append(event)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    return threads, results


def sse_events(resp):
    """SSE `data:` payloads of an http.client response, as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        yield payload if payload == "[DONE]" else json.loads(payload)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def worker_ranks(pids: list[int]) -> dict[int, int]:
    """{global rank: pid} of the torchrun workers among ``pids`` (their RANK, LOCAL_RANK)."""
    ranks = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"RANK" in env and b"LOCAL_RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def listening_ports(pids: list[int] | None = None) -> set[int]:
    """TCP ports on which these processes (None: any process) listen, what `ss -ltnp` shows."""
    return {port for _, port in listening_sockets(pids)}


def speaks_zeromq(port: int) -> bool:
    """A ZeroMQ (ZMTP 3) peer greets a new connection first: 0xFF, 8 bytes, 0x7F."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            greeting = b""
            while len(greeting) < 10:
                chunk = s.recv(10 - len(greeting))
                if not chunk:
                    return False
                greeting += chunk
            return greeting[0] == 0xFF and greeting[9] == 0x7F
    except OSError:
        return False


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _kill_group(pid: int) -> None:
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def _tail(run_dir) -> str:
    try:
        with open(os.path.join(run_dir, "stderr.txt"), "rb") as f:
            return f.read()[-3000:].decode(errors="replace")
    except OSError:
        return ""
