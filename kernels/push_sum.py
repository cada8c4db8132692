"""A TP sum whose bytes go out as stores: each rank writes its rows straight into every peer's
symmetric buffer, raises a flag there, awaits the peers' flags and sums its own buffer.

Reading a peer's rows (PyTorch's one-shot) waits a round trip over NVLink for every block a
program loads; a store is posted and the program goes on, so the rows cross at close to the
link's rate. Where it wins (two ranks, up to 4 MB) and where PyTorch's kernels do: BENCHMARKS.md,
"The sums through symmetric memory" (``tools/sum_kernels.py`` times them side by side).

``push_two_shot`` is the same exchange as a two-shot, for larger sums: rank r owns slice r of
the rows; each rank stores slice k of its rows into rank k's scatter region, raises its first
flag, awaits the peers', sums its own slice (rank order), stores that sum into its output and
into every peer's gather region, raises its second flag, awaits the peers' and copies their
sums out of its gather region. A rank stores 2 (W - 1) / W of its rows' bytes where the push
above stores W - 1 copies of them, and each rank adds one slice instead of all rows.

The memory, per rank (``parallel/symmetric.py`` allocates it): ``slots``, two slots that
successive sums alternate, each a region of ``slot_numel`` elements per rank (rank r's rows land
in region r); ``flags``, one int64 per (program, rank): program p of rank r raises
``flags[p * world + r]`` on every peer to the number of sums program p has made (``counts[p]``,
kept on the device, so graph replays count too). Program p of every rank covers the same
elements, so it waits for program p of each peer only, not for a barrier of the whole grid. A
rank writes a slot again two sums later, after that peer's program has raised its flag of the
sum between, which it does only after its kernel of the sum before has ended (kernels of one
stream run in order): two slots are enough. Every rank must make the same sums in the same
order, as the ranks of a TP group do.

``push_two_shot``'s memory is its own, laid out alike: two slots, each a scatter region then a
gather region of ``slot_numel`` elements (slice r of either at r × share), and flags [2,
programs, world] (the first round's, then the second's). A rank's first flag of a sum is raised
only after its kernel of the sum before has ended, the gather reads included, so a slot is again
free once that flag has been seen; its offsets are fixed by ``slot_numel``, so sums of any sizes
may follow each other.

Torch reference: the rows of every rank summed in float32 in rank order, rounded once
(``push_sum_reference``); every rank gets the same bits.

``push_add_rms_norm`` is the same exchange with the layer's next step fused behind it: the sum,
plus the residual, RMS-normed (``kernels/rms_norm``'s numerics), so a row-parallel layer's
partial rows go straight to the next norm and the sum's output makes no round trip through
memory into a separate norm kernel. Its programs cover whole rows (a row's norm needs all of
it); it and ``push_sum`` share one rank's slots, flags and counts (``push_two_shot`` has its
own), any sequence of the two in the same order on every rank.

``push_two_shot_add_rms_norm`` fuses the same norm behind the two-shot, for sums above the
push's sizes, on ``push_two_shot``'s memory (shared with it). Its slices are whole rows
(``two_shot_norm_rows`` each, the last slices shorter or empty): each rank stores slice k of its
rows into rank k's scatter region; sums, adds and norms its own slice; stores the slice's new
residual rows (not the normed ones: half the bytes) into every peer's gather region; and norms
the peers' slices out of its own gather region. The rows cross NVLink as the plain two-shot's
do, and the sum's output never goes through memory into a separate norm kernel.

Torch reference of both: ``add_rms_norm_reference(push_sum_reference(parts), residual, weight,
eps)``: the same roundings; the sum of squares may add in another order (an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a program moves per iteration; with 8 warps, the fastest measured
NUM_WARPS = 8


@triton.jit
def exchange_flags(flag_ptrs, base, pid, count, RANK: tl.constexpr, WORLD: tl.constexpr):
    """After this program's stores: raise its flag (``base`` + pid × WORLD + RANK) on every peer
    to ``count``, then wait until each peer's flag for this program has reached ``count`` here.
    The CTA barrier before the release orders every thread's stores ahead of it; the one after
    the acquiring spin orders every thread's reads after it."""
    tl.debug_barrier()
    for k in tl.static_range(1, WORLD):
        pad = tl.load(flag_ptrs + (RANK + k) % WORLD).to(tl.pointer_type(tl.int64)) + base
        tl.atomic_xchg(pad + pid * WORLD + RANK, count.to(tl.int64), sem="release", scope="sys")
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64)) + base + pid * WORLD
    for k in tl.static_range(1, WORLD):
        while tl.atomic_add(mine + (RANK + k) % WORLD, 0, sem="acquire", scope="sys") < count:
            pass
    tl.debug_barrier()


@triton.jit
def buffer(slot_ptrs, rank, like):
    """Rank ``rank``'s slots as this process maps them, typed as ``like``. Every rank's slots start
    16-byte aligned (``parallel/symmetric`` checks it): told so, the compiler moves a thread's
    elements in vector loads and stores, not one element each."""
    return tl.multiple_of(tl.load(slot_ptrs + rank).to(like.dtype), 16)


@triton.jit
def next_count(counts_ptr, pid):
    """This program's sums so far, this one included (the same on every rank), stored back."""
    count = tl.load(counts_ptr + pid) + 1
    tl.debug_barrier()  # every warp has read the count before one thread stores the next
    tl.store(counts_ptr + pid, count)
    return count


@triton.jit
def sum_rows(x_ptr, x_at, peers_ptr, region, peer_at, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every rank's copy of some elements summed in float32, in rank order (every rank rounds
    the same sum): this rank's at ``x_ptr + x_at``, rank r's at ``peers_ptr + r * region + peer_at``."""
    acc = tl.zeros(x_at.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
        else:  # .cg: the peer's stores, not a line this SM cached two sums ago
            acc += tl.load(peers_ptr + r * region + peer_at, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit
def _push_sum_kernel(x_ptr, out_ptr, slot_ptrs, flag_ptrs, counts_ptr, numel, slot_numel,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    count = next_count(counts_ptr, pid)
    slot = (count % 2) * WORLD * slot_numel
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, numel, step):
        idx = start + offs
        mask = idx < numel
        v = tl.load(x_ptr + idx, mask=mask)
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            dst = buffer(slot_ptrs, peer, x_ptr) + slot + RANK * slot_numel
            tl.store(dst + idx, v, mask=mask)
    exchange_flags(flag_ptrs, 0, pid, count, RANK, WORLD)
    own = buffer(slot_ptrs, RANK, x_ptr) + slot
    for start in range(pid * BLOCK, numel, step):
        idx = start + offs
        mask = idx < numel
        acc = sum_rows(x_ptr, idx, own, slot_numel, idx, mask, RANK, WORLD)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_residual(acc, residual_ptr, at, mask):
    """The sum rounded as ``push_sum`` rounds it, plus the residual rounded as ``rms_norm`` does:
    the new residual, in the activation dtype."""
    dtype = residual_ptr.dtype.element_ty
    return (acc.to(dtype).to(tl.float32) + tl.load(residual_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(dtype)


@triton.jit
def store_rms_norm(s, w, out_ptr, residual_out_ptr, at, mask, H, eps):
    """Store the new residual row ``s`` and its RMSNorm times ``w`` (float32), ``kernels/rms_norm``'s
    numerics."""
    dtype = out_ptr.dtype.element_ty
    tl.store(residual_out_ptr + at, s, mask=mask)
    sf = s.to(tl.float32)
    normed = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)).to(dtype)
    tl.store(out_ptr + at, (normed.to(tl.float32) * w).to(dtype), mask=mask)


@triton.jit
def _push_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, slot_ptrs, flag_ptrs,
                              counts_ptr, T, H, slot_numel, eps,
                              RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    count = next_count(counts_ptr, pid)
    slot = (count % 2) * WORLD * slot_numel
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    for row in range(pid, T, programs):  # rows pid, pid + programs, ...: the same on every rank
        at = row * H + cols  # int32: within a slot, below 2**31 elements (the push's is 4 MB)
        v = tl.load(x_ptr + at, mask=mask)
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            dst = buffer(slot_ptrs, peer, x_ptr) + slot + RANK * slot_numel
            tl.store(dst + at, v, mask=mask)
    exchange_flags(flag_ptrs, 0, pid, count, RANK, WORLD)
    own = buffer(slot_ptrs, RANK, x_ptr) + slot
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, T, programs):
        at = row * H + cols
        s = add_residual(sum_rows(x_ptr, at, own, slot_numel, at, mask, RANK, WORLD), residual_ptr, at, mask)
        store_rms_norm(s, w, out_ptr, residual_out_ptr, at, mask, H, eps)


def _check_memory(rank: int, world: int, slot_ptrs: torch.Tensor, flag_ptrs: torch.Tensor,
                  counts: torch.Tensor) -> None:
    assert slot_ptrs.dtype == flag_ptrs.dtype == counts.dtype == torch.int64
    assert slot_ptrs.numel() == flag_ptrs.numel() == world and 0 <= rank < world


def _check_norm_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(T, H) of the fused norms' rows [T, H], after checking the three tensors agree."""
    assert x.dim() == 2 and x.is_contiguous() and residual.is_contiguous(), (x.shape, x.stride(), residual.stride())
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
    T, H = x.shape
    assert weight.shape == (H,) and weight.is_contiguous() and weight.dtype == x.dtype, (weight.shape, weight.dtype)
    assert H <= MAX_NORM_HIDDEN, H
    return T, H


def push_sum(x: torch.Tensor, out: torch.Tensor, *, rank: int, world: int, slot_ptrs: torch.Tensor,
             flag_ptrs: torch.Tensor, counts: torch.Tensor, slot_numel: int) -> torch.Tensor:
    """``out`` = the sum of ``x`` over the ranks. ``slot_ptrs`` / ``flag_ptrs``: int64 [world], every
    rank's slots and flags as this process maps them; ``counts``: int64 [programs], this rank's
    own (the grid is its length, the same on every rank)."""
    assert x.is_contiguous() and out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype
    assert x.numel() <= slot_numel, (x.numel(), slot_numel)
    _check_memory(rank, world, slot_ptrs, flag_ptrs, counts)
    _push_sum_kernel[(counts.numel(),)](x, out, slot_ptrs, flag_ptrs, counts, x.numel(), slot_numel,
                                        RANK=rank, WORLD=world, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


@triton.jit
def _push_two_shot_kernel(x_ptr, out_ptr, slot_ptrs, flag_ptrs, counts_ptr, share, slot_numel,
                          RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    step = programs * BLOCK
    count = next_count(counts_ptr, pid)
    slot = (count % 2) * 2 * slot_numel  # [scatter region | gather region]
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, share, step):  # slice k of my rows -> rank k's scatter region
        idx = start + offs
        mask = idx < share
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            v = tl.load(x_ptr + peer * share + idx, mask=mask)
            dst = buffer(slot_ptrs, peer, x_ptr) + slot + RANK * share
            tl.store(dst + idx, v, mask=mask)
    exchange_flags(flag_ptrs, 0, pid, count, RANK, WORLD)
    own = buffer(slot_ptrs, RANK, x_ptr) + slot
    for start in range(pid * BLOCK, share, step):  # my slice's sum -> my output, every gather region
        idx = start + offs
        mask = idx < share
        red = sum_rows(x_ptr, RANK * share + idx, own, share, idx, mask, RANK, WORLD).to(dtype)
        tl.store(out_ptr + RANK * share + idx, red, mask=mask)
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            dst = buffer(slot_ptrs, peer, x_ptr) + slot + slot_numel + RANK * share
            tl.store(dst + idx, red, mask=mask)
    exchange_flags(flag_ptrs, programs * WORLD, pid, count, RANK, WORLD)  # the second round's flags
    for start in range(pid * BLOCK, share, step):  # the peers' sums, out of my gather region
        idx = start + offs
        mask = idx < share
        for k in tl.static_range(1, WORLD):
            peer = (RANK + k) % WORLD
            v = tl.load(own + slot_numel + peer * share + idx, mask=mask, cache_modifier=".cg")
            tl.store(out_ptr + peer * share + idx, v, mask=mask)


def push_two_shot(x: torch.Tensor, out: torch.Tensor, *, rank: int, world: int, slot_ptrs: torch.Tensor,
                  flag_ptrs: torch.Tensor, counts: torch.Tensor, slot_numel: int) -> torch.Tensor:
    """``out`` = the sum of ``x`` over the ranks, as ``push_sum`` (the same bits), in two
    rounds; ``x.numel()`` a multiple of ``world``. The memory: the module's docstring."""
    assert x.is_contiguous() and out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype
    assert x.numel() <= slot_numel and x.numel() % world == 0, (x.numel(), slot_numel, world)
    _check_memory(rank, world, slot_ptrs, flag_ptrs, counts)
    _push_two_shot_kernel[(counts.numel(),)](x, out, slot_ptrs, flag_ptrs, counts, x.numel() // world, slot_numel,
                                             RANK=rank, WORLD=world, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


# A program holds a row in registers (fp32): past this it would spill.
MAX_NORM_HIDDEN = 16384


def push_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, rank: int,
                      world: int, slot_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, counts: torch.Tensor,
                      slot_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s + residual) * weight, s + residual) where s is the sum of ``x`` [T, H] over the
    ranks, as ``kernels/rms_norm.add_rms_norm`` after ``push_sum``; the memory as ``push_sum``'s
    (and shared with it)."""
    T, H = _check_norm_args(x, residual, weight)
    assert x.numel() <= slot_numel, (x.numel(), slot_numel)
    _check_memory(rank, world, slot_ptrs, flag_ptrs, counts)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    _push_add_rms_norm_kernel[(counts.numel(),)](
        x, residual, weight, out, residual_out, slot_ptrs, flag_ptrs, counts, T, H, slot_numel, eps,
        RANK=rank, WORLD=world, BLOCK_H=triton.next_power_of_2(H), num_warps=NUM_WARPS)
    return out, residual_out


def two_shot_norm_rows(T: int, world: int) -> int:
    """Rows of each rank's slice in ``push_two_shot_add_rms_norm`` (the last slices may hold fewer,
    or none): the two-shot's regions must hold ``world`` slices of this many rows."""
    return -(-T // world)


@triton.jit
def _push_two_shot_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, slot_ptrs,
                                       flag_ptrs, counts_ptr, T, H, rows, slot_numel, eps,
                                       RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    count = next_count(counts_ptr, pid)
    slot = (count % 2) * 2 * slot_numel  # [scatter region | gather region]
    share = rows * H  # a slice's elements; rank r's slice holds rows r * rows on
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    for k in tl.static_range(1, WORLD):  # slice k of my rows -> rank k's scatter region
        peer = (RANK + k) % WORLD
        dst = buffer(slot_ptrs, peer, x_ptr) + slot + RANK * share
        for j in range(pid, tl.minimum(rows, T - peer * rows), programs):
            tl.store(dst + j * H + cols, tl.load(x_ptr + (peer * rows + j) * H + cols, mask=mask), mask=mask)
    exchange_flags(flag_ptrs, 0, pid, count, RANK, WORLD)
    own = buffer(slot_ptrs, RANK, x_ptr) + slot
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for j in range(pid, tl.minimum(rows, T - RANK * rows), programs):  # my slice: sum, add, norm, share
        at = (RANK * rows + j) * H + cols
        s = add_residual(sum_rows(x_ptr, at, own, share, j * H + cols, mask, RANK, WORLD), residual_ptr, at, mask)
        store_rms_norm(s, w, out_ptr, residual_out_ptr, at, mask, H, eps)
        for k in tl.static_range(1, WORLD):  # the new residual row into every peer's gather region
            peer = (RANK + k) % WORLD
            dst = buffer(slot_ptrs, peer, x_ptr) + slot + slot_numel + RANK * share
            tl.store(dst + j * H + cols, s, mask=mask)
    exchange_flags(flag_ptrs, programs * WORLD, pid, count, RANK, WORLD)  # the second round's flags
    for k in tl.static_range(1, WORLD):  # the peers' new residual rows, normed here
        peer = (RANK + k) % WORLD
        for j in range(pid, tl.minimum(rows, T - peer * rows), programs):
            s = tl.load(own + slot_numel + peer * share + j * H + cols, mask=mask, other=0.0, cache_modifier=".cg")
            store_rms_norm(s, w, out_ptr, residual_out_ptr, (peer * rows + j) * H + cols, mask, H, eps)


def push_two_shot_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                               rank: int, world: int, slot_ptrs: torch.Tensor, flag_ptrs: torch.Tensor,
                               counts: torch.Tensor, slot_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``push_add_rms_norm``'s result (its roundings) as a two-shot over whole rows, on
    ``push_two_shot``'s memory (and shared with it): rank r sums, adds and norms slice r of the
    rows (``two_shot_norm_rows`` each), stores the new residual rows into every peer's gather
    region, and norms the peers' slices from its own. ``world`` slices must fit ``slot_numel``."""
    T, H = _check_norm_args(x, residual, weight)
    rows = two_shot_norm_rows(T, world)
    assert world * rows * H <= slot_numel and slot_numel < 2**31, (T, H, world, slot_numel)  # int32 offsets
    _check_memory(rank, world, slot_ptrs, flag_ptrs, counts)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    _push_two_shot_add_rms_norm_kernel[(counts.numel(),)](
        x, residual, weight, out, residual_out, slot_ptrs, flag_ptrs, counts, T, H, rows, slot_numel, eps,
        RANK=rank, WORLD=world, BLOCK_H=triton.next_power_of_2(H), num_warps=NUM_WARPS)
    return out, residual_out
