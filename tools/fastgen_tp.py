"""DeepSpeed-FastGen tensor-parallel on a Llama-3 shape, on benchmarks/throughput.py's workloads
(the same prompt token ids, every request the same output length, EOS ignored), for a same-run
comparison with pipeserve's layouts on one machine:

    python3 -m tools.fastgen_tp write DIR --shape llama3-70b [--tokenizer tokenizer.json]
    python3 -m deepspeed.launcher.runner --num_gpus 4 tools/fastgen_tp.py run DIR --tp 4 \\
        --workloads peers,decode-heavy

``write`` lays out a Hugging Face folder (config, tokenizer, sharded safetensors with an index)
with random bf16 weights: a 128 MB block of N(0, 0.02) values tiled through every matrix, each
matrix starting at its own offset, norms at one. It writes the safetensors files directly, a
tensor at a time from the block (no host memory beyond it, unless the folder is in /dev/shm:
then the files are the memory). FastGen reads the folder; pipeserve's runs (throughput.py) draw
their own random weights: throughput does not depend on the values.

FastGen runs at MII's defaults, as a user gets it: at most 768 tokens and 512 sequences a
forward (DeepSpeed's ``DSStateManagerConfig``); pipeserve's runs take 2,048 tokens and 256
sequences. ``--max-ragged-batch-size 2048`` gives FastGen pipeserve's token budget.

``run`` is started by DeepSpeed's launcher, one process per GPU (it sets LOCAL_SIZE, which
FastGen's tensor-parallel code needs); every rank builds the MII pipeline and submits the same
requests, rank 0 prints one ``RESULT {...}`` line per workload, in throughput.py's fields.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # started as a script by DeepSpeed's launcher
    sys.path.insert(0, REPO)

BLOCK_VALUES = 1 << 26
"""Random bf16 values tiled through the weights (128 MB)."""
SHARD_BYTES = 5 << 30


def _throughput():
    spec = importlib.util.spec_from_file_location("throughput", os.path.join(REPO, "benchmarks", "throughput.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of ``LlamaForCausalLM`` with ``config``, in layer order."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    tensors = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f))]
    tensors += [("model.norm.weight", (h,))]
    if not config.get("tie_word_embeddings", False):
        tensors += [("lm_head.weight", (v, h))]
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...]]], block: memoryview, first: int) -> None:
    """One bf16 safetensors file of ``tensors``: 1-D ones (norms), matrices tiled from ``block``
    (bytes of random bf16 values), tensor k starting at value ``(first + k) * 7919`` of it."""
    header, offset = {}, 0
    for name, shape in tensors:
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    ones = b"\x80\x3f" * 65536  # bf16 1.0, little-endian
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for k, (name, shape) in enumerate(tensors):
            size = 2 * _numel(shape)
            if len(shape) == 1:
                for i in range(0, size, len(ones)):
                    f.write(ones[:min(len(ones), size - i)])
                continue
            pos = (2 * (first + k) * 7919) % len(block)
            while size:
                n = min(size, len(block) - pos)
                f.write(block[pos:pos + n])
                size -= n
                pos = 0


def write_folder(folder: str, *, shape: str, tokenizer: str | None, num_layers: int | None) -> None:
    import torch

    from pipeserve.runtime.bench import dummy_model

    layers = num_layers or dummy_model.SHAPES[shape]["num_hidden_layers"]
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):  # written last: a folder without it is incomplete
        os.remove(index_path)
    dummy_model.write_model_folder(folder, shape=shape, num_layers=layers, tokenizer=tokenizer)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(BLOCK_VALUES, generator=gen) * 0.02).to(torch.bfloat16)
    block = memoryview(values.view(torch.uint8).numpy())
    shards, current, size = [], [], 0
    for name, tshape in llama_tensors(config):
        if current and size + 2 * _numel(tshape) > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, tshape))
        size += 2 * _numel(tshape)
    shards.append(current)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    t0 = time.perf_counter()
    firsts = [sum(map(len, shards[:i])) for i in range(len(shards))]
    with ThreadPoolExecutor(8) as pool:  # file writes release the GIL
        list(pool.map(lambda a: write_safetensors(os.path.join(folder, a[0]), a[1], block, a[2]),
                      zip(files, shards, firsts)))
    total = sum(2 * _numel(s) for shard in shards for _, s in shard)
    index = {"metadata": {"total_size": total},
             "weight_map": {name: file for file, shard in zip(files, shards) for name, _ in shard}}
    with open(f"{index_path}.tmp", "w") as f:
        json.dump(index, f)
    os.replace(f"{index_path}.tmp", index_path)
    print(f"wrote {total / 1e9:.1f} GB in {len(files)} files in {time.perf_counter() - t0:.0f} s", flush=True)


def run(folder: str, *, tp: int, workloads: list[str], seed: int, max_ragged_batch_size: int | None,
        rounds: int = 1) -> None:
    """Each workload ``rounds`` times back to back; its RESULT line is the last round's, as
    throughput.py's (with every round's total tokens/s where there are several)."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder chokes on '9.0a'
    import mii
    import torch

    from tools.bench_peers import fastgen_generate

    throughput = _throughput()
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    engine = {} if max_ragged_batch_size is None else {
        "inference_engine_config": {"state_manager": {"max_ragged_batch_size": max_ragged_batch_size}}}
    pipe = mii.pipeline(folder, tensor_parallel=tp, **engine)
    start_s = time.perf_counter() - t0
    warm, _ = throughput.workload_prompts("peers", 8, seed)
    fastgen_generate(pipe, warm, [8] * len(warm))  # kernels and allocations that appear only at run time
    for workload in workloads:
        prompts, out_len = throughput.workload_prompts(workload, None, seed)
        walls = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            responses = fastgen_generate(pipe, prompts, [out_len] * len(prompts))
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        if rank != 0:
            continue
        wall = walls[-1]
        prompt_tokens = sum(map(len, prompts))
        # Credited the requested tokens, as pipeserve is; say so where FastGen made fewer.
        out_tokens = out_len * len(prompts)
        short = sum(r.generated_length != out_len for r in responses)
        result = {"system": "fastgen", "workload": workload, "tp": tp, "requests": len(prompts),
                  "max_ragged_batch_size": max_ragged_batch_size or 768,
                  "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, "wall_s": round(wall, 3),
                  "output_tok_s": round(out_tokens / wall, 1),
                  "total_tok_s": round((prompt_tokens + out_tokens) / wall, 1), "start_s": round(start_s, 1),
                  "requests_short_of_their_length": short}
        if rounds > 1:
            result["rounds"] = [{"total_tok_s": round((prompt_tokens + out_tokens) / w, 1)} for w in walls]
        print("RESULT " + json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed's launcher
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="a model folder with random bf16 weights")
    w.add_argument("folder")
    w.add_argument("--shape", default="llama3-70b", choices=("llama3-8b", "llama3-70b"))
    w.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: a generated GPT-2-size one)")
    w.add_argument("--num-layers", type=int, default=None, help="fewer for a quick check (default: the shape's)")
    r = sub.add_parser("run", help="FastGen on the folder, under DeepSpeed's launcher")
    r.add_argument("folder")
    r.add_argument("--tp", type=int, required=True)
    r.add_argument("--workloads", default="peers,decode-heavy", help="throughput.py workloads, comma-separated")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-ragged-batch-size", type=int, default=None,
                   help="FastGen's tokens per forward (default: DeepSpeed's, 768)")
    r.add_argument("--rounds", type=int, default=1, help="timed runs of each workload, one after another")
    args = p.parse_args(argv)
    if args.command == "write":
        write_folder(args.folder, shape=args.shape, tokenizer=args.tokenizer, num_layers=args.num_layers)
    else:
        run(args.folder, tp=args.tp, workloads=[x for x in args.workloads.split(",") if x], seed=args.seed,
            max_ragged_batch_size=args.max_ragged_batch_size, rounds=args.rounds)


if __name__ == "__main__":
    main()
