"""The host-side description of one micro-batch, and its conversion to model inputs.

`StepInputs` holds plain lists (what a control-plane plan carries) and the padded block tables a
worker's `BlockTableArray` keeps across steps; `to_tensors` turns it into the packed,
padding-free tensors one forward pass takes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.parallel.wire import BlockTableMirror, StepPlan


@dataclass(kw_only=True, slots=True)
class StepInputs:
    request_ids: list[str]
    token_ids: list[int]  # [T] new tokens of every sequence, packed in order
    query_lens: list[int]  # [S] tokens of each sequence in this step
    start_positions: list[int]  # [S] position of each sequence's first new token
    block_tables: list[list[int]]  # [S][blocks]
    needs_sample: list[bool]  # [S] does this step end at the sequence's last known token
    padded_block_tables: np.ndarray | None = None
    """[S, max blocks] int64, ``block_tables`` padded with 0, where a ``BlockTableArray`` holds
    them already; None: ``to_tensors`` pads ``block_tables`` itself."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sample_indices(self) -> list[int]:
        """Row in the packed batch of the last token of every sequence that samples."""
        ends = np.cumsum(self.query_lens, dtype=np.int64) - 1
        return ends[np.asarray(self.needs_sample, dtype=bool)].tolist()


@dataclass(kw_only=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64 rows whose logits are sampled


@dataclass(slots=True)
class PackedArrays:
    """A step's packed layout on the host (numpy): what ``to_tensors`` moves to the device and
    a CUDA-graph runner pads into its static buffers."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start: np.ndarray  # [S+1] int64
    seq_lens: np.ndarray  # [S] int64
    block_tables: np.ndarray  # [S, max blocks] int64, padded with 0


def pack_step(step: StepInputs, *, block_size: int) -> PackedArrays:
    """Positions, KV slots, query offsets, context lengths and block tables of a step."""
    q_lens = np.asarray(step.query_lens, dtype=np.int64)
    starts = np.asarray(step.start_positions, dtype=np.int64)
    query_start = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start[1:])
    # positions: for each sequence, start .. start+q_len-1
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = starts[seq_of_token] + (np.arange(query_start[-1]) - query_start[seq_of_token])
    tables = step.padded_block_tables
    if tables is None:
        tables = _pad_block_tables(step.block_tables)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return PackedArrays(positions=positions, slot_mapping=slots, query_start=query_start,
                        seq_lens=starts + q_lens, block_tables=tables)


def to_tensors(step: StepInputs, *, block_size: int, device: torch.device) -> ModelInputs:
    """Packs a step into tensors (built in numpy, ``pack_step``, and moved once)."""
    packed = pack_step(step, block_size=block_size)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return host_to_device(a, dtype, device)

    meta = AttentionMetadata(
        slot_mapping=dev(packed.slot_mapping, torch.int64),
        query_start_loc=dev(packed.query_start, torch.int32),
        seq_lens=dev(packed.seq_lens, torch.int32),
        block_tables=dev(packed.block_tables, torch.int32),
        block_size=block_size,
        query_start_loc_cpu=packed.query_start.tolist(),
        seq_lens_cpu=packed.seq_lens.tolist(),
    )
    return ModelInputs(
        input_ids=dev(np.asarray(step.token_ids, dtype=np.int64), torch.int64),
        positions=dev(packed.positions, torch.int64),
        meta=meta,
        # step.sample_indices, from the offsets computed above: the last row of each sampled seq
        sample_indices=dev(packed.query_start[1:][np.asarray(step.needs_sample, dtype=bool)] - 1, torch.int64),
    )


def host_to_device(a, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array (numpy, or nested lists) as a ``dtype`` tensor on ``device``, without
    blocking the host (see ``host_staging``)."""
    return host_staging(a, device, dtype).to(device, non_blocking=True)


def host_staging(a, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a`` as the host tensor of a ``non_blocking`` copy to ``device``: on CUDA in pinned
    memory. A copy from pageable memory may first wait for the stream's earlier work (CUDA's
    API synchronization rules), which would keep a worker's host from preparing micro-batch
    j + 1 while the device runs j; the device would then idle while the host launches j + 1's
    kernels one by one. The pinned block returns to PyTorch's caching host allocator once the
    copy has run."""
    t = torch.as_tensor(a, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def _pad_block_tables(block_tables: list[list[int]]) -> np.ndarray:
    """[S, max_blocks] int64 (at least one column), each row padded with 0."""
    num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    tables = np.zeros((len(block_tables), max(int(num_blocks.max(initial=0)), 1)), dtype=np.int64)
    # One assignment instead of one per row: the mask selects each row's leading entries in
    # row-major order, which is the order of the concatenated tables.
    is_block = np.arange(tables.shape[1]) < num_blocks[:, None]
    tables[is_block] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(num_blocks.sum())
    )
    return tables


class BlockTableArray:
    """The block tables of live requests as rows of one int64 array, kept across steps.

    A step writes only what changed (a table that grew, or the whole table of a new or
    restarted request) and then gathers its rows, instead of converting every block id of every
    table from Python ints. A table only grows while its request lives, except when it is
    replaced whole (a plan that carries its full table: a new request, or one restarted after
    preemption). Call ``free`` when a request finishes.
    """

    def __init__(self) -> None:
        self._rows = _RowIds()
        self._array = np.zeros((0, 1), dtype=np.int64)  # [rows, blocks], 0 past each table
        self._num_blocks = np.zeros(0, dtype=np.int64)  # [rows] blocks written

    def gather(self, request_ids: list[str], block_tables: list[list[int]], replaced: list[bool]) -> np.ndarray:
        """[S, max blocks] int64 (at least one column), each table padded with 0; ``replaced[i]``:
        table i is a new one, not the previous one grown."""
        n = len(request_ids)
        rows = np.fromiter(map(self._rows.__getitem__, request_ids), dtype=np.int64, count=n)
        num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
        width = max(int(num_blocks.max(initial=0)), 1)
        self._reserve(self._rows.num_rows, width)
        stale = (num_blocks != self._num_blocks[rows]) | np.asarray(replaced, dtype=bool)
        for i in np.flatnonzero(stale).tolist():
            self._write(int(rows[i]), block_tables[i], replaced[i])
        return self._array[rows, :width]

    def free(self, request_id: str) -> None:
        """Forget a finished request (unknown ids are ignored); its row is reused."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._rows.free.append(row)
            self._array[row] = 0
            self._num_blocks[row] = 0

    def _write(self, row: int, table: list[int], replaced: bool) -> None:
        start = int(self._num_blocks[row])
        if replaced or start > len(table):  # a new table, not a grown one
            self._array[row] = 0
            start = 0
        self._array[row, start : len(table)] = table[start:]
        self._num_blocks[row] = len(table)

    def _reserve(self, num_rows: int, width: int) -> None:
        """Grow the arrays (doubling) to hold ``num_rows`` rows of ``width`` blocks."""
        rows, cols = self._array.shape
        if num_rows <= rows and width <= cols:
            return
        new_rows = rows if num_rows <= rows else max(num_rows, 2 * rows)
        new_cols = cols if width <= cols else max(width, 2 * cols)
        array = np.zeros((new_rows, new_cols), dtype=np.int64)
        array[:rows, :cols] = self._array
        self._array = array
        self._num_blocks = np.concatenate([self._num_blocks, np.zeros(new_rows - rows, dtype=np.int64)])


class _RowIds(dict):
    """request id -> row of a BlockTableArray; an unknown id takes a free row (or a new one)."""

    def __init__(self) -> None:
        super().__init__()
        self.free: list[int] = []

    @property
    def num_rows(self) -> int:
        """Rows handed out so far: those in use and the free ones."""
        return len(self) + len(self.free)

    def __missing__(self, request_id: str) -> int:
        row = self.free.pop() if self.free else self.num_rows
        self[request_id] = row
        return row


class PlanInputs:
    """A worker's view of the engine's plans: every live request's block table, mirrored from the
    plans' full tables and diffs and kept padded in one array, and each plan's ``StepInputs``."""

    def __init__(self) -> None:
        self.mirror = BlockTableMirror()
        self.tables = BlockTableArray()

    def step_inputs(self, plan: StepPlan, *, can_feed: bool) -> StepInputs:
        """Drops ``plan.freed``, applies the plan's tables; ``can_feed``: this rank patches fed
        decodes' tokens (a first stage with token feedback) or embeds none (a later stage)."""
        for rid in plan.freed:
            self.tables.free(rid)
        tables = self.mirror.apply_plan(plan)
        step = StepInputs(
            request_ids=[s.request_id for s in plan.seqs],
            token_ids=_token_ids(plan, can_feed=can_feed),
            query_lens=[s.num_scheduled_tokens for s in plan.seqs],
            start_positions=[s.num_computed_tokens for s in plan.seqs],
            block_tables=tables,
            needs_sample=[s.needs_sample for s in plan.seqs],
        )
        # A full table replaces the mirror's (a new or restarted request); a diff grows it.
        step.padded_block_tables = self.tables.gather(step.request_ids, tables,
                                                      [s.block_table is not None for s in plan.seqs])
        return step


def _token_ids(plan: StepPlan, *, can_feed: bool) -> list[int]:
    """The plan's packed input tokens; a fed decode's is a placeholder 0 until stage 0's patch."""
    ids: list[int] = []
    for s in plan.seqs:
        ids += s.new_token_ids
        if s.feed_step >= 0:
            if not can_feed:
                raise RuntimeError("a plan feeds a decode but this worker runs without token feedback "
                                   "(parallel.token_feedback differs between the engine and the workers)")
            ids.append(0)
    return ids
