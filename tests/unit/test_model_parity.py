"""The Llama-family model against transformers on the same tiny random checkpoints.

Every kind (GQA Llama untied/tied, Llama-3 and linear RoPE scaling, Qwen2 with q/k/v bias,
Mistral, Gemma 2 / 3 with sliding windows shorter than the prompts, Phi-3 with LongRoPE and
fused checkpoint projections, Phi-4-mini's partial RoPE, Mixtral and Qwen3-MoE's routed experts) runs: a whole-prompt prefill, chunked prefills through a shuffled paged cache followed
by greedy decoding, a packed mixed batch, and a two-stage pipeline split. CPU float32 must
match transformers (eager attention) within 1e-4; the GPU tests check bf16 within bf16 noise.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers_model

from helpers_model import (  # noqa: E402
    TINY_KINDS,
    PagedRunner,
    hf_logits,
    load_hf_reference,
    make_metadata,
    tiny_hf_config,
    write_tiny_checkpoint,
)

from pipeserve.runtime.worker.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block  # noqa: E402
from pipeserve.runtime.model.llama import LlamaForCausalLM, rope_inv_freq, rope_parameters  # noqa: E402
from pipeserve.runtime.model.model_config import ModelConfig  # noqa: E402
from pipeserve.runtime.model.weights import iter_safetensors, load_hf_model  # noqa: E402
from pipeserve.scheduler import SlidingLayers  # noqa: E402

ATOL = 1e-4
PROMPT_LEN = 70
NUM_DECODE_STEPS = 20


def _prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


# Under -m slow only (CI time): the scaled RoPE variants (their frequencies against transformers'
# are test_rope_inv_freq_matches_transformers, in CI) and Qwen3-MoE, the slowest reference (the
# MoE block runs in CI through Mixtral, the q/k norms through Qwen3).
SLOW_KINDS = ("llama_linear_rope", "llama_yarn_rope", "qwen3_moe")


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k
                                        for k in TINY_KINDS])
def tiny(request, tmp_path_factory):
    """A tiny checkpoint of one kind, our model of it, and transformers' (float32, CPU)."""
    kind = request.param
    folder = write_tiny_checkpoint(
        tmp_path_factory.mktemp("ckpt"), kind, seed=TINY_KINDS.index(kind)
    )
    model, config = load_hf_model(folder, dtype=torch.float32, device="cpu")
    return SimpleNamespace(
        kind=kind, folder=folder, model=model, config=config, hf=load_hf_reference(folder)
    )


# --- parity with transformers -------------------------------------------------------------


def test_whole_prompt_prefill_matches_transformers(tiny):
    prompt = _prompt(PROMPT_LEN)
    [logits] = PagedRunner(tiny.model).step([(0, prompt)])
    assert _max_diff(logits, hf_logits(tiny.hf, prompt)) < ATOL


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_prefill_then_greedy_decode_matches_transformers(tiny, chunk_size):
    prompt = _prompt(PROMPT_LEN)
    runner = PagedRunner(tiny.model, block_size=16, seed=chunk_size)
    logits = [
        runner.step([(0, prompt[i : i + chunk_size])])[0] for i in range(0, len(prompt), chunk_size)
    ]
    tokens = list(prompt)
    for _ in range(NUM_DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, tokens[-1:])])[0])
    ours = torch.cat(logits)  # [70 + 20, V]: every position, prompt and decode steps
    # By causality, one HF pass over the final sequence gives each step's logits.
    ref = hf_logits(tiny.hf, tokens)
    assert ours.shape == ref.shape
    assert _max_diff(ours, ref) < ATOL
    assert ours[PROMPT_LEN - 1 :].argmax(-1).tolist()[:-1] == tokens[PROMPT_LEN:]


def test_packed_mixed_batch_matches_each_sequence_alone(tiny):
    """One forward holding a decode, a prefill chunk over a cached prefix, and another decode
    (decodes not adjacent) equals running each of them alone."""
    prompts = {0: _prompt(40, seed=2), 1: _prompt(30, seed=3), 2: _prompt(19, seed=4)}
    prefix = {0: prompts[0][:24], 1: prompts[1], 2: prompts[2]}
    new = {0: prompts[0][24:], 1: [5], 2: [7]}  # a 16-token chunk and two decode tokens

    packed = PagedRunner(tiny.model, seed=10)
    for seq_id, tokens in prefix.items():
        packed.step([(seq_id, tokens)])
    mixed = packed.step([(1, new[1]), (0, new[0]), (2, new[2])])

    for seq_id, got in zip((1, 0, 2), mixed, strict=True):
        alone = PagedRunner(tiny.model, seed=20 + seq_id)
        alone.step([(seq_id, prefix[seq_id])])
        [want] = alone.step([(seq_id, new[seq_id])])
        assert _max_diff(got, want) < 1e-5
        ref = hf_logits(tiny.hf, prefix[seq_id] + new[seq_id])[-len(new[seq_id]) :]
        assert _max_diff(got, ref) < ATOL


def test_two_stage_pipeline_split_matches_whole_model(tiny):
    """Stage 0 = embedding + layer 0, stage 1 = the rest + norm + LM head (a tied model's
    stage 1 reads its LM head from the embedding); one tensor travels between them."""
    num_layers = tiny.config.num_hidden_layers
    stage0, _ = load_hf_model(tiny.folder, dtype=torch.float32, device="cpu", end_layer=1)
    stage1, _ = load_hf_model(tiny.folder, dtype=torch.float32, device="cpu", start_layer=1)
    assert stage0.lm_head is None and stage0.norm is None and len(stage0.layers) == 1
    assert stage1.embed_tokens is None and len(stage1.layers) == num_layers - 1
    prompt = _prompt(PROMPT_LEN)
    [want] = PagedRunner(tiny.model).step([(0, prompt)])

    def cache(layers):
        return allocate_kv_cache(
            tiny.config,
            num_layers=layers,
            num_blocks=8,
            block_size=16,
            dtype=torch.float32,
            device="cpu",
        )

    meta = make_metadata([(PROMPT_LEN, PROMPT_LEN)], [[6, 2, 7, 0, 3]], block_size=16)
    positions = torch.arange(PROMPT_LEN)
    with torch.no_grad():
        hidden = stage0(torch.tensor(prompt), positions, cache(1), meta)  # [T, H]
        out = stage1(None, positions, cache(num_layers - 1), meta, hidden_states=hidden)
        got = stage1.compute_logits(out)
    assert _max_diff(got, want) < 1e-5


# --- RoPE, config, weights, cache ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama3_rope", "llama_linear_rope", "llama_yarn_rope", "phi3", "phi4_mini"])
def test_rope_inv_freq_matches_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = tiny_hf_config(kind)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())  # the architecture from model_type
    rope_type = config.rope_scaling["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    got, scale = rope_parameters(config)
    assert torch.equal(got, want) and scale == want_scale
    unscaled = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    assert (got != unscaled).sum() >= len(got) // 2  # the scaling is really exercised


def _llama_dict(**overrides):
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
    }
    return d | overrides


def test_config_defaults_and_hf_variants():
    c = ModelConfig.from_hf_dict(_llama_dict(eos_token_id=[128001, 128009], bos_token_id=128000))
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta, c.rope_scaling) == (
        16,
        4,
        10000.0,
        None,
    )
    assert c.eos_token_ids == (128001, 128009) and c.bos_token_id == 128000
    assert not c.attention_bias and not c.tie_word_embeddings
    # transformers 4.x layout, old "type" key
    c = ModelConfig.from_hf_dict(
        _llama_dict(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0}, eos_token_id=2)
    )
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert c.eos_token_ids == (2,)
    # dynamic NTK grows the base past config.json's context (as transformers does, whatever else
    # the parameters say) and the context extends by its factor
    c = ModelConfig.from_hf_dict(_llama_dict(rope_scaling={"type": "dynamic", "factor": 2.5,
                                                           "original_max_position_embeddings": 100}))
    assert c.rope_scaling == {"rope_type": "dynamic", "factor": 2.5, "original_max_position_embeddings": 256}
    assert c.max_position_embeddings == 640 and c.length_scaled_rope
    # transformers 5.x layout
    c = ModelConfig.from_hf_dict(
        _llama_dict(rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    )
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    c = ModelConfig.from_hf_dict(
        _llama_dict(architectures=["Qwen2ForCausalLM"], num_key_value_heads=2)
    )
    assert c.attention_bias and not c.o_proj_bias and c.num_key_value_heads == 2
    c = ModelConfig.from_hf_dict(
        _llama_dict(architectures=None, model_type="mistral", sliding_window=64)
    )
    assert c.architecture == "MistralForCausalLM" and c.max_position_embeddings == 64


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": None, "model_type": "gemma"}, "unsupported model_type"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 66}, "no head_dim"),
        ({"head_dim": 15}, "even"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "unsupported rope scaling"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, r"lacks \['factor'\]"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": "4"}}, "factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 0.5}}, "factor must be >= 1"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "lacks"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
         "original_max_position_embeddings"),
        ({"original_max_position_embeddings": 64, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                                                                   "long_factor": [1.0]}}, "needs 8"),
    ],
)
def test_config_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_llama_dict(**overrides))


def _gemma_dict(architecture="Gemma2ForCausalLM", **overrides):
    return _llama_dict(architectures=[architecture], head_dim=32, query_pre_attn_scalar=24,
                       sliding_window=16) | overrides


def test_gemma_and_phi3_configs():
    c = ModelConfig.from_hf_dict(_gemma_dict(num_hidden_layers=3))
    assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (c.layer_window(0), c.layer_window(1), c.hidden_act) == (16, None, "gelu_pytorch_tanh")
    assert SlidingLayers.of(c.layer_windows) == SlidingLayers(window=16, layer_share=2 / 3)  # the scheduler's
    assert c.max_position_embeddings == 256 and c.is_gemma and not c.qk_norm
    # transformers 4's Gemma 3 layout: global theta and scaling, a local base, a layer pattern
    c = ModelConfig.from_hf_dict(_gemma_dict("Gemma3ForCausalLM", num_hidden_layers=4, sliding_window_pattern=3,
                                             rope_theta=1e6, rope_local_base_freq=1e4,
                                             rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert c.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling["factor"], c.qk_norm) == (1e6, 1e4, 8.0, True)
    # Phi-3: "su" is LongRoPE, its long factors past original_max_position_embeddings (the context
    # is max_position_embeddings); the window slides everywhere
    c = ModelConfig.from_hf_dict(_llama_dict(
        architectures=["Phi3ForCausalLM"], original_max_position_embeddings=64, sliding_window=47,
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_scaling["factor"] == 4.0
    assert c.rope_scaling["original_max_position_embeddings"] == 64 and c.length_scaled_rope
    assert c.max_position_embeddings == 256 and c.layer_types == ("sliding_attention",) * 2


@pytest.mark.parametrize(
    "d, message",
    [
        (_gemma_dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (_gemma_dict("Gemma3ForCausalLM", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (_gemma_dict(layer_types=["sliding_attention", "chunked_attention"]), "chunked_attention"),
        (_gemma_dict(layer_types=["sliding_attention"]), "1 entries for 2 layers"),
        (_gemma_dict(sliding_window=None), "positive sliding_window"),
        (_gemma_dict(hidden_activation="gelu"), "hidden_act"),
        (_gemma_dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
        (_gemma_dict("Gemma3ForCausalLM", rope_parameters={
            "full_attention": {"rope_type": "default"},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0}}), "sliding-window layers"),
        (_gemma_dict(partial_rotary_factor=0.5), "Phi3ForCausalLM only"),
        (_llama_dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.1), "even number"),
    ],
)
def test_gemma_and_phi3_configs_reject_unsupported_settings(d, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_gemma_refuses_deterministic_mode():
    """Batch-invariant ops (a matmul in the table) would not cover Gemma's torch norms."""
    from pipeserve.kernels import torch_ops
    from pipeserve.kernels.reference import matmul_reference

    model = LlamaForCausalLM(ModelConfig.from_hf_dict(tiny_hf_config("gemma2").to_dict()))
    with pytest.raises(ValueError, match="deterministic mode does not cover Gemma"):
        model.set_ops(dataclasses.replace(torch_ops(), matmul=matmul_reference))


def _mixtral_dict(**overrides):
    return _llama_dict(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
                       router_jitter_noise=0.0, sliding_window=100) | overrides


def _qwen3_moe_dict(**overrides):  # the hub's layout (num_experts, moe_intermediate_size)
    return _llama_dict(architectures=["Qwen3MoeForCausalLM"], num_experts=128, num_experts_per_tok=8,
                       moe_intermediate_size=48, norm_topk_prob=True, sliding_window=100,
                       decoder_sparse_step=1, mlp_only_layers=[]) | overrides


def test_moe_configs():
    """Mixtral renormalizes its top-k and its window caps the context (as Mistral's); Qwen3-MoE's
    experts are moe_intermediate_size wide, its heads normed, its window off unless used."""
    c = ModelConfig.from_hf_dict(_mixtral_dict())
    assert (c.num_local_experts, c.num_experts_per_tok, c.norm_topk_prob, c.is_moe) == (8, 2, True, True)
    assert (c.intermediate_size, c.max_position_embeddings, c.qk_norm) == (128, 100, False)
    c = ModelConfig.from_hf_dict(_qwen3_moe_dict())
    assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size) == (128, 8, 48)
    assert (c.norm_topk_prob, c.qk_norm, c.max_position_embeddings) == (True, True, 256)
    assert not ModelConfig.from_hf_dict(_qwen3_moe_dict(norm_topk_prob=False)).norm_topk_prob


@pytest.mark.parametrize(
    "d, message",
    [
        (_mixtral_dict(router_jitter_noise=0.01), "router_jitter_noise"),
        (_mixtral_dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (_qwen3_moe_dict(mlp_only_layers=[1]), "dense layers"),
        (_qwen3_moe_dict(decoder_sparse_step=2), "dense layers"),
    ],
)
def test_moe_configs_reject_unsupported_settings(d, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_moe_refuses_deterministic_mode():
    from pipeserve.kernels import torch_ops
    from pipeserve.kernels.reference import matmul_reference

    model = LlamaForCausalLM(ModelConfig.from_hf_dict(tiny_hf_config("mixtral").to_dict()))
    with pytest.raises(ValueError, match="deterministic mode does not cover mixture-of-experts"):
        model.set_ops(dataclasses.replace(torch_ops(), matmul=matmul_reference))


def test_moe_checkpoint_errors_name_the_expert(tmp_path):
    """An expert index past the model's, a misshapen expert and a missing one are load errors."""
    folder = write_tiny_checkpoint(tmp_path, "mixtral")
    weights = dict(iter_safetensors(folder))
    prefix = "model.layers.0.block_sparse_moe.experts"
    weights[f"{prefix}.4.w1.weight"] = weights.pop(f"{prefix}.3.w1.weight")
    weights[f"{prefix}.2.w2.weight"] = weights[f"{prefix}.2.w2.weight"][:, :-1]
    with pytest.raises(ValueError) as e:
        LlamaForCausalLM(ModelConfig.from_hf_folder(folder)).load_weights(weights.items())
    assert "expert 4 of a model with 4 experts" in str(e.value)
    assert f"{prefix}.2.w2.weight: checkpoint shape (64, 63)" in str(e.value)
    assert f"missing parameters: {prefix}.3.w1.weight" in str(e.value)


def test_phi3_fused_projection_with_wrong_rows_is_an_error(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "phi3")
    weights = dict(iter_safetensors(folder))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16]
    with pytest.raises(ValueError, match="qkv_proj.weight has 112 rows, not 128"):
        LlamaForCausalLM(ModelConfig.from_hf_folder(folder)).load_weights(weights.items())


def test_load_hf_model_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_model(tmp_path / "nope", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(tmp_path, dtype=torch.float32, device="cpu")


def test_load_weights_reports_missing_and_unexpected(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "llama")
    config = ModelConfig.from_hf_folder(folder)
    weights = dict(iter_safetensors(folder))
    del weights["model.layers.1.mlp.up_proj.weight"], weights["model.norm.weight"]
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError) as err:
        LlamaForCausalLM(config).load_weights(weights.items())
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "model.norm.weight" in str(err.value)
    assert "unexpected parameter model.layers.0.self_attn.o_proj.bias" in str(err.value)
    # A stage holding only layer 0 needs none of those.
    LlamaForCausalLM(config, end_layer=1).load_weights(
        (n, t) for n, t in weights.items() if "o_proj.bias" not in n
    )


def test_untied_checkpoint_without_lm_head_uses_embedding(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "llama")
    weights = dict(iter_safetensors(folder))
    del weights["lm_head.weight"]
    model = LlamaForCausalLM(ModelConfig.from_hf_folder(folder))
    model.load_weights(weights.items())
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])
    assert model.lm_head.weight is not model.embed_tokens.weight


def test_load_in_bfloat16_keeps_default_dtype_and_float32_rope(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen2")
    model, _ = load_hf_model(folder, dtype=torch.bfloat16, device="cpu")
    assert torch.get_default_dtype() == torch.float32
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.rotary_emb.cos.dtype == torch.float32
    model.to(torch.float16)  # a later cast must not round the RoPE tables either
    assert model.rotary_emb.cos.dtype == torch.float32


def test_kv_cache_shapes_and_bytes():
    config = ModelConfig.from_hf_dict(_llama_dict(num_key_value_heads=2))
    caches = allocate_kv_cache(
        config, num_layers=3, num_blocks=5, block_size=16, dtype=torch.bfloat16, device="cpu"
    )
    assert len(caches) == 3 and caches[0].shape == (2, 5, 16, 2, 16)
    assert caches[0].dtype == torch.bfloat16 and not caches[0].any()
    per_block = kv_cache_bytes_per_block(config, 3, 16, torch.bfloat16)
    assert per_block * 5 == sum(c.numel() * c.element_size() for c in caches)
    assert kv_cache_bytes_per_block(config, 3, 16, torch.bfloat16, num_kv_heads=1) == per_block // 2


# --- GPU (bf16) ---------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "llama_yarn_rope", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                  "phi4_mini", "mixtral", "qwen3_moe"])
def test_gpu_float32_chunked_prefill_and_decode_match_transformers(tmp_path, kind, backend):
    from pipeserve.kernels import kernel_ops

    folder = write_tiny_checkpoint(tmp_path, kind)
    model, _ = load_hf_model(folder, dtype=torch.float32, device="cuda")
    model.set_ops(kernel_ops(backend, torch.device("cuda")))
    hf = load_hf_reference(folder, device="cuda")
    prompt = _prompt(PROMPT_LEN)
    runner = PagedRunner(model, device="cuda")
    logits = [runner.step([(0, prompt[i : i + 16])])[0] for i in range(0, PROMPT_LEN, 16)]
    tokens = list(prompt)
    for _ in range(NUM_DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, tokens[-1:])])[0])
    assert _max_diff(torch.cat(logits), hf_logits(hf, tokens)) < 1e-3


@pytest.mark.gpu
@gpu
# (Not the MoE kinds: in bf16 a near tie between two experts' router scores goes one way in ours
# and the other in transformers' at single tokens, 0.93 apart on a logit scale of 3.5 for the
# tiny Mixtral on an H200; their float32 parity, through both op tables, is the test above.)
@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi4_mini"])
def test_gpu_bfloat16_matches_transformers_within_bf16_noise(tmp_path, kind):
    """bf16 error of ours vs the float32 reference is no worse than transformers' own bf16
    error (scaled), and greedy choices mostly agree."""
    folder = write_tiny_checkpoint(tmp_path, kind)
    model, _ = load_hf_model(folder, dtype=torch.bfloat16, device="cuda")
    hf16 = load_hf_reference(folder, dtype=torch.bfloat16, device="cuda")
    hf32 = load_hf_reference(folder, dtype=torch.float32, device="cuda")
    tokens = _prompt(PROMPT_LEN + NUM_DECODE_STEPS)
    runner = PagedRunner(model, device="cuda")
    prompt = tokens[:PROMPT_LEN]
    ours = torch.cat(
        [runner.step([(0, prompt[i : i + 16])])[0] for i in range(0, PROMPT_LEN, 16)]
        + [runner.step([(0, [t])])[0] for t in tokens[PROMPT_LEN:]]
    )
    ref32, ref16 = hf_logits(hf32, tokens), hf_logits(hf16, tokens)
    scale = ref32.abs().max().item()
    assert _max_diff(ours, ref16) < 0.05 * scale
    assert _max_diff(ours, ref32) <= 2 * _max_diff(ref16, ref32) + 0.01 * scale
    agree = (ours.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    assert agree >= 0.9
