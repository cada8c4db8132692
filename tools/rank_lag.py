"""Where the ranks of a run wait for each other, step by step, from the workers' timelines:

    PIPESERVE_STAGE_STATS_DIR=/tmp/ranks python3 benchmarks/throughput.py --tp 4 --workload decode-heavy
    python -m tools.rank_lag /tmp/ranks [--out ranks.json]

Each worker records, per step, when its forward started and ended on its device (CUDA events
on the host clock, which every process of a host shares) and when its host had queued the
step's work; rank 0 writes every rank's ``stage_rank{r}.json`` at shutdown. Per rank, medians
over the steps every rank of its stage ran:

- ``compute_ms``: the forward span (it includes any wait inside it, e.g. a sum whose peers are late);
- ``gap_ms``: the device idle before the step (start minus the previous step's end);
  ``gap_total_s`` and ``gap_max_ms``: all of them summed, and the longest (a median hides a
  few long stops); ``longest_gaps``: the five longest, as [step, ms] (stops that recur every
  so many steps, on every rank at once, are the rank's own process held);
- ``late_ms``: how long after the stage's first rank it started the step;
- ``host_ahead_ms``: start minus the host's "queued" instant: positive, the host had queued the
  step before the device reached it; negative, the device started while the host was still
  launching (``host_bound`` is the fraction of such steps). On a CPU the host computes the
  step itself, so every step reads as host-bound there;
- ``full_gcs`` and ``full_gc_ms``: the cycle collector's full (generation 2) collections in the
  rank's process from its first step on, and their summed time (``runtime/heap.py``).

Rank 0 late by the same amount every step while the others' compute spans exceed its own by
it reads as the others waiting for rank 0 inside their first collective.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def load_timelines(folder: str) -> list[dict]:
    """Every ``stage_rank*.json`` of ``folder``, by rank."""
    paths = glob.glob(os.path.join(folder, "stage_rank*.json"))
    if not paths:
        raise SystemExit(f"no stage_rank*.json in {folder} (was PIPESERVE_STAGE_STATS_DIR set for the run?)")
    timelines = []
    for path in paths:
        with open(path) as f:
            timelines.append(json.load(f))
    return sorted(timelines, key=lambda t: t["rank"])


def rank_lags(timelines: list[dict]) -> list[dict]:
    """Per rank: its stage and tp rank, the number of steps compared, and the medians above (ms)."""
    by_stage: dict[int, list[dict]] = {}
    for t in timelines:
        by_stage.setdefault(t["stage"], []).append(t)
    rows = []
    for stage, ranks in sorted(by_stage.items()):
        spans = [{step: (start, end, queued) for step, _recv, start, end, queued in t["spans"]} for t in ranks]
        common = sorted(set.intersection(*(set(s) for s in spans)))
        first = {step: min(s[step][0] for s in spans) for step in common}
        for t, own in zip(ranks, spans):
            ordered = sorted(own.items(), key=lambda kv: kv[1][0])
            gaps = [b[0] - a[1] for (_, a), (_, b) in zip(ordered, ordered[1:])]
            longest = sorted(zip(gaps, (step for step, _ in ordered[1:])), reverse=True)[:LONGEST]
            ahead = [own[step][0] - own[step][2] for step in common]
            full = t.get("host", {}).get("gc", {}).get("gen2", {})
            rows.append({
                "rank": t["rank"], "stage": stage, "tp_rank": t.get("tp_rank"), "steps": len(common),
                "compute_ms": _median_ms(own[step][1] - own[step][0] for step in common),
                "gap_ms": _median_ms(gaps),
                "gap_total_s": round(sum(g for g in gaps if g > 0), 3),
                "gap_max_ms": round(max(gaps) * 1e3, 3) if gaps else None,
                "longest_gaps": [[step, round(gap * 1e3, 1)] for gap, step in longest],
                "late_ms": _median_ms(own[step][0] - first[step] for step in common),
                "host_ahead_ms": _median_ms(ahead),
                "host_bound": round(sum(a < 0 for a in ahead) / len(ahead), 3) if ahead else None,
                "full_gcs": full.get("n"), "full_gc_ms": full.get("total_ms"),
            })
    return rows


LONGEST = 5
"""Gaps listed per rank, the longest first."""


def _median_ms(seconds) -> float | None:
    values = list(seconds)
    return round(statistics.median(values) * 1e3, 3) if values else None


def table(rows: list[dict]) -> str:
    head = ["rank", "stage", "steps", "compute ms", "gap ms", "gaps s", "longest gap ms", "late ms", "host ahead ms",
            "host-bound", "full GCs", "full GC ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in (
            r["rank"], r["stage"], r["steps"], r["compute_ms"], r["gap_ms"], r["gap_total_s"], r["gap_max_ms"],
            r["late_ms"], r["host_ahead_ms"], r["host_bound"], r["full_gcs"], r["full_gc_ms"])) + " |")
    lines.append("")
    for r in rows:  # the stops the medians hide
        gaps = ", ".join(f"{ms} ms before step {step}" for step, ms in r["longest_gaps"])
        lines.append(f"rank {r['rank']}, longest gaps: {gaps or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the run's PIPESERVE_STAGE_STATS_DIR")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = rank_lags(load_timelines(args.folder))
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
