"""The plain-torch references of the kernels: what CPU runs use, and what the Triton kernels are
tested against. No Triton here (CPU installs need not have it).

Norm, RoPE and SiLU·mul follow HF Llama's rounding order exactly (the transformers parity tests
run through them). Below them: paged attention over a packed mixed batch.

A batch packs T new tokens from S sequences (see ``AttentionMetadata``). Sequence i's
``q_len`` queries are the LAST q_len positions of its ``seq_len``-long context: query j sits at
absolute position ``seq_len - q_len + j`` and attends to every position <= that (its cached
prefix plus the causal part of its own chunk). Heads are grouped (GQA): query head h reads
KV head ``h // (num_heads // num_kv_heads)``, as in HF's ``repeat_kv``. Two options of a layer
(Gemma's): ``sliding_window`` W hides keys older than the window (query at position p sees
``p - W < k <= p``), and ``softcap`` c maps each scaled score s to ``c * tanh(s / c)`` before the
softmax.

``pipeserve.kernels.paged_attention`` is the Triton kernel with the same signature. Here,
decodes (q_len == 1) run together as one padded, masked batch; prefill chunks run one sequence
at a time through SDPA.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeserve.kernels.attention_metadata import AttentionMetadata


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): RMSNorm in float32, cast back before the weight
    multiply (as HF Llama does)."""
    # x, residual: [T, H]; weight: [H]
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / rotate-half RoPE, as HF Llama (dimension i pairs with i + head_dim / 2)."""
    # x: [T, nh, d]; cos, sin: [T, d]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on queries [T, h, d] and keys [T, kvh, d] with cos, sin [T, d]."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def push_sum_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """``kernels/push_sum``: every rank's rows (in rank order) summed in float32, rounded once."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(parts[0].dtype)


def matmul_reference(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ w.T`` in float64, rounded once to ``out_dtype`` (default x's dtype): what
    ``pipeserve.kernels.matmul`` approximates with float32 accumulation."""
    # x: [M, K]; w: [N, K] -> [M, N]
    return (x.double() @ w.double().T).to(out_dtype or x.dtype)


def fp8_linear_reference(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (w · w_scale[:, None]).T + bias`` with the FP8 weight w [N, K] dequantized to x's
    dtype (per output row scale w_scale [N] float32) and x [M, K] left as it is: the FP8
    layers' path on the CPU, exact against a float model holding the dequantized weights."""
    return F.linear(x, (w.float() * w_scale[:, None]).to(x.dtype), bias)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with GELU's tanh approximation (Gemma's GeGLU): [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh") * up


def moe_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts: token t's output is sum_j weights[t, j] * expert_{ids[t, j]}(x[t]),
    expert e being w2[e] (silu(gate) * up) with [gate | up] = w13[e] x. Grouped: the (token,
    slot) pairs are sorted by expert and each expert runs its two matmuls once over its tokens,
    in x's dtype as transformers does; the weighted results are summed in float32 and rounded
    once. ``pipeserve.kernels.moe.moe_experts`` is the Triton kernel with this signature."""
    # x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_ids: [T, k] int; topk_weights: [T, k] float
    T, k = topk_ids.shape
    flat_ids = topk_ids.flatten()  # [T * k]
    order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = topk_weights.flatten().float()  # [T * k]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]  # [n]
        start += count
        tokens = pairs // k  # [n]
        h = silu_mul_reference(F.linear(x[tokens], w13[expert]))  # [n, I]
        y = F.linear(h, w2[expert])  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(x.dtype)


# cuDNN's SDPA builds an execution plan for every new shape, and every prefill chunk has a new
# shape: on an H200 that cost ~1.3 ms of host time per call (measured with torch.profiler). The
# flash / memory-efficient kernels have no per-shape plan.
_GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V at their cache slots (slot = block_id * block_size + offset)."""
    # k, v: [T, kvh, d]; kv_cache: [2, num_blocks, block_size, kvh, d]; slot_mapping: [T]
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    kv_flat = kv_cache.view(2, num_blocks * block_size, kvh, d)  # [2, num_slots, kvh, d]
    kv_flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context; returns [T, h, d].

    The new tokens' K/V must already be in ``kv_cache`` (``write_kv`` first).
    """
    # q: [T, h, d]; kv_cache: [2, num_blocks, block_size, kvh, d]
    assert q.shape[1] % kv_cache.shape[3] == 0, "num_heads must be a multiple of num_kv_heads"
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
    out = torch.empty_like(q)
    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    backends = sdpa_kernel(_GPU_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        if decodes:
            _decode_batch(q, kv_cache, meta, decodes, scale, out, sliding_window, softcap)
        for i, q_len in enumerate(q_lens):
            if q_len > 1:
                start, end = starts[i], starts[i + 1]
                out[start:end] = _prefill_one(
                    q[start:end], kv_cache, meta.block_tables[i], seq_lens[i], meta.block_size, scale,
                    sliding_window, softcap,
                )  # fmt: skip
    return out


def _decode_batch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    decodes: list[int],
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """All single-token sequences at once: gather their blocks, pad to the longest, mask."""
    first, n = decodes[0], len(decodes)
    if decodes == list(range(first, first + n)):
        # The common case (schedulers put decodes together): slices, no host-to-device copy.
        token_idx = slice(meta.query_start_loc_cpu[first], meta.query_start_loc_cpu[first] + n)
        seq_idx = slice(first, first + n)
    else:
        token_idx = torch.tensor([meta.query_start_loc_cpu[i] for i in decodes], device=q.device)
        seq_idx = torch.tensor(decodes, device=q.device)
    max_seq_len = max(meta.seq_lens_cpu[i] for i in decodes)
    out[token_idx] = _decode_attention(
        q[token_idx],
        kv_cache,
        meta.block_tables[seq_idx],
        meta.seq_lens[seq_idx],
        max_seq_len,
        scale,
        sliding_window,
        softcap,
    )


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    # q: [S, h, d]; block_tables: [S, max_blocks]; seq_lens: [S]
    S, h, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    num_blocks = -(-max_seq_len // block_size)
    L = num_blocks * block_size
    blocks = block_tables[:, :num_blocks].long()  # [S, num_blocks]
    k = kv_cache[0][blocks].view(S, L, kvh, d)  # [S, L, kvh, d]
    v = kv_cache[1][blocks].view(S, L, kvh, d)  # [S, L, kvh, d]
    # Fold each KV head's group of g query heads into g query rows: no K/V repeat for GQA.
    # SDPA keeps scores and softmax in float32 for half-precision inputs.
    qg = q.reshape(S, kvh, h // kvh, d)  # [S, kvh, g, d]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [S, kvh, L, d] each
    positions = torch.arange(L, device=q.device)  # [L]
    valid = positions[None, :] < seq_lens[:, None]  # [S, L], False past each context
    if sliding_window is not None:  # the query sits at seq_len - 1
        valid &= positions[None, :] >= seq_lens[:, None] - sliding_window
    o = _attention(qg, k, v, valid[:, None, None, :], scale, softcap)
    return o.reshape(S, h, d)  # [S, kvh, g, d] -> [S, h, d]


def _prefill_one(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One sequence's chunk of q_len > 1 queries over its seq_len-long context."""
    # q: [q_len, h, d]; block_table: [max_blocks]
    q_len, h, d = q.shape
    kvh = kv_cache.shape[3]
    blocks = block_table[: -(-seq_len // block_size)].long()  # [num_blocks]
    k = kv_cache[0][blocks].view(-1, kvh, d)[:seq_len]  # [seq_len, kvh, d]
    v = kv_cache[1][blocks].view(-1, kvh, d)[:seq_len]  # [seq_len, kvh, d]
    k = k.transpose(0, 1).unsqueeze(0)  # [1, kvh, seq_len, d]
    v = v.transpose(0, 1).unsqueeze(0)  # [1, kvh, seq_len, d]
    windowed = sliding_window is not None and sliding_window < seq_len
    if q_len == seq_len and not windowed and softcap is None:  # plain causal: any SDPA backend
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, h, q_len, d]
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # [q_len, h, d]
    # A chunk over a cached prefix (SDPA's is_causal aligns top-left, we need bottom-right), a
    # window or a cap: pass the mask. Fold each KV head's query group into the rows (no K/V
    # repeat needed).
    g = h // kvh
    qf = q.reshape(q_len, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * q_len, d)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
    k_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
    mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
    if windowed:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    o = _attention(qf, k, v, mask.repeat(g, 1), scale, softcap)  # mask: [g * q_len, seq_len]
    # o: [1, kvh, g * q_len, d]
    return o.view(kvh, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, h, d)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """softmax(scale * q k^T, masked) v; with a softcap, as HF's eager Gemma 2: the capped
    scores and the float32 softmax spelled out (SDPA has no cap)."""
    # q: [..., M, d]; k, v: [..., L, d]; mask: broadcastable to [..., M, L], True = visible
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., M, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Naive float64 per-sequence loop, slot by slot; for tests only. Returns [T, h, d] float64."""
    # q: [T, h, d]; kv_cache: [2, num_blocks, block_size, kvh, d]
    T, h, d = q.shape
    kvh, bs = kv_cache.shape[3], meta.block_size
    k_slots = kv_cache[0].reshape(-1, kvh, d).double().cpu()  # [num_slots, kvh, d]
    v_slots = kv_cache[1].reshape(-1, kvh, d).double().cpu()
    block_tables = meta.block_tables.cpu().long()
    out = torch.zeros(T, h, d, dtype=torch.float64)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], end - start
        pos = torch.arange(seq_len)
        slots = block_tables[i][pos // bs] * bs + pos % bs  # [seq_len]
        k = k_slots[slots].repeat_interleave(h // kvh, dim=1)  # [seq_len, h, d]
        v = v_slots[slots].repeat_interleave(h // kvh, dim=1)  # [seq_len, h, d]
        qi = q[start:end].double().cpu()  # [q_len, h, d]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [h, q_len, seq_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)
        hidden = pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


# --- the race of temperature sampling (kernels/race.py) -------------------------------------------

_PHILOX_KEYS = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUNDS = (0xD2511F53, 0xCD9E8D57)
_MASK32 = 0xFFFFFFFF


def philox_uniform(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Triton's ``tl.rand(seed, offsets)`` for int32 offsets, bit for bit: Philox-4x32 with 10
    rounds keyed by the 64-bit seed, counter (offset, 0, 0, 0), its first word as a float32 in
    [0, 1)."""
    c0 = offsets.astype(np.int64).astype(np.uint64) & np.uint64(_MASK32)
    c1 = c2 = c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & _MASK32), np.uint64((seed >> 32) & _MASK32)
    a, b = (np.uint64(r) for r in _PHILOX_ROUNDS)
    mask, shift = np.uint64(_MASK32), np.uint64(32)
    for _ in range(10):
        p_a, p_b = a * c0, b * c2  # < 2**64: exact in uint64
        c0, c1, c2, c3 = ((p_b >> shift) ^ c1 ^ k0) & mask, p_b & mask, ((p_a >> shift) ^ c3 ^ k1) & mask, p_a & mask
        k0, k1 = (k0 + np.uint64(_PHILOX_KEYS[0])) & mask, (k1 + np.uint64(_PHILOX_KEYS[1])) & mask
    x = c0.astype(np.uint32).view(np.int32).astype(np.int64)
    x = np.where(x < 0, -x - 1, x).astype(np.int32)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def race_max_reference(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                       vocab_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.race.race_max`` in NumPy (for tests: a Philox in NumPy is slow): each row's
    first maximum of ``logit * inv_temperature - log(-log u)`` (raw logits where
    ``inv_temperature`` is 0), u = ``philox_uniform(seed, global token id)``; NaN never wins."""
    # logits: [N, V]
    x = logits.detach().float().cpu().numpy()
    inv_t, row_seeds = inv_temperature.cpu().numpy(), seeds.cpu().tolist()
    ids = np.arange(x.shape[1], dtype=np.int64) + vocab_start
    values, index = [], []
    for row, t, seed in zip(x, inv_t, row_seeds):
        if t > 0:
            with np.errstate(divide="ignore"):
                row = row * np.float32(t) - np.log(-np.log(philox_uniform(seed, ids)))
        row = np.where(np.isnan(row), -np.inf, row)
        best = int(np.argmax(row))
        values.append(row[best])
        index.append(best + vocab_start)
    device = logits.device
    return torch.tensor(values, dtype=torch.float32, device=device), torch.tensor(index, dtype=torch.int64, device=device)
