"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3, and the
mixture-of-experts Mixtral and Qwen3-MoE), for packed paged-KV serving.

Tokens arrive flat: a micro-batch is T tokens from several sequences, with no batch dimension
and no padding; ``AttentionMetadata`` says which tokens belong to which sequence and where
their K/V live. A module holds the decoder layers [start_layer, end_layer) of one pipeline
stage, plus the embedding on the first stage and the final norm + LM head on the last.

Between stages travels one tensor, the residual stream [T, H] after the stage's last layer
(inside a stage, layers pass ``(x, residual)`` so that RMSNorm can fuse the residual add).

q/k/v and gate/up are fused into one projection each (one GEMM instead of three/two);
``load_weights`` maps HF's separate tensors into their row ranges. Modules come in reading
order: RMSNorm, RoPE, attention, MLP, decoder layer, model.

Gemma (``ModelConfig.is_gemma``) runs the same modules with its own pieces: ``GemmaRMSNorm``
((1 + w), float32), a norm after attention and around the MLP, GeGLU, the embedding scaled by
sqrt(hidden), per-layer sliding windows and soft-capped scores and logits. Its norms and GeGLU
are plain torch on every device (no Triton kernel rounds Gemma's way yet). Phi-3's checkpoints
fuse q/k/v and gate/up themselves; ``load_weights`` splits them into the HF tensors they stack,
and Phi-4-mini turns RoPE on part of each head only (``Attention._rope``). Mixtral and
Qwen3-MoE swap each layer's MLP for ``MoE``: a router and routed experts, stacked at load into
one [E, ...] tensor per projection kind (``ops.moe_experts`` runs them grouped by expert).

Tensor parallelism lives in the layers (``pipeserve.parallel.tp_layers``): attention heads and
the MLP's intermediate features are split over the TP ranks of a stage (column-parallel in,
row-parallel out, one all-reduce each, which a Llama-style layer leaves to the norm after it:
``DecoderLayer``), the embedding and LM head over the vocabulary; an
MoE splits every expert's intermediate features the way the MLP splits its own. The
residual stream [T, H] is whole on every TP rank. With one TP rank the layers are plain
``nn.Linear`` / ``nn.Embedding``. With ``ModelConfig.quantization == "fp8"`` the attention and
MLP projections hold FP8 weights with a scale per row (read from an FP8 checkpoint, or
quantized as a float one loads) and multiply through ``ops.fp8_linear``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipeserve.kernels import KernelOps, torch_ops
from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.kernels.reference import gelu_tanh_mul_reference
from pipeserve.parallel.context import ParallelContext, tp_all_reduce, tp_argmax, tp_sum_add_rms_norm
from pipeserve.parallel.tp_layers import (
    FP8_DTYPE,
    InvariantNumerics,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    RowRange,
    VocabParallelEmbedding,
    check_shape,
    checkpoint_shape,
    default_weight_loader,
    is_fp8,
    read_cols,
    read_rows,
    shard_heads,
    split_evenly,
)
from pipeserve.runtime.model.model_config import ModelConfig

# An FP8 checkpoint's tensors that serve what pipeserve does another way: static activation
# scales (activations are quantized per token) and KV-cache scales (the cache keeps the model's
# dtype).
_FP8_UNUSED = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the normed input and the new residual."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as w and applied as (1 + w), in float32, rounded
    once at the end (HF Gemma's order; Llama's rounds before the weight, as ``ops`` does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual), as ``RMSNorm``; ``ops`` is not used."""
        # x, residual: [T, H]
        if residual is not None:
            x = x + residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype), x


def norm_class(config: ModelConfig) -> type[RMSNorm] | type[GemmaRMSNorm]:
    return GemmaRMSNorm if config.is_gemma else RMSNorm


# --- RoPE ---------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32 (``rope_parameters`` without its factor)."""
    return rope_parameters(config)[0]


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in float32, the factor cos and sin are scaled by),
    with Llama-3, linear, YaRN or LongRoPE scaling, computed exactly as transformers'
    ``_compute_llama3_parameters`` / ``_compute_linear_scaling_rope_parameters`` /
    ``_compute_yarn_parameters`` / ``_compute_longrope_parameters``. For the length-scaled
    types, those of a sequence within its original context: LongRoPE's short factors, and
    dynamic NTK's unscaled frequencies (past it: ``LengthScaledRotaryEmbedding``)."""
    d = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] == "dynamic":
        return inv_freq, 1.0
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"], 1.0
    if scaling["rope_type"] == "yarn":
        return _yarn(config, scaling)
    if scaling["rope_type"] == "longrope":
        return _longrope(config, scaling, "short_factor")
    assert scaling["rope_type"] == "llama3", scaling
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
    # band between interpolated smoothly.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama), 1.0


def _yarn(config: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context are
    interpolated (slowed by ``factor``), those that turn more than ``beta_fast`` times kept,
    with a linear ramp between; cos and sin grow by the attention factor (0.1 ln(factor) + 1
    unless given)."""
    d, base = config.rotary_dim, config.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _longrope(config: ModelConfig, scaling: dict, factors: str) -> tuple[torch.Tensor, float]:
    """LongRoPE's ``factors`` ("short_factor" or "long_factor") divide each frequency; cos and
    sin grow by sqrt(1 + ln(factor) / ln(original context)) unless an attention factor is given."""
    d, original, factor = config.rotary_dim, scaling["original_max_position_embeddings"], scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(scaling[factors], dtype=torch.float32)  # [d / 2]
    inv_freq_shape = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    return 1.0 / (ext_factors * config.rope_theta**inv_freq_shape), float(attention_factor)


def dynamic_ntk_inv_freq(config: ModelConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK's inverse frequencies [N, rotary_dim / 2] in float32 for sequences of
    ``seq_lens`` [N] tokens (any integer dtype, on any device): the base becomes
    theta * (factor * L / M - (factor - 1)) ** (d / (d - 2)) for L = max(seq_len, M), M the
    original context, in float32 as transformers' ``_compute_dynamic_ntk_parameters`` computes
    it in a forward (its seq_len a tensor)."""
    scaling, d = config.rope_scaling, config.rotary_dim
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    length = seq_lens.long().clamp(min=original).float()  # [N]
    base = config.rope_theta * ((factor * length / original) - (factor - 1)) ** (d / (d - 2))  # [N]
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device=seq_lens.device).float() / d  # [d/2]
    return 1.0 / (base[:, None] ** exponents[None, :])  # [N, d/2]


def _cos_sin(freqs: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, d] of rotation angles freqs [N, d/2] (NeoX layout: each angle twice), times
    the attention factor ``scale``."""
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, d]
    return emb.cos() * scale, emb.sin() * scale


def _position_tables(config: ModelConfig, num_positions: int, device: torch.device | None) -> dict[str, torch.Tensor]:
    """{"cos", "sin"}: [num_positions, d] float32 tables of ``rope_parameters``."""
    inv_freq, scale = rope_parameters(config)
    positions = torch.arange(num_positions, device=device).float()
    cos, sin = _cos_sin(positions[:, None] * inv_freq.to(device)[None, :], scale)
    return {"cos": cos, "sin": sin}


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_pos, rotary_dim] for every position up to max_position_embeddings,
    kept in float32: a token turns by its position alone."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        for name, table in self._tables().items():
            self.register_buffer(name, table, persistent=False)  # float32

    def _tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        return _position_tables(self.config, self.config.max_position_embeddings, device)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) would round the tables; rebuild them in float32 instead.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32 and self.cos.device.type != "meta":
            for name, table in self._tables(self.cos.device).items():
                setattr(self, name, table)
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d] for positions [T], cast to the activations' dtype (as HF does);
        ``meta`` is not read."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class LengthScaledRotaryEmbedding(RotaryEmbedding):
    """Dynamic NTK and LongRoPE (``ModelConfig.length_scaled_rope``): a token turns by
    frequencies that depend on its sequence's length when it is computed. transformers sets
    them per forward from the forward's largest position + 1 (``dynamic_rope_update``), and
    keys already in its cache keep the rotation they got; here the length is per sequence per
    step, the last position + 1 of the sequence's tokens in the step (its ``meta.seq_lens``),
    so a whole prefill, a decode step or a chunk turns as transformers turns that sequence's
    tokens fed alone.

    Within the original context (length <= original_max_position_embeddings) the tokens read
    a table of that many positions (plain RoPE, LongRoPE's short factors). Past it, LongRoPE
    turns by its long factors and dynamic NTK by its base for that length, computed per token
    (cos and sin of T × d angles, shared by every layer). Device tensors in fixed shapes only,
    so a CUDA graph captures it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.original = config.rope_scaling["original_max_position_embeddings"]
        self.scale = rope_parameters(config)[1]  # LongRoPE's attention factor, either side

    def _tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        scaling = self.config.rope_scaling
        tables = _position_tables(self.config, scaling["original_max_position_embeddings"], device)
        if scaling["rope_type"] == "longrope":
            tables["long_inv_freq"] = _longrope(self.config, scaling, "long_factor")[0].to(device)  # [d/2]
        return tables

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d] for positions [T] of the sequences ``meta`` describes (its
        query_start_loc ends at T), cast to the activations' dtype."""
        tokens = torch.arange(positions.shape[0], dtype=meta.query_start_loc.dtype, device=positions.device)
        seq_of_token = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True)  # [T]
        # (A padded graph step's tokens past its last sequence, and a capture's placeholder
        # metadata, would index past the sequences: they take the last one's length.)
        seq_of_token.clamp_(max=meta.seq_lens.shape[0] - 1)
        seq_lens = meta.seq_lens[seq_of_token]  # [T]: the token's sequence's length this step
        if self.config.rope_scaling["rope_type"] == "longrope":
            inv_freq = self.long_inv_freq[None, :]  # [1, d/2]
        else:
            inv_freq = dynamic_ntk_inv_freq(self.config, seq_lens)  # [T, d/2]
        cos, sin = _cos_sin(positions.float()[:, None] * inv_freq, self.scale)  # [T, d] each
        past = (seq_lens > self.original)[:, None]  # [T, 1]
        within = positions.clamp(max=self.original - 1)  # rows of the table (where not past)
        cos = torch.where(past, cos, self.cos[within])
        sin = torch.where(past, sin, self.sin[within])
        return cos.to(dtype), sin.to(dtype)


# --- decoder ------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query attention with a fused qkv projection over the paged KV cache.

    Holds this TP rank's heads (``shard_heads``): ``num_heads`` query heads and
    ``num_kv_heads`` KV heads, all counts local. Global layer ``layer`` may slide a window
    (``ModelConfig.layer_window``) and soft-cap its scores; those options go to
    ``ops.paged_attention`` only when set.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext, layer: int) -> None:
        super().__init__()
        heads = shard_heads(
            config.num_attention_heads,
            config.num_key_value_heads,
            parallel.tp_size,
            parallel.tp_rank,
        )
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = d = config.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.rotary_dim = config.rotary_dim
        self.scale = (config.query_pre_attn_scalar or d) ** -0.5
        options = {"sliding_window": config.layer_window(layer), "softcap": config.attn_logit_softcapping}
        self.attention_options = {k: v for k, v in options.items() if v is not None}
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            d,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            heads=heads,
            bias=config.attention_bias,
            parallel=parallel,
            quantization=config.quantization,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d,
            config.hidden_size,
            bias=config.o_proj_bias,
            parallel=parallel,
            cols=(heads.q_start * d, heads.q_stop * d),
            unit=d,  # deterministic segments hold whole heads
            quantization=config.quantization,
        )
        # HF projection -> (our fused projection, its part: the loader places the rows).
        self.hf_shards = {f"{p}_proj": ("qkv_proj", p) for p in "qkv"}
        # Qwen3, Gemma 3: one RMSNorm weight over head_dim for every query head, one for every
        # key head (the same on every TP rank).
        norm = norm_class(config)
        self.q_norm = norm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        *,
        reduce: bool = True,
    ) -> torch.Tensor:
        """[T, H]: summed over the TP ranks, or with ``reduce=False`` this rank's partial rows."""
        # x: [T, H]; cos, sin: [T, d]; kv_cache: [2, num_blocks, block_size, kvh, d]
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, h, d]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        if self.q_norm is not None:  # per head: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim), None, ops)[0].view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim), None, ops)[0].view(T, self.num_kv_heads, self.head_dim)
        q, k = self._rope(q, k, cos, sin, ops)
        ops.write_kv(k, v, kv_cache, meta.slot_mapping)
        o = ops.paged_attention(q, kv_cache, meta, self.scale, **self.attention_options)  # [T, h, d]
        return self.o_proj(o.reshape(T, self.q_size), reduce=reduce)  # [T, H]

    def _rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on each head's first rotary_dim dimensions (all of them but for Phi-4-mini)."""
        # q: [T, h, d]; k: [T, kvh, d]; cos, sin: [T, rotary_dim]
        r = self.rotary_dim
        if r == self.head_dim:
            return ops.rope(q, k, cos, sin)
        q_rot, k_rot = ops.rope(q[..., :r], k[..., :r], cos, sin)  # (the Triton kernel: in place)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one projection; GeGLU
    (Gemma) with GELU's tanh approximation in place of silu."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.hidden_act = config.hidden_act
        # Both split evenly over TP ranks, so gate and up keep equal local widths and
        # down_proj's columns (the same even split) match them.
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=False, parallel=parallel, quantization=config.quantization
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=False, parallel=parallel, quantization=config.quantization
        )
        self.hf_shards = {  # HF projection -> (our fused projection, its part)
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }

    def forward(self, x: torch.Tensor, ops: KernelOps, *, reduce: bool = True) -> torch.Tensor:
        """[T, H]: summed over the TP ranks, or with ``reduce=False`` this rank's partial rows."""
        # x: [T, H]
        gate_up = self.gate_up_proj(x)  # [T, 2I_local]
        if self.hidden_act == "silu":
            return self.down_proj(ops.silu_mul(gate_up), reduce=reduce)  # [T, H]
        return self.down_proj(gelu_tanh_mul_reference(gate_up), reduce=reduce)  # [T, H]


# An expert's HF projection names (Mixtral's w1/w3/w2, Qwen3-MoE's) -> its part in ``MoE``.
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class MoE(nn.Module):
    """A sparse MLP (Mixtral, Qwen3-MoE): the router ``gate`` scores the experts, each token
    goes to the top k of their softmax (weights renormalized to sum 1 where the model does),
    and ``ops.moe_experts`` runs the chosen SwiGLU experts and sums their weighted outputs.

    Tensor parallelism splits every expert's intermediate features evenly over the TP ranks, as
    vLLM's fused MoE does: a rank holds its rows of each expert's gate and up (``w13``
    [E, 2 I_local, H], gate rows then up rows) and the same columns of each down projection
    (``w2`` [E, H, I_local]), so that its experts' partial sums need one all-reduce, where the
    dense MLP's down_proj reduces. The router is whole on every rank (every rank routes alike).
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        E, H, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        if inter < parallel.tp_size:
            raise ValueError(f"cannot split {inter} expert features over {parallel.tp_size} TP ranks")
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        # transformers' Qwen3-MoE rounds the routing weights to the activations' dtype; its
        # Mixtral weighs in float32.
        self.round_weights = config.architecture == "Qwen3MoeForCausalLM"
        self.parallel, self.hidden_size, self.intermediate_size = parallel, H, inter
        self.cols = split_evenly(inter, parallel.tp_size, parallel.tp_rank)
        local = self.cols[1] - self.cols[0]
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * local, H))
        self.w2 = nn.Parameter(torch.empty(E, H, local))

    def forward(self, x: torch.Tensor, ops: KernelOps, *, reduce: bool = True) -> torch.Tensor:
        """[T, H]: summed over the TP ranks, or with ``reduce=False`` this rank's partial rows."""
        # x: [T, H]
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype)
        out = ops.moe_experts(x, self.w13, self.w2, ids, weights)  # [T, H], this rank's share
        return out if self.parallel.tp_size == 1 or not reduce else tp_all_reduce(out, self.parallel)

    def hf_param(self, parts: list[str]) -> tuple[str, tuple[int, str]] | None:
        """(our parameter, (expert, "gate" | "up" | "down")) for an expert's tensor named
        ``experts.<e>.<projection>.weight`` after the layer's MoE prefix; None for others."""
        if len(parts) != 4 or parts[0] != "experts" or not parts[1].isdigit() or parts[3] != "weight":
            return None
        part = _EXPERT_PARTS.get(parts[2])
        if part is None:
            return None
        return ("w2" if part == "down" else "w13"), (int(parts[1]), part)

    def weight_loader(self, param: torch.Tensor, loaded: Any, part: tuple[int, str]) -> None:
        """One expert's projection into its slot of ``w13`` / ``w2``, reading only this rank's
        rows (gate, up) or columns (down)."""
        expert, proj = part
        if expert >= param.shape[0]:
            raise ValueError(f"expert {expert} of a model with {param.shape[0]} experts")
        start, stop = self.cols
        if proj == "down":
            check_shape(loaded, (self.hidden_size, self.intermediate_size))
            param.data[expert].copy_(read_cols(loaded, start, stop))
            return
        check_shape(loaded, (self.intermediate_size, self.hidden_size))
        offset = 0 if proj == "gate" else stop - start
        param.data[expert, offset : offset + stop - start].copy_(read_rows(loaded, range(start, stop)))


def hf_mlp_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of one layer's MLP (``prefix``: "model.layers.<i>.") with their
    shapes: a dense gate/up/down, or an MoE's router and every expert's projections (Mixtral's
    w1/w3/w2 under ``block_sparse_moe``, Qwen3-MoE's gate/up/down_proj under ``mlp``)."""
    H, inter = config.hidden_size, config.intermediate_size
    dense = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
    if not config.is_moe:
        return {f"{prefix}mlp.{p}.weight": shape for p, shape in dense.items()}
    module, names = "mlp", {p: p for p in dense}
    if config.architecture == "MixtralForCausalLM":
        module, names = "block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    shapes = {f"{prefix}{module}.gate.weight": (config.num_local_experts, H)}
    for e in range(config.num_local_experts):
        shapes |= {f"{prefix}{module}.experts.{e}.{names[p]}.weight": shape for p, shape in dense.items()}
    return shapes


class DecoderLayer(nn.Module):
    """Global layer ``layer``. Gemma's post_attention_layernorm norms the attention's output
    before the residual add, and the MLP has a norm of its own before and after.

    With TP, a Llama-style layer can leave its two sums (after o_proj and after down_proj) to
    the norm that follows each (``defer``): one kernel then sums the partial rows, adds the
    residual and norms (``tp_sum_add_rms_norm``). ``can_defer``: this layer's sums all feed a
    norm with the residual (not Gemma's post-norms, not a biased o_proj's sum)."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, layer: int) -> None:
        super().__init__()
        norm, H, eps = norm_class(config), config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(H, eps)
        self.self_attn = Attention(config, parallel, layer)
        self.post_attention_layernorm = norm(H, eps)
        self.mlp = MoE(config, parallel) if config.is_moe else MLP(config, parallel)
        self.pre_feedforward_layernorm = norm(H, eps) if config.is_gemma else None
        self.post_feedforward_layernorm = norm(H, eps) if config.is_gemma else None
        # Gemma 3's sliding-window layers turn RoPE on their own base.
        self.local_rope = config.local_rope_theta is not None and config.layer_window(layer) is not None
        self.parallel = parallel
        self.can_defer = not config.is_gemma and not config.o_proj_bias

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        *,
        summed: bool = True,
        defer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block; the residual stream is ``x + residual`` on entry and exit (residual
        None: x alone), where ``x`` is the TP ranks' sum: summed already (``summed``), or this
        rank's partial rows. ``defer`` (``can_defer`` layers): the returned ``x`` is partial."""
        x, residual = self._norm(self.input_layernorm, x, residual, ops, summed)
        x = self.self_attn(x, cos, sin, kv_cache, meta, ops, reduce=not defer)
        if self.pre_feedforward_layernorm is None:
            x, residual = self._norm(self.post_attention_layernorm, x, residual, ops, not defer)
            return self.mlp(x, ops, reduce=not defer), residual
        x, _ = self.post_attention_layernorm(x, None, ops)
        x, residual = self.pre_feedforward_layernorm(x, residual, ops)
        x, _ = self.post_feedforward_layernorm(self.mlp(x, ops), None, ops)
        return x, residual

    def _norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
              ops: KernelOps, summed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if summed:
            return norm(x, residual, ops)
        assert isinstance(norm, RMSNorm), "only Llama-style norms take a deferred sum (can_defer)"
        return tp_sum_add_rms_norm(x, residual, norm.weight, norm.eps, self.parallel, ops.add_rms_norm)


class LlamaForCausalLM(nn.Module):
    """Decoder layers [start_layer, end_layer) of a Llama-family model (one pipeline stage).

    Holds ``embed_tokens`` only when start_layer == 0 and ``norm`` + ``lm_head`` only when
    end_layer == num_hidden_layers; ``layers[j]`` is global layer ``start_layer + j``.
    ``parallel`` (default: one process) gives the TP rank whose shard of every layer this
    module holds; ``num_local_kv_heads`` is the KV heads per layer on this rank, the head count
    of its KV cache. ``ops`` (``pipeserve.kernels``; default the torch references, replaced
    with ``set_ops``) runs the norm, RoPE, SiLU·mul, KV write, attention and routed experts.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        start_layer: int = 0,
        end_layer: int | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        num_layers = config.num_hidden_layers
        end_layer = num_layers if end_layer is None else end_layer
        if not 0 <= start_layer <= end_layer <= num_layers:
            raise ValueError(
                f"need 0 <= start_layer <= end_layer <= {num_layers}, "
                f"got [{start_layer}, {end_layer})"
            )
        parallel = ParallelContext.single() if parallel is None else parallel
        self.config, self.parallel = config, parallel
        self.ops = torch_ops()
        self.start_layer, self.end_layer = start_layer, end_layer
        self.num_local_kv_heads = shard_heads(
            config.num_attention_heads,
            config.num_key_value_heads,
            parallel.tp_size,
            parallel.tp_rank,
        ).num_kv_heads
        self.embed_tokens = None
        if start_layer == 0:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel=parallel
            )
        self.rotary_emb = (LengthScaledRotaryEmbedding if config.length_scaled_rope else RotaryEmbedding)(config)
        self.local_rotary_emb = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            self.local_rotary_emb = RotaryEmbedding(local)
        # Gemma scales the embedding by sqrt(hidden), rounded to the activations' dtype as HF does.
        self.embed_scale = config.hidden_size**0.5 if config.is_gemma else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, parallel, layer) for layer in range(start_layer, end_layer)
        )
        self.num_layers = end_layer - start_layer  # one KV cache each
        self.layers_can_defer = all(layer.can_defer for layer in self.layers)  # (``_defers_sums``)
        self.norm = self.lm_head = None
        if end_layer == num_layers:
            self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel=parallel)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage on T packed tokens; returns [T, H].

        input_ids [T] on the first stage, else hidden_states [T, H] (the previous stage's
        output); positions [T]; kv_caches: one per layer held. The output is final-normed on
        the last stage, else the residual stream for the next stage.
        """
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            x = self.embed_tokens(input_ids)  # [T, H]
            if self.embed_scale is not None:
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:
            if hidden_states is None:
                raise ValueError("a stage after the first needs hidden_states")
            x = hidden_states  # [T, H]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        rope = self.rotary_emb(positions, x.dtype, meta)  # cos, sin: [T, d] each
        local_rope = rope if self.local_rotary_emb is None else self.local_rotary_emb(positions, x.dtype, meta)
        residual = None
        defer, summed = self._defers_sums(), True
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = local_rope if layer.local_rope else rope
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, self.ops, summed=summed, defer=defer)
            summed = not defer
        if self.norm is not None and summed:
            x, _ = self.norm(x, residual, self.ops)
        elif self.norm is not None:
            x, _ = tp_sum_add_rms_norm(x, residual, self.norm.weight, self.norm.eps, self.parallel,
                                       self.ops.add_rms_norm)
        elif residual is not None:
            x = (x if summed else tp_all_reduce(x, self.parallel)) + residual
        return x

    def _defers_sums(self) -> bool:
        """Whether the layers leave their sums to the next norm (``DecoderLayer``): with TP, but
        for the deterministic numerics, whose sums stay inside the layers. Where the TP group's
        symmetric sums cannot fuse the norm, the norm sums first: the same operations as a
        layer's own sum."""
        return self.parallel.tp_size > 1 and self.ops.matmul is None and self.layers_can_defer

    def set_ops(self, ops: KernelOps, *, reduction_splits: int = 1) -> None:
        """Run the hot operations through ``ops`` (torch references or Triton kernels).

        Batch-invariant ops (``kernel_ops(..., batch_invariant=True)``) also make the linear
        layers deterministic: their matmul everywhere, row-parallel inputs reduced over
        ``reduction_splits`` float32 segments (``InvariantNumerics``)."""
        if ops.matmul is not None and self.config.is_gemma:
            raise ValueError(
                "deterministic mode does not cover Gemma yet: its (1 + w) norms run as plain "
                "torch, whose reductions may round differently with the batch's size"
            )
        if ops.matmul is not None and self.config.is_moe:
            raise ValueError(
                "deterministic mode does not cover mixture-of-experts models yet: the grouped "
                "expert kernel's tiles follow the batch's size"
            )
        if self.config.quantization is not None:
            self._check_fp8_ops(ops)
        self.ops = ops
        numerics = None
        if ops.matmul is not None:
            numerics = InvariantNumerics(matmul=ops.matmul, reduction_splits=reduction_splits)
        for module in self.modules():
            if hasattr(module, "set_numerics"):
                module.set_numerics(numerics)
            if getattr(module, "weight_scale", None) is not None:
                module.fp8_linear = ops.fp8_linear

    def _check_fp8_ops(self, ops: KernelOps) -> None:
        if ops.matmul is not None:
            raise ValueError("deterministic mode does not cover FP8 weights: their GEMM's tiles follow the batch's size")
        device = next(self.parameters()).device
        if ops.name.startswith("triton") and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"FP8 weights need FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); {name} has none")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final-normed hidden states -> [N, V] float32 logits over the full vocabulary,
        on every TP rank (last stage only; with TP > 1 a collective that every TP rank joins),
        soft-capped where the model caps them (Gemma 2)."""
        assert self.lm_head is not None, "compute_logits needs the last stage"
        return self._soft_cap(self.lm_head(hidden))

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N] int64: ``compute_logits(hidden).argmax(-1)``, exactly, on every TP rank, without
        gathering the logits: each rank takes the first maximum of its vocab shard and the ranks
        exchange one (value, token) pair a row (``tp_argmax``). A collective that every TP rank
        joins, as ``compute_logits``'s."""
        # hidden: [N, H]
        local = self._shard_logits(hidden)  # [N, V_local]
        index = local.argmax(dim=-1, keepdim=True)  # [N, 1]: argmax on the model's dtype is exact
        values = local.gather(-1, index).squeeze(-1)  # [N]
        return tp_argmax(values, index.squeeze(-1) + self.lm_head.vocab_start, self.parallel)

    def race_token_ids(self, hidden: torch.Tensor, inv_temperature: torch.Tensor,
                       seeds: torch.Tensor) -> torch.Tensor:
        """[N] int64: each row's token drawn from softmax(logits / T) by the ops' race
        (``kernels/race.py``: ``inv_temperature`` [N] float32 1 / T, 0 for a greedy row; ``seeds``
        [N] int64 its noise), on every TP rank, without gathering the logits: each rank races its
        vocab shard and the ranks exchange their winners (``tp_argmax``). A collective that every
        TP rank joins, as ``compute_logits``'s."""
        # hidden: [N, H]
        values, index = self.ops.race_max(self._shard_logits(hidden), inv_temperature, seeds,
                                          self.lm_head.vocab_start)
        return tp_argmax(values, index, self.parallel)

    def _shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This TP rank's columns of ``compute_logits``' values: the model's dtype, float32 where
        they are soft-capped."""
        # hidden: [N, H] -> [N, V_local]
        assert self.lm_head is not None, "sampling needs the last stage"
        local = self.lm_head.shard_logits(hidden)
        return local if self.config.final_logit_softcapping is None else self._soft_cap(local.float())

    def _soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # --- weights --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named tensors in (converting dtype/device), skipping what this stage does
        not hold. The LM head falls back to the embedding when tied or absent. Raises
        ValueError listing missing, unexpected or misshapen parameters.

        A weight may be a full tensor or a lazy slice (safetensors ``get_slice``,
        ``GGUFTensorSlice``): each layer's ``weight_loader`` reads only this TP rank's rows or
        columns of it, and tensors this stage does not hold are never read.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        errors: list[str] = []
        with torch.no_grad():
            for hf_name, tensor in self._split_fused(weights):
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue
                if self.config.fp8_checkpoint and hf_name.endswith(_FP8_UNUSED):
                    continue
                # A real lm_head.weight wins over the embedding, whichever comes first.
                if (
                    hf_name == "model.embed_tokens.weight"
                    and self._head_reads_embedding()
                    and "lm_head.weight" not in loaded
                ):
                    self._load_param(self._target("lm_head.weight")[0], None, tensor, hf_name, errors)
                    loaded.add("lm_head.weight")
                target = self._target(hf_name)
                if target is None:
                    continue
                name, part = target
                if name not in params:
                    errors.append(f"unexpected parameter {hf_name}")
                    continue
                self._load_param(name, part, tensor, hf_name, errors)
                loaded.add(hf_name)
        missing = sorted(self.expected_weight_names() - loaded)
        if missing:
            errors.append(f"missing parameters: {', '.join(missing)}")
        if errors:
            raise ValueError("load_weights failed:\n  " + "\n  ".join(errors))

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` tensors as the separate HF tensors
        they stack (lazy row ranges: a TP rank still reads only its rows of each part)."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        parts = {
            "self_attn.qkv_proj": (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
            "mlp.gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)),
        }
        for hf_name, tensor in weights:
            module, _, leaf = hf_name.rpartition(".")
            fused = next((f for f in parts if module.endswith("." + f)), None)
            if fused is None or not hf_name.startswith("model.layers."):
                yield hf_name, tensor
                continue
            prefix = module.removesuffix(fused.rpartition(".")[2])
            if math.prod(checkpoint_shape(tensor)) == 1:  # an FP8 scale of the whole fused tensor
                for name, _, _ in parts[fused]:
                    yield f"{prefix}{name}.{leaf}", tensor
                continue
            rows = checkpoint_shape(tensor)[0]
            if rows != parts[fused][-1][2]:
                raise ValueError(f"{hf_name} has {rows} rows, not {parts[fused][-1][2]}")
            for name, start, stop in parts[fused]:
                yield f"{prefix}{name}.{leaf}", RowRange(tensor, start, stop)

    def expected_weight_names(self) -> set[str]:
        """HF names this module needs (a separate ``lm_head.weight`` may come from the
        embedding; a shared one is the embedding)."""
        names = set()
        if self.embed_tokens is not None:
            names.add("model.embed_tokens.weight")
        if self.lm_head is not None:
            names.add("model.norm.weight")
            if self.embed_tokens is None or self.lm_head.weight is not self.embed_tokens.weight:
                names.add("lm_head.weight")
        for i in range(self.start_layer, self.end_layer):
            prefix = f"model.layers.{i}."
            names |= {
                prefix + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
            }
            names |= {f"{prefix}self_attn.{p}_proj.weight" for p in "qkvo"}
            names |= set(hf_mlp_shapes(self.config, prefix))
            if self.config.qk_norm:
                names |= {f"{prefix}self_attn.{p}_norm.weight" for p in "qk"}
            if self.config.is_gemma:
                names |= {f"{prefix}{p}_feedforward_layernorm.weight" for p in ("pre", "post")}
            if self.config.attention_bias:
                names |= {f"{prefix}self_attn.{p}_proj.bias" for p in "qkv"}
            if self.config.o_proj_bias:
                names.add(f"{prefix}self_attn.o_proj.bias")
            if self.config.fp8_checkpoint:  # every quantized projection's scale
                names |= {f"{prefix}self_attn.{p}_proj.weight_scale" for p in "qkvo"}
                names |= {n + "_scale" for n in hf_mlp_shapes(self.config, prefix) if n.endswith(".weight")}
        return names

    def _head_reads_embedding(self) -> bool:
        """The embedding is copied into a separate lm_head (tied across stages, or a
        checkpoint without lm_head.weight: a later lm_head.weight overwrites it)."""
        if self.lm_head is None:
            return False
        return self.embed_tokens is None or self.lm_head.weight is not self.embed_tokens.weight

    def _target(self, hf_name: str) -> tuple[str, Any] | None:
        """(our parameter name, its part of a fused projection or None) for an HF name; None
        when this stage does not hold it. Unknown names map to a name absent from the module."""
        if hf_name == "lm_head.weight" or hf_name.startswith("model.norm."):
            return None if self.lm_head is None else (hf_name.removeprefix("model."), None)
        if hf_name.startswith("model.embed_tokens."):
            return None if self.embed_tokens is None else (hf_name.removeprefix("model."), None)
        parts = hf_name.split(".")
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return hf_name, None
        layer = int(parts[2])
        if not self.start_layer <= layer < self.end_layer:
            return None
        prefix = f"layers.{layer - self.start_layer}"
        attr = "mlp" if parts[3] == "block_sparse_moe" else parts[3]  # Mixtral's name for its MoE
        # e.g. model.layers.3.self_attn.q_proj.bias -> layers.1.self_attn.qkv_proj.bias, "q"
        module = getattr(self.layers[layer - self.start_layer], attr, None)
        shards = getattr(module, "hf_shards", {})
        if len(parts) == 6 and parts[4] in shards:
            fused, part = shards[parts[4]]
            return f"{prefix}.{attr}.{fused}.{parts[5]}", part
        # e.g. model.layers.3.block_sparse_moe.experts.5.w1.weight -> layers.1.mlp.w13, (5, "gate")
        expert = module.hf_param(parts[4:]) if isinstance(module, MoE) else None
        if expert is not None:
            return f"{prefix}.{attr}.{expert[0]}", expert[1]
        return f"{prefix}.{'.'.join([attr, *parts[4:]])}", None

    def _load_param(
        self, name: str, part: Any, tensor: Any, hf_name: str, errors: list[str]
    ) -> None:
        """Load through the owning layer's ``weight_loader`` (TP layers slice their rank's
        share), else whole; a shape mismatch becomes an error line."""
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        param = getattr(module, attr)
        loader = getattr(module, "weight_loader", None)
        if is_fp8(tensor) and param.dtype != FP8_DTYPE:
            errors.append(f"{hf_name} is stored in FP8, but this model holds {name} in {param.dtype}")
            return
        try:
            if loader is not None:
                loader(param, tensor, part)
            else:
                default_weight_loader(param, tensor)
        except ValueError as e:
            errors.append(f"{hf_name}: {e}")
