"""rope (Triton, in place) against the torch reference ``rope_reference``.

cos/sin come from the model's own tables (``RotaryEmbedding``: plain RoPE and Llama-3
scaling) at random positions up to several thousand, cast to the activation dtype as the
model does. q and k are strided views: out of a fused qkv projection (as the model passes
them), out of padded rows, and head-major. The whole backing tensor is checked after the
call, so a write outside q/k (into v or padding) shows. Fresh random inputs every run (the
seed is in every failure message). Interpreter on CPU (float32, float16); GPU in bfloat16.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from helpers_kernels import DEVICE, fresh_seed, gpu, runs_triton  # noqa: E402

from pipeserve.kernels.rope import rope  # noqa: E402
from pipeserve.kernels.reference import rope_reference, rotate_half  # noqa: E402
from pipeserve.runtime.model.llama import RotaryEmbedding  # noqa: E402
from pipeserve.runtime.model.model_config import ModelConfig  # noqa: E402

pytestmark = runs_triton

MAX_POSITIONS = 8192
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_TABLES: dict = {}


def _tables(head_dim: int, scaled: bool) -> RotaryEmbedding:
    """The model's RoPE tables (float32, [MAX_POSITIONS, head_dim]), built once per kind."""
    key = (head_dim, scaled)
    if key not in _TABLES:
        config = ModelConfig.from_hf_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 256,
                "hidden_size": 4 * head_dim,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "head_dim": head_dim,
                "max_position_embeddings": MAX_POSITIONS,
                "rope_theta": 500000.0 if scaled else 10000.0,
                "rope_scaling": LLAMA3_SCALING if scaled else None,
            }
        )
        _TABLES[key] = RotaryEmbedding(config)
    return _TABLES[key]


def _cos_sin(T, head_dim, scaled, dtype, gen, device):
    """cos, sin [T, d] in ``dtype`` at random positions (some past the original context)."""
    positions = torch.randint(0, MAX_POSITIONS, (T,), generator=gen)
    positions[0] = 0  # the identity rotation
    cos, sin = _tables(head_dim, scaled)(positions, dtype, None)  # (tables: no metadata read)
    return cos.to(device), sin.to(device)


def _backing(layout, T, h, kvh, d, dtype, gen, device):
    """A random tensor holding q and k (and more) in the given memory layout."""
    shape = {
        "fused_qkv": (T, (h + 2 * kvh) * d),  # as the model: [q | k | v] rows
        "padded_rows": (T, (h + kvh) * d + 3),  # rows carry 3 spare elements
        "head_major": (h + kvh, T, d),  # q/k transposed: stride(0) = d, stride(1) = T d
    }[layout]
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _qk_views(layout, buf, T, h, kvh, d):
    """q [T, h, d] and k [T, kvh, d] as strided views of a layout's backing tensor."""
    if layout == "head_major":
        return buf[:h].transpose(0, 1), buf[h:].transpose(0, 1)
    return buf[:, : h * d].view(T, h, d), buf[:, h * d : (h + kvh) * d].view(T, kvh, d)


def _check(got, want, x, cos, sin, seed):
    """``got`` against the torch reference ``want`` (same dtype) and an exact float32 one.

    Half precision: the result must lie within the rounding error of the computation, i.e. a
    couple of units in the last place of the products x·cos and x·sin (with cancellation the
    result itself can be much smaller than they are). Exact bit equality with the eager torch
    reference is not required: GPUs may round a product at a different point.
    """
    msg = f"seed {seed}"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=msg)
        return
    xf, cf, sf = x.float(), cos.float()[:, None, :], sin.float()[:, None, :]
    exact = xf * cf + rotate_half(xf) * sf  # [T, nh, d], float32
    scale = (xf * cf).abs() + (rotate_half(xf) * sf).abs()
    ulp = torch.finfo(got.dtype).eps
    for name, ref, ulps in (("float32 reference", exact, 2), ("torch reference", want.float(), 3)):
        err = (got.float() - ref).abs()
        bound = ulps * ulp * scale + torch.finfo(got.dtype).tiny
        worst = (err / bound).max().item()
        assert worst <= 1.0, f"{name}: error {worst:.2f}× the rounding bound, {msg}"


def _run_case(*, layout, T, h, kvh, d, scaled, dtype, device=DEVICE):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    cos, sin = _cos_sin(T, d, scaled, dtype, gen, device)
    buf = _backing(layout, T, h, kvh, d, dtype, gen, device)
    q, k = _qk_views(layout, buf, T, h, kvh, d)
    buf_before = buf.clone()
    q_in, k_in = q.clone(), k.clone()
    want_q, want_k = rope_reference(q.clone(), k.clone(), cos, sin)

    got_q, got_k = rope(q, k, cos, sin)

    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr(), "not in place"
    _check(got_q, want_q, q_in, cos, sin, seed)
    _check(got_k, want_k, k_in, cos, sin, seed)
    # Everything outside q and k (v, padding) is untouched.
    untouched = torch.ones_like(buf, dtype=torch.bool)
    for view in _qk_views(layout, untouched, T, h, kvh, d):
        view.fill_(False)
    assert torch.equal(buf[untouched], buf_before[untouched]), f"wrote outside q/k, seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaled", [True, False], ids=["llama3", "plain"])
@pytest.mark.parametrize(
    "h, kvh, d",
    [
        (8, 2, 128),  # Llama-3 head_dim, GQA
        (9, 3, 64),  # SmolLM2: 9 / 3 heads, a non-power-of-two head count
        (4, 4, 80),  # MHA; half of head_dim (40) not a power of two
        (40, 8, 128),  # q and k each span several programs
    ],
)
def test_fused_qkv_views_match_reference(dtype, scaled, h, kvh, d):
    _run_case(layout="fused_qkv", T=5, h=h, kvh=kvh, d=d, scaled=scaled, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["padded_rows", "head_major"])
def test_other_strided_layouts_match_reference(dtype, layout):
    _run_case(layout=layout, T=4, h=6, kvh=2, d=32, scaled=True, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_token_one_kv_head(dtype):
    """A decode step of an MQA model (or a TP rank's single KV head): counts of 1, which
    Triton specializes to constants."""
    _run_case(layout="fused_qkv", T=1, h=8, kvh=1, d=64, scaled=True, dtype=dtype)


def test_empty_batch():
    q, k = torch.ones(0, 4, 16, device=DEVICE), torch.ones(0, 2, 16, device=DEVICE)
    cos = sin = torch.ones(0, 16, device=DEVICE)
    got_q, got_k = rope(q, k, cos, sin)
    assert got_q is q and got_k is k


def test_rejects_mismatched_inputs():
    q, k = torch.ones(3, 4, 16, device=DEVICE), torch.ones(3, 2, 16, device=DEVICE)
    cos = sin = torch.ones(3, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="cos"):
        rope(q, k, cos[:, :8], sin[:, :8])
    with pytest.raises(AssertionError):
        rope(q, k.half(), cos, sin)
    with pytest.raises(AssertionError, match="strides"):
        rope(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scaled", [True, False], ids=["llama3", "plain"])
@pytest.mark.parametrize(
    "h, kvh, d", [(32, 8, 128), (9, 3, 64), (40, 8, 128), (4, 4, 80), (8, 1, 64)]
)
@pytest.mark.parametrize("T", [1, 300])
def test_gpu_bfloat16_matches_reference(T, scaled, h, kvh, d):
    _run_case(
        layout="fused_qkv",
        T=T,
        h=h,
        kvh=kvh,
        d=d,
        scaled=scaled,
        dtype=torch.bfloat16,
        device="cuda",
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["padded_rows", "head_major"])
def test_gpu_bfloat16_other_layouts(layout):
    _run_case(
        layout=layout, T=300, h=32, kvh=8, d=128, scaled=True, dtype=torch.bfloat16, device="cuda"
    )
