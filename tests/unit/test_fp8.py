"""FP8 weights on the CPU: FP8 checkpoints (AutoFP8's ``fp8`` with a scale per tensor,
``compressed-tensors`` with a scale per tensor or per output channel, static input scales
beside them) and a float checkpoint quantized at load (``quantization="fp8"``, a scale per
row). The CPU runs the dequantizing reference, so the model must match transformers holding
the dequantized weights within the float32 parity tolerance, through a whole prefill, chunked
prefills and decodes. The GPU's FP8 GEMM is tests/kernels/test_fp8_kernels.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers_model

from helpers_model import (  # noqa: E402
    PagedRunner,
    hf_logits,
    load_hf_reference,
    quantize_fp8,
    write_fp8_checkpoint,
    write_tiny_checkpoint,
)

from pipeserve.kernels import torch_ops  # noqa: E402
from pipeserve.kernels.reference import matmul_reference  # noqa: E402
from pipeserve.runtime.model.model_config import ModelConfig  # noqa: E402
from pipeserve.runtime.model.weights import iter_safetensors, load_hf_model  # noqa: E402

ATOL = 1e-4
E4M3 = torch.float8_e4m3fn


def _prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_against(model, hf) -> None:
    """A whole prefill, then 7-token chunks and greedy decodes, against transformers."""
    prompt = _prompt(40)
    [whole] = PagedRunner(model).step([(0, prompt)])
    assert (whole - hf_logits(hf, prompt)).abs().max().item() < ATOL
    runner = PagedRunner(model, seed=3)
    logits = [runner.step([(0, prompt[i : i + 7])])[0] for i in range(0, len(prompt), 7)]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, tokens[-1:])])[0])
    assert (torch.cat(logits) - hf_logits(hf, tokens)).abs().max().item() < ATOL


@pytest.mark.parametrize(
    "kind, method, strategy",
    [("llama", "fp8", "tensor"), ("llama", "compressed-tensors", "channel"), ("qwen2", "compressed-tensors", "tensor"),
     ("phi3", "fp8", "tensor")],
)
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path, kind, method, strategy):
    """Qwen2 adds q/k/v biases; Phi-3's fused qkv_proj / gate_up_proj carry one scale for the
    whole fused tensor, which each part it is split into takes."""
    src = write_tiny_checkpoint(tmp_path, kind, seed=21)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", method=method, strategy=strategy)
    model, config = load_hf_model(tmp_path / "fp8", dtype=torch.float32, device="cpu")
    assert config.quantization == "fp8" and config.fp8_checkpoint
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == E4M3 and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    assert model.lm_head.weight.dtype == torch.float32 and model.layers[0].input_layernorm.weight.dtype == torch.float32
    _check_against(model, load_hf_reference(tmp_path / "ref"))


def test_quantized_at_load_matches_a_per_row_reference(tmp_path):
    """``quantization="fp8"`` on a float checkpoint: each projection row scaled to 448 at its
    largest magnitude and rounded to e4m3; the model then matches transformers holding exactly
    those values, and its projections take a quarter of float32's bytes."""
    src = write_tiny_checkpoint(tmp_path, "llama", seed=22)
    model, config = load_hf_model(src, dtype=torch.float32, device="cpu", quantization="fp8")
    assert config.quantization == "fp8" and not config.fp8_checkpoint
    float_model, _ = load_hf_model(src, dtype=torch.float32, device="cpu")
    for (name, p), (_, f) in zip(model.named_parameters(), float_model.named_parameters(), strict=False):
        if name.endswith("proj.weight"):
            assert p.dtype == E4M3 and p.element_size() * 4 == f.element_size()
    ref = tmp_path / "ref"
    shutil.copytree(src, ref)
    tensors = {}
    for name, w in iter_safetensors(src):
        if name.endswith("proj.weight"):
            q, scale = quantize_fp8(w, "channel")
            w = q.float() * scale
        tensors[name] = w.contiguous()
    save_file(tensors, str(ref / "model.safetensors"))
    _check_against(model, load_hf_reference(ref))


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
        ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}, "int 4-bit"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
          "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "besides lm_head"),
    ],
)
def test_unsupported_quantization_configs_are_clear_errors(quantization_config, message):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
         "quantization_config": quantization_config}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_fp8_checkpoint_errors_name_what_is_wrong(tmp_path):
    src = write_tiny_checkpoint(tmp_path, "llama", seed=23)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", method="fp8", strategy="tensor")
    # Without its quantization_config the FP8 tensors meet float layers.
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "fp8", bare)
    (bare / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"q_proj.weight is stored in FP8, but this model holds"):
        load_hf_model(bare, dtype=torch.float32, device="cpu")
    # A missing scale.
    tensors = dict(iter_safetensors(tmp_path / "fp8"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing parameters: model.layers.1.mlp.down_proj.weight_scale"):
        load_hf_model(tmp_path / "fp8", dtype=torch.float32, device="cpu")


def test_fp8_refusals(tmp_path):
    with pytest.raises(ValueError, match="FP8 weights is not supported yet"):
        load_hf_model(write_tiny_checkpoint(tmp_path, "mixtral", seed=24), dtype=torch.float32, device="cpu",
                      quantization="fp8")
    model, _ = load_hf_model(write_tiny_checkpoint(tmp_path, "llama", seed=25), dtype=torch.float32, device="cpu",
                             quantization="fp8")
    with pytest.raises(ValueError, match="deterministic mode does not cover FP8"):
        model.set_ops(dataclasses.replace(torch_ops(), matmul=matmul_reference))
    with pytest.raises(ValueError, match="divisible by 16"):
        load_hf_model(write_tiny_checkpoint(tmp_path / "odd", "llama", seed=26, intermediate_size=40),
                      dtype=torch.float32, device="cpu", quantization="fp8")


def test_engine_serves_fp8_weights(tmp_path):
    """``LLM(..., quantization="fp8")`` through the engine and its worker: greedy tokens equal
    transformers' on the per-row dequantized weights."""
    from helpers_model import write_tiny_model

    from pipeserve import LLM, SamplingParams

    src = Path(write_tiny_model(tmp_path, seed=27))
    ref = tmp_path / "ref"
    shutil.copytree(src, ref)
    save_file({name: (quantize_fp8(w, "channel")[0].float() * quantize_fp8(w, "channel")[1]
                      if name.endswith("proj.weight") else w).contiguous() for name, w in iter_safetensors(src)},
              str(ref / "model.safetensors"))
    hf = load_hf_reference(ref)
    prompts = [_prompt(9, seed=s) for s in (5, 6, 7)]
    with LLM(str(src), device="cpu", quantization="fp8", num_kv_blocks=32) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 9:]
        assert out.outputs[0].token_ids == want.tolist()


def test_scales_stay_float32_in_a_bfloat16_model(tmp_path):
    model, _ = load_hf_model(write_tiny_checkpoint(tmp_path, "llama", seed=28), dtype=torch.bfloat16, device="cpu",
                             quantization="fp8")
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("weight_scale")} == {torch.float32}
