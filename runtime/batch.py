"""The host-side description of one micro-batch, and its conversion to model inputs.

`StepInputs` holds plain lists only (what a control-plane plan can carry); `to_tensors`
turns it into the packed, padding-free tensors one forward pass takes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.scheduler import SchedulerOutput


@dataclass(kw_only=True, slots=True)
class StepInputs:
    request_ids: list[str]
    token_ids: list[int]  # [T] new tokens of every sequence, packed in order
    query_lens: list[int]  # [S] tokens of each sequence in this step
    start_positions: list[int]  # [S] position of each sequence's first new token
    block_tables: list[list[int]]  # [S][blocks]
    needs_sample: list[bool]  # [S] does this step end at the sequence's last known token

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> StepInputs:
        token_ids: list[int] = []
        for s in out.scheduled:
            start = s.num_computed_tokens
            token_ids.extend(s.request.token_ids_between(start, start + s.num_scheduled_tokens))
        return cls(
            request_ids=[s.request.request_id for s in out.scheduled],
            token_ids=token_ids,
            query_lens=[s.num_scheduled_tokens for s in out.scheduled],
            start_positions=[s.num_computed_tokens for s in out.scheduled],
            block_tables=[s.block_table for s in out.scheduled],
            needs_sample=[s.needs_sample for s in out.scheduled],
        )

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


def to_tensors(step: StepInputs, *, block_size: int, device: torch.device) -> ModelInputs:
    """Packs a step into tensors: positions, KV slots, block tables (built in numpy, moved once)."""
    q_lens = np.asarray(step.query_lens, dtype=np.int64)
    starts = np.asarray(step.start_positions, dtype=np.int64)
    seq_lens = starts + q_lens
    query_start = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start[1:])
    # positions: for each sequence, start .. start+q_len-1
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = starts[seq_of_token] + (np.arange(query_start[-1]) - query_start[seq_of_token])
    tables = _pad_block_tables(step.block_tables)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=dev(slots, torch.int64),
        query_start_loc=dev(query_start, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev(tables, torch.int32),
        block_size=block_size,
        query_start_loc_cpu=query_start.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return ModelInputs(
        input_ids=dev(np.asarray(step.token_ids, dtype=np.int64), torch.int64),
        positions=dev(positions, torch.int64),
        meta=meta,
        # step.sample_indices, from the offsets computed above: the last row of each sampled seq
        sample_indices=dev(query_start[1:][np.asarray(step.needs_sample, dtype=bool)] - 1, torch.int64),
    )


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
