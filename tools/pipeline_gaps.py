"""Where a pipeline's idle time goes, from a bench run's Chrome trace.

    python -m tools.pipeline_gaps RUN_DIR            # RUN_DIR/trace.json + result.json
    python -m tools.pipeline_gaps trace.json --pp 2 --feedback

For every stage lane (TP rank 0 of each stage) it splits the wall time from the first
micro-batch's start to the last one's end into compute and the gaps before each micro-batch,
and gives each gap the cause that ended it, judged from the engine's submit instants and the
other stages' spans:

- ``previous stage``: a later stage waiting for its input hidden states (its recv wait);
- ``fed tokens``: stage 0 with token feedback, when the last stage ended a micro-batch whose
  sampled ids j's fed decodes take inside the gap (the ids' trip; the sampling is inside the last
  stage's compute);
- ``plan``: the engine submitted micro-batch j inside the gap (nothing to run yet);
- ``host``: none of these: the rank's own host work between micro-batches (plan decoding,
  input preparation, launches).

When both the fed ids and the plan came inside a gap, the later of the two ended it. The steps a
micro-batch is fed from are in the trace's submit instants (``fed_from``); for traces written
before they were, a decode of j counts as fed from j − pp when ``--feedback`` is on.

Compute is shown per kind of micro-batch (carrying prompt tokens, or decodes only): the median
span and, in brackets, the median time the span went on after the rank's host had queued its
last kernel (from the trace's ``queued_ms``). Near zero, the device ran at the pace of the host's
launches: a stage that never waits for its input starts each span as soon as the previous one
ends, while its host is still launching, so a slow launch shows as compute there and as
``previous stage`` idle on the stages after it. The ``imbalance`` column is the mean over
micro-batches of 1 - (this stage's compute / the slowest stage's compute of that micro-batch):
what an even split of the layers would save.
The attribution is a reading of host-clock instants, good to tens of microseconds.

A second table says where the idle sits: the part before decode-only micro-batches, by cause,
and, for the gaps a plan ended, how long before the submit the engine had had its newest result
(the micro-batches' async slices end when it has them): a short time means the plan waited for
that result (the in-flight window was full), a long one that the engine's own loop was slow.

A third table splits the decode-only micro-batches by how many decodes they carry: a micro-batch
of one or two decodes means one to four requests were running, too few to fill the pipeline (a
request decodes at most once per ``pp`` micro-batches), so its stages wait for each other by
construction; the large ones show what a full pipeline of decodes loses per micro-batch.

A fourth table says how uniform the compute was: the coefficient of variation of the spans of
micro-batches carrying prompt tokens (those a token or time budget fills) and of decode-only
ones, and with a time budget, the median and CV of span / predicted time per micro-batch. Its
last column is the idle before micro-batches within ``pp`` steps of a switch between the two
kinds (the engine's step order): where a long micro-batch follows short ones the stage after
waits for the difference, and where a short one follows, the stage before does (with token
feedback, one step later), so each prompt that arrives into decode-only steps costs about one
difference on each stage.

Given a run directory whose ``result.json`` holds the workers' host summaries, a fifth table
gives each rank's host time per step from the forward's first launch to its last (eager and
CUDA graph steps) and the caching allocator's retries (each one synchronizes the device).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import statistics
from collections.abc import Sequence

from pipeserve.runtime.bench.metrics import coefficient_of_variation, percentile

_EPS_S = 20e-6  # instants closer than this count as the same moment
DECODE_SIZES = ((1, 2), (3, 7), (8, 31), (32, None))
"""Buckets of decode-only micro-batches by their decodes (inclusive bounds; None: no upper one)."""


_SIZE_NAMES = [f"{lo}+" if hi is None else f"{lo}-{hi}" for lo, hi in DECODE_SIZES]
_SIZE_ORDER = {name: i for i, name in enumerate(["0", *_SIZE_NAMES])}


def _size_bucket(decodes: int) -> str:
    for (lo, hi), name in zip(DECODE_SIZES, _SIZE_NAMES):
        if decodes >= lo and (hi is None or decodes <= hi):
            return name
    return "0"


def stage_lanes(events: list[dict]) -> dict[int, str]:
    """Thread id -> name of every stage lane (TP rank 0 of each stage) in trace events."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return {tid: name for tid, name in names.items() if name.startswith("stage ") and " tp" not in name}


def analyze(trace: dict, *, pp: int, feedback: bool) -> list[dict]:
    """One row per stage lane: wall, compute, idle by cause (seconds) and compute shapes."""
    events = trace["traceEvents"]
    names = stage_lanes(events)
    lanes = sorted(names)
    compute: dict[int, dict[int, tuple[float, float]]] = {tid: {} for tid in lanes}
    after_queued: dict[int, dict[int, float]] = {tid: {} for tid in lanes}  # span end - host's last launch
    recv: dict[int, dict[int, float]] = {tid: {} for tid in lanes}
    submit: dict[int, tuple[float, int, int, list[int] | None]] = {}  # step -> (ts s, tokens, prefill, fed from)
    predicted: dict[int, float] = {}  # step -> the cost model's seconds (time budget runs)
    results: list[float] = []  # when the engine had each micro-batch's result (its async slice's end)
    for e in events:
        if e.get("ph") == "X" and e.get("tid") in compute:
            step = e["args"]["step"]
            if e.get("cat") == "compute":
                compute[e["tid"]][step] = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                if (queued := e["args"].get("queued_ms")) is not None:
                    after_queued[e["tid"]][step] = (e["dur"] / 1e3 - max(queued, 0.0)) / 1e3
            elif e.get("cat") == "wait":
                recv[e["tid"]][step] = e["dur"] / 1e6
        elif e.get("ph") == "i" and e.get("name", "").startswith("submit "):
            a = e["args"]
            step = int(e["name"].split()[1])
            submit[step] = (e["ts"] / 1e6, a["tokens"], a["prefill_tokens"], a.get("fed_from"))
            if a.get("predicted_ms"):
                predicted[step] = a["predicted_ms"] / 1e3
        elif e.get("ph") == "e" and e.get("cat") == "microbatch":
            results.append(e["ts"] / 1e6)
    results.sort()
    if not lanes or not any(compute.values()):
        raise ValueError("the trace has no stage lanes with compute spans (a bench run's trace.json?)")
    last = compute[lanes[-1]]
    slowest = {}
    for spans in compute.values():
        for step, (a, b) in spans.items():
            slowest[step] = max(slowest.get(step, 0.0), b - a)
    def fed_end(step: int) -> float | None:
        """When the last stage ended the newest micro-batch whose ids ``step`` is fed from."""
        _, tokens, prefill, fed_from = submit.get(step, (None, 0, 0, None))
        if fed_from is None:  # an older trace: a decode of j is fed from j - pp
            fed_from = [step - pp] if feedback and tokens > prefill else []
        ends = [last[k][1] for k in fed_from if k in last]
        return max(ends) if ends else None

    def reaction(step: int) -> float | None:
        """How long before submitting ``step`` the engine had its newest result (None: none yet)."""
        i = bisect.bisect_right(results, submit[step][0] + _EPS_S)
        return submit[step][0] - results[i - 1] if i else None

    def carries_prompt(step: int) -> bool:
        return submit[step][2] > 0

    ordered = sorted(submit)
    num_switches = sum(carries_prompt(a) != carries_prompt(b) for a, b in itertools.pairwise(ordered))
    rows = []
    for index, tid in enumerate(lanes):
        spans = compute[tid]
        steps = sorted(spans)
        idle = {"previous stage": 0.0, "fed tokens": 0.0, "plan": 0.0, "host": 0.0}
        decode_idle = dict.fromkeys(idle, 0.0)  # the part of each before a decode-only micro-batch
        num_plan_gaps, reactions = 0, []  # plan gaps; the engine's time from its newest result to each submit
        switch_idle = 0.0  # idle before steps within pp of a switch between prompt-carrying and decode-only
        by_size: dict[str, list[float]] = {}  # decode-only size bucket -> [steps, busy s, idle before s]
        for step in spans:
            if step in submit and submit[step][2] == 0:
                b = by_size.setdefault(_size_bucket(submit[step][1]), [0, 0.0, 0.0])
                b[0] += 1
                b[1] += spans[step][1] - spans[step][0]
        for prev, step in itertools.pairwise(steps):
            gap_start, start = spans[prev][1], spans[step][0]
            gap = start - gap_start
            if gap <= 0:
                continue
            decode_only = step in submit and submit[step][2] == 0
            if decode_only:
                by_size[_size_bucket(submit[step][1])][2] += gap
            if len({carries_prompt(k) for k in range(step - pp, step + 1) if k in submit}) > 1:
                switch_idle += gap
            wait = min(recv[tid].get(step, 0.0), gap)
            idle["previous stage"] += wait
            decode_idle["previous stage"] += wait * decode_only
            rest = gap - wait
            if rest <= 0:
                continue
            # what arrived inside the gap; the later one ended it
            fed = fed_end(step) if index == 0 else None
            plan = submit[step][0] if step in submit else None
            causes = [(t, name) for t, name in ((fed, "fed tokens"), (plan, "plan"))
                      if t is not None and gap_start + _EPS_S < t <= start + _EPS_S]
            cause = max(causes)[1] if causes else "host"
            idle[cause] += rest
            decode_idle[cause] += rest * decode_only
            if cause == "plan":
                num_plan_gaps += 1
                if (r := reaction(step)) is not None:  # (traces without result instants: unknown)
                    reactions.append(r)
        durations = {s: spans[s][1] - spans[s][0] for s in steps}
        mixed = [s for s in steps if s in submit and submit[s][2] > 0]
        decode = [s for s in steps if s in submit and submit[s][2] == 0]
        shares = [1 - durations[s] / slowest[s] for s in steps if slowest[s] > 0]
        wall = spans[steps[-1]][1] - spans[steps[0]][0] if steps else 0.0
        busy = sum(durations.values())
        rows.append({
            "lane": names[tid], "num_steps": len(steps), "wall_s": wall, "busy_s": busy,
            "idle_s": wall - busy, **{f"idle_{k.replace(' ', '_')}_s": v for k, v in idle.items()},
            "num_with_prompt": len(mixed), "num_decode_only": len(decode),
            **dict(zip(("median_with_prompt_ms", "median_with_prompt_after_queued_ms"),
                       _medians_ms(mixed, durations, after_queued[tid]))),
            **dict(zip(("median_decode_only_ms", "median_decode_only_after_queued_ms"),
                       _medians_ms(decode, durations, after_queued[tid]))),
            "imbalance": statistics.fmean(shares) if shares else None,
            "idle_near_switch_s": switch_idle, "num_switches": num_switches,
            "with_prompt_cv": coefficient_of_variation([durations[s] for s in mixed]),
            "decode_only_cv": coefficient_of_variation([durations[s] for s in decode]),
            **_prediction_ratios(mixed, durations, predicted),
            **{f"idle_decode_only_{k.replace(' ', '_')}_s": v for k, v in decode_idle.items()},
            "num_plan_gaps": num_plan_gaps,
            "plan_reaction_ms_p50": statistics.median(reactions) * 1e3 if reactions else None,
            "plan_reaction_ms_p90": percentile(sorted(reactions), 90) * 1e3 if reactions else None,
            "decode_only_by_size": {k: {"num_steps": n, "busy_s": b, "idle_before_s": i}
                                    for k, (n, b, i) in sorted(by_size.items(), key=lambda kv: _SIZE_ORDER[kv[0]])},
        })
    return rows


def _prediction_ratios(steps: list[int], durations: dict[int, float], predicted: dict[int, float]) -> dict:
    """How the cost model's predictions track ``steps``' spans: the median and the CV of span /
    predicted (a CV near 0 means the spans are the predictions up to one scale)."""
    ratios = [durations[s] / predicted[s] for s in steps if predicted.get(s)]
    return {"with_prompt_ratio_median": statistics.median(ratios) if ratios else None,
            "with_prompt_ratio_cv": coefficient_of_variation(ratios)}


def _medians_ms(steps: list[int], durations: dict[int, float], tails: dict[int, float]):
    """(median span, median time after the last launch) of ``steps``, in ms; None where none."""
    known = [tails[s] for s in steps if s in tails]
    return (statistics.median(durations[s] for s in steps) * 1e3 if steps else None,
            statistics.median(known) * 1e3 if known else None)


def format_rows(rows: Sequence[dict]) -> str:
    pct = lambda x, w: f"{x / w:.1%}" if w > 0 else "-"  # noqa: E731
    ms = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    tail = lambda x: "" if x is None else f" ({x:.2f})"  # noqa: E731
    share = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    lines = ["| lane | steps | busy | idle: previous stage | fed tokens | plan | host | imbalance"
             " | with prompt: n, median ms (after last launch) | decode only: n, median ms (after last launch) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["wall_s"]
        lines.append(
            f"| {r['lane']} | {r['num_steps']} | {pct(r['busy_s'], w)} | {pct(r['idle_previous_stage_s'], w)}"
            f" | {pct(r['idle_fed_tokens_s'], w)} | {pct(r['idle_plan_s'], w)} | {pct(r['idle_host_s'], w)}"
            f" | {share(r['imbalance'])} | {r['num_with_prompt']}, {ms(r['median_with_prompt_ms'])}"
            f"{tail(r['median_with_prompt_after_queued_ms'])}"
            f" | {r['num_decode_only']}, {ms(r['median_decode_only_ms'])}{tail(r['median_decode_only_after_queued_ms'])} |")
    return "\n".join(lines)


def format_idle_kinds(rows: Sequence[dict]) -> str:
    """Where the idle sits: the share of the wall spent idle before decode-only micro-batches,
    by cause, and for the gaps a plan ended, how long the engine had had its newest result."""
    pct = lambda x, w: f"{x / w:.1%}" if w > 0 else "-"  # noqa: E731
    ms = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    causes = ("previous_stage", "fed_tokens", "plan", "host")
    lines = ["| lane | idle before decode-only steps | of it: previous stage / fed tokens / plan / host"
             " | gaps a plan ended: n, engine's result-to-plan ms P50 / P90 |", "|---|---|---|---|"]
    for r in rows:
        w = r["wall_s"]
        total = sum(r[f"idle_decode_only_{c}_s"] for c in causes)
        parts = " / ".join(pct(r[f"idle_decode_only_{c}_s"], w) for c in causes)
        lines.append(f"| {r['lane']} | {pct(total, w)} | {parts} | {r['num_plan_gaps']}, "
                     f"{ms(r['plan_reaction_ms_p50'])} / {ms(r['plan_reaction_ms_p90'])} |")
    return "\n".join(lines)


def format_decode_sizes(rows: Sequence[dict]) -> str:
    """Decode-only micro-batches by their decodes: per lane and size, how many, their share of
    the wall (compute + the idle before them), the idle's share of that, and the idle per step."""
    lines = ["| lane | decodes | steps | share of wall | idle before them, of their share | idle per step ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        w = r["wall_s"]
        for size, d in r["decode_only_by_size"].items():
            span = d["busy_s"] + d["idle_before_s"]
            lines.append(f"| {r['lane']} | {size} | {d['num_steps']} | {span / w:.1%} | "
                         f"{d['idle_before_s'] / span:.1%} | {d['idle_before_s'] / d['num_steps'] * 1e3:.2f} |"
                         if w > 0 and span > 0 else f"| {r['lane']} | {size} | {d['num_steps']} | - | - | - |")
    return "\n".join(lines)


def format_uniformity(rows: Sequence[dict]) -> str:
    """How uniform the micro-batches' compute was: the CV of the spans of those carrying prompt
    tokens (the ones a budget fills) and of the decode-only ones, and, with a time budget, how
    the spans track the cost model's predictions."""
    num = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = ["| lane | with prompt: span CV | span / predicted: median, CV | decode only: span CV"
             " | idle near a prompt/decode switch: share of wall, ms per switch (switches) |", "|---|---|---|---|---|"]
    for r in rows:
        w, n = r["wall_s"], r["num_switches"]
        near = (f"{r['idle_near_switch_s'] / w:.1%}, {r['idle_near_switch_s'] / n * 1e3:.2f} ({n})"
                if w > 0 and n else "-")
        lines.append(f"| {r['lane']} | {num(r['with_prompt_cv'], '.3f')} | {num(r['with_prompt_ratio_median'], '.3f')}, "
                     f"{num(r['with_prompt_ratio_cv'], '.3f')} | {num(r['decode_only_cv'], '.3f')} | {near} |")
    return "\n".join(lines)


def format_host(stages: Sequence[dict]) -> str:
    """The workers' host summaries (``result.json`` stages' ``host``), one row per rank that has one."""
    ms = lambda d, k: "-" if d.get(k) is None else f"{d[k]:.2f}"  # noqa: E731
    lines = ["| rank (stage) | eager steps: n, launch ms P50 / P90 | CUDA graph steps: n, launch ms P50 / P90"
             " | allocator retries |", "|---|---|---|---|"]
    for s in stages:
        if not (host := s.get("host")):
            continue
        eager, graph = host.get("eager", {}), host.get("graph", {})
        retries = host.get("allocator", {}).get("num_alloc_retries", "-")
        lines.append(f"| {s['rank']} ({s['stage']}) | {eager.get('n', 0)}, {ms(eager, 'launch_ms_p50')} / "
                     f"{ms(eager, 'launch_ms_p90')} | {graph.get('n', 0)}, {ms(graph, 'launch_ms_p50')} / "
                     f"{ms(graph, 'launch_ms_p90')} | {retries} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a bench run's directory, or its trace.json")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: result.json's, else the trace's stage lanes)")
    p.add_argument("--feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="token feedback was on (default: result.json's; only for traces without fed_from)")
    args = p.parse_args(argv)
    trace_path = os.path.join(args.path, "trace.json") if os.path.isdir(args.path) else args.path
    pp, feedback = args.pp, args.feedback
    result_path = os.path.join(os.path.dirname(trace_path), "result.json")
    stages = []
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        stages = result.get("stages", [])
        parallel = result["config"]["parallel"]
        pp = parallel["pp"] if pp is None else pp
        feedback = bool(parallel.get("token_feedback")) and pp > 1 if feedback is None else feedback
    with open(trace_path) as f:
        trace = json.load(f)
    if pp is None:
        pp = len(stage_lanes(trace.get("traceEvents", [])))
    try:
        rows = analyze(trace, pp=pp, feedback=bool(feedback))
    except ValueError as e:
        p.error(str(e))
    print(format_rows(rows))
    print(format_idle_kinds(rows))
    print(format_decode_sizes(rows))
    print(format_uniformity(rows))
    if host := format_host(stages):  # (runs from before the workers' host summaries have none)
        print(host)


if __name__ == "__main__":
    main()
