"""The TP all-reduce through symmetric memory over NVLink, for the sums a forward makes (one
after each layer's attention and one after its MLP).

NCCL's all-reduce of a decode step's hidden states (2 MB at batch 256 of an 8B model) took
34 µs inside a CUDA graph on 2 × H200, and 90 µs for a 2,048-token step (16 MB): 64 of them
were a fifth of a tp=2 step (``tools/tp_steps.py``). Here every rank of the group maps the
others' copy of its buffers (``torch.distributed._symmetric_memory``): a one-shot all-reduce
reads each peer's rows straight over NVLink and sums them; a two-shot one reduces a slice per
rank and then gathers the slices, moving half the bytes per rank, which wins on large messages.
Both run as a single kernel, so they replay inside the CUDA graphs as NCCL's do.

The one-shot sum is this module's Triton kernel: one program per SM, each copying its share of
the rows into this rank's slot, telling every peer so (a flag it raises on each rank), waiting
for the peers' flags of the same program, then summing that share from every rank in rank
order (so every rank rounds the same sum). A program's flags count its calls, so they never
need resetting, and a CUDA graph replays them as they are; consecutive calls write alternate
slots, so a call never overwrites rows a slower peer may still be reading from the call
before (a peer that raises its flag for call c + 1 has finished call c: stream order). One
barrier per sum, and every SM reading, where PyTorch's one-shot kernel barriers on both sides
from a few dozen blocks. The two-shot sum is PyTorch's.

Only point-to-point NVLink access is used, never NVLink multicast (``multimem``):
``TORCH_SYMM_MEM_DISABLE_MULTICAST`` is set before the first allocation unless the caller set it.
Sums larger than the buffer, other dtypes and any setup that fails go through NCCL.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 1 << 20
"""Sums up to this size read every peer whole (one-shot); larger ones reduce a slice per rank
and gather (two-shot)."""


@triton.jit
def _one_shot_sum_kernel(
    x_ptr,
    out_ptr,
    slot_ptrs,  # [world] int64: every rank's slots buffer (2 * slot_numel elements)
    flag_ptrs,  # [world] int64: every rank's flags (int64 [programs, world])
    counts_ptr,  # [programs] int64, this rank's: calls each program has made
    numel,
    slot_numel,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    count = tl.load(counts_ptr + pid) + 1  # the same on every program and rank: the call's number
    tl.store(counts_ptr + pid, count)
    slot = (count % 2) * slot_numel  # consecutive calls alternate slots (see SymmetricAllReduce)
    offs = tl.arange(0, BLOCK)
    own = tl.load(slot_ptrs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
    for start in range(pid * BLOCK, numel, step):
        idx = start + offs
        mask = idx < numel
        tl.store(own + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's copy is written before the signal below
    for r in tl.static_range(WORLD):  # "my rows of this call are in place", on every rank
        pad = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(pad + pid * WORLD + RANK, count, sem="release", scope="sys")
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64)) + pid * WORLD
    for r in tl.static_range(WORLD):
        if r != RANK:  # (a peer may be one call ahead already: >=, not ==)
            while tl.atomic_add(mine + r, 0, sem="acquire", scope="sys") < count:
                pass
    tl.debug_barrier()  # no thread reads a peer's rows before the waits above are over
    for start in range(pid * BLOCK, numel, step):
        idx = start + offs
        mask = idx < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank rounds the same sum
            buf = tl.load(slot_ptrs + r).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
            acc += tl.load(buf + idx, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


_BLOCK = 2048
"""Elements a one-shot program moves per iteration (8 warps, 16 bytes a thread of bf16)."""


class SymmetricAllReduce:
    """Sums tensors over ``group`` through one symmetric buffer of ``max_numel`` elements."""

    def __init__(self, group: dist.ProcessGroup, *, max_numel: int, dtype: torch.dtype,
                 device: torch.device, one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.group_name = group.group_name
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self._ops = torch.ops.symm_mem
        # The one-shot kernel's own memory: two slots of the largest one-shot sum, and flags.
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.slot_numel = min(max_numel, one_shot_max_bytes // dtype.itemsize)
        self.slots = symm_mem.empty(2 * self.slot_numel, dtype=dtype, device=device)
        self.flags = symm_mem.empty(self.num_programs * self.world_size, dtype=torch.int64, device=device)
        self.flags.zero_()
        self.counts = torch.zeros(self.num_programs, dtype=torch.int64, device=device)
        self._handles = [symm_mem.rendezvous(t, group) for t in (self.slots, self.flags)]
        self.slot_ptrs, self.flag_ptrs = (torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device)
                                          for h in self._handles)

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, *, max_numel: int, dtype: torch.dtype,
               device: torch.device, one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> SymmetricAllReduce | None:
        """One for ``group`` on CUDA (every rank of the group calls this together), or None
        where it cannot run (no group, not CUDA, the setup fails: then NCCL sums). Its closing
        all-reduce is also the barrier after which every rank's flags are zero."""
        if group is None or device.type != "cuda" or max_numel <= 0:
            return None
        try:
            made = cls(group, max_numel=max_numel, dtype=dtype, device=device, one_shot_max_bytes=one_shot_max_bytes)
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
        n = x.numel()
        if n * x.element_size() <= ONE_SHOT_MAX_BYTES and n <= self.slot_numel:
            return self.one_shot(x)
        buf = self.buffer[:n]
        buf.copy_(x.view(-1))
        out = torch.empty_like(x)
        self._ops.two_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        return out

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum through this module's one-shot kernel (``x.numel() <= slot_numel``)."""
        out = torch.empty_like(x)
        _one_shot_sum_kernel[(self.num_programs,)](
            x, out, self.slot_ptrs, self.flag_ptrs, self.counts, x.numel(), self.slot_numel,
            RANK=self.rank, WORLD=self.world_size, BLOCK=_BLOCK, num_warps=8)
        return out
