"""The table of one benchmarks/gpu.sh scenario, from the files its runs left in their folder.

Standard library only: it reads what any pipeserve tree writes (bench's result.json, bench_peers'
and roofline's --out JSON), so the same script summarizes a run of an older tree.

    python3 benchmarks/summarize.py SCENARIO RUN_FOLDER [--label TREE] [--card NAME] [--json results.json]

--json merges the scenario's figures into that file under {label: {scenario: ...}}.
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def bench_result(folder: str, name: str) -> dict | None:
    """A bench run's result.json (rank0/ holds it after a multi-node run)."""
    return load(os.path.join(folder, name, "result.json")) or load(os.path.join(folder, name, "rank0", "result.json"))


def lead_stages(result: dict) -> list[dict]:
    """One row per pipeline stage: its first tensor-parallel rank."""
    return [s for s in result.get("stages", []) if s.get("tp_rank", 0) == 0]


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def num(x, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


# ---- bench_peers: peers, prefix, sharegpt --------------------------------------------------------

def peers_tables(folder: str, files: list[str]) -> tuple[list[str], dict]:
    lines, figures = [], {}
    for name in files:
        data = load(os.path.join(folder, name))
        if data is None:
            lines.append(f"{name}: no result (see {name.removesuffix('.json')}.log)")
            continue
        results = data["results"]
        base = results.get("pipeserve", {}).get("tokens_per_s")
        fastgen = results.get("fastgen", {}).get("tokens_per_s")
        rows, fig = [], {}
        for system, r in results.items():
            if "tokens_per_s" not in r:
                rows.append([system, "failed", "", "", "", ""])
                fig[system] = {"error": str(r.get("error", ""))[-300:]}
                continue
            tps = r["tokens_per_s"]
            rows.append([system, f"{r['wall_s']:.2f}", f"{tps:,.0f}", f"{base / tps:.2f}" if base else "-",
                         f"{tps / fastgen:.2f}" if fastgen else "-", pct(r.get("prefill_saved_fraction"))])
            fig[system] = {k: r[k] for k in ("wall_s", "tokens_per_s", "prefill_saved_fraction") if k in r}
        args = data.get("args", {})
        lines += [f"{name.removesuffix('.json')}: {args.get('workload', 'uniform')}, {args.get('num_requests')} requests,"
                  f" {data.get('total_tokens')} tokens"]
        lines += table(["system", "wall s", "tokens/s", "pipeserve / system", "system / FastGen", "prefill saved"], rows)
        figures[name.removesuffix(".json")] = fig
    return lines, figures


def peers(folder: str):
    return peers_tables(folder, ["peers.json"])


def prefix(folder: str):
    return peers_tables(folder, ["prefix-mooncake.json", "prefix-shared_prefix.json"])


def sharegpt(folder: str):
    return peers_tables(folder, ["sharegpt.json"])


# ---- pipeserve bench: scaling, capacity, bubbles -------------------------------------------------

SCALING_WORKLOADS = {"uniform": "256 requests, 256 out", "decode-heavy": "128 requests, ~1.7k out"}


def throughput_result(folder: str, name: str) -> dict | None:
    """The RESULT line of a benchmarks/throughput.py log."""
    try:
        with open(os.path.join(folder, f"{name}.log")) as f:
            lines = [line for line in f if line.startswith("RESULT ")]
    except OSError:
        return None
    for line in reversed(lines):  # the last that parses (another process's output may have cut one)
        try:
            return json.loads(line[len("RESULT "):])
        except ValueError:
            continue
    return None


def scaling(folder: str, prefix: str = "scaling", layouts=(("1gpu", "1 GPU"), ("pp2", "pp=2"), ("tp2", "tp=2"))):
    rows, figures = [], {}
    for workload, label in SCALING_WORKLOADS.items():
        one = None
        for layout, name in layouts:
            r = throughput_result(folder, f"{prefix}-{workload}-{layout}")
            if r is None:
                rows.append([name, label, "no result", "", ""])
                continue
            one = r["total_tok_s"] if layout == "1gpu" else one
            ratio = f"{r['total_tok_s'] / one:.2f}" if one else "-"
            rows.append([name, label, f"{r['output_tok_s']:,.0f}", f"{r['total_tok_s']:,.0f}", ratio])
            figures[f"{workload}-{layout}"] = r
    return table(["layout", "workload", "output tok/s", "total tok/s", "total / 1 GPU"], rows), figures


def scaling4(folder: str):
    return scaling(folder, "scaling4", (("1gpu", "1 GPU"), ("tp4", "tp=4"), ("pp4", "pp=4"), ("tp2pp2", "tp=2 × pp=2")))


def big4(folder: str):
    """The Llama-3-70B shape on four GPUs: FastGen tp=4 at MII's 768-token forwards and at
    pipeserve's 2,048 (a log each, a RESULT line per workload) against pipeserve's layouts (a log
    per layout and workload); each row against FastGen's better budget on its workload."""
    fastgen = {}  # (layout, workload) -> result
    for layout in FASTGEN_BIG4:
        try:
            with open(os.path.join(folder, f"big4-{layout}.log")) as f:
                for line in f:
                    if line.startswith("RESULT "):
                        r = json.loads(line[len("RESULT "):])
                        fastgen[layout, r["workload"]] = r
        except OSError:
            pass
    rows, figures = [], {}
    logs = [f for f in os.listdir(folder) if f.startswith("big4-") and f.endswith(".log")] if os.path.isdir(folder) else []
    workloads = sorted({w for _, w in fastgen} | {w for w in WORKLOADS_BIG4 if any(f.startswith(f"big4-{w}-") for f in logs)})
    for workload in workloads:
        ran = [fastgen[l, workload] for l in FASTGEN_BIG4 if (l, workload) in fastgen]
        base = max(ran, key=lambda r: r["total_tok_s"]) if ran else None
        runs = [(name, f"big4-{layout}", fastgen.get((layout, workload))) for layout, name in FASTGEN_BIG4.items()] + [
            (f"pipeserve {name}", f"big4-{workload}-{layout}", throughput_result(folder, f"big4-{workload}-{layout}"))
            for layout, name in (("tp4", "tp=4"), ("tp2pp2", "tp=2 × pp=2"), ("pp4", "pp=4"))]
        for name, log, r in runs:
            if r is None:
                if f"{log}.log" in logs:  # a run that left no result (its log says why)
                    rows.append([name, workload, "no result", "", "", "", ""])
                continue
            ratio = f"{r['total_tok_s'] / base['total_tok_s']:.2f}" if base else "-"
            short = r.get("requests_short_of_their_length")
            rows.append([name + (f" ({short} requests short)" if short else ""), workload, f"{r['output_tok_s']:,.0f}",
                         f"{r['total_tok_s']:,.0f}", f"{r['wall_s']:.2f}", f"{r['start_s']:.1f}", ratio])
            figures[f"{workload}-{name}"] = r
    # FastGen's start-up includes its kernel build and reading the weights; pipeserve draws random ones.
    return table(["system", "workload", "output tok/s", "total tok/s", "wall s", "start-up s", "/ best FastGen"],
                 rows), figures


FASTGEN_BIG4 = {"fastgen-tp4": "DeepSpeed-FastGen tp=4", "fastgen-tp4-2048": "DeepSpeed-FastGen tp=4, 2,048-token forwards"}
WORKLOADS_BIG4 = ("peers", "decode-heavy", "uniform")


def async_(folder: str):
    """Token feedback (async scheduling) off against scaling's default runs, from one folder
    holding both scenarios' logs (gpu.sh keeps each scenario's folder: pass scaling's too)."""
    rows, figures = [], {}
    scaling_dir = os.path.join(os.path.dirname(folder), "scaling")
    for workload, label in SCALING_WORKLOADS.items():
        for layout, name in (("1gpu", "1 GPU"), ("tp2", "tp=2")):
            off = throughput_result(folder, f"async-{workload}-{layout}-off")
            on = throughput_result(scaling_dir, f"scaling-{workload}-{layout}")
            if off is None or on is None:
                rows.append([name, label, "no result", "", ""])
                continue
            gain = f"{on['total_tok_s'] / off['total_tok_s']:.3f}"
            rows.append([name, label, f"{off['total_tok_s']:,.0f}", f"{on['total_tok_s']:,.0f}", gain])
            figures[f"{workload}-{layout}"] = {"off": off, "on": on}
    return table(["layout", "workload", "feedback off tok/s", "on (default) tok/s", "on / off"], rows), figures


def coldstart(folder: str):
    rows, figures = [], {}
    for cache in ("cold", "warm"):
        r = throughput_result(folder, f"coldstart-{cache}")
        if r is None:
            rows.append([cache, "no result", "", "", ""])
            continue
        rounds = r.get("rounds") or []
        tok = [x["total_tok_s"] for x in rounds]
        ttft = [x["mean_ttft_s"] for x in rounds]
        last = tok[-1] if tok else None
        rows.append([f"{cache} cache", f"{r['start_s']:.1f}", " / ".join(f"{t:,.0f}" for t in tok),
                     f"{tok[0] / last:.3f}" if last else "-",
                     " / ".join(ms(t) for t in ttft if t is not None)])
        figures[cache] = r
    return table(["compile cache", "start-up s", "rounds' total tok/s", "first / last", "mean TTFT ms per round"],
                 rows), figures


def coldserve(folder: str):
    """benchmarks/cold_serve.py with an empty compile cache, then the filled one: start-up to the
    server's ready line, and each HTTP round's TTFT and throughput."""
    rows, figures = [], {}
    for cache in ("cold", "warm"):
        r = throughput_result(folder, f"coldserve-{cache}")
        if r is None:
            rows.append([f"{cache} cache", "no result", "", "", "", "", ""])
            continue
        rounds = r["rounds"]
        tok = [x["total_tok_s"] for x in rounds]
        mean = [x["mean_ttft_ms"] for x in rounds]
        failed = sum(x["failed"] for x in rounds)
        rows.append([f"{cache} cache", f"{r['start_s']:.1f}", " / ".join(f"{t:,.0f}" for t in tok),
                     " / ".join(num(t) for t in mean), f"{mean[0] / mean[-1]:.3f}" if mean[0] and mean[-1] else "-",
                     " / ".join(num(x["p99_ttft_ms"]) for x in rounds), failed])
        figures[cache] = r
    return table(["compile cache", "start to ready s", "rounds' total tok/s", "mean TTFT ms per round",
                  "first / last TTFT", "P99 TTFT ms per round", "failed"], rows), figures


def capacity(folder: str):
    rows, figures = [], {}
    for policy in ("sarathi", "vllm"):
        r = bench_result(folder, f"capacity-{policy}")
        cap = (r or {}).get("capacity")
        if not cap:
            rows.append([policy, "no result", ""])
            continue
        probes = "; ".join(f"{p['rate']:.3g} {'✓' if p['meets_slo'] else '✗'} ({ms(p['tbt_p99_s'])},"
                           f" {p['scheduling_delay_p50_s']:.2f}, {p['throughput_rps']:.2f})" for p in cap["probes"])
        rows.append([policy, probes, f"{cap['capacity_rps']:.4g} req/s" + ("" if cap["converged"] else " (not converged)")])
        figures[policy] = {"capacity_rps": cap["capacity_rps"], "converged": cap["converged"], "probes": cap["probes"]}
    lines = table(["policy", "probes: rate req/s ✓/✗ (P99 TBT ms, P50 delay s, served req/s)", "capacity"], rows)
    if figures.get("vllm", {}).get("capacity_rps") and "sarathi" in figures:
        lines.append(f"sarathi / vllm = {figures['sarathi']['capacity_rps'] / figures['vllm']['capacity_rps']:.2f}")
    return lines, figures


def bubble_seconds(result: dict) -> list[float]:
    """Per stage: wall − busy, the idle time the bubble fraction counts."""
    return [s["wall_s"] - s["busy_s"] for s in lead_stages(result)]


def bubbles(folder: str):
    rows, figures, idle = [], {}, {}
    names = sorted((os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(folder, "bubbles-*", "result.json"))),
                   key=lambda n: ("orca" in n, n))  # the sarathi runs, then orca
    for name in names:
        r = bench_result(folder, name)
        stages = lead_stages(r)
        whole = " / ".join(pct(s["bubble_fraction"]) for s in stages)
        loaded = " / ".join(pct(s.get("bubble_fraction_loaded")) for s in stages)
        layers = " / ".join(f"{s['num_layers']:g}" if s.get("num_layers") is not None else "-" for s in stages)
        rows.append([name.removeprefix("bubbles-"), layers, f"{r['throughput']['total_tokens_per_s']:,.0f}",
                     f"{r['tbt_s']['p99'] * 1e3:.1f}", f"{whole} ({loaded})"])
        idle[name] = bubble_seconds(r)
        figures[name] = {"total_tokens_per_s": r["throughput"]["total_tokens_per_s"], "tbt_p99_s": r["tbt_s"]["p99"],
                         "bubble_fraction": [s["bubble_fraction"] for s in stages],
                         "bubble_fraction_loaded": [s.get("bubble_fraction_loaded") for s in stages],
                         "bubble_s": idle[name]}
    lines = table(["run", "layers", "tok/s", "P99 TBT ms", "bubble per stage, whole run (while loaded)"], rows)
    repeats: dict[str, list[list[float]]] = {}
    for name, fig in figures.items():
        repeats.setdefault(name.rsplit("-", 1)[0] if name[-1].isdigit() else name, []).append(fig["bubble_fraction"])
    for group, runs in repeats.items():
        if len(runs) > 1:
            means = [sum(col) / len(col) for col in zip(*runs)]
            lines.append(f"{group.removeprefix('bubbles-')}: mean of {len(runs)} runs "
                         + " / ".join(pct(m) for m in means))
    orca = idle.get("bubbles-orca")
    if orca:
        for name, secs in idle.items():
            if name != "bubbles-orca" and all(secs):
                lines.append(f"orca's bubble time / {name.removeprefix('bubbles-')}'s: "
                             + " / ".join(f"{o / s:.1f}×" for o, s in zip(orca, secs)))
    return lines, figures


# ---- roofline ------------------------------------------------------------------------------------

def roofline(folder: str):
    data = load(os.path.join(folder, "roofline.json"))
    if data is None:
        return ["roofline: no result (see roofline.log)"], {}
    rows = []
    for name, r in data["rows"].items():
        rows.append([name, f"{r['seconds'] * 1e3:.2f}", f"{r['tflops']:.0f}" if "tflops" in r else "",
                     pct(r.get("mfu")) if "tflops" in r else "",
                     f"{r['floor_seconds'] * 1e3:.2f}" if "floor_seconds" in r else "",
                     f"{r['ratio_to_floor']:.2f}" if "ratio_to_floor" in r else ""])
    head = f"copy bandwidth {data['copy_bandwidth_Bps'] / 1e9:,.0f} GB/s, peak {data['peak_tflops']} TFLOP/s"
    return [head] + table(["step", "ms", "TFLOP/s", "MFU", "floor ms", "÷ floor"], rows), data["rows"]


def fp8(folder: str):
    """FP8 weights against bf16 in the same run: throughput and KV blocks per workload, decode
    steps against each one's weight-read floor, and greedy agreement on SmolLM2's chats."""
    rows, figures = [], {}
    for workload, label in SCALING_WORKLOADS.items():
        bf16, fp8_ = (throughput_result(folder, f"fp8-{workload}-{q}") for q in ("bf16", "fp8"))
        if bf16 is None or fp8_ is None:
            rows.append([label, "no result", "", "", "", ""])
            continue
        rows.append([label, f"{bf16['total_tok_s']:,.0f}", f"{fp8_['total_tok_s']:,.0f}",
                     f"{fp8_['total_tok_s'] / bf16['total_tok_s']:.3f}",
                     f"{bf16.get('num_kv_blocks', 0):,}", f"{fp8_.get('num_kv_blocks', 0):,}"])
        figures[workload] = {"bf16": bf16, "fp8": fp8_}
    lines = table(["workload", "bf16 tok/s", "fp8 tok/s", "fp8 / bf16", "bf16 KV blocks", "fp8 KV blocks"], rows)
    steps = {q: load(os.path.join(folder, f"roofline-{q}.json")) for q in ("bf16", "fp8")}
    if steps["bf16"] and steps["fp8"]:
        srows = []
        for name, b in steps["bf16"]["rows"].items():
            f = steps["fp8"]["rows"][name]
            floor = lambda r: f"{r['floor_seconds'] * 1e3:.2f}" if "floor_seconds" in r else ""  # noqa: E731
            ratio = lambda r: f"{r['ratio_to_floor']:.2f}" if "ratio_to_floor" in r else ""  # noqa: E731
            srows.append([name, f"{b['seconds'] * 1e3:.2f}", f"{f['seconds'] * 1e3:.2f}", floor(b), floor(f),
                          ratio(b), ratio(f)])
        lines += [""] + table(["step", "bf16 ms", "fp8 ms", "bf16 floor ms", "fp8 floor ms", "bf16 ÷ floor",
                               "fp8 ÷ floor"], srows)
        figures["steps"] = {q: steps[q]["rows"] for q in steps}
    agree = (load(os.path.join(folder, "agreement.json")) or {}).get("agreement", {})
    if "fp8" in agree:
        a = agree["fp8"]
        lines += ["", f"greedy agreement, fp8 against bf16 (SmolLM2-135M, 64 chats × 64 tokens): same output "
                      f"{a['same_greedy_fraction']:.0%}, tokens before the first difference "
                      f"{a.get('mean_common_prefix', float('nan')):.1f} on average"]
        figures["agreement"] = a
    return lines, figures


def tpsteps(folder: str):
    runs = {name: load(os.path.join(folder, f"{name}.json")) for name in ("tp1", "tp2", "tp2-nccl", "tp4")}
    if runs["tp1"] is None or runs["tp2"] is None:
        return ["tpsteps: no result (see tpsteps-*.log)"], {}
    rows, figures = [], {}
    four = runs["tp4"]
    for case, one in runs["tp1"]["rows"].items():
        two, nccl = runs["tp2"]["rows"][case], (runs["tp2-nccl"] or {"rows": {}})["rows"].get(case)
        coll = two.get("kernel_ms", {}).get("collective")
        row = [case, f"{one['step_ms']:.2f}", f"{nccl['step_ms']:.2f}" if nccl else "",
               f"{two['step_ms']:.2f}", f"{one['step_ms'] / two['step_ms']:.2f}×",
               f"{coll:.2f}" if coll is not None else ""]
        figures[case] = {"tp1_ms": one["step_ms"], "tp2_ms": two["step_ms"],
                         "tp2_nccl_ms": nccl["step_ms"] if nccl else None, "tp2_collective_ms": coll}
        if four is not None:
            row += [f"{four['rows'][case]['step_ms']:.2f}", f"{one['step_ms'] / four['rows'][case]['step_ms']:.2f}×"]
            figures[case]["tp4_ms"] = four["rows"][case]["step_ms"]
        rows.append(row)
    header = ["step", "tp=1 ms", "tp=2 NCCL ms", "tp=2 ms", "tp=1 / tp=2", "tp=2 sums ms (kernels)"]
    lines = table(header + (["tp=4 ms", "tp=1 / tp=4"] if four is not None else []), rows)
    # Kernel time by kind at each tp (rank 0), where the step's time goes as the shard shrinks.
    profiled = [(name, r) for name, r in (("tp=1", runs["tp1"]), ("tp=2", runs["tp2"]), ("tp=4", four))
                if r is not None and any("kernel_ms" in c for c in r["rows"].values())]
    if profiled:
        kinds = [k for k in next(iter(profiled[0][1]["rows"].values()))["kernel_ms"]]
        krows = []
        for case in runs["tp1"]["rows"]:
            for name, r in profiled:
                ms_ = r["rows"][case].get("kernel_ms", {})
                krows.append([case, name] + [f"{ms_.get(k, 0):.2f}" for k in kinds]
                             + [f"{r['rows'][case]['step_ms']:.2f}"])
                figures[case][f"{name}_kernel_ms"] = ms_
        lines += [""] + table(["step", "tp"] + [f"{k} ms" for k in kinds] + ["step ms"], krows)
    # tools/tp_overlap: a layer's sums in line against two halves whose sums overlap the other's GEMMs.
    orows = []
    for name in ("overlap-tp2", "overlap-pull-tp2", "overlap-tp4", "overlap-pull-tp4"):
        r = load(os.path.join(folder, f"{name}.json"))
        for tokens, row in (r or {"rows": {}})["rows"].items():
            hidden = row.get("hidden")
            orows.append([f"tp={r['tp']}", "pull" if "pull" in name else "symmetric", tokens]
                         + [f"{row[k]:.3f}" if k in row else "" for k in ("serial", "halves", "no_sums", "async_tp")]
                         + ["" if hidden is None else f"{hidden:.0%}"])
            figures[f"{name}-{tokens}"] = row
    if orows:
        lines += [""] + table(["layer shard", "sums", "tokens", "serial ms/layer", "halves ms/layer",
                               "no sums ms/layer", "async TP ms/layer", "sums hidden by halves"], orows)
    sum_lines, sum_figures = sum_kernel_tables(folder, ("sumkernels-tp2", "sumkernels-tp4"))
    return lines + sum_lines, {**figures, **sum_figures}


def sum_kernel_tables(folder: str, names) -> tuple[list[str], dict]:
    """tools/sum_kernels' tables: µs a sum (or a sum + norm) per kernel and size."""
    lines, figures = [], {}
    for name in names:
        r = load(os.path.join(folder, f"{name}.json"))
        if not r or not r["rows"]:
            continue
        kernels = list(dict.fromkeys(k for row in r["rows"].values() for k in row))
        srows = [[f"tp={r['tp']}", rows] + [f"{row[k]['us']:.1f}{' WRONG' if row[k]['exact'] is False else ''}"
                                            if k in row else "" for k in kernels]
                 for rows, row in r["rows"].items()]
        figures[name] = r
        what = ("tp=2 kernels on 1 GPU, peer simulated" if r.get("simulated")
                else "sum + norm" if "norms" in name else "sum")
        lines += [""] + table([what, "rows of 4096"] + [f"{k} µs" for k in kernels], srows)
    return lines, figures


def sums(folder: str):
    lines, figures = sum_kernel_tables(folder, ("sumsimulated", "sumkernels-tp2", "sumnorms-tp2", "sumkernels-tp4",
                                                "sumnorms-tp4"))
    return (lines[1:] if lines else ["sums: no result (see sums-*.log)"]), figures


def profile(folder: str):
    data = load(os.path.join(folder, "cost_model.json"))
    if data is None:
        return ["profile: no cost model (see profile.log)"], {}
    err = data["relative_error"]
    return [f"cost model on {data.get('device')}: " + ", ".join(f"{k}={v:.3g}" for k, v in data["cost_model"].items()),
            f"fit error: mean {err['mean']:.1%}, max {err['max']:.1%} over {len(data['samples'])} shapes;"
            f" suggested time budget {data['suggested_time_budget_s'] * 1e3:.2f} ms"], \
        {k: data[k] for k in ("cost_model", "relative_error", "suggested_time_budget_s")}


def structured(folder: str):
    """benchmarks/throughput.py's uniform workload plain, with penalties, and with a quarter of
    the requests under a JSON schema (the grammar probes' tables are in their logs)."""
    rows, figures = [], {}
    plain = throughput_result(folder, "structured-plain")
    for kind, label in (("plain", "plain"), ("penalties", "all with penalties"),
                        ("json", "a quarter under a JSON schema")):
        r = throughput_result(folder, f"structured-{kind}")
        if r is None:
            rows.append([label, "no result", "", ""])
            continue
        ratio = f"{r['total_tok_s'] / plain['total_tok_s']:.3f}" if plain else "-"
        rows.append([label, f"{r['output_tokens']:,}", f"{r['total_tok_s']:,.0f}", ratio])
        figures[kind] = r
    return table(["requests", "output tokens", "total tok/s", "against plain"], rows), figures


def ranks(folder: str):
    """tools/rank_lag's rows of each workload's runs, tp > 1 and one GPU (and each run's throughput)."""
    lines, figures = [], {}
    for workload, name in [(w, f"ranks-{w}{suffix}") for w in SCALING_WORKLOADS for suffix in ("", "-1gpu")]:
        rows, r = load(os.path.join(folder, f"{name}.json")), throughput_result(folder, name)
        if rows is None or r is None:
            continue
        lines += [f"{workload}: tp={r['tp']}, {r['total_tok_s']:,.0f} tok/s, {r['wall_s']:.2f} s", ""]
        lines += table(["rank", "steps", "compute ms", "gap ms", "gaps s", "longest gap ms", "late ms", "host ahead ms",
                        "host-bound", "full GCs", "full GC ms"],
                       [[x["rank"], x["steps"], x["compute_ms"], x["gap_ms"], x["gap_total_s"], x.get("gap_max_ms"),
                         x["late_ms"], x["host_ahead_ms"], x["host_bound"], x.get("full_gcs"), x.get("full_gc_ms")]
                        for x in rows]) + [""]
        lines += [f"rank {x['rank']}, longest gaps (ms before step): "
                  + ", ".join(f"{ms} before {step}" for step, ms in x.get("longest_gaps", [])) for x in rows] + [""]
        figures[name.removeprefix("ranks-")] = {"throughput": r, "ranks": rows}
    return (lines or ["ranks: no result (see ranks-*.log)"]), figures


def pairs(folder: str):
    """Each workload's runs of the two trees (two rounds, their GPUs swapped between them):
    per run its throughput and its ranks' idle time, longest gap and full collections; then each
    tree's mean and this tree's against the other's."""
    trees = dict(line.split(None, 1) for line in open(os.path.join(folder, "pairs.trees")).read().splitlines()) \
        if os.path.exists(os.path.join(folder, "pairs.trees")) else {"this": "this", "before": "before"}
    tp = int(trees.get("tp", 2))
    first, second = ",".join(map(str, range(tp))), ",".join(map(str, range(tp, 2 * tp)))
    lines, figures = [], {}
    for workload, label in SCALING_WORKLOADS.items():
        rows, means = [], {}
        for tree in ("this", "before"):
            for rnd, gpus in (("1", first if tree == "this" else second), ("2", second if tree == "this" else first)):
                name = f"pairs-{workload}-{tree}-{rnd}"
                r, ranks_ = throughput_result(folder, name), load(os.path.join(folder, f"{name}.json"))
                if r is None:
                    continue
                means.setdefault(tree, []).append(r["total_tok_s"])
                ranks_ = ranks_ or []
                rows.append([trees[tree], gpus, f"{r['total_tok_s']:,.0f}",
                             " / ".join(f"{x['gap_total_s']:.2f}" for x in ranks_) or "-",
                             num(max((x["gap_max_ms"] for x in ranks_ if x.get("gap_max_ms") is not None),
                                     default=None), ".1f"),
                             " / ".join("-" if x.get("full_gcs") is None else str(x["full_gcs"]) for x in ranks_) or "-"])
                figures[name.removeprefix("pairs-")] = {"throughput": r, "ranks": ranks_}
        if not rows:
            continue
        mean = {t: sum(v) / len(v) for t, v in means.items()}
        ratio = f"{mean['this'] / mean['before']:.3f}" if len(mean) == 2 else "-"
        lines += [f"{label}, tp={tp}: {trees['this']} {mean.get('this', 0):,.0f} tok/s against "
                  f"{trees['before']} {mean.get('before', 0):,.0f} (mean of its runs): {ratio}", ""]
        lines += table(["tree", "GPUs", "total tok/s", "idle between steps s (per rank)", "longest gap ms",
                        "full GCs (per rank)"], rows) + [""]
    return (lines or ["pairs: no result (see pairs-*.log)"]), figures


SCENARIOS = {f.__name__.rstrip("_"): f for f in (peers, prefix, sharegpt, scaling, scaling4, big4, ranks, pairs, async_, coldstart, coldserve, capacity, bubbles,
                                                  roofline, fp8, tpsteps, sums, profile, structured)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("folder")
    p.add_argument("--label", default="tree")
    p.add_argument("--card", default=None)
    p.add_argument("--json", default=None, help="merge the figures into this file")
    args = p.parse_args(argv)
    lines, figures = SCENARIOS[args.scenario](args.folder)
    print("\n".join(lines))
    if args.json:
        merged = load(args.json) or {}
        merged.setdefault(args.label, {})[args.scenario] = {"card": args.card, "figures": figures}
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
