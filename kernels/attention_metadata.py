"""What one packed forward pass needs to know about its sequences' places in the paged KV cache.

A micro-batch is a flat list of T new tokens from S sequences, packed without padding:
sequence i owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the batch (a prefill chunk
over an already-cached prefix, or a single decode token). Its K/V for those tokens are written to
``slot_mapping`` (flat slot = block_id * block_size + offset) and it attends to the first
``seq_lens[i]`` positions of its blocks ``block_tables[i]`` (cached prefix + the new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [S+1] int32, on the model's device
    seq_lens: torch.Tensor  # [S] int32, context length after this step, on the model's device
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0, on the model's device
    block_size: int
    # Host copies, so CPU-side loops never read the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Optional, for a CUDA graph of a mixed batch: every attention program's (sequence, M tile)
    # on the device, [W, 2] int32 (-1 for an unused item), made for ``work_block_m``-row tiles
    # (``kernels.paged_attention.attention_work_list``); the host lists are then not read.
    work_list: torch.Tensor | None = None
    work_block_m: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
