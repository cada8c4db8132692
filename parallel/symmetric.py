"""The TP all-reduce through symmetric memory over NVLink, for the sums a forward makes (one
after each layer's attention and one after its MLP).

NCCL's all-reduce of a decode step's hidden states (2 MB at batch 256 of an 8B model) took
34 µs inside a CUDA graph on 2 × H200, and 90 µs for a 2,048-token step (16 MB): 64 of them
were a fifth of a tp=2 step (``tools/tp_steps.py``). Here every rank of the group maps the
others' copy of one buffer (``torch.distributed._symmetric_memory``): a one-shot all-reduce
reads each peer's rows straight over NVLink and sums them; a two-shot one reduces a slice per
rank and then gathers the slices, moving half the bytes per rank, which wins on large messages.
Both run as a single kernel with a barrier among the ranks on either side, so they replay
inside the CUDA graphs as NCCL's do. Two ranks sum with pipeserve's own kernels instead
(``kernels/push_sum.py``), which store their rows into the peer's buffer rather than read the
peer's: up to 4 MB the push (``push_max_bytes``; 8.4 µs a 1 MB sum against PyTorch's 14.7),
above it the push's two-shot (``uses_push_two_shot``; 65.2 µs a 16 MB sum against 74.5). Where
a layer's sum feeds the next residual add and RMSNorm, either is fused with them in one kernel
(``push_add_rms_norm``), so the sum's output makes no round trip through memory.

Only point-to-point NVLink access is used, never NVLink multicast (``multimem``):
``TORCH_SYMM_MEM_DISABLE_MULTICAST`` is set before the first allocation unless the caller set it.
Sums larger than the buffer, other dtypes and any setup that fails go through NCCL.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from pipeserve.kernels.push_sum import (
    MAX_NORM_HIDDEN, push_add_rms_norm, push_sum, push_two_shot, push_two_shot_add_rms_norm, two_shot_norm_rows,
)

logger = logging.getLogger(__name__)


def one_shot_max_bytes(world_size: int) -> int:
    """Sums up to this size read every peer whole (one-shot); larger ones reduce a slice per
    rank and gather (two-shot). Where the two cross, 64 sums replayed in a CUDA graph on
    4 × H200 (``tools/sum_kernels.py`` prints both): two ranks, one-shot 14.7 µs against 15.7 at
    1 MB, 17.5 against 16.4 at 1.5 MB; four ranks (three peers to read whole), 15.7 against
    16.2 at 768 KB, 18.8 against 17.3 at 1 MB. Other rank counts take the nearer measured
    limit (not measured themselves)."""
    return 1 << 20 if world_size <= 2 else 768 << 10


def push_max_bytes(world_size: int) -> int:
    """Sums up to this size go through ``kernels/push_sum``'s push (0: never). Two ranks, 64 sums
    in a CUDA graph on two H200s (``tools/sum_kernels.py``): it beat both PyTorch kernels from
    128 KB (4.7 µs against 7.8) to 8 MB (37.4 against 41.1 for the two-shot) and lost at 16 MB
    (79.5 against 74.6); its two-shot beats it from 8 MB (35.1 µs; 4 MB: 20.9 against 20.7).
    Four ranks push three copies of their rows: 13.3 against 13.5 µs at 512 KB, 19.0 against
    17.2 (two-shot) at 1 MB, at most 0.8 µs gained below; they keep PyTorch's kernels."""
    return 4 << 20 if world_size == 2 else 0


def uses_push_two_shot(world_size: int) -> bool:
    """Whether sums above ``push_max_bytes`` (up to the buffer) go through ``kernels/push_sum``'s
    two-shot. Two ranks (the same tool and cards): 35.1 µs at 8 MB against 37.4 for the push and
    40.6 for PyTorch's two-shot, 50.3 at 12 MB against 55.3 / 56.5, 65.2 at 16 MB against
    78.7 / 74.5 (the forward's largest sum, a 2,048-token step of the 8B shape). Four ranks (4 ×
    H200): slower than PyTorch's two-shot at every size from 1 MB (16 MB: 105.0 against 99.1;
    32 MB: 213.5 against 185.5), and whole tp=4 runs with it gained nothing; PyTorch's kernels."""
    return world_size == 2


class _PushState:
    """``kernels/push_sum``'s memory on this rank, for its push or (``two_shot``) its two-shot: two
    slots (of a region per rank, or of a scatter and a gather region), a flag per (program, rank)
    (two with ``two_shot``), this rank's sum counts; ``programs`` (default: one per SM) the same on
    every rank."""

    def __init__(self, group: dist.ProcessGroup, *, numel: int, dtype: torch.dtype, device: torch.device,
                 programs: int | None = None, two_shot: bool = False) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if programs is None:  # one per SM of the smallest GPU: program p of each rank pairs with p
            sms = torch.tensor([torch.cuda.get_device_properties(device).multi_processor_count], device=device)
            dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
            programs = int(sms.item())
        self.slot_numel, self.two_shot = numel, two_shot
        regions, rounds = (2, 2) if two_shot else (self.world, 1)
        self.slots = symm_mem.empty(2 * regions * numel, dtype=dtype, device=device)
        self.flags = symm_mem.empty(rounds * programs * self.world, dtype=torch.int64, device=device)
        self.flags.zero_()
        self.counts = torch.zeros(programs, dtype=torch.int64, device=device)
        handles = [symm_mem.rendezvous(t, group) for t in (self.slots, self.flags)]
        for t, h in zip((self.slots, self.flags), handles):  # the kernel indexes from each buffer's start
            assert h.buffer_ptrs[self.rank] == t.data_ptr(), "symmetric buffer not at its allocation's start"
        # the kernels vector their loads and stores on that (kernels/push_sum.buffer); allocations start on pages
        assert all(ptr % 16 == 0 for ptr in handles[0].buffer_ptrs), handles[0].buffer_ptrs
        self.slot_ptrs, self.flag_ptrs = (torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device)
                                          for h in handles)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before any rank raises one

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the peers' regions hold slot_numel of this dtype: another would write past them
        assert x.dtype == self.slots.dtype and x.device == self.slots.device, (x.dtype, x.device)
        kernel = push_two_shot if self.two_shot else push_sum
        return kernel(x, torch.empty_like(x), rank=self.rank, world=self.world, slot_ptrs=self.slot_ptrs,
                      flag_ptrs=self.flag_ptrs, counts=self.counts, slot_numel=self.slot_numel)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum fused with the next residual add and RMSNorm, on this memory (the push's or the
        two-shot's kernel)."""
        assert x.dtype == self.slots.dtype and x.device == self.slots.device, (x.dtype, x.device)
        kernel = push_two_shot_add_rms_norm if self.two_shot else push_add_rms_norm
        return kernel(x, residual, weight, eps, rank=self.rank, world=self.world, slot_ptrs=self.slot_ptrs,
                      flag_ptrs=self.flag_ptrs, counts=self.counts, slot_numel=self.slot_numel)

    def fits_norm(self, T: int, H: int) -> bool:
        """Whether ``add_rms_norm``'s rows [T, H] fit this memory's regions."""
        rows = two_shot_norm_rows(T, self.world) * self.world if self.two_shot else T
        return rows * H <= self.slot_numel < 2**31  # the kernels' offsets are int32


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
        self.world = world = dist.get_world_size(group)
        self.one_shot_max_bytes = one_shot_max_bytes(world)
        push_numel = min(max_numel, push_max_bytes(world) // self.buffer.element_size())
        self._push = _PushState(group, numel=push_numel, dtype=dtype, device=device) if push_numel else None
        self._push_two_shot = None
        if uses_push_two_shot(world) and max_numel > push_numel:
            self._push_two_shot = _PushState(group, numel=max_numel, dtype=dtype, device=device, two_shot=True)

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
        if self._push is not None and x.numel() <= self._push.slot_numel:
            return self.push(x)
        if x.numel() % self.world:  # the two-shots split the rows' elements evenly; the one-shot takes any
            return self.one_shot(x)
        if self._push_two_shot is not None and x.numel() <= self._push_two_shot.slot_numel:
            return self.push_two_shot(x)
        if x.numel() * x.element_size() <= self.one_shot_max_bytes:
            return self.one_shot(x)
        return self.two_shot(x)

    @property
    def push_max_numel(self) -> int:
        return 0 if self._push is None else self._push.slot_numel

    def push(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through ``kernels/push_sum`` (``x.numel() <= push_max_numel``)."""
        return self._push(x)

    @property
    def push_two_shot_max_numel(self) -> int:
        return 0 if self._push_two_shot is None else self._push_two_shot.slot_numel

    def push_two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through ``kernels/push_sum``'s two-shot (``x.numel() <= push_two_shot_max_numel``,
        a multiple of the group's size)."""
        return self._push_two_shot(x)

    def _norm_state(self, x: torch.Tensor, residual: torch.Tensor | None) -> _PushState | None:
        """The push kernels' memory whose fused norm takes ``x`` (the sum's rows) and ``residual``:
        the push's up to its size, above it the two-shot's (as ``__call__`` chooses the plain
        sums), None where neither does."""
        if (residual is None or x.dim() != 2 or x.shape[1] > MAX_NORM_HIDDEN or not self.fits(x)
                or residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()):
            return None
        if self._push is not None and x.numel() <= self._push.slot_numel:
            return self._push
        if self._push_two_shot is not None and self._push_two_shot.fits_norm(*x.shape):
            return self._push_two_shot
        return None

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether ``push_add_rms_norm`` takes ``x`` (the sum's rows) and ``residual``."""
        return self._norm_state(x, residual) is not None

    def push_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual) * weight, sum + residual), the sum of ``x`` over the group, in
        one kernel: the push's up to ``push_max_numel``, the push's two-shot's above
        (``fits_norm(x, residual)`` must hold: the size alone picks the kernel here, unchecked again)."""
        small = self._push is not None and x.numel() <= self._push.slot_numel
        return (self._push if small else self._push_two_shot).add_rms_norm(x, residual, weight, eps)

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
