"""Builders for model / attention tests: tiny random HF checkpoints, attention metadata, and a
small driver that runs a model through the paged KV cache the way the engine will.

Import from a test file with ``tests/`` on ``sys.path`` (see the top of
``tests/unit/test_model_parity.py``).
"""

from __future__ import annotations

import inspect
import json
import random
import shutil
from pathlib import Path

import torch

from pipeserve.kernels.attention_metadata import AttentionMetadata
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.model.llama import LlamaForCausalLM

# Every kind is hidden 64, 4 heads / 2 KV heads (GQA), head_dim 16, vocab 256.
TINY_KINDS = ("llama", "llama_tied", "llama3_rope", "llama_linear_rope", "llama_yarn_rope", "qwen2", "qwen3",
              "mistral", "gemma2", "gemma3", "phi3", "phi4_mini", "mixtral", "qwen3_moe")
# Gemma's (and the tiny Phi-3's) sliding layers see this many keys: fewer than the tests'
# prompts, so windows matter.
TINY_SLIDING_WINDOW = 12
# Kinds whose RoPE frequencies follow the sequence's length when a token is computed (dynamic
# NTK, LongRoPE past its original context): a chunk turns as transformers turns it fed alone, so
# their reference is ``hf_logits_by_chunks``, not one pass over the whole sequence. Their
# original context is TINY_ORIGINAL_CONTEXT, shorter than the tests' prompts.
LENGTH_SCALED_KINDS = ("llama_dynamic_rope", "phi4_mini_long")
TINY_ORIGINAL_CONTEXT = 32

_TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_hf_config(kind: str, **overrides):
    """A transformers config for one of TINY_KINDS."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    shape = {**_TINY_SHAPE, **overrides}
    if kind == "llama":
        return LlamaConfig(**shape, tie_word_embeddings=False)
    if kind == "llama_tied":
        return LlamaConfig(**shape, tie_word_embeddings=True)
    if kind == "llama3_rope":  # original context 32 < prompt, so scaled frequencies matter
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**shape, rope_scaling=scaling)
    if kind == "llama_linear_rope":
        return LlamaConfig(**shape, rope_scaling={"rope_type": "linear", "factor": 2.0})
    if kind == "llama_yarn_rope":  # original context 32 < prompt; cos/sin scaled by 0.1 ln 4 + 1
        return LlamaConfig(**shape, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32})
    if kind == "llama_dynamic_rope":  # the base grows past 32 tokens; the context: 4 × 32
        return LlamaConfig(**{**shape, "max_position_embeddings": TINY_ORIGINAL_CONTEXT, **overrides},
                           rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    if kind == "qwen2":  # q/k/v biases, tied like Qwen2-0.5B
        return Qwen2Config(**shape, tie_word_embeddings=True)
    if kind == "qwen3":  # q/k norms per head; heads × head_dim ≠ hidden (as Qwen3-0.6B); untied
        return Qwen3Config(**{**shape, "head_dim": 32, **overrides}, tie_word_embeddings=False, attention_bias=False)
    if kind == "mistral":
        return MistralConfig(**shape, sliding_window=None)
    # Mixture of experts: 4 experts of width 64, each token routed to 2.
    if kind == "mixtral":  # top-2 weights renormalized
        return MixtralConfig(**{**shape, "intermediate_size": 64, **overrides}, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=None)
    if kind == "qwen3_moe":  # Qwen3's head norms; top-2 weights not renormalized
        return Qwen3MoeConfig(**{**shape, "head_dim": 32, "moe_intermediate_size": 64, **overrides}, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False)
    gemma = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_SLIDING_WINDOW)
    if kind == "gemma2":  # layer 0 slides, layer 1 global; caps small enough to bend the values
        return Gemma2Config(**{**shape, **gemma, **overrides}, attn_logit_softcapping=2.0,
                            final_logit_softcapping=3.0)
    if kind == "gemma3":  # layer 0 slides on its local RoPE base, layer 1 global with linear RoPE
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
        return Gemma3TextConfig(**{**shape, **gemma, **overrides}, rope_parameters=rope,
                                sliding_window_pattern=2, tie_word_embeddings=True)
    if kind in ("phi3", "phi4_mini"):
        # LongRoPE's short factors (all a prompt this short uses) and its attention factor
        # (context 256 over original 128); Phi-3 slides every layer, Phi-4-mini turns 3/4 of
        # each head and ties its head.
        partial = 1.0 if kind == "phi3" else 0.75
        half = int(shape["head_dim"] * partial) // 2
        rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.5 * i for i in range(half)],
                "long_factor": [4.0] * half, "partial_rotary_factor": partial, "rope_theta": 10000.0}
        window = TINY_SLIDING_WINDOW if kind == "phi3" else None
        return Phi3Config(**shape, original_max_position_embeddings=128, rope_parameters=rope, pad_token_id=0,
                          sliding_window=window, tie_word_embeddings=kind == "phi4_mini")
    if kind == "phi4_mini_long":  # Phi-4-mini whose prompts outgrow the short factors' 32 tokens
        half = int(shape["head_dim"] * 0.75) // 2
        rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.5 * i for i in range(half)],
                "long_factor": [2.0 + 1.5 * i for i in range(half)], "partial_rotary_factor": 0.75,
                "rope_theta": 10000.0}
        return Phi3Config(**shape, original_max_position_embeddings=TINY_ORIGINAL_CONTEXT, rope_parameters=rope,
                          pad_token_id=0, sliding_window=None, tie_word_embeddings=True)
    raise ValueError(f"unknown tiny model kind {kind!r}")


def write_tiny_checkpoint(
    tmp_path: Path, kind: str, *, seed: int = 0, std: float = 0.1, dtype=torch.float32, **overrides
) -> Path:
    """Save a random transformers model of ``kind`` (safetensors) under tmp_path; returns the
    folder. Every weight is redrawn (N(0, std); norms 1 + N(0, std)), biases included, so that
    logits differ meaningfully and every tensor's loading is exercised."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std)
            if "norm" in name:
                p.add_(1.0)
    folder = Path(tmp_path) / kind
    model.to(dtype).save_pretrained(folder)
    return folder


def write_word_level_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """tokenizer.json of a word-level vocabulary t0..t{n-1} (t2 is EOS, t1 BOS), so that the
    engine can load a tiny checkpoint folder; decodes join tokens with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t1", "eos_token": "t2", "add_bos_token": False})
    )


def write_tiny_model(folder: Path, **overrides) -> str:
    """A tiny random Llama checkpoint (``write_tiny_checkpoint``) with the word-level
    tokenizer: the cheapest model the engine loads from a folder."""
    path = write_tiny_checkpoint(folder, "llama", **overrides)
    write_word_level_tokenizer(path)
    return str(path)


FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                   "gate_up_proj")


def quantize_fp8(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale) the way FP8 checkpoints are made: the largest magnitude of the
    tensor ("tensor") or of each output row ("channel") maps to e4m3's largest value."""
    amax = w.abs().amax() if strategy == "tensor" else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / torch.finfo(torch.float8_e4m3fn).max).float()
    return (w / scale).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(src: Path, dst: Path, ref: Path, *, method: str, strategy: str) -> None:
    """``dst``: ``src``'s checkpoint with every decoder projection in FP8 beside its
    ``weight_scale`` (and a static ``input_scale``, which pipeserve does not use), its
    config.json saying so; ``ref``: the same model with those weights dequantized, for
    transformers."""
    from safetensors.torch import save_file

    from pipeserve.runtime.model.weights import iter_safetensors

    quantized, dequantized = {}, {}
    for name, w in iter_safetensors(src):
        if name.endswith(".weight") and name.split(".")[-2] in FP8_PROJECTIONS:
            q, scale = quantize_fp8(w, strategy)
            one = () if method == "fp8" else (1,)  # AutoFP8 saves scalars, compressed-tensors [1]
            scale_shape = one if strategy == "tensor" else (w.shape[0], 1)
            quantized |= {name: q, name + "_scale": scale.reshape(scale_shape),
                          name.removesuffix("weight") + "input_scale": torch.tensor(0.05).reshape(one)}
            dequantized[name] = q.float() * scale
        else:
            quantized[name] = dequantized[name] = w
    config = json.loads((src / "config.json").read_text())
    if method == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                    "symmetric": True, "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    for folder, tensors in ((dst, quantized), (ref, dequantized)):
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        shutil.copy(src / "generation_config.json", folder)
    (dst / "config.json").write_text(json.dumps(config))
    del config["quantization_config"]
    (ref / "config.json").write_text(json.dumps(config))


# Prompt shapes of a mixed batch: (tokens computed this step, context length after it).
MIXED_BATCH = [
    (1, 37),  # decode
    (9, 50),  # prefill chunk over a cached prefix
    (23, 23),  # whole prompt
    (1, 1),  # decode of a one-token context
    (1, 32),  # decode ending on a block boundary
    (16, 32),  # chunk ending on a block boundary
]


def load_hf_reference(folder: Path, *, dtype=torch.float32, device="cpu"):
    """The transformers model for a checkpoint, eager attention (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype)
    return model.to(device).eval()


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] float32 logits of one sequence."""
    device = next(hf_model.parameters()).device
    return hf_model(torch.tensor([token_ids], device=device)).logits[0].float()


@torch.no_grad()
def hf_logits_by_chunks(folder: Path, chunks: list[list[int]], *, device="cpu") -> torch.Tensor:
    """[total tokens, V] float32 logits of one sequence fed to transformers chunk by chunk
    through its KV cache, each chunk one forward: with dynamic NTK or LongRoPE each turns by the
    frequencies of its own last position + 1. The model is loaded afresh, since dynamic NTK keeps
    a grown base across forwards (a model that saw a longer sequence would keep its base)."""
    from transformers import DynamicCache

    hf_model = load_hf_reference(folder, device=device)
    # transformers 5 renames past_key_values to cache (the old name is deprecated)
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=hf_model.config)}
    return torch.cat([
        hf_model(torch.tensor([chunk], device=device), use_cache=True, **cache).logits[0].float() for chunk in chunks
    ])


def make_metadata(
    seqs: list[tuple[int, int]],
    block_tables: list[list[int]],
    block_size: int,
    device="cpu",
) -> AttentionMetadata:
    """Metadata for sequences given as (q_len, seq_len): each one's new tokens are the last
    q_len of its seq_len positions, stored through its block table."""
    query_start_loc, slots = [0], []
    for (q_len, seq_len), table in zip(seqs, block_tables, strict=True):
        assert 0 < q_len <= seq_len <= len(table) * block_size
        query_start_loc.append(query_start_loc[-1] + q_len)
        positions = range(seq_len - q_len, seq_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
    max_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    seq_lens = [seq_len for _, seq_len in seqs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        block_size=block_size,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


class PagedRunner:
    """Runs a whole (single-stage) model over the paged cache, the way the engine will:
    each sequence gets blocks from a shuffled free list (so tables are non-contiguous), and
    ``step`` packs several sequences' new tokens into one forward."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int = 64,
        block_size: int = 16,
        seed: int = 0,
        device="cpu",
    ) -> None:
        param = next(model.parameters())
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_caches = allocate_kv_cache(
            model.config,
            num_layers=model.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=param.dtype,
            device=device,
        )
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One packed forward over (seq_id, new token ids) chunks; returns each chunk's
        logits [len(chunk), V] float32."""
        seqs, tables, ids, positions = [], [], [], []
        for seq_id, tokens in chunks:
            start = self.num_tokens.get(seq_id, 0)
            seq_len = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < seq_len:
                table.append(self.free_blocks.pop())
            self.num_tokens[seq_id] = seq_len
            seqs.append((len(tokens), seq_len))
            tables.append(table)
            ids += tokens
            positions += range(start, seq_len)
        meta = make_metadata(seqs, tables, self.block_size, self.device)
        hidden = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            meta,
        )
        logits = self.model.compute_logits(hidden)
        return list(logits.split([len(tokens) for _, tokens in chunks]))
