"""The first requests after `pipeserve serve` reports ready, against the later ones: start-up
and TTFT through HTTP, as a user of a freshly started server meets them.

Starts `pipeserve serve` on a config-only model folder (random weights of ``--shape``, as
throughput.py's), times it from launch to its "serving ... on URL" line, then sends the same
requests ``--rounds`` times, one round after another, through `pipeserve bench serve` (the same
prompts and arrivals each round; prefix caching is off by default, so no round reuses another's
KV). Prints one JSON line (``RESULT {...}``): the start-up seconds and, per round, the mean, median
and P99 TTFT, total tokens/s and failures. The Triton cache is wherever the server finds it
(``TRITON_CACHE_DIR``): `bash benchmarks/gpu.sh coldserve` runs this with an emptied one, then
with the one that run left.

    python3 benchmarks/cold_serve.py [--tp 2] [--rounds 3] [--num-prompts 64] [--tokenizer T]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import SHAPES, model_folder  # noqa: E402  (this folder's)

READY = re.compile(r"^pipeserve: serving .* on (http://\S+)")


class Server:
    """`pipeserve serve` on a model folder, its output echoed here line by line."""

    def __init__(self, folder: str, args: argparse.Namespace, run_dir: str) -> None:
        cmd = [sys.executable, "-m", "pipeserve.launch.cli", "serve", "model=hf", f"model.path={folder}",
               "engine.load_format=dummy", "server.port=0", f"parallel.tp={args.tp}", f"parallel.pp={args.pp}",
               f"scheduler.max_num_batched_tokens={args.max_num_batched_tokens}",
               f"scheduler.max_num_seqs={args.max_num_seqs}", f"engine.max_model_len={args.max_model_len}",
               f"hydra.run.dir={run_dir}", *args.override]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            sys.stdout.write(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout_s: float) -> tuple[str, float]:
        """(its URL, seconds from launch to its ready line); RuntimeError with the output's tail
        if it exits first or is not ready within ``timeout_s``."""
        seen: list[str] = []
        while True:
            left = timeout_s - (time.perf_counter() - self.t0)
            try:
                line = self.lines.get(timeout=left) if left > 0 else None
            except queue.Empty:
                line = None
            if line is None:
                tail = "".join(seen[-20:])
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pipeserve serve exited ({self.proc.returncode}) before it was ready:\n{tail}")
                raise RuntimeError(f"pipeserve serve was not ready within {timeout_s:.0f} s:\n{tail}")
            seen.append(line)
            if m := READY.match(line):
                return m.group(1), time.perf_counter() - self.t0

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (the server drains, then stops its engine and workers), then SIGKILL; then the
        rest of its output, so that nothing of it lands after this process's own lines."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.pump.join(timeout=10.0)  # EOF once every process that held the pipe has gone


def one_round(url: str, folder: str, args: argparse.Namespace, out: str) -> dict:
    """One `pipeserve bench serve` round; its TTFT figures (ms), throughput and failures."""
    cmd = [sys.executable, "-m", "pipeserve.launch.cli", "bench", "serve", "--base-url", url, "--tokenizer", folder,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
           "--save-result", "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out)]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        r = json.load(f)
    ttft = r["ttft_s"]
    return {"mean_ttft_ms": _ms(ttft.get("mean")), "p50_ttft_ms": _ms(ttft.get("p50")),
            "p99_ttft_ms": _ms(ttft.get("p99")), "total_tok_s": round(r["throughput"]["total_tokens_per_s"] or 0, 1),
            "wall_s": round(r["throughput"]["wall_s"], 3), "failed": r["num_failed"]}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: a generated GPT-2-size one)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None, help="fewer for a quick check (default: the shape's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--seed", type=int, default=0, help="the prompts and arrivals, the same every round")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("override", nargs="*", help="more `pipeserve serve` overrides (key=value)")
    args = p.parse_args(argv)
    # A timeout's SIGTERM unwinds through the clean-up below: the server is never left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    folder = model_folder(args.tokenizer, args.num_layers, args.shape)
    work = tempfile.mkdtemp(prefix="pipeserve-cold-serve-")
    server = None
    try:
        server = Server(folder, args, os.path.join(work, "serve"))
        url, start_s = server.wait_ready(args.start_timeout_s)
        rounds = [one_round(url, folder, args, os.path.join(work, f"round{i}.json")) for i in range(args.rounds)]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    result = {"shape": args.shape, "tp": args.tp, "pp": args.pp, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len,
              "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
              "start_s": round(start_s, 1), "rounds": rounds}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: no other line inside it
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
