"""Loading HF checkpoints (``config.json`` + ``*.safetensors``) into ``LlamaForCausalLM``.

Each rank reads only its slice: tensors go to the model as lazy safetensors slices, so a
pipeline stage never reads another stage's layers, and a TP rank reads only its rows/columns.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipeserve.parallel.context import ParallelContext
from pipeserve.runtime.model.llama import LlamaForCausalLM
from pipeserve.runtime.model.model_config import ModelConfig


def iter_safetensors(
    folder: str | Path, *, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor in the folder's safetensors files, one at a time.

    With ``model.safetensors.index.json`` present, reads only the files it lists (Mistral
    repos also ship a ``consolidated.safetensors`` under other names).
    """
    for path in _safetensors_files(Path(folder)):
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_safetensors_slices(folder: str | Path) -> Iterator[tuple[str, Any]]:
    """(HF name, lazy slice) for every tensor in the folder's safetensors files.

    A slice (safetensors' ``get_slice``) reads nothing until indexed (``s[a:b]``,
    ``s[:, a:b]``, ``s[:]``) and reads only what the index selects. It is valid only until the
    next item is requested (its file may close then): use each one before moving on.
    """
    for path in _safetensors_files(Path(folder)):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_hf_model(
    folder: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    start_layer: int = 0,
    end_layer: int | None = None,
    parallel: ParallelContext | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build layers [start_layer, end_layer) of this TP rank's shard (``parallel``; default one
    process) directly on ``device`` in ``dtype``, and read just those weights into it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    config = ModelConfig.from_hf_folder(folder)
    model = build_model(
        config,
        dtype=dtype,
        device=device,
        start_layer=start_layer,
        end_layer=end_layer,
        parallel=parallel,
        quantization=quantization,
    )
    model.load_weights(iter_safetensors_slices(folder))
    return model, model.config


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    start_layer: int = 0,
    end_layer: int | None = None,
    parallel: ParallelContext | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """An inference-mode model (no grads, eval) born on ``device`` in ``dtype``, with
    PyTorch's default init; load_weights (or a benchmark's random fill) comes next. The
    global default dtype is restored afterwards; the RoPE tables stay float32. ``parallel``
    picks the TP shard (default: one process, the whole layers). ``quantization="fp8"`` holds
    the decoder's projections in FP8 (a float checkpoint is quantized as it loads)."""
    if quantization is not None and quantization != config.quantization:
        config = dataclasses.replace(config, quantization=quantization)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, start_layer=start_layer, end_layer=end_layer, parallel=parallel)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.requires_grad_(False).eval()


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted({folder / name for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(folder)!r}")
    return files
