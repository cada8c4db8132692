"""The paged KV cache: one tensor per decoder layer a stage holds.

Layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at index 0, V at
1). Flat slot ``s = block_id * block_size + offset`` addresses one token's K (or V) row in
``kv_cache[i].view(-1, num_kv_heads, head_dim)``. Every stage allocates the same number of
blocks, so the engine's block ids are valid on all of them.
"""

from __future__ import annotations

import torch

from pipeserve.runtime.model.model_config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer. ``num_kv_heads`` overrides the config's count:
    a tensor-parallel rank passes ``model.num_local_kv_heads`` (its share of the KV heads,
    which can differ between the ranks of a stage when KV heads are replicated; the number of
    blocks must still be the same on every rank).

    Zeroed, not empty: attention gathers whole blocks and masks the unused tail, and a masked
    NaN would still poison ``probs @ V`` (0 * NaN = NaN). Recycled blocks hold finite values.
    """
    if num_layers < 0 or num_blocks <= 0 or block_size <= 0:
        raise ValueError(
            f"need num_layers >= 0, num_blocks > 0, block_size > 0; "
            f"got {num_layers}, {num_blocks}, {block_size}"
        )
    kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    shape = (2, num_blocks, block_size, kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_cache_bytes_per_block(
    config: ModelConfig,
    num_layers: int,
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int | None = None,
) -> int:
    """Bytes one block costs across ``num_layers`` attention layers (K and V), to size the pool."""
    kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * kv_heads * config.head_dim * element_size
