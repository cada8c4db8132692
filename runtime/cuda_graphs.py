"""CUDA graphs for decode-only micro-batches, one set per pipeline stage, bucketed by batch size.

A decode step is launch-bound: every layer is a dozen small kernels over a few hundred rows.
At start-up ``CudaGraphRunner.capture`` records this stage's forward once per batch-size bucket
(1, 2, 4, 8, 16, 24, 32, 48, …, ``max_batch``) over static input buffers; a step whose
sequences all have one new token (``plan_graph_step``) is padded to the next bucket, copied
into those buffers and replayed. Every other step runs eagerly.

Padding rows are inert: slot -1 (``write_kv`` skips it), seq_len 0 (the attention kernel gives
a finite row and reads no KV), token/position 0. Every operation in the forward is row-wise,
so padding rows never touch the real ones. The static block table is ``[max_batch,
ceil(max_model_len / block_size)]``; a step writes only its rows and used columns, so columns
past a row's blocks hold stale block ids from an earlier step: valid ids, never read (the
kernel stops at ``ceil(seq_len / block_size)`` blocks).

What makes a forward capturable: with the Triton ops, a decode step's launches depend only on
tensor shapes (never on ``seq_lens`` values, read on the device); host lists in the metadata
are those of a decode step and are not read beyond that. The torch reference attention loops
over host lists and is never captured. With TP > 1 the all-reduces are captured too (NCCL
supports graph capture): every TP rank of a stage captures the same buckets in the same order
and replays on the same plans. Pipeline send/recv stay outside the graph. Deterministic mode
keeps tp/pp workers eager: capturing its float32 partial-sum gathers has not been verified.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.runtime.batch import StepInputs, host_staging, host_to_device
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.model import LlamaForCausalLM

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


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences; None if none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) and num_seqs > 0 else None


@dataclass(kw_only=True, slots=True)
class GraphStep:
    """A decode step padded to a bucket: host arrays to copy into the static buffers."""

    num_seqs: int  # real rows; rows num_seqs..bucket-1 are padding
    bucket: int
    input_ids: np.ndarray  # [bucket] int64, padding 0
    positions: np.ndarray  # [bucket] int64, padding 0
    slot_mapping: np.ndarray  # [bucket] int64, padding -1 (no KV write)
    seq_lens: np.ndarray  # [bucket] int32, padding 0 (no KV read)
    block_tables: np.ndarray  # [bucket, used blocks] int32, padding 0
    sample_rows: list[int] | None  # rows to sample; None = every real row
    # Rows whose logits are sampled, as an index of the [num_seqs, H] output: a slice when every
    # row samples (no gather), else a device tensor (set by CudaGraphRunner.prepare).
    sample_indices: torch.Tensor | slice = field(default_factory=lambda: slice(None))


def plan_graph_step(
    step: StepInputs, *, buckets: list[int], block_size: int, max_blocks_per_seq: int
) -> GraphStep | None:
    """The step padded to its bucket, or None when it must run eagerly: not decode-only (some
    sequence has more than one new token), larger than every bucket, or a block table wider
    than the static one."""
    n = len(step.query_lens)
    bucket = bucket_for(n, buckets)
    if bucket is None or any(q != 1 for q in step.query_lens):
        return None
    width = max(max((len(t) for t in step.block_tables), default=1), 1)
    if width > max_blocks_per_seq:
        return None
    positions = np.zeros(bucket, dtype=np.int64)
    positions[:n] = step.start_positions
    tables = np.zeros((bucket, width), dtype=np.int32)
    for i, t in enumerate(step.block_tables):
        tables[i, : len(t)] = t
    slots = np.full(bucket, -1, dtype=np.int64)
    rows = np.arange(n)
    slots[:n] = tables[rows, positions[:n] // block_size].astype(np.int64) * block_size + (
        positions[:n] % block_size
    )
    input_ids = np.zeros(bucket, dtype=np.int64)
    input_ids[:n] = step.token_ids
    seq_lens = np.zeros(bucket, dtype=np.int32)
    seq_lens[:n] = positions[:n] + 1
    sample_rows = None if all(step.needs_sample) else step.sample_indices
    return GraphStep(
        num_seqs=n, bucket=bucket, input_ids=input_ids, positions=positions, slot_mapping=slots,
        seq_lens=seq_lens, block_tables=tables, sample_rows=sample_rows,
    )


def graphs_enabled(*, max_batch: int, device: torch.device, ops_name: str) -> bool:
    """Graphs need CUDA and the Triton ops (the torch attention reads host lists)."""
    return max_batch > 0 and device.type == "cuda" and ops_name.startswith("triton")


def graph_max_batch(config: EngineConfig) -> int:
    """The largest bucket worth capturing: no micro-batch holds more sequences than the
    scheduler allows, nor a decode more sequences than the token budget."""
    sched = config.scheduler
    return min(config.cuda_graph_max_batch, sched.max_num_seqs, sched.max_num_batched_tokens)


def capture_cuda_graphs(
    model: LlamaForCausalLM,
    kv_caches: list[torch.Tensor],
    config: EngineConfig,
    *,
    max_model_len: int,
    device: torch.device,
) -> CudaGraphRunner | None:
    """This stage's captured decode graphs, or None when they are off (CPU, the torch ops, or
    ``cuda_graph_max_batch`` 0).

    Memory: captured after the KV cache is allocated, out of the reserve the KV sizing already
    leaves for transient activations (``engine._activation_bytes``, sized for a whole
    ``max_num_batched_tokens`` step plus 1 GiB; the workers' 2 GiB). The graphs' shared pool
    holds one decode forward of the largest bucket (at most a few hundred rows, tens of MiB
    for an 8B model) plus the static buffers, well inside that reserve, so the KV sizing needs
    no extra term. The capture log line reports what it took.
    """
    max_batch = graph_max_batch(config)
    if not graphs_enabled(max_batch=max_batch, device=device, ops_name=model.ops.name):
        return None
    runner = CudaGraphRunner(model, kv_caches, max_batch=max_batch, block_size=config.block_size,
                             max_model_len=max_model_len, device=device)
    runner.capture()
    return runner


# --- capture and replay (CUDA) -------------------------------------------------------------


class CudaGraphRunner:
    """Captured decode forwards of one stage's model, one per batch-size bucket.

    ``prepare(step)`` → a ``GraphStep`` or None (run eagerly); ``replay(g, hidden_states)`` →
    the stage's output ``[num_seqs, H]``, a view of the graph's output buffer that the next
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
        use_graphs: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.device, self.use_graphs = block_size, device, use_graphs
        self.buckets = batch_size_buckets(max_batch)
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.is_first_stage = model.embed_tokens is not None
        dtype = next(model.parameters()).dtype
        hidden_size = model.config.hidden_size
        with torch.inference_mode():  # the buffers are written inside inference mode
            i64 = {"dtype": torch.int64, "device": device}
            self.input_ids = torch.zeros(max_batch, **i64)  # [B_max]
            self.positions = torch.zeros(max_batch, **i64)  # [B_max]
            self.slot_mapping = torch.full((max_batch,), -1, **i64)  # [B_max]
            i32 = {"dtype": torch.int32, "device": device}
            self.seq_lens = torch.zeros(max_batch, **i32)  # [B_max]
            # Decode: sequence i's one token is row i, so [:B+1] of this is any bucket's.
            self.query_start_loc = torch.arange(max_batch + 1, **i32)  # [B_max + 1]
            self.block_tables = torch.zeros(max_batch, self.max_blocks_per_seq, **i32)
            self.hidden = None if self.is_first_stage else torch.zeros(
                max_batch, hidden_size, dtype=dtype, device=device
            )  # [B_max, H]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> [B, H] output buffer
        self.capture_seconds = 0.0
        self.num_replays = 0  # steps run through the padded path (a statistic)

    # ---- capture ------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared memory pool (a
        smaller bucket's activations fit in the largest one's freed blocks). Leaves the KV
        cache untouched: every slot is -1 while capturing."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            meta = self._metadata(bucket)
            # Warm-up on the capture stream: compiles this shape's Triton kernels, creates the
            # stream's cuBLAS handle/workspace and (TP) the NCCL communicator, none of which
            # may happen during capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(bucket, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread may query events while this one captures.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._outputs[bucket] = self._forward(bucket, meta)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        used_mib = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(self._graphs), self.buckets, self.capture_seconds, used_mib,
        )

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """Static-buffer metadata of a ``bucket``-row decode step. The host lists are a
        decode step's (one token per sequence); nothing captured depends on their values."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=[1] * bucket,
        )

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        # [bucket] tokens (first stage) or [bucket, H] hidden states -> [bucket, H]
        if self.is_first_stage:
            return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
        return self.model(None, self.positions[:bucket], self.kv_caches, meta,
                          hidden_states=self.hidden[:bucket])

    # ---- replay -------------------------------------------------------------------------

    def prepare(self, step: StepInputs) -> GraphStep | None:
        """Host side of a graphed step (can run while the previous stage still computes);
        None when the step must run eagerly."""
        g = plan_graph_step(step, buckets=self.buckets, block_size=self.block_size,
                            max_blocks_per_seq=self.max_blocks_per_seq)
        if g is not None and g.sample_rows is not None:
            g.sample_indices = host_to_device(np.asarray(g.sample_rows, dtype=np.int64), torch.int64, self.device)
        return g

    @torch.inference_mode()
    def replay(self, g: GraphStep, hidden_states: torch.Tensor | None = None, feed=None) -> torch.Tensor:
        """Runs the step: ``hidden_states`` [num_seqs, H] on stages after the first. Returns
        [num_seqs, H], valid until the next replay. ``feed(input_ids)`` (token feedback) writes
        fed decode tokens into the static input ids before the replay."""
        if self.is_first_stage != (hidden_states is None):
            raise ValueError("hidden_states must be given exactly on stages after the first")
        b, n = g.bucket, g.num_seqs
        # Same stream as the previous replay and its consumers: no buffer is overwritten early.
        for buf, host in (
            (self.input_ids, g.input_ids),
            (self.positions, g.positions),
            (self.slot_mapping, g.slot_mapping),
            (self.seq_lens, g.seq_lens),
        ):
            buf[:b].copy_(host_staging(host, self.device), non_blocking=True)
        width = g.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(host_staging(g.block_tables, self.device), non_blocking=True)
        if feed is not None:
            feed(self.input_ids)
        if hidden_states is not None:
            self.hidden[:n].copy_(hidden_states)
        self.num_replays += 1
        if self.use_graphs:
            self._graphs[b].replay()
            return self._outputs[b][:n]
        return self._forward(b, self._metadata(b))[:n]
