"""Who this process is in the TP × PP mesh, and the collectives tensor parallelism needs.

Ranks are stage-major: global rank = stage * tp_size + tp_rank, so the tp_size workers of one
pipeline stage are consecutive (on one node whenever tp_size <= GPUs per node: the all-reduces
of TP stay on NVLink, and only PP's point-to-point sends may cross nodes). TP rank r of stage s
sends its hidden states to TP rank r of stage s + 1 (every TP rank holds the full residual
stream, so each pair carries a complete copy and no gather is needed between stages).

Nothing here is global: a ``ParallelContext`` is built once per process and passed explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeserve.parallel.symmetric import SymmetricAllReduce

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelContext:
    """This process's place in the mesh. ``tp_rank`` and ``stage`` derive from ``rank``."""

    rank: int
    """Global rank in torch.distributed's default group (stage-major)."""
    world_size: int
    """tp_size * pp_size processes in all."""
    tp_size: int
    """Tensor-parallel ranks per pipeline stage."""
    pp_size: int
    """Pipeline stages."""
    tp_group: dist.ProcessGroup | None = None
    """This stage's TP group (ranks ``stage_ranks``); None when tp_size == 1, where the TP
    layers run no collective at all."""
    tp_reduce: SymmetricAllReduce | None = None
    """The forward's TP sums through symmetric memory (CUDA, set up by the worker once it knows
    the largest micro-batch); None: NCCL's all-reduce."""
    feedback_group: dist.ProcessGroup | None = None
    """Token feedback (``parallel/feedback.py``): the group of the first stage's ranks and the
    driver, on the ranks in it; None elsewhere or without feedback."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(
                f"tp_size and pp_size must be >= 1, got {self.tp_size}, {self.pp_size}"
            )
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(
                f"world_size {self.world_size} != tp_size {self.tp_size} * pp_size {self.pp_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")
        if (self.tp_group is None) != (self.tp_size == 1):
            raise ValueError("tp_group must be given exactly when tp_size > 1")

    @classmethod
    def single(cls) -> ParallelContext:
        """One process holding the whole model: no groups, no collectives."""
        return cls(rank=0, world_size=1, tp_size=1, pp_size=1)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def stage_ranks(self) -> list[int]:
        """Global ranks of this stage's TP group, in TP-rank order."""
        return stage_ranks(self.stage, self.tp_size)

    @property
    def prev_rank(self) -> int | None:
        """The same TP rank in the previous stage (whence hidden states come); None on stage 0."""
        return None if self.is_first_stage else self.rank - self.tp_size

    @property
    def next_rank(self) -> int | None:
        """The same TP rank in the next stage (where hidden states go); None on the last stage."""
        return None if self.is_last_stage else self.rank + self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The one rank that samples and reports results: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def driver_rank(self) -> int:
        """Global rank of the driver."""
        return (self.pp_size - 1) * self.tp_size


def stage_ranks(stage: int, tp_size: int) -> list[int]:
    """Global ranks of pipeline stage ``stage`` (stage-major layout)."""
    return list(range(stage * tp_size, (stage + 1) * tp_size))


FEEDBACK_MAX_CTAS = 1
"""NCCL: the CTAs (SMs) each kernel of the token-feedback channel may hold. The first stage posts
each receive of sampled ids early (``parallel/feedback.py``), and a posted receive holds its CTAs
until the ids arrive, beside the stage's own compute; the messages are a few hundred bytes.
Beside an uncapped receive 16 layers of Llama-3-8B's products ran 48% slower, capped at one CTA
13.5% (H200)."""


def build_parallel_context(tp_size: int, pp_size: int, *, token_feedback: bool = False) -> ParallelContext:
    """The context of this process, creating one TP group per stage (and, with
    ``token_feedback`` and more than one rank, the feedback group: the first stage's ranks and
    the driver; on NCCL its kernels hold at most ``FEEDBACK_MAX_CTAS`` CTAs).

    torch.distributed must already be initialized with world_size == tp_size * pp_size.
    ``dist.new_group`` is collective over the whole world: every rank calls it for every stage's
    group, in the same order (stage 0, 1, ...), and keeps only its own. A rank that skipped the
    groups it is not in would deadlock or mismatch the others' groups.
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized (init_process_group first)")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != tp_size * pp_size:
        raise ValueError(
            f"world size {world_size} != tp {tp_size} * pp {pp_size}; launch tp * pp processes"
        )
    tp_group = None
    if tp_size > 1:
        for stage in range(pp_size):
            ranks = stage_ranks(stage, tp_size)
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
    feedback_group = None
    if token_feedback and world_size > 1:  # (pp=1: the driver is in the first stage)
        ranks = sorted({*stage_ranks(0, tp_size), (pp_size - 1) * tp_size})
        group = dist.new_group(ranks, pg_options=nccl_options(max_ctas=FEEDBACK_MAX_CTAS))
        if rank in ranks:
            feedback_group = group
    return ParallelContext(
        rank=rank, world_size=world_size, tp_size=tp_size, pp_size=pp_size, tp_group=tp_group,
        feedback_group=feedback_group,
    )


def nccl_options(*, max_ctas: int | None):
    """Options for ``dist.new_group`` whose NCCL communicators' kernels hold at most
    ``max_ctas`` CTAs (SMs); None where that does not apply (no cap asked, another backend)."""
    if max_ctas is None or dist.get_backend() != "nccl":
        return None
    try:
        options = dist.ProcessGroupNCCL.Options()
        options.config.min_ctas = 1
        options.config.max_ctas = max_ctas
    except AttributeError as e:  # a torch built against an NCCL without per-communicator config
        logger.warning("NCCL communicator options unavailable (%s): the CTA cap is not applied", e)
        return None
    return options


# --- collectives over the TP group ----------------------------------------------------------


def tp_all_reduce(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group; returns the sum (``x`` itself, summed in place by NCCL,
    or a new tensor from ``parallel.tp_reduce``). No-op when tp_size == 1."""
    if parallel.tp_size > 1:
        if parallel.tp_reduce is not None and parallel.tp_reduce.fits(x):
            return parallel.tp_reduce(x)
        dist.all_reduce(x, group=parallel.tp_group)
    return x


def tp_sum_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        parallel: ParallelContext, add_rms_norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(tp_all_reduce(x), residual, weight, eps)``: the sum of a row-parallel
    layer's partial rows, plus the residual, RMS-normed. Where the TP group's symmetric sums
    take it, one kernel does all three (``kernels/push_sum``'s push or its two-shot with the norm
    fused: Triton kernels with ``kernels/rms_norm``'s numerics whatever ``add_rms_norm`` is; the
    symmetric sums run on CUDA only, where the norms are Triton's unless
    ``engine.kernel_backend=torch``)."""
    reduce = parallel.tp_reduce
    if parallel.tp_size > 1 and reduce is not None and reduce.fits_norm(x, residual):
        return reduce.push_add_rms_norm(x, residual, weight, eps)
    return add_rms_norm(tp_all_reduce(x, parallel), residual, weight, eps)


def tp_gather_list(x: torch.Tensor, parallel: ParallelContext) -> list[torch.Tensor]:
    """Every TP rank's ``x`` (one shape on all ranks), in TP-rank order; ``[x]`` when
    tp_size == 1."""
    if parallel.tp_size == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x, group=parallel.tp_group)
    return parts


def tp_argmax(values: torch.Tensor, token_ids: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """[N] int64: per row, the ``token_ids`` of the rank whose ``values`` is largest, the lowest
    TP rank where several tie (and a NaN counting as largest, as ``torch.argmax`` has it).

    Each rank passes its vocab shard's row maxima (``values`` [N]) and where they lie
    (``token_ids`` [N], global ids, the first maximum in its shard). With shards in rank order
    that is ``torch.argmax`` over the concatenated rows, exactly: the first maximum of the
    whole row. The ranks exchange 16 bytes a row (both as float64, exact for ids below 2**53)."""
    if parallel.tp_size == 1:
        return token_ids
    pairs = torch.stack([values.double(), token_ids.double()], dim=-1)  # [N, 2]
    candidates = torch.stack(tp_gather_list(pairs, parallel))  # [tp, N, 2]
    best = candidates[..., 0].argmax(dim=0, keepdim=True)  # [1, N]: the first rank of the maximum
    return candidates[..., 1].gather(0, best).squeeze(0).long()


def tp_all_gather(x: torch.Tensor, parallel: ParallelContext, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along the last dim, in TP-rank order.

    Rank r's ``x`` is ``[..., sizes[r]]``; shards may be uneven (vocab 49155 on 2 ranks), and
    NCCL's all_gather needs equal sizes, so each shard is padded to ``max(sizes)`` for the
    collective and trimmed after. No-op when tp_size == 1.
    """
    if parallel.tp_size == 1:
        return x
    assert len(sizes) == parallel.tp_size and x.shape[-1] == sizes[parallel.tp_rank], (
        x.shape,
        sizes,
    )
    padded = F.pad(x, (0, max(sizes) - x.shape[-1])).contiguous()  # [..., max(sizes)]
    shards = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(shards, padded, group=parallel.tp_group)
    return torch.cat([s[..., :n] for s, n in zip(shards, sizes, strict=True)], dim=-1)
