"""Random-weights models of a real shape, for benchmarks on a GPU without a checkpoint.

A config-only Hugging Face folder (config.json, tokenizer.json, tokenizer_config.json) that the
engine loads with ``load_format="dummy"``: throughput does not depend on weight values. The
tokenizer is generated here: a word-level vocabulary of GPT-2's size (50257 entries, the last
``<|endoftext|>``, BOS and EOS), so prompts of random token ids below it mean the same in every
system, and transformers (``AutoTokenizer``) and DeepSpeed-FastGen load the same folder.

    engine = with_dummy_model(engine, DummyModelConfig(shape="llama3-8b"), out_dir)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from pipeserve.runtime.config import EngineConfig

GPT2_VOCAB = 50257
"""Tokenizer entries; prompt token ids are drawn below it."""
END_OF_TEXT = "<|endoftext|>"

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=50304,  # the tokenizer's 50257, padded to a multiple of 64
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=GPT2_VOCAB - 1,
    eos_token_id=GPT2_VOCAB - 1,
)

# A Llama-3-70B shape (too large for one GPU in bf16 at 80 layers: ~141 GB), the same vocabulary.
LLAMA3_70B = dict(
    LLAMA3_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
MAX_MODEL_LEN = LLAMA3_8B["max_position_embeddings"]  # every shape's context


@dataclass(frozen=True, kw_only=True, slots=True)
class DummyModelConfig:
    shape: str | None = None
    """A key of SHAPES (llama3-8b, llama3-70b); None = no dummy model (use the configured one)."""
    num_layers: int = 32
    """Decoder layers of the model (fewer than the shape's fit a smaller card)."""
    tokenizer: str | None = None
    """A tokenizer.json to ship with it; None = the generated word-level GPT-2-size vocabulary."""

    def __post_init__(self) -> None:
        if self.shape is not None and self.shape not in SHAPES:
            raise ValueError(f"dummy_model.shape must be one of {sorted(SHAPES)} (or null), got {self.shape!r}")
        if self.num_layers < 1:
            raise ValueError("dummy_model.num_layers must be >= 1")


def with_dummy_model(config: EngineConfig, dummy: DummyModelConfig, out_dir: str) -> EngineConfig:
    """``config`` loading random weights of ``dummy.shape`` from a folder written in
    ``out_dir/dummy_model`` (``config`` itself when no shape is set)."""
    if dummy.shape is None:
        return config
    folder = os.path.join(out_dir, "dummy_model")
    write_model_folder(folder, shape=dummy.shape, num_layers=dummy.num_layers, tokenizer=dummy.tokenizer)
    return dataclasses.replace(config, model=folder, load_format="dummy")


def write_model_folder(folder: str, *, shape: str = "llama3-8b", num_layers: int, tokenizer: str | None = None) -> None:
    """config.json of ``shape`` with ``num_layers`` layers, and its tokenizer, in ``folder``."""
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise ValueError(f"dummy_model.tokenizer {tokenizer!r} does not exist")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(SHAPES[shape], num_hidden_layers=num_layers), f)
    if tokenizer is None:
        word_level_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    else:
        shutil.copy(tokenizer, os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:  # FastGen needs an EOS token
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": END_OF_TEXT,
                   "eos_token": END_OF_TEXT, "add_bos_token": False}, f)


def word_level_tokenizer():
    """A `tokenizers.Tokenizer` of GPT2_VOCAB entries: words w0 … w50255, then END_OF_TEXT
    (special; also the unknown word). Text splits on whitespace; decoding joins with spaces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(GPT2_VOCAB - 1)}
    vocab[END_OF_TEXT] = GPT2_VOCAB - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=END_OF_TEXT))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    return tokenizer


def load_dummy_model(*, shape: str, num_layers: int, dtype, device, tokenizer: str | None = None,
                     quantization: str | None = None):
    """A ``shape`` model of ``num_layers`` layers with random weights (``load_model``'s result),
    from a config-only folder that is gone again once loaded."""
    from pipeserve.runtime.model.loader import load_model

    with tempfile.TemporaryDirectory(prefix="dummy-model-") as folder:
        write_model_folder(folder, shape=shape, num_layers=num_layers, tokenizer=tokenizer)
        return load_model(folder, dtype=dtype, device=device, load_format="dummy", quantization=quantization)
