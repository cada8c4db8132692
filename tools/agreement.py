"""Greedy agreement between parallel layouts of one real model (the distributed issue's check).

Runs the same 64 chat prompts greedily through one process and through each tp/pp layout
(each in its own process; tp × pp > 1 starts torchrun workers), then compares token by token:

- same greedy: the fraction of prompts whose whole output equals the one-GPU output;
- where an output diverges, whether the logits were close there: at the first differing
  position, the one-GPU run's log-probability margin between its token and the layout's token
  (a margin of a few hundredths is a near-tie that bf16 rounding may flip), and the largest
  |Δ log p| of the chosen tokens over the common prefix.

    python -m tools.agreement --model model.gguf --layouts tp=2,pp=2 --out agree.json
    python -m tools.agreement --model model.gguf --layouts tp=2,pp=2 --deterministic
    python -m tools.agreement --layouts fp8                      # FP8 weights against bf16, one GPU
    python -m tools.agreement --shape llama3-70b --num-layers 80 \
        --base pp=2 --layouts pp=4,tp=2+pp=2 --deterministic     # random weights, same in every layout

``--deterministic`` runs every layout in deterministic mode (``engine.deterministic``, with
``reduction_splits`` the largest tp compared), where the layouts must agree bit for bit:
"identical" counts prompts whose tokens and log-probabilities are all equal. ``--shape``
serves random weights of a benchmark shape (``load_format=dummy``: the same values in every
layout) with plain-text prompts and ``ignore_eos``; ``--base`` is the layout the others are
compared with (default one process; a model too large for one GPU compares with a smaller
layout). ``--reuse`` keeps the outputs of layouts already in ``--workdir`` (run the base on
some GPUs while others are busy, the rest later: pass the same ``--reduction-splits``).
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


_CONTEXT = (
    "The history of science is the study of how people came to understand the natural world, "
    "from early observations of the sky and of living things to the experiments and theories of "
    "the modern era, and of how that understanding changed the way they lived and worked. "
)


def prompts(num: int, context_words: int = 0) -> list[str]:
    """`num` distinct chat prompts (tasks × topics, deterministic), each after the first
    `context_words` words of a fixed passage (repeated as needed): long prompts are cut into
    chunks that start at different positions in different layouts."""
    all_prompts = [t.format(topic) for topic in _TOPICS for t in _TASKS]
    if num > len(all_prompts):
        raise ValueError(f"at most {len(all_prompts)} prompts")
    words = _CONTEXT.split()
    context = " ".join(words[i % len(words)] for i in range(context_words))
    return [f"{context} {p}".strip() for p in all_prompts[:num]]


def run_layout(model: str, layout: str, args) -> dict:
    """Greedy outputs (token ids, top-k logprobs per token) of one layout, in this process."""
    from pipeserve import LLM, SamplingParams

    par = _parse_layout(layout)
    dummy = args.shape is not None
    llm = LLM(model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              kernel_backend=args.kernel_backend, load_format="dummy" if dummy else "auto",
              deterministic=args.deterministic, reduction_splits=_reduction_splits(args),
              tensor_parallel_size=par["tp"], pipeline_parallel_size=par["pp"], quantization=par["quantization"])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=args.logprobs, ignore_eos=dummy)
    if dummy:  # no chat template in a benchmark shape's folder
        outs = llm.generate(prompts(args.num_prompts, args.context_words), params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts(args.num_prompts, args.context_words)], params)
    llm.close()
    return {"settings": _settings(args),
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[{str(k): v for k, v in lp.items()} for lp in o.outputs[0].logprobs] for o in outs]}


def _settings(args) -> dict:
    """What a layout's outputs depend on besides the layout (a reused file must match)."""
    return {"model": args.model if args.shape is None else f"{args.shape}-{args.num_layers}",
            "dtype": args.dtype, "deterministic": args.deterministic,
            "reduction_splits": _reduction_splits(args), "kernel_backend": args.kernel_backend,
            "num_prompts": args.num_prompts, "context_words": args.context_words, "max_tokens": args.max_tokens, "logprobs": args.logprobs,
            "max_num_batched_tokens": args.max_num_batched_tokens}


def _reusable(path: str, args) -> bool:
    if not (args.reuse and os.path.exists(path)):
        return False
    with open(path) as f:
        return json.load(f).get("settings") == _settings(args)


def _parse_layout(layout: str) -> dict:
    """"tp=2+pp=2" -> {"tp": 2, "pp": 2}; "1" -> one process; "+fp8" (or "fp8" alone): FP8
    weights quantized at load."""
    par = {"tp": 1, "pp": 1, "quantization": None}
    for kv in layout.split("+"):
        if kv == "fp8":
            par["quantization"] = "fp8"
        elif kv != "1":
            key, value = kv.split("=")
            if key not in par:
                raise ValueError(f"bad layout {layout!r}: use tp=N, pp=N, tp=N+pp=M, 1, and +fp8")
            par[key] = int(value)
    return par


def _reduction_splits(args) -> int:
    """Deterministic runs share one reduction: over the largest tp compared."""
    if not args.deterministic:
        return 0
    if args.reduction_splits:
        return args.reduction_splits
    return max(_parse_layout(x)["tp"] for x in [args.base, *_layouts(args)])


def _layouts(args) -> list[str]:
    return [x for x in args.layouts.split(",") if x]


def compare(base: dict, other: dict) -> dict:
    """Agreement of `other` with `base` (see the module docstring)."""
    same, identical, margins, prefix_dev, bounds_only, length_only, prefixes = 0, 0, [], [], 0, 0, []
    for bt, ot, blp, olp in zip(base["tokens"], other["tokens"], base["logprobs"], other["logprobs"]):
        if bt == ot:
            same += 1
            identical += blp == olp  # every top-k log-probability equal, bit for bit
        n = next((i for i, (a, b) in enumerate(zip(bt, ot)) if a != b), min(len(bt), len(ot)))
        prefixes.append(n)
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
        "mean_common_prefix": sum(prefixes) / num,  # tokens before the first difference
        "identical_fraction": identical / num,
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
    p.add_argument("--context-words", type=int, default=0,
                   help="put this many words of a fixed passage before every prompt (long prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel-backend", default="auto", help="auto | torch | triton")
    p.add_argument("--deterministic", action="store_true", help="every layout in deterministic mode")
    p.add_argument("--reduction-splits", type=int, default=None,
                   help="deterministic: row-parallel segments (default the largest tp compared)")
    p.add_argument("--reuse", action="store_true", help="keep layouts already run in --workdir")
    p.add_argument("--base", default="1", help="the layout the others are compared with")
    p.add_argument("--shape", default=None, help="random weights of this benchmark shape (llama3-8b, llama3-70b)")
    p.add_argument("--num-layers", type=int, default=None, help="--shape: layers (default the shape's)")
    p.add_argument("--tokenizer", default=None,
                   help="--shape: tokenizer.json to put beside it (default: a generated GPT-2-size vocabulary)")
    p.add_argument("--workdir", default=".")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = run_layout(args.model, args.child, args)
        with open(os.path.join(args.workdir, f"agree_{args.child}.json"), "w") as f:
            json.dump(result, f)
        return
    child_args = list(argv or sys.argv[1:])
    if args.shape is not None:
        child_args += ["--model", _shape_folder(args)]
    outputs = {}
    for layout in [args.base, *_layouts(args)]:
        path = os.path.join(args.workdir, f"agree_{layout}.json")
        if not _reusable(path, args):
            cmd = [sys.executable, "-m", "tools.agreement", *child_args, "--child", layout]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{layout}: failed\n{proc.stderr[-3000:]}", flush=True)
                continue
        with open(path) as f:
            outputs[layout] = json.load(f)
    if args.base not in outputs:
        sys.exit(f"the base layout {args.base} failed: nothing to compare against")
    report = {layout: compare(outputs[args.base], out) for layout, out in outputs.items() if layout != args.base}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "agreement": report}, f, indent=1)
    mode = "deterministic" if args.deterministic else "default"
    print(f"| layout vs {args.base} | same greedy ({args.dtype}, {mode}, {args.num_prompts} prompts × "
          f"{args.max_tokens} tokens) | identical log-probs | margins at divergence | max |Δ log p| before it |")
    print("|---|---|---|---|---|")
    for layout, r in report.items():
        m = ", ".join(f"{x:.3f}" for x in r["divergence_margins"]) or "—"
        print(f"| {layout} | {r['same_greedy_fraction']:.0%} | {r['identical_fraction']:.0%} | {m} | "
              f"{r['max_prefix_logprob_deviation']:.3f} |")


def _shape_folder(args) -> str:
    """A config.json + tokenizer folder of the benchmark shape, in --workdir."""
    from pipeserve.runtime.bench.dummy_model import SHAPES, write_model_folder

    num_layers = args.num_layers or SHAPES[args.shape]["num_hidden_layers"]
    folder = os.path.join(args.workdir, f"{args.shape}-{num_layers}")
    write_model_folder(folder, shape=args.shape, num_layers=num_layers, tokenizer=args.tokenizer)
    return folder


if __name__ == "__main__":
    main()
