"""Faults under load, measured: real `pipeserve serve` processes (the embedded SmolLM2, CPU),
real sockets, and what each client, /health, /metrics and the process table show.

    python benchmarks/reliability.py                         # every scenario, ~8 min on 2 cores
    python benchmarks/reliability.py --only streams,disconnect --streams 64

Scenarios (each on a server of its own, started as the tests start theirs:
tests/server/helpers_server.py):

- ``bad``: the hand-made bad requests of tests/server/helpers_bad_requests.py, then
  Schemathesis's CLI against /openapi.json (coverage and fuzzing phases); the status codes seen.
- ``streams``: N concurrent streaming chat clients (greedy, 8 tokens), each answer against the
  same question asked alone; the time, and the /metrics gauges afterwards.
- ``disconnect``: N streaming clients hang up after their first tokens; how long until no
  request runs or waits and no KV block is held.
- ``sigkill``: pp=2, one worker SIGKILLed under load: what the clients get and when, when
  /health turns 503, the server's exit code.
- ``sigterm``: pp=2, SIGTERM to the server alone, to its process group, to every process: the
  in-flight streams finish, what new requests get, the exit code and the time to exit.

After each: no process of the server's tree, no port it listened on, no file in the private
TMPDIR its processes were given, no control-key file in its run folder. A table prints at the
end; ``--json PATH`` keeps the figures. Product code never imports this file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import io
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "server"), str(ROOT / "tests")]

from helpers_bad_requests import ALL, CHECK_NAMES, error_message, register_hooks, send  # noqa: E402
from helpers_server import (  # noqa: E402
    API_KEY,
    QUESTIONS,
    SIGNAL_MODES,
    Server,
    descendants,
    listening_ports,
    one_stream,
    pid_alive,
    run_load,
    signal_server,
    sse_events,
    worker_ranks,
)

IDLE_GAUGES = ("pipeserve:num_requests_running", "pipeserve:num_requests_waiting",
               "pipeserve:num_requests_in_flight", "pipeserve:kv_cache_blocks_used")
LONG = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 256, "ignore_eos": True,
        "temperature": 0, "stream": True}


# ---- a server of its own, and what it leaves behind ------------------------------------------


@dataclass
class Run:
    """One scenario's server: its process tree and ports (taken once it serves), its private
    TMPDIR and run folder."""

    server: Server
    tree: list[int]
    ports: set[int]
    tmpdir: Path
    run_dir: Path

    def leftovers(self, timeout_s: float = 60.0) -> dict:
        """What is left once the server has exited: live processes of its tree (after up to
        ``timeout_s``), ports still listening, files in its TMPDIR, control-key files."""
        deadline = time.monotonic() + timeout_s
        while any(map(pid_alive, self.tree)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {
            "processes": [pid for pid in self.tree if pid_alive(pid)],
            "ports": sorted(self.ports & listening_ports()),
            "tmp_files": sorted(str(p.relative_to(self.tmpdir)) for p in self.tmpdir.rglob("*")),
            "key_files": sorted(str(p) for p in self.run_dir.rglob("*") if "key" in p.name),
        }


@contextlib.contextmanager
def started(base: Path, name: str, *overrides: str):
    """A server whose processes get ``base/name/tmp`` as TMPDIR; killed (group and all) on the
    way out whatever happened."""
    run_dir, tmpdir = base / name, base / name / "tmp"
    tmpdir.mkdir(parents=True)
    saved = dict(os.environ)
    os.environ["TMPDIR"] = str(tmpdir)  # Server.start hands its environment on
    try:
        server = Server.start(run_dir, *overrides)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    tree = [server.proc.pid, *descendants(server.proc.pid)]
    try:
        yield Run(server, tree, listening_ports(tree), tmpdir, run_dir)
    finally:
        server.kill()


def idle_gauges(server: Server) -> dict[str, float]:
    m = server.metrics()
    return {k.removeprefix("pipeserve:"): m.get(k, 0.0) for k in IDLE_GAUGES}


def roles(run: Run) -> dict[int, str]:
    """{pid: frontend, engine, torchrun or worker N} of the tree (read while they all live)."""
    ranks = {pid: rank for rank, pid in worker_ranks(run.tree).items()}
    role = {run.server.proc.pid: "frontend", run.server.engine_pid: "engine"}
    return {pid: role.get(pid) or (f"worker {ranks[pid]}" if pid in ranks else "torchrun") for pid in run.tree}


def watch_exits(names: dict[int, str], t0: float) -> tuple[threading.Thread, dict[str, float]]:
    """A thread that notes, for each of ``names``' processes, the seconds from ``t0`` until it
    was gone (polled every 20 ms, for up to 3 minutes); start it right after the fault."""
    gone: dict[str, float] = {}

    def watch() -> None:
        while len(gone) < len(names) and time.monotonic() - t0 < 180:
            for pid, name in names.items():
                if name not in gone and not pid_alive(pid):
                    gone[name] = round(time.monotonic() - t0, 2)
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, gone


def stop(run: Run) -> dict:
    """SIGTERM, the exit code, the seconds to exit, and the leftovers."""
    t0 = time.monotonic()
    code = run.server.terminate(timeout_s=180)
    return {"exit_code": code, "exit_s": round(time.monotonic() - t0, 2), "leftovers": run.leftovers()}


# ---- bad requests and the fuzzer --------------------------------------------------------------


def scenario_bad(base: Path, args) -> dict:
    with started(base, "bad") as run:
        s = run.server
        cases = []
        for case in ALL:
            status, data = send(s, case)
            cases.append({"name": case.name, "expected": case.status, "got": status,
                          "message": (error_message(data) or data[:80].decode(errors="replace"))[:160]})
        fuzz = run_schemathesis(s, base, args)
        status, r = s.post("/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "temperature": 0})
        m = s.metrics()
        result = {"cases": cases, "fuzz": fuzz, "still_serving": status == 200, "idle": idle_after(s),
                  "rejected_500": m.get("pipeserve:requests_rejected_total[500]", 0.0)}
        return result | stop(run)


def run_schemathesis(server: Server, base: Path, args) -> dict:
    """Schemathesis's CLI in this process (its hooks cap generation and count statuses); its
    own report is kept in the results (``report``), its summary line printed. It runs in
    ``base``, where it keeps its caches (.schemathesis, .hypothesis)."""
    from schemathesis.cli import schemathesis as cli

    statuses: Counter = Counter()
    max_model_len = json.loads(server.request("GET", "/v1/models")[2])["data"][0]["max_model_len"]
    register_hooks(max_model_len, statuses)
    argv = ["run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {server.api_key}",
            "--phases", "examples,coverage,fuzzing", "-n", str(args.fuzz_examples), "--seed", str(args.seed),
            "-w", "1", "--checks", ",".join(CHECK_NAMES), "--request-timeout", "120", "--no-color"]
    t0 = time.monotonic()
    out = io.StringIO()
    with contextlib.chdir(base), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main(argv, standalone_mode=False)
            code = 0
        except SystemExit as e:
            code = e.code
    report = out.getvalue()
    by_op: dict[str, dict[int, int]] = {}
    for (op, status), n in sorted(statuses.items()):
        by_op.setdefault(op, {})[status] = n
    return {"exit_code": code, "seconds": round(time.monotonic() - t0, 1), "statuses": by_op,
            "max_examples": args.fuzz_examples, "seed": args.seed, "checks": CHECK_NAMES,
            "summary": next((line.strip() for line in report.splitlines() if re.match(r"\s*\d+ generated", line)), "?"),
            "report": report}


def idle_after(server: Server, timeout_s: float = 60.0) -> dict:
    """Seconds until no request runs or waits and no KV block is held; the gauges then."""
    t0 = time.monotonic()
    server.wait_idle(timeout_s=timeout_s)
    return {"seconds": round(time.monotonic() - t0, 2), **idle_gauges(server)}


# ---- concurrent streams ------------------------------------------------------------------------


@contextlib.contextmanager
def health_polled(server: Server):
    """/health every 100 ms while the block runs: how many answers, which statuses, the
    slowest answer's seconds."""
    seen: dict = {"answers": 0, "statuses": Counter(), "slowest_s": 0.0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            try:
                status = server.request("GET", "/health", timeout_s=30)[0]
            except (OSError, http.client.HTTPException) as e:
                status = type(e).__name__
            seen["answers"] += 1
            seen["statuses"][status] += 1
            seen["slowest_s"] = round(max(seen["slowest_s"], time.monotonic() - t0), 3)
            done.wait(0.1)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(timeout=60)


async def one_by_one(url: str) -> list:
    """Each question's streamed answer, asked alone."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        return [await one_stream(client, q) for q in QUESTIONS]


def scenario_streams(base: Path, args) -> dict:
    with started(base, "streams") as run:
        s = run.server
        alone = asyncio.run(one_by_one(s.url))
        sizes = []
        for n in args.streams:
            t0 = time.monotonic()
            with health_polled(s) as health:
                results = asyncio.run(run_load(s.url, n))
            wall = time.monotonic() - t0
            right = sum(got == alone[i % len(QUESTIONS)] for i, got in enumerate(results))
            sizes.append({"streams": n, "seconds": round(wall, 2), "correct": right, "health": health,
                          "tokens": sum(r[2] for r in results), "idle": idle_after(s)})
        return {"sizes": sizes} | stop(run)


# ---- clients hanging up ------------------------------------------------------------------------


def open_stream(server: Server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=120)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket, num_events: int) -> None:
    """Reads until ``num_events`` SSE events have arrived."""
    received = b""
    while received.count(b"data: ") < num_events:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the stream")
        received += chunk


def hang_up(server: Server, socks: list[socket.socket]) -> dict:
    """Closes ``socks``; the gauges just before, and how long until the server is idle."""
    before = idle_gauges(server)
    for sock in socks:
        sock.close()
    return {"before": before, "idle": idle_after(server)}


def scenario_disconnect(base: Path, args) -> dict:
    """Clients hang up mid-stream (after 1 to 4 events each); then, with more clients than the
    engine runs at once (max_num_seqs 128), while some are still queued."""
    with started(base, "disconnect") as run:
        s = run.server
        before = s.metrics()
        n = args.disconnects
        socks = [open_stream(s, LONG) for _ in range(n)]
        for i, sock in enumerate(socks):
            read_events(sock, 1 + i % 4)
        mid_stream = hang_up(s, socks)
        socks = [open_stream(s, LONG) for _ in range(n + 128)]
        s.wait_until(lambda m: m["pipeserve:num_requests_waiting"] > 0, timeout_s=60)
        queued = hang_up(s, socks)
        m = s.metrics()
        aborted = m.get("pipeserve:request_success_total[abort]", 0) - before.get(
            "pipeserve:request_success_total[abort]", 0)
        made = m["pipeserve:generation_tokens_total"] - before.get("pipeserve:generation_tokens_total", 0)
        status, _ = s.post("/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "temperature": 0})
        waves = [{"wave": "mid-stream (after 1-4 events)", "clients": n, **mid_stream},
                 {"wave": "some still queued", "clients": n + 128, **queued}]
        result = {"waves": waves, "asked_tokens": (2 * n + 128) * LONG["max_tokens"], "made_tokens": made,
                  "aborted": aborted, "still_serving": status == 200}
        return result | stop(run)


# ---- a worker SIGKILLed ------------------------------------------------------------------------


@dataclass
class Client:
    """One request in the background: what it got and when (time.monotonic())."""

    stream: bool
    status: int | None = None
    events: list = field(default_factory=list)
    answer: dict | None = None
    error: str | None = None
    ended: float | None = None

    def run(self, server: Server, body: dict) -> None:
        conn = server.connection(timeout_s=300)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=self.stream)),
                         headers=server.headers())
            resp = conn.getresponse()
            self.status = resp.status
            if self.stream and resp.status == 200:
                for event in sse_events(resp):
                    self.events.append(event)
            elif resp.status == 200:
                self.answer = json.loads(resp.read())
            else:
                self.error = error_message(resp.read())
        except (OSError, http.client.HTTPException) as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
            self.ended = time.monotonic()

    def finish_reason(self) -> str | None:
        if self.answer is not None:
            return self.answer["choices"][0]["finish_reason"]
        if len(self.events) >= 2 and self.events[-1] == "[DONE]":
            return self.events[-2]["choices"][0]["finish_reason"]
        return None

    def outcome(self) -> str:
        if reason := self.finish_reason():
            return f"{self.status}, finish_reason {reason}"
        if self.events and isinstance(self.events[-1], dict) and "error" in self.events[-1]:
            return f"{self.status}, then an error event: {self.events[-1]['error']['message']}"
        return f"{self.status}: {self.error}"


def in_background(server: Server, body: dict, streams: int, plain: int) -> tuple[list[Client], list[threading.Thread]]:
    clients = [Client(stream=True) for _ in range(streams)] + [Client(stream=False) for _ in range(plain)]
    threads = [threading.Thread(target=c.run, args=(server, body), daemon=True) for c in clients]
    for t in threads:
        t.start()
    return clients, threads


def poll_health(server: Server, t0: float, until_s: float) -> list[tuple[float, str]]:
    """/health every 50 ms from ``t0``: each change of answer (a status, or the error reaching
    it) with its time since ``t0``."""
    seen: list[tuple[float, str]] = []
    while time.monotonic() - t0 < until_s:
        try:
            answer = str(server.request("GET", "/health", timeout_s=5)[0])
        except (OSError, http.client.HTTPException) as e:
            answer = type(e).__name__
        if not seen or seen[-1][1] != answer:
            seen.append((round(time.monotonic() - t0, 3), answer))
        if answer == "ConnectionRefusedError":
            break
        time.sleep(0.05)
    return seen


def scenario_sigkill(base: Path, args) -> dict:
    return {"ranks": [kill_worker(base, rank) for rank in args.kill_ranks]}


def kill_worker(base: Path, rank: int) -> dict:
    with started(base, f"sigkill-{rank}", "parallel.pp=2") as run:
        s = run.server
        workers, names = worker_ranks(run.tree), roles(run)
        clients, threads = in_background(s, LONG, streams=4, plain=2)
        s.wait_until(lambda m: m.get("pipeserve:generation_tokens_total", 0) >= 16, timeout_s=120)
        t0 = time.monotonic()
        os.kill(workers[rank], signal.SIGKILL)
        watcher, gone = watch_exits(names, t0)
        health = poll_health(s, t0, until_s=60)
        for t in [*threads, watcher]:
            t.join(timeout=180)
        code = s.proc.wait(timeout=120)
        return {"killed_rank": rank, "health": health, "exit_code": code, "gone_s": gone,
                "clients": [{"stream": c.stream, "outcome": c.outcome(), "after_s": round(c.ended - t0, 3)}
                            for c in clients],
                "leftovers": run.leftovers()}


# ---- SIGTERM drains ----------------------------------------------------------------------------


def probe_while_draining(server: Server, kept: http.client.HTTPConnection, t0: float) -> dict[str, list]:
    """New requests while the server drains: on a connection opened before the signal, and on
    new connections every 100 ms until the server is gone; each distinct answer with the first
    time it came."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    seen: dict[str, list] = {"kept-alive connection": [], "new connection": []}

    def note(kind: str, answer: str) -> None:
        if answer not in (a for _, a in seen[kind]):
            seen[kind].append((round(time.monotonic() - t0, 3), answer))

    try:
        kept.request("POST", "/v1/completions", body=body, headers=server.headers())
        resp = kept.getresponse()
        note("kept-alive connection", f"{resp.status} {error_message(resp.read()) or ''}".strip())
    except (OSError, http.client.HTTPException) as e:
        note("kept-alive connection", type(e).__name__)
    while server.proc.poll() is None and time.monotonic() - t0 < 180:
        try:
            status, _, data = server.request("POST", "/v1/completions", body.encode(), timeout_s=10)
            note("new connection", f"{status} {error_message(data) or ''}".strip())
        except (OSError, http.client.HTTPException) as e:
            note("new connection", type(e).__name__)
        time.sleep(0.1)
    return seen


def scenario_sigterm(base: Path, args) -> dict:
    modes = []
    body = dict(LONG, max_tokens=32)
    for how in SIGNAL_MODES:
        with started(base, f"sigterm-{how.replace(' ', '-')}", "parallel.pp=2") as run:
            s = run.server
            kept = s.connection(timeout_s=60)
            kept.request("GET", "/health")
            kept.getresponse().read()
            clients, threads = in_background(s, body, streams=3, plain=1)
            s.wait_until(lambda m: m.get("pipeserve:generation_tokens_total", 0) >= 4, timeout_s=120)
            names = roles(run)
            t0 = time.monotonic()
            signal_server(s, how)
            watcher, gone = watch_exits(names, t0)
            probes = probe_while_draining(s, kept, t0)
            for t in [*threads, watcher]:
                t.join(timeout=180)
            code = s.proc.wait(timeout=180)
            modes.append({"mode": how, "exit_code": code, "gone_s": gone,
                          "last_answer_s": round(max(c.ended for c in clients) - t0, 2),
                          "in_flight": [c.outcome() for c in clients],
                          "finished_in_full": sum(c.finish_reason() == "length" for c in clients),
                          "probes": probes, "leftovers": run.leftovers()})
    return {"modes": modes}


# ---- the tables --------------------------------------------------------------------------------


def idle_text(idle: dict) -> str:
    """The seconds until idle, or what was still held."""
    held = {k: v for k, v in idle.items() if k != "seconds" and v}
    return str(idle["seconds"]) if not held else f"NOT IDLE {held}"


def gone_text(gone: dict[str, float]) -> str:
    return ", ".join(f"{name} {s}" for name, s in gone.items())


def leftover_text(left: dict) -> str:
    items = [f"{k}: {v}" for k, v in left.items() if v]
    return "none" if not items else "; ".join(items)


def print_tables(results: dict) -> None:
    print("\n## Reliability\n")
    if bad := results.get("bad"):
        by_status: dict = {}
        for c in bad["cases"]:
            by_status.setdefault(c["got"], []).append(c["name"] + ("" if c["got"] == c["expected"] else
                                                                   f" (expected {c['expected']})"))
        wrong = [c["name"] for c in bad["cases"] if c["got"] != c["expected"]]
        print(f"Bad requests: {len(bad['cases'])} tried, {len(wrong)} not as expected {wrong or ''}\n")
        print("| status | cases |\n|---|---|")
        for status, names in sorted(by_status.items(), key=lambda kv: str(kv[0])):
            print(f"| {status if status is not None else 'closed'} | {len(names)}: {', '.join(names)} |")
        f = bad["fuzz"]
        print(f"\nSchemathesis ({f['max_examples']} examples per operation, seed {f['seed']}, checks "
              f"{', '.join(f['checks'])}): {f['summary']}, exit code {f['exit_code']}, {f['seconds']} s\n")
        print("| operation | cases | statuses |\n|---|---|---|")
        for op, statuses in f["statuses"].items():
            spread = ", ".join(f"{k}: {v}" for k, v in statuses.items())
            print(f"| {op} | {sum(statuses.values())} | {spread} |")
        print(f"\nafter: still serving {bad['still_serving']}, 500s counted {bad['rejected_500']:g}, idle after "
              f"{idle_text(bad['idle'])} s, exit {bad['exit_code']} in {bad['exit_s']} s, leftovers "
              f"{leftover_text(bad['leftovers'])}")
    if st := results.get("streams"):
        print("\n| concurrent streams | wall s | same answer as alone | tokens | /health meanwhile | "
              "gauges 0 after s | leftovers |")
        print("|---|---|---|---|---|---|---|")
        for z in st["sizes"]:
            h = z["health"]
            health = f"{dict(h['statuses'])} of {h['answers']}, slowest {h['slowest_s']} s"
            print(f"| {z['streams']} | {z['seconds']} | {z['correct']}/{z['streams']} | {z['tokens']} | {health} | "
                  f"{idle_text(z['idle'])} | {leftover_text(st['leftovers'])} |")
    if d := results.get("disconnect"):
        print("\n| clients hang up | clients | running / waiting / KV blocks before | idle after s | leftovers |")
        print("|---|---|---|---|---|")
        for w in d["waves"]:
            b = w["before"]
            print(f"| {w['wave']} | {w['clients']} | {b['num_requests_running']:g} / {b['num_requests_waiting']:g} / "
                  f"{b['kv_cache_blocks_used']:g} | {idle_text(w['idle'])} | {leftover_text(d['leftovers'])} |")
        print(f"\naborted {d['aborted']:g}, {d['made_tokens']:g} of {d['asked_tokens']} tokens made; still serving "
              f"{d['still_serving']}; exit {d['exit_code']}")
    if k := results.get("sigkill"):
        for r in k["ranks"]:
            print(f"\nSIGKILL of worker rank {r['killed_rank']} (pp=2):\n")
            print("| client | after s | got |\n|---|---|---|")
            for c in r["clients"]:
                print(f"| {'stream' if c['stream'] else 'non-stream'} | {c['after_s']} | {c['outcome'][:200]} |")
            print(f"\n/health: {r['health']}; server exit code {r['exit_code']}; gone after s: "
                  f"{gone_text(r['gone_s'])}; leftovers {leftover_text(r['leftovers'])}")
    if t := results.get("sigterm"):
        print("\n| SIGTERM to | in flight finished | last answer s | new requests while draining | exit code | "
              "gone after s | leftovers |")
        print("|---|---|---|---|---|---|---|")
        for m in t["modes"]:
            probes = "; ".join(f"{kind}: " + ", ".join(f"{a} ({s} s)" for s, a in answers)
                               for kind, answers in m["probes"].items())
            print(f"| {m['mode']} | {m['finished_in_full']}/{len(m['in_flight'])} | {m['last_answer_s']} | {probes} | "
                  f"{m['exit_code']} | {gone_text(m['gone_s'])} | {leftover_text(m['leftovers'])} |")


SCENARIOS = {"bad": scenario_bad, "streams": scenario_streams, "disconnect": scenario_disconnect,
             "sigkill": scenario_sigkill, "sigterm": scenario_sigterm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    p.add_argument("--streams", default="64,256", help="concurrent streaming clients, one run per size")
    p.add_argument("--disconnects", type=int, default=64, help="clients that hang up mid-stream")
    p.add_argument("--fuzz-examples", type=int, default=100, help="Schemathesis examples per operation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-ranks", default="1,0", help="the workers SIGKILLed at pp=2, one server each")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    args.streams = [int(n) for n in args.streams.split(",")]
    args.kill_ranks = [int(r) for r in args.kill_ranks.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeserve-reliability-") as base:
        for name in args.only.split(","):
            t0 = time.monotonic()
            print(f"reliability: {name} …", flush=True)
            results[name] = SCENARIOS[name](Path(base), args)
            print(f"reliability: {name} done in {time.monotonic() - t0:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print_tables(results)


if __name__ == "__main__":
    main()
