"""Greedy agreement between parallel layouts of one real model (the distributed issue's check).

Runs the same 64 chat prompts greedily through one process and through each tp/pp layout
(each in its own process; tp × pp > 1 starts torchrun workers), then compares token by token:

- same greedy: the fraction of prompts whose whole output equals the one-GPU output;
- where an output diverges, whether the logits were close there: at the first differing
  position, the one-GPU run's log-probability margin between its token and the layout's token
  (a margin of a few hundredths is a near-tie that bf16 rounding may flip), and the largest
  |Δ log p| of the chosen tokens over the common prefix.

    python -m pipeserve.launch.agreement --model model.gguf --layouts tp=2,pp=2 --out agree.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_TASKS = [
    "Explain in two sentences how {}.",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "What is the most common misconception about {}?",
]
_TOPICS = [
    "photosynthesis works", "the moon", "volcanoes", "honey bees", "the printing press",
    "black holes", "the French revolution", "coffee", "rainbows form", "the human heart",
    "glaciers", "electric cars", "the Roman empire", "octopuses", "vaccines work", "the internet",
]


def prompts(num: int) -> list[str]:
    """`num` distinct chat prompts (tasks × topics, deterministic)."""
    all_prompts = [t.format(topic) for topic in _TOPICS for t in _TASKS]
    if num > len(all_prompts):
        raise ValueError(f"at most {len(all_prompts)} prompts")
    return all_prompts[:num]


def run_layout(model: str, layout: str, args) -> dict:
    """Greedy outputs (token ids, top-k logprobs per token) of one layout, in this process."""
    from pipeserve import LLM, SamplingParams

    par = dict(kv.split("=") for kv in layout.split("+") if kv != "1")
    llm = LLM(model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              kernel_backend=args.kernel_backend,
              tensor_parallel_size=int(par.get("tp", 1)), pipeline_parallel_size=int(par.get("pp", 1)))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=args.logprobs)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts(args.num_prompts)], params)
    llm.close()
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[{str(k): v for k, v in lp.items()} for lp in o.outputs[0].logprobs] for o in outs]}


def compare(base: dict, other: dict) -> dict:
    """Agreement of `other` with `base` (see the module docstring)."""
    same, margins, prefix_dev, bounds_only, length_only = 0, [], [], 0, 0
    for bt, ot, blp, olp in zip(base["tokens"], other["tokens"], base["logprobs"], other["logprobs"]):
        if bt == ot:
            same += 1
        n = next((i for i, (a, b) in enumerate(zip(bt, ot)) if a != b), min(len(bt), len(ot)))
        dev = [abs(blp[i][str(bt[i])] - olp[i][str(bt[i])]) for i in range(n)]
        prefix_dev.append(max(dev, default=0.0))
        if bt != ot and n < min(len(bt), len(ot)):
            lp = blp[n]
            # The layout's token outside the base's top-k: the gap to the k-th is a lower bound.
            bounds_only += str(ot[n]) not in lp
            other_lp = lp.get(str(ot[n]), min(lp.values()))
            margins.append(lp[str(bt[n])] - other_lp)
        elif bt != ot:
            length_only += 1  # one output stops earlier (EOS or a stop string), same tokens before
    num = len(base["tokens"])
    return {
        "num_prompts": num,
        "same_greedy_fraction": same / num,
        "divergence_margins": sorted(margins),
        "margins_that_are_lower_bounds": bounds_only,
        "length_only_divergences": length_only,
        "max_prefix_logprob_deviation": max(prefix_dev, default=0.0),
        "median_prefix_logprob_deviation": sorted(prefix_dev)[num // 2] if prefix_dev else 0.0,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2)")
    p.add_argument("--layouts", default="tp=2,pp=2", help="comma-separated, e.g. tp=2,pp=2,tp=2+pp=2")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel-backend", default="auto", help="auto | torch | triton")
    p.add_argument("--workdir", default=".")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = run_layout(args.model, args.child, args)
        with open(os.path.join(args.workdir, f"agree_{args.child}.json"), "w") as f:
            json.dump(result, f)
        return
    outputs = {}
    for layout in ["1", *args.layouts.split(",")]:
        cmd = [sys.executable, "-m", "pipeserve.launch.agreement", *(argv or sys.argv[1:]), "--child", layout]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{layout}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        with open(os.path.join(args.workdir, f"agree_{layout}.json")) as f:
            outputs[layout] = json.load(f)
    if "1" not in outputs:
        sys.exit("the one-process run failed: nothing to compare against")
    report = {layout: compare(outputs["1"], out) for layout, out in outputs.items() if layout != "1"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "agreement": report}, f, indent=1)
    print(f"| layout | same greedy ({args.dtype}, {args.num_prompts} prompts × {args.max_tokens} tokens) "
          "| margins at divergence | max |Δ log p| before it |")
    print("|---|---|---|---|")
    for layout, r in report.items():
        m = ", ".join(f"{x:.3f}" for x in r["divergence_margins"]) or "—"
        print(f"| {layout} | {r['same_greedy_fraction']:.0%} | {m} | {r['max_prefix_logprob_deviation']:.3f} |")


if __name__ == "__main__":
    main()
