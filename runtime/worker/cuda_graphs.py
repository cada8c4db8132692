"""CUDA graphs for micro-batches, one set per pipeline stage: decode batches bucketed by batch
size, and prompt-carrying (mixed) batches bucketed by token count.

Every layer is a dozen kernels, and launching them one by one costs the host about as long as
the device takes to run a 512-token chunk of an 8B model (``tools/host_launch.py``: 10 ms to
launch 16 layers that run in 6–8 ms on an H100). A stage whose host paces it leaves the next
stage idle, so both kinds are captured. At start-up ``CudaGraphRunner.capture`` records this
stage's forward over static input buffers once per bucket:

- decode: batch sizes 1, 2, 4, 8, 16, 24, 32, 48, …, ``max_batch`` (``plan_graph_step``: every
  sequence has one new token);
- mixed: token counts 16, 32, …, up to ``max_tokens`` (``token_buckets``; ``plan_mixed_step``:
  any other step of at most ``max_tokens`` tokens and ``max_seqs`` sequences).

A step is padded to the next bucket of its kind, copied into the buffers and replayed; a step
no bucket holds runs eagerly.

Padding is inert. Decode rows: slot -1 (``write_kv`` skips it), seq_len 0 (the attention
kernel gives a zero row and reads no KV), token/position 0. Mixed: the padding tokens form one
extra sequence with no context (seq_len 0, slot -1), whose rows attend to nothing. Every other
operation in the forward is row-wise, so padding rows never touch the real ones. The static
block table is ``[rows, ceil(max_model_len / block_size)]``; a step writes only its rows and
used columns, so columns past a row's blocks hold stale block ids from an earlier step: valid
ids, never read (the kernel stops at ``ceil(seq_len / block_size)`` blocks).

What makes a forward capturable: with the Triton ops, a step's launches depend only on tensor
shapes, never on values the host would read. A decode batch's attention reads ``seq_lens`` on
the device; a mixed batch's attention takes a work list (``kernels.paged_attention``: each
program's sequence and query tile), rebuilt on the host per step, so its grid is the bucket's,
not the step's longest chunk. The torch reference attention loops over host lists and is never
captured. With TP > 1 the all-reduces are captured too (NCCL supports graph capture): every
TP rank of a stage captures the same buckets in the same order and replays on the same plans.
Pipeline send/recv stay outside the graph. Deterministic mode keeps tp/pp workers eager:
capturing its float32 partial-sum gathers has not been verified.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.kernels.paged_attention import attention_work_list, mixed_block_m, work_list_size
from pipeserve.runtime import progress
from pipeserve.runtime.worker.batch import StepInputs, host_staging, host_to_device, pack_step
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.model.llama import LlamaForCausalLM

logger = logging.getLogger("pipeserve.cuda_graphs")


# --- pure planning (host only) ------------------------------------------------------------


def batch_size_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes up to ``max_batch``: 1, 2, 4, 8, 16, then steps of half the last
    power of two (24, 32, 48, 64, 96, 128, 192, 256, 384, …), and ``max_batch`` itself.
    A padded step does at most 50% more rows, which a weight-bound decode barely notices."""
    if max_batch < 0:
        raise ValueError(f"max_batch must be >= 0, got {max_batch}")
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b = b * 2 if b < 16 else b + (1 << (b.bit_length() - 1)) // 2
    return buckets + [max_batch] if max_batch else []


def token_buckets(max_tokens: int) -> list[int]:
    """Captured token counts of mixed steps up to ``max_tokens``: multiples of 16 up to 512,
    then steps of a sixteenth of the last power of two (32 up to 1024, 64 up to 2048, …), and
    ``max_tokens`` itself. A prompt chunk is compute-bound, so padding costs what it computes:
    past 256 tokens a padded step does at most 1/16 more."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    buckets, t = [], 16
    while t < max_tokens:
        buckets.append(t)
        t += max(16, (1 << (t.bit_length() - 1)) // 16)
    return buckets + [max_tokens] if max_tokens else []


def bucket_for(size: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``size`` (sequences or tokens); None if none does."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) and size > 0 else None


@dataclass(frozen=True, slots=True)
class MixedShape:
    """The static shapes of one mixed bucket of ``bucket`` tokens: up to ``seqs`` sequences (the
    step's, plus one of padding) and ``work`` attention work items. Its int32 buffer holds
    seq_lens [seqs], query_start [seqs + 1] and the work list [work, 2], in that order."""

    seqs: int
    work: int

    @classmethod
    def of(cls, bucket: int, *, max_seqs: int, g: int, block_m: int) -> MixedShape:
        seqs = min(max_seqs, bucket) + 1
        return cls(seqs, work_list_size(bucket, seqs, g, block_m))

    @property
    def num_ints(self) -> int:
        return 2 * self.seqs + 1 + 2 * self.work

    def split(self, ints):
        """(seq_lens, query_start, work list [work, 2]): views of an int32 array or tensor."""
        s = self.seqs
        return ints[:s], ints[s : 2 * s + 1], ints[2 * s + 1 : self.num_ints].reshape(self.work, 2)


@dataclass(kw_only=True, slots=True)
class GraphStep:
    """A step padded to a bucket: host arrays to copy into the static buffers."""

    kind: str  # "decode" (a batch-size bucket) or "mixed" (a token bucket)
    num_seqs: int  # the step's sequences
    num_tokens: int  # real rows; rows num_tokens..bucket-1 are padding
    bucket: int
    tokens: np.ndarray  # [3, bucket] int64: input ids (padding 0), positions (0), slots (-1: no KV write)
    # int32: decode: seq_lens [bucket] (padding 0: no KV read); mixed: MixedShape's layout
    ints: np.ndarray
    block_tables: np.ndarray  # [num_seqs, used blocks] int32
    sample_rows: list[int] | None  # rows to sample; None = every row (decode only)
    # Rows whose logits are sampled, as an index of the [num_tokens, H] output: a slice when every
    # row samples (no gather), else a device tensor (set by CudaGraphRunner.prepare).
    sample_indices: torch.Tensor | slice = field(default_factory=lambda: slice(None))

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, self.bucket

    @property
    def input_ids(self) -> np.ndarray:
        return self.tokens[0]

    @property
    def positions(self) -> np.ndarray:
        return self.tokens[1]

    @property
    def slot_mapping(self) -> np.ndarray:
        return self.tokens[2]


def _padded_tokens(bucket: int, token_ids: list[int], positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """[3, bucket] int64: ids, positions and slots, padded with 0, 0 and -1."""
    n = len(token_ids)
    tokens = np.zeros((3, bucket), dtype=np.int64)
    tokens[0, :n] = token_ids
    tokens[1, :n] = positions
    tokens[2, :n] = slots
    tokens[2, n:] = -1
    return tokens


def plan_graph_step(
    step: StepInputs, *, buckets: list[int], block_size: int, max_blocks_per_seq: int
) -> GraphStep | None:
    """A decode step padded to its bucket, or None when it is not one (some sequence has
    more than one new token), is larger than every bucket, or has a block table wider than
    the static one."""
    n = len(step.query_lens)
    bucket = bucket_for(n, buckets)
    if bucket is None or any(q != 1 for q in step.query_lens):
        return None
    packed = pack_step(step, block_size=block_size)
    if packed.block_tables.shape[1] > max_blocks_per_seq:
        return None
    seq_lens = np.zeros(bucket, dtype=np.int32)
    seq_lens[:n] = packed.seq_lens
    return GraphStep(
        kind="decode", num_seqs=n, num_tokens=n, bucket=bucket,
        tokens=_padded_tokens(bucket, step.token_ids, packed.positions, packed.slot_mapping), ints=seq_lens,
        block_tables=packed.block_tables.astype(np.int32),
        sample_rows=None if all(step.needs_sample) else step.sample_indices,
    )


def plan_mixed_step(
    step: StepInputs, *, buckets: list[int], block_size: int, max_blocks_per_seq: int, max_seqs: int,
    g: int, block_m: int,
) -> GraphStep | None:
    """Any step padded to its token bucket (``g`` query heads per KV head, ``block_m``-row
    attention tiles), or None when no bucket holds its tokens, it has more than ``max_seqs``
    sequences, or a block table wider than the static one."""
    n, num_seqs = step.num_tokens, len(step.query_lens)
    bucket = bucket_for(n, buckets)
    if bucket is None or not 0 < num_seqs <= max_seqs:
        return None
    packed = pack_step(step, block_size=block_size)
    if packed.block_tables.shape[1] > max_blocks_per_seq:
        return None
    shape = MixedShape.of(bucket, max_seqs=max_seqs, g=g, block_m=block_m)
    ints = np.zeros(shape.num_ints, dtype=np.int32)
    seq_lens, query_start, work = shape.split(ints)
    seq_lens[:num_seqs] = packed.seq_lens  # the padding sequence's (and later ones'): 0
    query_start[: num_seqs + 1] = packed.query_start
    query_start[num_seqs + 1 :] = bucket  # the padding sequence holds tokens n..bucket-1
    work[:] = attention_work_list([*step.query_lens, bucket - n], g, block_m, shape.work)
    return GraphStep(
        kind="mixed", num_seqs=num_seqs, num_tokens=n, bucket=bucket,
        tokens=_padded_tokens(bucket, step.token_ids, packed.positions, packed.slot_mapping), ints=ints,
        block_tables=packed.block_tables.astype(np.int32), sample_rows=step.sample_indices,
    )


def graphs_enabled(*, max_batch: int, device: torch.device, ops_name: str, max_tokens: int = 0) -> bool:
    """Graphs need CUDA and the Triton ops (the torch attention reads host lists)."""
    return (max_batch > 0 or max_tokens > 0) and device.type == "cuda" and ops_name.startswith("triton")


def graph_max_batch(config: EngineConfig) -> int:
    """The largest decode bucket worth capturing: no micro-batch holds more sequences than the
    scheduler allows, nor a decode more sequences than the token budget."""
    sched = config.scheduler
    return min(config.cuda_graph_max_batch, sched.max_num_seqs, sched.max_num_batched_tokens)


def graph_max_tokens(config: EngineConfig) -> int:
    """The largest mixed bucket worth capturing: no micro-batch holds more tokens than the
    scheduler's budget. 0 in deterministic mode (whether a padded mixed step keeps its bits
    through a graph is not verified)."""
    if config.deterministic:
        return 0
    return min(config.cuda_graph_max_tokens, config.scheduler.max_num_batched_tokens)


def capture_cuda_graphs(
    model: LlamaForCausalLM,
    kv_caches: list[torch.Tensor],
    config: EngineConfig,
    *,
    max_model_len: int,
    device: torch.device,
) -> CudaGraphRunner | None:
    """This stage's captured graphs, or None when they are off (CPU, the torch ops, or both
    ``cuda_graph_max_batch`` and ``cuda_graph_max_tokens`` 0).

    Memory: captured after the KV cache is allocated, out of the reserve the KV sizing already
    leaves for transient activations (``engine._activation_bytes``, sized for a whole
    ``max_num_batched_tokens`` step plus 1 GiB; the workers' 2 GiB). The graphs share one
    pool, which holds one forward of the largest bucket (at most ``max_num_batched_tokens``
    tokens: the step that reserve is sized for), plus every bucket's output buffer (its rows
    × hidden: about 22k rows with the defaults, 170 MiB for an 8B model in bf16) and the
    static buffers, inside the reserve's slack; the KV sizing adds no term. The capture log
    line reports what it took.
    """
    max_batch, max_tokens = graph_max_batch(config), graph_max_tokens(config)
    if not graphs_enabled(max_batch=max_batch, max_tokens=max_tokens, device=device, ops_name=model.ops.name):
        return None
    runner = CudaGraphRunner(model, kv_caches, max_batch=max_batch, max_tokens=max_tokens,
                             max_seqs=config.scheduler.max_num_seqs, block_size=config.block_size,
                             max_model_len=max_model_len, device=device)
    runner.capture()
    return runner


# --- capture and replay (CUDA) -------------------------------------------------------------


class CudaGraphRunner:
    """Captured forwards of one stage's model: decode batches up to ``max_batch`` sequences,
    and mixed batches up to ``max_tokens`` tokens over at most ``max_seqs`` sequences.

    ``prepare(step)`` → a ``GraphStep`` or None (run eagerly); ``replay(g, hidden_states)`` →
    the stage's output ``[num_tokens, H]``, a view of the graph's output buffer that the next
    replay overwrites (clone it before handing it to another stream, e.g. an isend).

    ``use_graphs=False`` runs the same padded static-buffer forward eagerly instead of
    replaying: it checks the padding and buffer plumbing on CPU (Triton interpreter) and helps
    tell a capture bug from a padding bug.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        *,
        max_batch: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        max_tokens: int = 0,
        max_seqs: int | None = None,
        use_graphs: bool = True,
    ) -> None:
        if max_batch < 0 or max_tokens < 0 or max_batch + max_tokens == 0:
            raise ValueError(f"need max_batch or max_tokens >= 1, got {max_batch} and {max_tokens}")
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.device, self.use_graphs = block_size, device, use_graphs
        self.buckets = batch_size_buckets(max_batch)
        self.token_buckets = token_buckets(max_tokens)
        self.max_seqs = max_tokens if max_seqs is None else max_seqs
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.is_first_stage = model.embed_tokens is not None
        attn = model.layers[0].self_attn if len(model.layers) else None
        self.g = attn.num_heads // attn.num_kv_heads if attn is not None else 1
        self.block_m = mixed_block_m(self.g)
        self.mixed_shapes = {t: MixedShape.of(t, max_seqs=self.max_seqs, g=self.g, block_m=self.block_m)
                             for t in self.token_buckets}
        rows = max(max_batch, max_tokens)
        seq_rows = max([max_batch, *(m.seqs for m in self.mixed_shapes.values())])
        dtype = next(model.parameters()).dtype
        hidden_size = model.config.hidden_size
        with torch.inference_mode():  # the buffers are written inside inference mode
            i64 = {"dtype": torch.int64, "device": device}
            self.tokens = torch.zeros(3, rows, **i64)  # [3, rows]: ids, positions, slots (one copy)
            self.tokens[2] = -1
            self.input_ids, self.positions, self.slot_mapping = self.tokens  # [rows] each
            i32 = {"dtype": torch.int32, "device": device}
            self.seq_lens = torch.zeros(max_batch, **i32)  # [B_max]
            # Decode: sequence i's one token is row i, so [:B+1] of this is any bucket's.
            self.query_start_loc = torch.arange(max_batch + 1, **i32)  # [B_max + 1]
            self.block_tables = torch.zeros(seq_rows, self.max_blocks_per_seq, **i32)
            num_ints = max((m.num_ints for m in self.mixed_shapes.values()), default=0)
            self.mixed_ints = torch.zeros(num_ints, **i32)  # a mixed bucket's MixedShape layout
            self.hidden = None if self.is_first_stage else torch.zeros(
                rows, hidden_size, dtype=dtype, device=device
            )  # [rows, H]
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}  # key -> [bucket, H] output buffer
        self.capture_seconds = 0.0
        self.num_replays = 0  # steps run through the padded path (a statistic)
        self.num_mixed_replays = 0  # of which mixed

    # ---- capture ------------------------------------------------------------------------

    @property
    def keys(self) -> list[tuple[str, int]]:
        """Every bucket, the most rows first (mixed before decode at equal rows)."""
        keys = [("mixed", t) for t in self.token_buckets] + [("decode", b) for b in self.buckets]
        return sorted(keys, key=lambda k: (-k[1], k[0] != "mixed"))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared memory pool (a
        smaller bucket's activations fit in the largest one's freed blocks). Leaves the KV
        cache untouched: every slot is -1 and every work item empty while capturing."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        keys = self.keys
        progress.info("capturing CUDA graphs: %d buckets (compiles each shape's kernels)…", len(keys))
        # A bar on a terminal only (tqdm's disable=None), and only where the lines show.
        for key in tqdm(keys, desc="pipeserve: CUDA graphs", unit="graph", leave=False,
                        disable=None if progress.enabled() else True):
            meta = self._metadata(key)
            # Warm-up on the capture stream: compiles this shape's Triton kernels, creates the
            # stream's cuBLAS handle/workspace and (TP) the NCCL communicator, none of which
            # may happen during capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(key[1], meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread may query events while this one captures.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._outputs[key] = self._forward(key[1], meta)
            self._graphs[key] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        used_mib = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        logger.info(
            "captured %d CUDA graphs (batch sizes %s, token counts %s) in %.1f s, %.0f MiB",
            len(self._graphs), self.buckets, self.token_buckets, self.capture_seconds, used_mib,
        )

    def release(self) -> None:
        """Frees every captured graph. NCCL counts the graphs that captured a collective on a
        communicator, and destroying the communicator waits until that count is zero: a TP
        worker whose graphs were still alive hung in ``destroy_process_group`` (pytorch#115388;
        on 2 × H200 the workers never exited). Call before destroying the process group."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()

    def _metadata(self, key: tuple[str, int]) -> AttentionMetadata:
        """Static-buffer metadata of a bucket. A decode bucket's host lists are a decode
        step's (one token per sequence); a mixed bucket's attention runs from its work list.
        Nothing captured depends on the host lists' values."""
        kind, bucket = key
        if kind == "decode":
            return AttentionMetadata(
                slot_mapping=self.slot_mapping[:bucket],
                query_start_loc=self.query_start_loc[: bucket + 1],
                seq_lens=self.seq_lens[:bucket],
                block_tables=self.block_tables[:bucket],
                block_size=self.block_size,
                query_start_loc_cpu=list(range(bucket + 1)),
                seq_lens_cpu=[1] * bucket,
            )
        shape = self.mixed_shapes[bucket]
        seq_lens, query_start, work = shape.split(self.mixed_ints)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_tables=self.block_tables[: shape.seqs],
            block_size=self.block_size,
            query_start_loc_cpu=[0] * (shape.seqs + 1),  # (not read: the work list is)
            seq_lens_cpu=[0] * shape.seqs,
            work_list=work,
            work_block_m=self.block_m,
        )

    def _forward(self, rows: int, meta: AttentionMetadata) -> torch.Tensor:
        # [rows] tokens (first stage) or [rows, H] hidden states -> [rows, H]
        if self.is_first_stage:
            return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta)
        return self.model(None, self.positions[:rows], self.kv_caches, meta, hidden_states=self.hidden[:rows])

    # ---- replay -------------------------------------------------------------------------

    def prepare(self, step: StepInputs) -> GraphStep | None:
        """Host side of a graphed step (can run while the previous stage still computes): a
        decode bucket's for a decode-only step, a mixed bucket's for any other; None when the
        step must run eagerly (a decode-only step never takes a mixed graph: with
        ``cuda_graph_max_batch`` 0 decodes stay eager, and a mixed graph's 64-row attention
        tiles would hold g rows each)."""
        g = plan_graph_step(step, buckets=self.buckets, block_size=self.block_size,
                            max_blocks_per_seq=self.max_blocks_per_seq)
        if g is None and self.token_buckets and step.num_tokens > len(step.query_lens):
            g = plan_mixed_step(step, buckets=self.token_buckets, block_size=self.block_size,
                                max_blocks_per_seq=self.max_blocks_per_seq, max_seqs=self.max_seqs,
                                g=self.g, block_m=self.block_m)
        if g is not None and g.sample_rows is not None:
            g.sample_indices = host_to_device(np.asarray(g.sample_rows, dtype=np.int64), torch.int64, self.device)
        return g

    @torch.inference_mode()
    def replay(self, g: GraphStep, hidden_states: torch.Tensor | None = None, feed=None) -> torch.Tensor:
        """Runs the step: ``hidden_states`` [num_tokens, H] on stages after the first. Returns
        [num_tokens, H], valid until the next replay. ``feed(input_ids)`` (token feedback)
        writes fed decode tokens into the static input ids before the replay."""
        if self.is_first_stage != (hidden_states is None):
            raise ValueError("hidden_states must be given exactly on stages after the first")
        b, n = g.bucket, g.num_tokens
        # Same stream as the previous replay and its consumers: no buffer is overwritten early.
        self.tokens[:, :b].copy_(host_staging(g.tokens, self.device), non_blocking=True)
        ints = self.seq_lens if g.kind == "decode" else self.mixed_ints
        ints[: len(g.ints)].copy_(host_staging(g.ints, self.device), non_blocking=True)
        rows, width = g.block_tables.shape
        self.block_tables[:rows, :width].copy_(host_staging(g.block_tables, self.device), non_blocking=True)
        if feed is not None:
            feed(self.input_ids)
        if hidden_states is not None:
            self.hidden[:n].copy_(hidden_states)
        self.num_replays += 1
        self.num_mixed_replays += g.kind == "mixed"
        if self.use_graphs:
            self._graphs[g.key].replay()
            return self._outputs[g.key][:n]
        return self._forward(b, self._metadata(g.key))[:n]
