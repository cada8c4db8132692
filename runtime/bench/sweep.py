"""A sweep's points, each run as a process of its own, and one table of their results.

A process group cannot be re-initialized inside one process, and with parallel.tp × pp > 1 a
point starts its own torchrun job: so each point is a child process that writes its
result.json, and the parent collects one row per point (``run_point``) and writes the table
(``write_table``: sweep_table.csv and sweep_table.md). `pipeserve bench --multirun` drives it
(launch/bench.py, launch/sweep.py).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import threading

# (column, path into result.json, scale) of the sweep table, after the point's overrides.
COLUMNS = [
    ("req/s", ("throughput", "requests_per_s"), 1),
    ("out tok/s", ("throughput", "output_tokens_per_s"), 1),
    ("total tok/s", ("throughput", "total_tokens_per_s"), 1),
    ("prefill saved", ("prefill", "saved_fraction"), 1),
    ("TTFT P50 ms", ("ttft_s", "p50"), 1e3),
    ("TTFT P99 ms", ("ttft_s", "p99"), 1e3),
    ("TBT P50 ms", ("tbt_s", "p50"), 1e3),
    ("TBT P99 ms", ("tbt_s", "p99"), 1e3),
    ("e2e P50 s", ("e2e_s", "p50"), 1),
    ("sched delay P50 s", ("scheduling_delay_s", "p50"), 1),
    ("sched delay P99 s", ("scheduling_delay_s", "p99"), 1),
    ("bubble", ("bubble_fraction_mean",), 1),
    ("step time CV", ("step_time_cv_mean",), 1),
    ("decode stalls", ("num_decode_stalls",), 1),
    ("prefill MFU", ("efficiency", "prefill_mfu"), 1),
    ("decode MBU", ("efficiency", "decode_mbu"), 1),
    ("capacity req/s", ("capacity", "capacity_rps"), 1),
]


def run_point(command: list[str], *, overrides: list[str], out_dir: str) -> dict:
    """Runs one sweep point as ``command`` (a process that writes ``out_dir``/result.json);
    returns its table row (never raises). ``overrides`` name the point in the table."""
    code, err_tail = _run_teeing_stderr(command)
    row = {"overrides": overrides, "dir": out_dir, "status": "ok", "error": None}
    path = os.path.join(out_dir, "result.json")
    if code == 0 and os.path.exists(path):
        with open(path) as f:
            row["result"] = json.load(f)
    else:
        row.update(status="failed", error=_last_error_line(err_tail) or f"exit code {code}")
    return row


def _run_teeing_stderr(cmd: list[str]) -> tuple[int, str]:
    """Runs ``cmd`` with its stderr shown live (progress bars) and its last 8 KB kept."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    tail = bytearray()

    def pump() -> None:
        while chunk := proc.stderr.read1(4096):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail.extend(chunk)
            del tail[:-8192]

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    code = proc.wait()
    thread.join(timeout=5)
    return code, tail.decode(errors="replace")


def _last_error_line(text: str) -> str | None:
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or [None])[-1]


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells: one column per swept key (overrides that differ between points; every
    override for a single point), then the metric columns."""
    given = [dict(o.lstrip("+~").split("=", 1) for o in row["overrides"] if "=" in o) for row in rows]
    keys: list[str] = []
    for g in given:
        keys += [k for k in g if k not in keys]
    if len(rows) > 1:
        keys = [k for k in keys if len({g.get(k) for g in given}) > 1]
    header = [*keys, "status", *(c for c, _, _ in COLUMNS), "error"]
    cells = []
    for row, g in zip(rows, given):
        result = row.get("result") or {}
        cells.append([g.get(k, "") for k in keys] + [row["status"]]
                     + [_fmt(_get(result, path), scale) for _, path, scale in COLUMNS] + [row["error"] or ""])
    return header, cells


def _get(d: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _fmt(x, scale: float) -> str:
    if x is None:
        return ""
    if isinstance(x, int):
        return str(x)
    return f"{x * scale:.4g}"


def write_table(rows: list[dict], out_dir: str) -> tuple[str, str]:
    """sweep_table.csv and sweep_table.md in ``out_dir``; returns the markdown."""
    header, cells = table_rows(rows)
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *cells])
    with open(os.path.join(out_dir, "sweep_table.csv"), "w") as f:
        f.write(buf.getvalue())
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "sweep_table.md"), "w") as f:
        f.write(text)
    return buf.getvalue(), text
