"""The TP all-reduce through symmetric memory over NVLink, for the sums a forward makes (one
after each layer's attention and one after its MLP).

NCCL's all-reduce of a decode step's hidden states (2 MB at batch 256 of an 8B model) took
34 µs inside a CUDA graph on 2 × H200, and 90 µs for a 2,048-token step (16 MB): 64 of them
were a fifth of a tp=2 step (``tools/tp_steps.py``). Here every rank of the group maps the
others' copy of one buffer (``torch.distributed._symmetric_memory``): a one-shot all-reduce
reads each peer's rows straight over NVLink and sums them; a two-shot one reduces a slice per
rank and then gathers the slices, moving half the bytes per rank, which wins on large messages.
Both run as a single kernel with a barrier among the ranks on either side, so they replay
inside the CUDA graphs as NCCL's do.

Only point-to-point NVLink access is used, never NVLink multicast (``multimem``):
``TORCH_SYMM_MEM_DISABLE_MULTICAST`` is set before the first allocation unless the caller set it.
Sums larger than the buffer, other dtypes and any setup that fails go through NCCL.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def one_shot_max_bytes(world_size: int) -> int:
    """Sums up to this size read every peer whole (one-shot); larger ones reduce a slice per
    rank and gather (two-shot). Where the two cross, 64 sums replayed in a CUDA graph on
    4 × H200 (``tools/sum_kernels.py`` prints both): two ranks, one-shot 14.7 µs against 15.7 at
    1 MB, 17.5 against 16.4 at 1.5 MB; four ranks (three peers to read whole), 15.7 against
    16.2 at 768 KB, 18.8 against 17.3 at 1 MB. Other rank counts take the nearer measured
    limit (not measured themselves)."""
    return 1 << 20 if world_size <= 2 else 768 << 10


class SymmetricAllReduce:
    """Sums tensors over ``group`` through one symmetric buffer of ``max_numel`` elements."""

    def __init__(self, group: dist.ProcessGroup, *, max_numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.group_name = group.group_name
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self._ops = torch.ops.symm_mem
        self.one_shot_max_bytes = one_shot_max_bytes(dist.get_world_size(group))

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, *, max_numel: int, dtype: torch.dtype,
               device: torch.device) -> SymmetricAllReduce | None:
        """One for ``group`` on CUDA (every rank of the group calls this together), or None
        where it cannot run (no group, not CUDA, the setup fails: then NCCL sums)."""
        if group is None or device.type != "cuda" or max_numel <= 0:
            return None
        try:
            made = cls(group, max_numel=max_numel, dtype=dtype, device=device)
        except Exception as e:  # an old driver, no peer access, a torch built without it
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s); NCCL sums instead",
                           type(e).__name__, e)
            made = None
        agreed = torch.tensor([made is not None], dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # all ranks sum the same way
        return made if agreed.item() else None

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, a new tensor (``fits(x)`` must hold)."""
        if x.numel() * x.element_size() <= self.one_shot_max_bytes:
            return self.one_shot(x)
        return self.two_shot(x)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum with every peer's rows read whole (``x`` copied into the buffer), at any size
        the buffer holds."""
        out = self._ops.one_shot_all_reduce_copy(self.buffer[:x.numel()], x.view(-1), "sum", self.group_name)
        return out.view(x.shape)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum reduced a slice per rank, then gathered, at any size the buffer holds."""
        buf = self.buffer[:x.numel()]
        buf.copy_(x.view(-1))
        out = torch.empty_like(x)
        self._ops.two_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        return out
