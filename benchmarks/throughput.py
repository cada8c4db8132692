"""Offline throughput of one layout through the public ``LLM`` API, the way a user measures it:

    python benchmarks/throughput.py [--tp 2] [--pp 2] [--workload decode-heavy] [--tokenizer tokenizer.json]

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``; throughput does not
depend on the values), prompts of random token ids, every request the same number of output
tokens (EOS ignored), all submitted at once. It uses nothing but ``pipeserve.LLM`` and
``SamplingParams``, so it runs unchanged against an older checkout (``TREE=`` in gpu.sh) for a
same-run before/after. Prints one JSON line (``RESULT {...}``): wall seconds, output and total
tokens per second.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=50304,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=50256, eos_token_id=50256,
)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
JSON_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                               "items": {"type": "array", "items": {"type": "string"}}},
               "required": ["title", "items"]}
"""--json-fraction's schema: strings and a list of them, so an answer may run long."""
WORKLOADS = {  # name: (requests, prompt range, output tokens)
    "uniform": (256, (128, 2048), 256),
    "decode-heavy": (128, (1000, 1200), 1700),
    "peers": (64, (128, 2048), 128),
}


def model_folder(tokenizer: str | None, num_layers: int | None, shape: str = "llama3-8b") -> str:
    """A config-only folder of ``shape`` (``num_layers`` of its layers; None: all); its tokenizer
    is ``tokenizer``, or the random-weights model's generated one (this checkout's
    ``runtime/bench/dummy_model.py``, whatever tree runs)."""
    folder = tempfile.mkdtemp(prefix=f"pipeserve-{shape}-")
    config = SHAPES[shape]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(config, num_hidden_layers=num_layers or config["num_hidden_layers"]), f)
    if tokenizer is not None:
        shutil.copy(tokenizer, os.path.join(folder, "tokenizer.json"))
        return folder
    spec = importlib.util.spec_from_file_location("dummy_model", os.path.join(REPO, "runtime/bench/dummy_model.py"))
    dummy = sys.modules["dummy_model"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(dummy)
    dummy.word_level_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    return folder


def workload_prompts(workload: str, num_requests: int | None = None, seed: int = 0) -> tuple[list[list[int]], int]:
    """``workload``'s prompts (random token ids; ``num_requests`` of them, default the workload's)
    and every request's output length. tools/fastgen_tp.py gives FastGen the same ones."""
    default_requests, (lo, hi), out_len = WORKLOADS[workload]
    rng = random.Random(seed)
    return [[rng.randrange(50000) for _ in range(rng.randint(lo, hi))]
            for _ in range(num_requests or default_requests)], out_len


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json of at most 50304 entries (default: a generated one of GPT-2's size)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="uniform")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None, help="fewer for a quick check (default: the shape's)")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    p.add_argument("--token-feedback", choices=("auto", "on", "off"), default="auto",
                   help="parallel.token_feedback (auto: the tree's default)")
    p.add_argument("--rounds", type=int, default=1, help="timed runs of the workload, one after another")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (default 0: greedy); nothing else set, as "
                        "an OpenAI client that sends only a temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (with --temperature)")
    p.add_argument("--penalties", action="store_true",
                   help="every request with presence 0.5, frequency 0.5 and repetition 1.1 penalties")
    p.add_argument("--json-fraction", type=float, default=0.0,
                   help="this fraction of the requests under a JSON schema (structured outputs; they stop where it ends)")
    p.add_argument("--quantization", default=None, help="fp8: the decoder's projections in FP8, quantized at load")
    p.add_argument("--no-warmup", action="store_true",
                   help="no untimed round first: the first timed round is the first work after start-up")
    args = p.parse_args(argv)

    from pipeserve import LLM, SamplingParams

    prompts, out_len = workload_prompts(args.workload, args.num_requests, args.seed)
    num_requests = len(prompts)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1) if args.penalties else {}
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=out_len, ignore_eos=True,
                            **penalties)
    if args.json_fraction:  # every round's same requests, spread evenly over the list
        from pipeserve import StructuredOutputsParams

        constrained = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=out_len, **penalties,
                                     structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA))
        every = round(1 / args.json_fraction)
        params = [constrained if i % every == 0 else params for i in range(num_requests)]
    folder = model_folder(args.tokenizer, args.num_layers, args.shape)
    extra = {} if args.token_feedback == "auto" else {"token_feedback": args.token_feedback == "on"}
    t0 = time.perf_counter()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, max_model_len=4096, tensor_parallel_size=args.tp,
              pipeline_parallel_size=args.pp, quantization=args.quantization, **extra)
    start_s = time.perf_counter() - t0
    num_kv_blocks = llm.engine.executor.num_kv_blocks
    rounds = []
    try:
        if not args.no_warmup:  # one small round first: kernels and allocations that appear only at run time
            llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rounds.append((time.perf_counter() - t0, _mean_ttft(outs)))
    finally:
        llm.close()
        shutil.rmtree(folder, ignore_errors=True)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    wall = rounds[-1][0]
    result = {"shape": args.shape, "workload": args.workload, "tp": args.tp, "pp": args.pp, "requests": num_requests,
              "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, "wall_s": round(wall, 3),
              "output_tok_s": round(out_tokens / wall, 1), "total_tok_s": round((prompt_tokens + out_tokens) / wall, 1),
              "start_s": round(start_s, 1), "token_feedback": args.token_feedback,
              "penalties": args.penalties, "json_fraction": args.json_fraction,
              "quantization": args.quantization, "num_kv_blocks": num_kv_blocks}
    if args.rounds > 1 or args.no_warmup:  # each round: total tokens/s and mean TTFT (s; None where not recorded)
        result["rounds"] = [{"total_tok_s": round((prompt_tokens + out_tokens) / w, 1),
                             "mean_ttft_s": None if t is None else round(t, 4)} for w, t in rounds]
    print("RESULT " + json.dumps(result), flush=True)
    return result


def _mean_ttft(outs) -> float | None:
    """Mean time from a request's arrival to its first token (the engine's RequestMetrics)."""
    times = [m.first_token_time - m.arrival_time for o in outs
             if (m := getattr(o, "metrics", None)) is not None and m.first_token_time is not None]
    return sum(times) / len(times) if times else None


if __name__ == "__main__":
    main()
