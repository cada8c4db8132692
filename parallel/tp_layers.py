"""Tensor-parallel layers (Megatron-style) and the pure functions that split a model over TP ranks.

- ``ColumnParallelLinear``: rank r holds some output features (rows of W) and computes only
  those; no collective. ``MergedColumnParallelLinear`` (gate|up) and ``QKVParallelLinear``
  (q|k|v) are fused ones: each checkpoint tensor ("part") is split on its own, and the rank's
  rows of every part are laid out part after part.
- ``RowParallelLinear``: rank r holds some input features (columns of W), computes a partial
  sum, and all-reduces it; the bias is added once, after the reduce.
- ``VocabParallelEmbedding``: rank r holds a contiguous vocab range; ids outside it give zero
  rows, and the all-reduce leaves exactly the one rank's row.
- ``ParallelLMHead``: the same vocab rows; logits shards are all-gathered so that every TP rank
  has the full-vocab logits.

With tp_size == 1 every layer is exactly ``nn.Linear`` / ``nn.Embedding`` (same parameters,
same forward, no collective), so single-process numerics do not change.

Deterministic serving (``InvariantNumerics``, set with ``set_numerics``) trades speed for
layout-invariant results: every product runs a batch-invariant matmul, row-parallel layers
cut their input features into a fixed number of segments whose float32 partial products are
summed in one fixed binary tree (``tree_sum``) whatever the TP size, and logits stay float32.
One GPU, a pipeline and a TP group then compute the same bits for every token.

FP8 weights (``quantization="fp8"`` on the column- and row-parallel layers): the weight is held
in ``float8_e4m3fn`` with a float32 ``weight_scale`` per local output row, and the product runs
through the op table's ``fp8_linear`` (``kernels/fp8.py`` on the GPU; a dequantizing reference
on the CPU). A float checkpoint tensor is quantized as it is loaded, row by row
(``quantize_rows``); an FP8 checkpoint's tensor is copied as it is and its ``weight_scale``
(one per tensor, or one per row) loaded beside it. A row-parallel rank's scale covers only its
own columns: each rank's partial product is scaled before the sum, so that is exact.

Each layer has ``weight_loader(param, loaded, part=None)``: ``loaded`` is the full checkpoint
tensor, or a lazy slice of it (safetensors' ``get_slice``, ``GGUFTensorSlice``), indexed only
with ``[a:b]`` / ``[:, a:b]`` so that only this rank's rows or columns are read. Loaders raise
ValueError on a checkpoint shape that does not match the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.kernels.reference import fp8_linear_reference
from pipeserve.parallel.context import ParallelContext, tp_all_gather, tp_all_reduce, tp_gather_list

QUANTIZATIONS = ("fp8",)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still divides by something positive

# --- splitting (pure) -----------------------------------------------------------------------


def split_evenly(size: int, num_parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``size`` items are cut into ``num_parts``
    contiguous parts as evenly as possible; the first ``size % num_parts`` parts get one more."""
    assert 0 <= index < num_parts, (index, num_parts)
    base, extra = divmod(size, num_parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def split_sizes(size: int, num_parts: int) -> list[int]:
    """Sizes of every part of ``split_evenly``."""
    return [b - a for a, b in (split_evenly(size, num_parts, i) for i in range(num_parts))]


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadShard:
    """The attention heads one TP rank holds."""

    q_start: int
    q_stop: int
    """Global query heads [q_start, q_stop)."""
    kv_heads: tuple[int, ...]
    """The global KV head in each local KV slot. Query head h reads local KV slot
    (h - q_start) // (num_heads / num_kv_heads), as in unsharded GQA."""

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Query heads split as evenly as possible (first ranks get the extra head).

    With group size g = num_heads // num_kv_heads, rank r's query heads [a, b) read KV heads
    h // g. Its local KV heads keep attention a uniform GQA (every local KV head serves the
    same number of local query heads):

    - [a, b) aligned to groups (a, b multiples of g): exactly KV heads [a/g, b/g);
    - [a, b) inside one group (tp_size > num_kv_heads, e.g. 8 / 2 heads on 4 ranks): that one
      KV head, replicated across the ranks that share it;
    - otherwise (9 / 3 heads on 2 ranks: [0, 5) and [5, 9)): one KV head per local query head,
      a copy of KV head h // g (local ratio 1). The copies cost KV-cache memory, but every
      rank's attention stays self-contained.
    """
    if not 1 <= tp_size <= num_heads:
        raise ValueError(f"tensor parallelism {tp_size} needs 1 <= tp <= num_heads ({num_heads})")
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    a, b = split_evenly(num_heads, tp_size, tp_rank)
    if a % group == 0 and b % group == 0:
        kv_heads = tuple(range(a // group, b // group))
    elif a // group == (b - 1) // group:
        kv_heads = (a // group,)
    else:
        kv_heads = tuple(h // group for h in range(a, b))
    return HeadShard(q_start=a, q_stop=b, kv_heads=kv_heads)


# --- deterministic numerics (pure) ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class InvariantNumerics:
    """How the linear layers compute in deterministic mode (see the module docstring)."""

    matmul: Callable[[torch.Tensor, torch.Tensor, torch.dtype | None], torch.Tensor]
    """A batch-invariant ``matmul(x [T, K], w [N, K], out_dtype) -> [T, N]``: its bits depend on
    neither T nor N (``pipeserve.kernels.matmul.matmul``)."""
    reduction_splits: int
    """Segments of every row-parallel input. Runs agree bit for bit when they share this value
    and each one's tp divides it (``check_reduction_splits``)."""


def check_reduction_splits(splits: int, tp_size: int) -> None:
    """ValueError unless ``tree_sum`` over ``splits`` leaves equals the tree over tp ranks of
    the trees over each rank's ``splits / tp`` leaves: tp must divide splits, and be a power of
    two (each level of the tree then halves evenly) or equal splits."""
    if splits < 1 or splits % tp_size or (tp_size & (tp_size - 1) and splits != tp_size):
        raise ValueError(
            f"deterministic reduction over {splits} segments cannot be split over tp={tp_size}: "
            "tp must divide it and be a power of two (or equal it)"
        )


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in one fixed binary tree: the first ceil(n/2) parts, plus the rest, recursively."""
    if len(parts) == 1:
        return parts[0]
    half = (len(parts) + 1) // 2
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def reduction_segments(
    num_units: int, unit: int, splits: int, tp_size: int, tp_rank: int, cols: tuple[int, int]
) -> list[tuple[int, int]]:
    """This rank's segments of a row-parallel input, as [a, b) local column ranges.

    The input's ``num_units * unit`` features (heads of ``unit`` features for o_proj) are cut
    into ``splits`` segments as evenly as possible; rank r holds segments
    [r * splits / tp, (r + 1) * splits / tp), which must be exactly its columns ``cols``.
    """
    check_reduction_splits(splits, tp_size)
    if splits > num_units:
        raise ValueError(f"cannot cut {num_units} input units into {splits} segments")
    per_rank = splits // tp_size
    mine = [split_evenly(num_units, splits, i) for i in range(tp_rank * per_rank, (tp_rank + 1) * per_rank)]
    start, stop = cols
    if mine[0][0] * unit != start or mine[-1][1] * unit != stop:
        raise ValueError(
            f"this rank's input columns [{start}, {stop}) are not its {per_rank} of {splits} "
            "deterministic segments; use reduction_splits = tp"
        )
    return [(a * unit - start, b * unit - start) for a, b in mine]


def check_reduction_layout(
    *, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, splits: int, tp_size: int
) -> None:
    """ValueError unless every TP rank's o_proj and down_proj columns are whole runs of the
    ``splits`` deterministic segments (checked before any worker starts); the message names
    the layer and the values of ``splits`` that would fit."""

    def misfit(s: int) -> str | None:
        for rank in range(tp_size):
            heads = shard_heads(num_heads, num_kv_heads, tp_size, rank)
            layers = {"o_proj": (num_heads, head_dim, (heads.q_start * head_dim, heads.q_stop * head_dim)),
                      "down_proj": (intermediate_size, 1, split_evenly(intermediate_size, tp_size, rank))}
            for name, (units, unit, cols) in layers.items():
                try:
                    reduction_segments(units, unit, s, tp_size, rank, cols)
                except ValueError as e:
                    return f"{name}: {e}"
        return None

    problem = misfit(splits)
    if problem is not None:
        fits = [tp_size * 2**k for k in range(8) if tp_size * 2**k <= num_heads and misfit(tp_size * 2**k) is None]
        raise ValueError(f"reduction_splits={splits} does not fit tp={tp_size} ({problem}); values that fit: {fits}")


# --- reading checkpoint slices ----------------------------------------------------------------


def checkpoint_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy slice (safetensors / GGUF ``get_shape()``)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def check_shape(loaded: Any, expected: Sequence[int]) -> None:
    shape = checkpoint_shape(loaded)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint shape {shape} != model shape {tuple(expected)}")


def read_rows(loaded: Any, rows: Sequence[int]) -> torch.Tensor:
    """``loaded[rows]`` (dim 0), reading only the contiguous range that covers ``rows``."""
    if isinstance(rows, range) and rows.step == 1:
        return loaded[rows.start : rows.stop]
    lo, hi = min(rows), max(rows) + 1
    return loaded[lo:hi][torch.tensor([r - lo for r in rows])]


class RowRange:
    """Rows [start, stop) of a tensor or lazy slice, itself a lazy slice (``get_shape()``,
    ``s[a:b]``, ``s[:, a:b]``, ``s[:]``): one part of a checkpoint's fused projection."""

    def __init__(self, loaded: Any, start: int, stop: int) -> None:
        assert 0 <= start < stop <= checkpoint_shape(loaded)[0], (start, stop, checkpoint_shape(loaded))
        self.loaded, self.start, self.stop = loaded, start, stop

    def get_shape(self) -> list[int]:
        return [self.stop - self.start, *checkpoint_shape(self.loaded)[1:]]

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, *rest = key if isinstance(key, tuple) else (key,)
        assert isinstance(rows, slice) and rows.step in (None, 1), f"rows must be a plain slice, got {key}"
        a, b, _ = rows.indices(self.stop - self.start)
        return self.loaded[(slice(self.start + a, self.start + b), *rest)]


def read_cols(loaded: Any, start: int, stop: int) -> torch.Tensor:
    """``loaded[:, start:stop]``, reading only those columns."""
    return loaded[:, start:stop]


def is_fp8(loaded: Any) -> bool:
    """A checkpoint tensor (or lazy slice) stored in float8_e4m3fn."""
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype == FP8_DTYPE
    get_dtype = getattr(loaded, "get_dtype", None)  # safetensors' slice: "F8_E4M3"
    return get_dtype is not None and get_dtype() == "F8_E4M3"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, s [N] float32) with ``q · s[:, None]`` ≈ ``w`` [N, K]: each
    row scaled so that its largest magnitude maps to 448, then rounded to the nearest FP8."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=_FP8_MIN_SCALE)  # [N]
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def default_weight_loader(param: torch.Tensor, loaded: Any) -> None:
    """A replicated parameter (norm weights, a TP-1 layer): the whole tensor."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded[:])


# --- linear layers ----------------------------------------------------------------------------


class _Numerics:
    """A layer whose products deterministic mode replaces (``InvariantNumerics``; None: the
    default, fastest path)."""

    numerics: InvariantNumerics | None = None

    def set_numerics(self, numerics: InvariantNumerics | None) -> None:
        self.numerics = numerics


class _Quantizable(_Numerics, nn.Linear):
    """A linear layer whose weight may be held in FP8 (``quantization="fp8"``): ``weight``
    [out, in] float8_e4m3fn and ``weight_scale`` [out] float32 (None otherwise), multiplied by
    ``fp8_linear`` (the op table's, set by the model's ``set_ops``; the reference until then)."""

    weight_scale: nn.Parameter | None
    fp8_linear: Callable = staticmethod(fp8_linear_reference)

    def _hold(self, quantization: str | None) -> None:
        self.register_parameter("weight_scale", None)
        if quantization is None:
            return
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        out_features, in_features = self.weight.shape
        if out_features % 16 or in_features % 16:  # (what the FP8 tensor-core GEMM needs)
            raise ValueError(
                f"FP8 weights need both dimensions divisible by 16; a [{out_features}, "
                f"{in_features}] shard is not"
            )
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)  # (float32 whatever the default dtype)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on the fastest path this layer may take (not deterministic mode)."""
        if self.weight_scale is not None:
            return self.fp8_linear(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def _load_rows(self, offset: int, rows: torch.Tensor) -> None:
        """Local rows [offset, offset + len) of the weight from checkpoint values: as they are,
        or quantized when the weight is FP8 and they are not."""
        if self.weight_scale is None:
            if rows.dtype == FP8_DTYPE:
                raise ValueError("an FP8 checkpoint tensor for a layer that is not quantized")
            self.weight.data[offset : offset + len(rows)].copy_(rows)
            return
        if rows.dtype != FP8_DTYPE:
            rows, scale = quantize_rows(rows)
            self.weight_scale.data[offset : offset + len(rows)].copy_(scale)
        self.weight.data[offset : offset + len(rows)].copy_(rows)

    def _load_scale(self, loaded: Any, offset: int, rows: Sequence[int] | None) -> None:
        """An FP8 checkpoint's ``weight_scale``: one value for the whole tensor (shape [] or
        [1]) or one per row ([rows] or [rows, 1]); ``rows``: which of them this rank holds
        (None: all), placed from local row ``offset``."""
        if self.weight_scale is None:
            raise ValueError("a weight_scale for a layer that is not quantized")
        full = checkpoint_shape(loaded)
        count = self.weight_scale.shape[0] - offset if rows is None else len(rows)
        values = loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # (a scale is small)
        if math.prod(full) == 1:
            self.weight_scale.data[offset : offset + count].fill_(values.reshape(()).item())
            return
        if len(full) not in (1, 2) or (len(full) == 2 and full[1] != 1):
            raise ValueError(f"weight_scale of shape {list(full)}: expected [], [1], [rows] or [rows, 1]")
        values = values.reshape(-1).float()
        values = values if rows is None else values[torch.as_tensor(list(rows), dtype=torch.long)]
        if len(values) != count:
            raise ValueError(f"weight_scale has {len(values)} rows, the weight {count}")
        self.weight_scale.data[offset : offset + count].copy_(values)



class ColumnParallelLinear(_Quantizable):
    """y = x W_r^T + b_r over this rank's output rows; no collective.

    ``parts`` maps each checkpoint tensor's id to (its full number of rows, the global rows of
    it this rank holds); local rows are the parts' rows in order. The default is one part (id
    None) split evenly.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        parts: dict[Any, tuple[int, Sequence[int]]] | None = None,
        quantization: str | None = None,
    ) -> None:
        if parts is None:
            parts = {None: (out_features, range(*_split(out_features, parallel)))}
        assert sum(full for full, _ in parts.values()) == out_features, (parts, out_features)
        super().__init__(in_features, sum(len(rows) for _, rows in parts.values()), bias=bias)
        self.parallel = parallel
        self.parts = parts
        self.part_offsets, offset = {}, 0
        for part, (_, rows) in parts.items():
            self.part_offsets[part] = offset
            offset += len(rows)
        self._hold(quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out_local]
        if self.numerics is None:
            return self._product(x, self.bias)
        y = self.numerics.matmul(x, self.weight, None)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: torch.Tensor, loaded: Any, part: Any = None) -> None:
        full_rows, rows = self.parts[part]
        offset = self.part_offsets[part]
        if param is self.weight_scale:
            self._load_scale(loaded, offset, rows)
            return
        check_shape(loaded, (full_rows, *param.shape[1:]))
        if param is self.weight:
            self._load_rows(offset, read_rows(loaded, rows))
        else:
            param.data[offset : offset + len(rows)].copy_(read_rows(loaded, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused (gate|up); part i is split evenly."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        parallel: ParallelContext,
        quantization: str | None = None,
    ) -> None:
        parts = {i: (size, range(*_split(size, parallel))) for i, size in enumerate(output_sizes)}
        super().__init__(in_features, sum(output_sizes), bias=bias, parallel=parallel, parts=parts,
                         quantization=quantization)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection over this rank's heads (``shard_heads``); parts "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        heads: HeadShard,
        bias: bool,
        parallel: ParallelContext,
        quantization: str | None = None,
    ) -> None:
        d = head_dim
        q_rows = range(heads.q_start * d, heads.q_stop * d)
        kv_rows = tuple(r for h in heads.kv_heads for r in range(h * d, (h + 1) * d))
        kv_rows = range(kv_rows[0], kv_rows[-1] + 1) if _contiguous(kv_rows) else kv_rows
        parts = {
            "q": (num_heads * d, q_rows),
            "k": (num_kv_heads * d, kv_rows),
            "v": (num_kv_heads * d, kv_rows),
        }
        out_features = (num_heads + 2 * num_kv_heads) * d
        super().__init__(hidden_size, out_features, bias=bias, parallel=parallel, parts=parts,
                         quantization=quantization)


class RowParallelLinear(_Quantizable):
    """y = all_reduce(x_r W_r^T) + b over this rank's input columns [start, stop).

    ``cols`` defaults to an even split; o_proj passes its query heads' columns and its head
    size as ``unit`` (deterministic segments are cut at multiples of it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        cols: tuple[int, int] | None = None,
        unit: int = 1,
        quantization: str | None = None,
    ) -> None:
        start, stop = cols if cols is not None else _split(in_features, parallel)
        super().__init__(stop - start, out_features, bias=bias)
        assert in_features % unit == 0 and start % unit == 0 and stop % unit == 0, (in_features, cols, unit)
        self.parallel, self.unit = parallel, unit
        self.full_in_features, self.cols = in_features, (start, stop)
        self.segments: list[tuple[int, int]] = []
        self._hold(quantization)

    def set_numerics(self, numerics: InvariantNumerics | None) -> None:
        super().set_numerics(numerics)
        if numerics is not None:
            p = self.parallel
            self.segments = reduction_segments(
                self.full_in_features // self.unit, self.unit, numerics.reduction_splits,
                p.tp_size, p.tp_rank, self.cols,
            )  # fmt: skip

    def forward(self, x: torch.Tensor, *, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial product, for the caller to sum (no bias; not
        under ``InvariantNumerics``)."""
        # x: [T, in_local] -> [T, out]
        if self.numerics is not None:
            assert reduce, "deterministic numerics sum inside the layer"
            return self._forward_invariant(x)
        if self.parallel.tp_size == 1:
            return self._product(x, self.bias)
        if not reduce:
            assert self.bias is None, "a partial product has no bias"
            return self._product(x, None)
        y = tp_all_reduce(self._product(x, None), self.parallel)
        return y if self.bias is None else y + self.bias

    def _forward_invariant(self, x: torch.Tensor) -> torch.Tensor:
        # Each segment's product in float32 ([T, out] each), one tree over all ranks' segments
        # (this rank's subtree here, the ranks' subtrees after the gather), one rounding.
        mm = self.numerics.matmul
        local = tree_sum([mm(x[:, a:b], self.weight[:, a:b], torch.float32) for a, b in self.segments])
        y = tree_sum(tp_gather_list(local, self.parallel)).to(x.dtype)  # [T, out]
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: torch.Tensor, loaded: Any, part: Any = None) -> None:
        if param is self.bias:
            default_weight_loader(param, loaded)
            return
        if param is self.weight_scale:
            self._load_scale(loaded, 0, None)
            return
        check_shape(loaded, (self.out_features, self.full_in_features))
        self._load_rows(0, read_cols(loaded, *self.cols))


# --- vocabulary -------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows [vocab_start, vocab_stop) on this rank; the all-reduce assembles rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, parallel: ParallelContext
    ) -> None:
        start, stop = _split(num_embeddings, parallel)
        super().__init__(stop - start, embedding_dim)
        self.vocab_start, self.vocab_stop = start, stop
        self.parallel, self.full_num_embeddings = parallel, num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        if self.parallel.tp_size == 1:
            return super().forward(input_ids)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_stop)  # [T]
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        x = F.embedding(local_ids, self.weight).masked_fill_(~in_shard[:, None], 0)  # [T, H]
        return tp_all_reduce(x, self.parallel)

    def weight_loader(self, param: torch.Tensor, loaded: Any, part: Any = None) -> None:
        check_shape(loaded, (self.full_num_embeddings, self.embedding_dim))
        param.data.copy_(read_rows(loaded, range(self.vocab_start, self.vocab_stop)))


class ParallelLMHead(_Numerics, nn.Linear):
    """LM head over the same vocab rows as ``VocabParallelEmbedding`` (so the two can share one
    weight); ``forward`` returns full-vocab float32 logits on every TP rank."""

    def __init__(self, vocab_size: int, hidden_size: int, *, parallel: ParallelContext) -> None:
        start, stop = _split(vocab_size, parallel)
        super().__init__(hidden_size, stop - start, bias=False)
        self.vocab_start, self.vocab_stop = start, stop
        self.parallel, self.full_vocab_size = parallel, vocab_size
        self.shard_sizes = split_sizes(vocab_size, parallel.tp_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32
        # Gathered in the model's dtype (half the bytes of float32), cast after: same values.
        return tp_all_gather(self.shard_logits(hidden), self.parallel, self.shard_sizes).float()

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's columns [vocab_start, vocab_stop) of ``forward``'s logits, no collective:
        [N, V_local] in the model's dtype (float32 under deterministic numerics, whose logits
        are never rounded to the model's dtype); ``forward`` is their gather, cast to float32."""
        # hidden: [N, H] -> [N, V_local]
        if self.numerics is not None:
            return self.numerics.matmul(hidden, self.weight, torch.float32)
        return F.linear(hidden, self.weight)

    def weight_loader(self, param: torch.Tensor, loaded: Any, part: Any = None) -> None:
        check_shape(loaded, (self.full_vocab_size, self.in_features))
        param.data.copy_(read_rows(loaded, range(self.vocab_start, self.vocab_stop)))


def _split(size: int, parallel: ParallelContext) -> tuple[int, int]:
    if size < parallel.tp_size:
        raise ValueError(f"cannot split {size} features over {parallel.tp_size} TP ranks")
    return split_evenly(size, parallel.tp_size, parallel.tp_rank)


def _contiguous(rows: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in pairwise(rows))
