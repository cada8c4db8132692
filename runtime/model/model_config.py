"""The shape of a Llama-family model, read from a Hugging Face ``config.json``.

Llama 2/3, Mistral, Qwen2 and Qwen3 share one decoder: RMSNorm, RoPE (NeoX / rotate-half
layout), grouped-query attention and a SwiGLU MLP. They differ only in the values here: Qwen2
adds q/k/v biases, Qwen3 an RMSNorm of each query and key head before RoPE, Llama 3 scales its
RoPE frequencies, small models tie the LM head to the embedding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("llama3", "linear", "yarn")  # plus no scaling ("default" / None)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    architecture: str
    """HF class name, one of SUPPORTED_ARCHITECTURES."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the SwiGLU MLP (each of gate/up)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than num_attention_heads for grouped-query attention; must divide it."""
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """None for plain RoPE; else {"rope_type": "llama3" | "linear" | "yarn", "factor": ..., ...}."""
    max_position_embeddings: int
    """Longest context; the RoPE tables are precomputed up to here."""
    tie_word_embeddings: bool
    """The LM head reuses the input embedding matrix."""
    attention_bias: bool
    """q/k/v projections have biases (Qwen2; Llama's ``attention_bias`` also biases o_proj)."""
    qk_norm: bool = False
    """Each query and key head is RMS-normed (its own weight of head_dim) before RoPE (Qwen3)."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        _check_rope_scaling(self.rope_scaling)

    @property
    def o_proj_bias(self) -> bool:
        """HF Llama's ``attention_bias`` covers o_proj too; Qwen2's q/k/v biases do not."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the contents of an HF ``config.json`` (transformers 4.x or 5.x layout)."""
        architecture = _architecture(d)
        hidden_size, num_heads = _require(d, "hidden_size"), _require(d, "num_attention_heads")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
                    f"({num_heads}) and config.json gives no head_dim"
                )
            head_dim = hidden_size // num_heads
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' (SwiGLU)")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']} (RoPE on part of each head) is not supported")
        rope_theta, rope_scaling = _rope(d)
        eos = d.get("eos_token_id")
        eos_token_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            architecture=architecture,
            vocab_size=_require(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(d, "intermediate_size"),
            num_hidden_layers=_require(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(d, architecture),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM"
            or bool(d.get("attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_token_ids),
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in {str(path)!r}")
        with open(config_path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


def _require(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(f"config.json lacks {key!r}")
    return d[key]


def _architecture(d: dict[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if len(architectures) > 1:
        raise ValueError(f"config.json names several architectures: {architectures}")
    if architectures:
        return architectures[0]
    model_type = d.get("model_type")
    if model_type not in _ARCH_BY_MODEL_TYPE:
        raise ValueError(
            f"unsupported model_type {model_type!r} (and no 'architectures' in config.json); "
            f"supported: {', '.join(_ARCH_BY_MODEL_TYPE)}"
        )
    return _ARCH_BY_MODEL_TYPE[model_type]


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 4 keys (``rope_theta`` +
    ``rope_scaling``) or transformers 5's ``rope_parameters``, which holds both."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None)
    params.pop("type", None)
    if rope_type in (None, "default"):
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **params}


def _check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {rope_type!r}; supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    keys = {"llama3": _LLAMA3_ROPE_KEYS, "yarn": ("original_max_position_embeddings",)}.get(rope_type, ("factor",))
    missing = [k for k in keys if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    if rope_type == "yarn" and rope_scaling.get("factor") is None:
        return  # DeepSeek-style: max_position_embeddings / original_max_position_embeddings
    if not rope_scaling["factor"] > 0 or not math.isfinite(rope_scaling["factor"]):
        raise ValueError(f"rope_scaling factor must be positive, got {rope_scaling['factor']}")


def _max_positions(d: dict[str, Any], architecture: str) -> int:
    """The context limit. We do not implement sliding-window attention, so a model that uses
    it (Mistral v0.1, Qwen2 with use_sliding_window) is capped to its window, within which
    full attention is exact (vLLM did the same before it supported windows)."""
    max_positions = _require(d, "max_position_embeddings")
    window = d.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
        window = None
    return min(max_positions, window) if window else max_positions
