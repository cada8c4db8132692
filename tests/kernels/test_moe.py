"""moe_experts (Triton grouped GEMMs) against the torch reference ``moe_experts_reference``, and
the reference against a per-token loop over each token's experts.

Routings with idle experts, one expert taking every token, decode-sized and prefill-sized
batches (both block heights), widths that are not multiples of the kernel's tiles. Interpreter
on CPU in float32 (the interpreter's bfloat16 is not the GPU's); GPU in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from helpers_kernels import DEVICE, fresh_seed, gpu, interpreter_array_warning, runs_triton  # noqa: E402

from pipeserve.kernels.moe import align_by_expert, moe_experts  # noqa: E402
from pipeserve.kernels.reference import moe_experts_reference  # noqa: E402


def _inputs(T, H, I, E, k, seed, *, dtype=torch.float32, device="cpu", skew=False):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], the top-k of random router probabilities
    (``skew``: expert 0 first for every token) with weights renormalized as Mixtral's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, I, generator=gen) * I**-0.5
    probs = torch.rand(T, E, generator=gen)
    if skew:
        probs[:, 0] += 1.0
    weights, ids = probs.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    cast = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
    return cast(x), cast(w13), cast(w2), ids.to(device), weights.to(device)


def _per_token(x, w13, w2, ids, weights):
    """Each token through each of its experts, one at a time (independent of the grouping)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True):
            gate, up = F.linear(x[t].double(), w13[e].double()).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, w2[e].double())
    return out


def test_reference_matches_per_token_loop():
    x, w13, w2, ids, weights = _inputs(T=19, H=24, I=40, E=6, k=2, seed=0)
    torch.testing.assert_close(moe_experts_reference(x, w13, w2, ids, weights).double(),
                               _per_token(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_by_expert_groups_every_pair_once(block_m):
    _, _, _, ids, _ = _inputs(T=37, H=8, I=8, E=8, k=2, seed=1)
    sorted_ids, block_experts = align_by_expert(ids, 8, block_m)
    num_pairs = ids.numel()
    assert sorted(p for p in sorted_ids.tolist() if p < num_pairs) == list(range(num_pairs))
    for b, expert in enumerate(block_experts.tolist()):
        pairs = [p for p in sorted_ids[b * block_m : (b + 1) * block_m].tolist() if p < num_pairs]
        if expert < 0:
            assert not pairs
        assert all(ids.flatten()[p] == expert for p in pairs), (b, expert, pairs)


@runs_triton
@interpreter_array_warning
@pytest.mark.parametrize(
    "T, H, I, E, k, skew",
    [
        (1, 64, 64, 4, 2, False),  # one decode token: two experts, the rest idle
        (5, 48, 40, 8, 2, False),  # widths off the 64-wide tiles
        (70, 64, 96, 4, 2, True),  # prefill-sized: 64-row blocks, expert 0 takes every token
        (33, 32, 32, 16, 4, False),  # k = 4, many idle blocks past the last run
    ],
)
def test_triton_matches_reference_float32(T, H, I, E, k, skew):
    seed = fresh_seed()
    args = _inputs(T, H, I, E, k, seed, device=DEVICE, skew=skew)
    got, want = moe_experts(*args), moe_experts_reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 200])
def test_triton_matches_reference_bfloat16(T):
    seed = fresh_seed()
    args = _inputs(T, 256, 384, 8, 2, seed, dtype=torch.bfloat16, device="cuda")
    got, want = moe_experts(*args), moe_experts_reference(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=f"seed {seed}")
