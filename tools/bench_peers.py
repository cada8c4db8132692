"""Side-by-side offline throughput: pipeserve against transformers (and DeepSpeed-FastGen).

The peers' common workload: a Llama-3-8B-shaped model with random bf16 weights
(runtime/bench/dummy_model.py), N requests with prompt lengths uniform in [min_prompt,
max_prompt], `output_len` tokens each, all submitted at once. Each system runs in its own process (so one's memory never limits the
next) on the same card, in the same run. Throughput counts prompt + output tokens.

    python -m tools.bench_peers --systems pipeserve,transformers --out results.json

`--workload mooncake` or `shared_prefix` runs prompts that share prefixes instead (the
Mooncake trace's last --num-requests rows, or --num-prefixes shared prompts each asked
--num-requests / --num-prefixes questions), every request still making --output-len tokens; the
`pipeserve:prefix=caching` and `pipeserve:prefix=grouping` systems turn on prefix caching and
BatchLLM-style grouping (runtime/bench/prefix_workloads.py):

    python -m tools.bench_peers --workload mooncake \
        --systems pipeserve,pipeserve:prefix=caching,pipeserve:prefix=grouping,fastgen

`--workload sharegpt` takes each request's prompt and output length from the ShareGPT trace
(rows drawn with --seed as `pipeserve bench` draws them; random prompt token ids), capped to
prompt + output <= the model's 8192 positions by cutting the prompt; every request makes exactly
its own output length (EOS ignored). transformers is skipped there (one length per batch):

    python -m tools.bench_peers --workload sharegpt --num-requests 1000 --systems pipeserve,fastgen
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from pipeserve.runtime.bench import dummy_model

MAX_MODEL_LEN = dummy_model.MAX_MODEL_LEN  # the models bench_peers writes
GPT2_VOCAB = dummy_model.GPT2_VOCAB  # prompt token ids are drawn below it


def make_workload(num_requests: int, min_prompt: int, max_prompt: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(0, GPT2_VOCAB) for _ in range(rng.randint(min_prompt, max_prompt))]
        for _ in range(num_requests)
    ]


def cap_lengths(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """(prompt, output) with prompt + output <= max_model_len: the output kept (at most
    max_model_len - 1), the prompt cut to fit."""
    output_len = min(output_len, max_model_len - 1)
    return min(prompt_len, max_model_len - output_len), output_len


def sharegpt_requests(num_requests: int, *, max_model_len: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (random token ids) and output lengths of ShareGPT trace rows, drawn with `seed` by
    runtime/bench/workload.py as `pipeserve bench` draws them, each capped by ``cap_lengths``."""
    import random

    from pipeserve.runtime.bench.workload import WorkloadConfig, build_workload

    specs = build_workload(WorkloadConfig(source="sharegpt", arrival="offline", num_requests=num_requests, seed=seed))
    lengths = [cap_lengths(s.prompt_len, s.output_len, max_model_len) for s in specs]
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, GPT2_VOCAB) for _ in range(p)] for p, _ in lengths]
    return prompts, [o for _, o in lengths]


def make_requests(args) -> tuple[list[list[int]], list[int]]:
    """The prompts of --workload and each one's output length (--output-len, or the trace's)."""
    if args.workload == "sharegpt":
        return sharegpt_requests(args.num_requests, max_model_len=MAX_MODEL_LEN, seed=args.seed)
    prompts = make_prompts(args)
    return prompts, [args.output_len] * len(prompts)


def make_prompts(args) -> list[list[int]]:
    """The prompts of --workload: uniform (the peers' common workload), mooncake, shared_prefix or sharegpt."""
    if args.workload == "uniform":
        return make_workload(args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    if args.workload == "sharegpt":
        return make_requests(args)[0]
    from pipeserve.runtime.bench import prefix_workloads as P

    if args.workload == "mooncake":
        start = P.MOONCAKE_NUM_ROWS - args.num_requests if args.start is None else args.start
        requests = P.mooncake_requests(P.MOONCAKE_TRACE, block_tokens=args.block_tokens, start=start,
                                       max_requests=args.num_requests, max_input_len=args.max_prompt, seed=args.seed)
    else:
        if args.num_requests % args.num_prefixes:
            raise ValueError("--num-requests must be a multiple of --num-prefixes")
        requests = P.shared_prefix_requests(num_prefixes=args.num_prefixes,
                                            requests_per_prefix=args.num_requests // args.num_prefixes,
                                            prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                                            max_tokens=args.output_len, seed=args.seed)
    return [r.prompt_token_ids for r in requests]


def _workload_label(args) -> str:
    if args.workload == "mooncake":
        start = "the last rows" if args.start is None else f"rows from {args.start}"
        return f"Mooncake trace ({start}, {args.block_tokens}-token blocks, prompts cut to {args.max_prompt})"
    if args.workload == "shared_prefix":
        return f"{args.num_prefixes} shared prompts of {args.prefix_len} + {args.suffix_len} own tokens"
    if args.workload == "sharegpt":
        return (f"ShareGPT trace lengths (rows drawn with seed {args.seed}; prompt + output <= {MAX_MODEL_LEN},"
                " longer prompts cut)")
    return f"prompts U[{args.min_prompt},{args.max_prompt}]"


def write_model_folder(folder: str, *, num_layers: int, with_weights: bool, tokenizer: str | None = None) -> None:
    """The Llama-3-8B-shaped folder every system loads; with random bf16 weights on disk when
    ``with_weights`` (peers cannot load a config-only folder)."""
    dummy_model.write_model_folder(folder, shape="llama3-8b", num_layers=num_layers, tokenizer=tokenizer)
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(folder))
    if with_weights and not has_weights:  # a child process: the parent holds no GPU memory while peers run
        # (an existing folder's weights are reused: the same seed wrote them)
        code = "import sys; from tools.bench_peers import hf_model; hf_model(sys.argv[1]).save_pretrained(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, folder], check=True)


def hf_model(folder: str):
    """transformers' Llama of the folder's config, random bf16 weights (seed 0), on the GPU if any."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def run_pipeserve(folder: str, prompts: list[list[int]], output_lens: list[int], args, variant: str = "") -> dict:
    """`variant` is "" or e.g. "tp=2" / "pp=2" (several GPUs: workers under torchrun) or
    "prefix=caching" / "prefix=grouping" (automatic prefix caching; plus BatchLLM grouping)."""
    from pipeserve import LLM, SamplingParams

    par = dict(kv.split("=") for kv in re.split(r"[+,]", variant) if kv)  # e.g. "tp=2+pp=2"
    os.environ["PIPESERVE_STAGE_STATS"] = "1"  # workers print their busy time at shutdown
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(folder))
    llm = LLM(
        folder,
        load_format="auto" if has_weights else "dummy",
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=256,
        block_size=args.block_size,
        tensor_parallel_size=int(par.get("tp", 1)),
        pipeline_parallel_size=int(par.get("pp", 1)),
        enable_prefix_caching=par.get("prefix", "off") in ("caching", "grouping"),
        prefix_grouping=par.get("prefix") == "grouping",
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    # Prefix workloads warm up on reversed prompts, so that nothing of the timed run is cached.
    warm = prompts[:4] if args.workload in ("uniform", "sharegpt") else [p[::-1] for p in prompts[:4]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    scheduler = getattr(llm.engine, "scheduler", None)  # in this process unless tp/pp workers
    cache_before = scheduler.prefix_cache_stats if scheduler is not None else None
    _sync()
    t0 = time.perf_counter()
    if args.profile:
        outs = _profiled(lambda: llm.generate(prompts, params), args.profile)
    else:
        outs = llm.generate(prompts, params)
    _sync()
    wall = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == output_lens
    with open(os.path.join(folder, f"tokens_pipeserve{variant}.json"), "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    blocks = llm.engine.state.num_kv_blocks
    result = {"wall_s": wall, "num_kv_blocks": blocks}
    if cache_before is not None:
        after = scheduler.prefix_cache_stats
        hit = after.num_cached_prompt_tokens - cache_before.num_cached_prompt_tokens
        result["prefill_saved_fraction"] = hit / sum(map(len, prompts))
    llm.close()
    return result


def _profiled(fn, path: str):
    """torch.profiler over one call; the top operators by device (else CPU) time go to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        out = fn()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40))
        f.write("\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    return out


def run_transformers(folder: str, prompts: list[list[int]], output_lens: list[int], args) -> dict:
    import torch

    if len(set(output_lens)) > 1:
        return {"skipped": "per-request output lengths: generate() makes one length per batch"}
    output_len = output_lens[0]
    model = hf_model(folder)
    batch = 32

    def generate(chunk: list[list[int]], n: int) -> None:
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
        assert out.shape[1] == width + n

    generate(prompts[:2], 4)  # warm-up
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        generate(prompts[i : i + batch], output_len)
    _sync()
    return {"wall_s": time.perf_counter() - t0}


def run_fastgen(folder: str, prompts: list[list[int]], output_lens: list[int], args) -> dict:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder chokes on '9.0a'
    os.environ.setdefault("LOCAL_SIZE", "1")
    try:
        import mii
    except ImportError:
        return {"skipped": "deepspeed-mii is not installed (pip install deepspeed-mii)"}

    pipe = mii.pipeline(folder)
    fastgen_generate(pipe, prompts[:2], [4, 4])  # warm-up
    _sync()
    t0 = time.perf_counter()
    responses = fastgen_generate(pipe, prompts, output_lens)
    _sync()
    wall = time.perf_counter() - t0
    generated = [r.generated_length for r in responses]
    # Every system is credited the requested tokens; say so where FastGen made fewer (it
    # recomputes requests after a KV-cache deadlock and then reports only the new tokens).
    result = {"wall_s": wall, "prompt_tokens": sum(r.prompt_length for r in responses),
              "generated_tokens": sum(generated)}
    if generated != output_lens:
        result["requests_short_of_their_length"] = sum(g != n for g, n in zip(generated, output_lens))
    return result


def fastgen_generate(pipe, prompts: list[list[int]], output_lens: list[int]) -> list:
    """One MII pipeline call in which request i is prompts[i] (token ids, not re-tokenized text)
    and makes exactly output_lens[i] tokens, greedy with EOS ignored, as the other systems do.

    ``pipe(texts, max_new_tokens=N, ...)`` gives every prompt the same keyword arguments. Its
    per-request step, in deepspeed-mii 0.3.3 (the version this was written against), is
    ``MIIPipeline.__call__`` -> ``self._put_request(uid, prompt, kwargs)`` with uid = the
    prompt's index -> ``self.make_request(tid, uid, input_tokens, kwargs)``, whose kwargs
    (``GenerateParamsConfig``) are per request; so this pipeline's ``_put_request`` is replaced,
    for the call, by the same three lines with token ids and the request's own lengths."""
    import queue

    import torch

    def put_request(uid: int, token_ids: list[int], kwargs: dict) -> None:
        n = output_lens[uid]
        kwargs.update(max_new_tokens=n, min_new_tokens=n, ignore_eos=True, do_sample=False)
        pipe.result_queues[pipe.tid] = queue.Queue()
        pipe.request_queue.put(pipe.make_request(pipe.tid, uid, torch.tensor(token_ids), kwargs))

    if not callable(getattr(pipe, "_put_request", None)):
        raise RuntimeError("this deepspeed-mii has no MIIPipeline._put_request (written against 0.3.3)")
    pipe._put_request = put_request
    try:
        return pipe(prompts)
    finally:
        del pipe._put_request  # the class's own again


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


RUNNERS = {"pipeserve": run_pipeserve, "transformers": run_transformers, "fastgen": run_fastgen}


def runner(name: str):
    """"pipeserve:tp=2" runs pipeserve with a parallel layout; plain names are peers."""
    base, _, variant = name.partition(":")
    if variant:
        return lambda *a: run_pipeserve(*a, variant=variant)
    return RUNNERS[base]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="pipeserve,transformers,fastgen",
                   help="pipeserve, pipeserve:<variant> (tp=2, pp=2, prefix=caching, prefix=grouping),"
                   " transformers, fastgen")
    p.add_argument("--workload", default="uniform", choices=("uniform", "mooncake", "shared_prefix", "sharegpt"),
                   help="uniform prompt lengths (the peers' common workload), prompts that share prefixes, or the"
                   " ShareGPT trace's prompt and output lengths (--min/max-prompt, --output-len unused)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128, help="every request's output (not sharegpt)")
    p.add_argument("--block-tokens", type=int, default=512, help="mooncake: tokens per trace hash id")
    p.add_argument("--start", type=int, default=None,
                   help="mooncake: first trace row (default: the last --num-requests rows)")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared_prefix: distinct shared prompts")
    p.add_argument("--prefix-len", type=int, default=2048, help="shared_prefix: tokens of each shared prompt")
    p.add_argument("--suffix-len", type=int, default=128, help="shared_prefix: tokens of each request's own")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json for the model folder (default: a generated vocabulary of GPT-2's size)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--profile", default=None, help="write a torch.profiler table of the pipeserve run here")
    p.add_argument("--dtype", default="bfloat16", help="pipeserve's dtype (peers run bf16)")
    p.add_argument("--weights", action="store_true", help="write real (random) weights even if no peer needs them")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    prompts, output_lens = make_requests(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pipeserve-bench-")
    if args.child:
        result = runner(args.child)(workdir, prompts, output_lens, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    systems = [s for s in args.systems.split(",") if s]
    # Real (random) weights on disk when a peer needs them or pipeserve layouts are compared
    # (tp/pp must load the same weights as one GPU for their greedy tokens to be comparable).
    with_weights = args.weights or "fastgen" in systems or any(":" in s for s in systems)
    write_model_folder(workdir, num_layers=args.num_layers, with_weights=with_weights, tokenizer=args.tokenizer)
    total = sum(map(len, prompts)) + sum(output_lens)  # the same for every system
    results = {}
    for name in systems:
        cmd = [sys.executable, "-m", "tools.bench_peers", *sys.argv[1:], "--child", name, "--workdir", workdir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            results[name] = {"error": (proc.stderr or proc.stdout)[-3000:]}
        else:
            r = json.loads(line[7:])
            if "wall_s" in r:
                r["tokens_per_s"] = total / r["wall_s"]
            # Workers print concurrently, so lines may interleave: pick out each JSON object.
            stages = [json.loads(m) for m in re.findall(r"STAGE_STATS (\{[^{}]*\})", proc.stdout)]
            if stages:
                r["stages"] = sorted(stages, key=lambda d: d["rank"])
            results[name] = r
        print(name, json.dumps(results[name])[:3000], flush=True)
    _greedy_agreement(workdir, results)
    summary = _summary(results, args, total, output_lens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "total_tokens": total, "results": results}, f, indent=1)
    print(summary)


def outputs_label(output_lens: list[int]) -> str:
    lo, hi = min(output_lens), max(output_lens)
    if lo == hi:
        return f"{lo} out"
    return f"{lo}-{hi} out each (mean {sum(output_lens) / len(output_lens):.0f}, {sum(output_lens)} in all)"


def _greedy_agreement(workdir: str, results: dict) -> None:
    """Fraction of prompts whose greedy tokens equal one GPU's, per pipeserve layout."""
    base_path = os.path.join(workdir, "tokens_pipeserve.json")
    if not os.path.exists(base_path):
        return
    base = json.load(open(base_path))
    for name, r in results.items():
        path = os.path.join(workdir, f"tokens_pipeserve{name.partition(':')[2]}.json")
        if ":" in name and os.path.exists(path):
            other = json.load(open(path))
            r["same_greedy_fraction"] = sum(a == b for a, b in zip(base, other)) / len(base)
            r["same_first_tokens_fraction"] = sum(a[:16] == b[:16] for a, b in zip(base, other)) / len(base)


def _summary(results: dict, args, total: int, output_lens: list[int]) -> str:
    import torch

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    base = results.get("pipeserve", {}).get("tokens_per_s")
    rows = [f"card: {card}; {args.num_requests} requests, {_workload_label(args)}, "
            f"{outputs_label(output_lens)}, {args.num_layers} layers, {total} tokens",
            "| system | wall s | tokens/s | pipeserve / system |", "|---|---|---|---|"]
    for name, r in results.items():
        if "tokens_per_s" in r:
            ratio = f"{base / r['tokens_per_s']:.2f}" if base else "-"
            extra = ""
            if "same_greedy_fraction" in r:
                extra += f" same greedy {r['same_greedy_fraction']:.0%};"
            if "prefill_saved_fraction" in r:
                extra += f" prefill saved {r['prefill_saved_fraction']:.1%};"
            if "requests_short_of_their_length" in r:  # credited the requested tokens all the same
                extra += f" {r['requests_short_of_their_length']} requests short, {r['generated_tokens']} made;"
            for st in r.get("stages", []):
                extra += f" rank{st['rank']}/stage{st['stage']} busy {st['busy_fraction']:.0%};"
            rows.append(f"| {name} | {r['wall_s']:.2f} | {r['tokens_per_s']:,.0f} | {ratio} |{extra}")
        else:
            rows.append(f"| {name} | - | {r.get('skipped') or 'error'} | - |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
