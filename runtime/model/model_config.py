"""The shape of a Llama-family model, read from a Hugging Face ``config.json``.

Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3 and Phi-3 share one decoder: RMSNorm, RoPE (NeoX /
rotate-half layout), grouped-query attention and a gated MLP. They differ only in the values
here: Qwen2 adds q/k/v biases, Qwen3 an RMSNorm of each query and key head before RoPE, Llama 3
scales its RoPE frequencies, small models tie the LM head to the embedding. Gemma (``is_gemma``)
scales the embedding by sqrt(hidden_size), norms with ``(1 + w)`` in float32 before and after
both attention and MLP, gates with GELU (tanh), scales queries by ``query_pre_attn_scalar`` and
alternates sliding-window and global layers (``layer_types``); Gemma 2 soft-caps the attention
scores and the logits, Gemma 3 norms q/k heads and gives its local layers their own RoPE base.
Phi-3 fuses q/k/v and gate/up in its checkpoints (split at load), scales RoPE with LongRoPE
(its short factors within the original context, its long ones past it) and, as Phi-4-mini, may
turn only part of each head (``partial_rotary_factor``).
Mixtral and Qwen3-MoE (``is_moe``) replace every layer's MLP with ``num_local_experts`` gated
MLPs of ``intermediate_size`` each and a router that sends each token to ``num_experts_per_tok``
of them; Qwen3-MoE has Qwen3's q/k head norms.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")  # plus no scaling ("default" / None)
# Scalings whose frequencies depend on the sequence's length when a token is computed.
LENGTH_SCALED_ROPE_TYPES = ("dynamic", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
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
    """Width of the SwiGLU MLP (each of gate/up); in an MoE model, of each expert's."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than num_attention_heads for grouped-query attention; must divide it."""
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """None for plain RoPE; else {"rope_type": "llama3" | "linear" | "dynamic" | "yarn" |
    "longrope", "factor": ..., ...}. "dynamic" (NTK) and "longrope" also hold
    ``original_max_position_embeddings``, the length past which a sequence's frequencies change
    (``length_scaled_rope``); for "dynamic" it is config.json's max_position_embeddings."""
    max_position_embeddings: int
    """Longest context (with dynamic NTK scaling, config.json's max_position_embeddings times
    its factor); the RoPE tables are precomputed up to here."""
    tie_word_embeddings: bool
    """The LM head reuses the input embedding matrix."""
    attention_bias: bool
    """q/k/v projections have biases (Qwen2; Llama's ``attention_bias`` also biases o_proj)."""
    qk_norm: bool = False
    """Each query and key head is RMS-normed (its own weight of head_dim) before RoPE (Qwen3,
    Gemma 3)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this ** -0.5 (Gemma); None: by head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Scores s become cap * tanh(s / cap) before the softmax (Gemma 2); None: no cap."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logits / cap) (Gemma 2); None: no cap."""
    sliding_window: int | None = None
    """Keys a sliding-window layer's query sees, itself included (the positions
    ``q - sliding_window < k <= q``); None when no layer slides."""
    layer_types: tuple[str, ...] = ()
    """One of LAYER_TYPES per layer (Gemma's alternation); empty: every layer full attention."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers, unscaled (Gemma 3's local base); None: every
    layer uses rope_theta and rope_scaling."""
    partial_rotary_factor: float = 1.0
    """RoPE turns the first ``rotary_dim`` = head_dim × this dimensions of each query and key
    head, the rest pass through (Phi-4-mini: 0.75)."""
    num_local_experts: int = 0
    """Experts per layer (Mixtral, Qwen3-MoE); 0: a dense MLP."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to: the top k of the router's softmax."""
    norm_topk_prob: bool = True
    """The top-k probabilities are renormalized to sum to 1 (Mixtral always; Qwen3-MoE per its
    ``norm_topk_prob``)."""
    quantization: str | None = None
    """How the decoder layers' linear weights are held: None in the model's dtype, "fp8" in
    float8_e4m3fn with a float32 scale per output row (``parallel/tp_layers.py``), from an FP8
    checkpoint or quantized at load. Embeddings, the LM head and norms keep the model's dtype."""
    fp8_checkpoint: bool = False
    """The checkpoint stores those weights in FP8, each with its ``weight_scale``
    (``quantization_config``: ``fp8``, or ``compressed-tensors`` float-quantized)."""
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
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                f"gives {self.rotary_dim} rotary dimensions; need an even number >= 2"
            )
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.rotary_dim // 2:
                    raise ValueError(
                        f"longrope {key} has {len(self.rope_scaling[key])} entries; "
                        f"rotary_dim {self.rotary_dim} needs {self.rotary_dim // 2}"
                    )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        self._check_layer_types()
        moe = self.architecture in MOE_ARCHITECTURES
        if (self.num_local_experts > 0) != moe or self.num_local_experts < 0:
            raise ValueError(
                f"{self.architecture} needs num_local_experts {'> 0' if moe else '= 0'}, "
                f"got {self.num_local_experts}"
            )
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_local_experts={self.num_local_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.quantization not in (None, "fp8") or (self.fp8_checkpoint and self.quantization != "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.quantization is not None and self.is_moe:
            raise ValueError(
                f"{self.architecture} with FP8 weights is not supported yet (the grouped-expert "
                "kernel multiplies bf16 experts)"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value}")

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            if self.sliding_window is not None:
                raise ValueError("sliding_window needs layer_types saying which layers slide")
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding-window layers need a positive sliding_window, got {self.sliding_window}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def length_scaled_rope(self) -> bool:
        """A token's RoPE frequencies depend on its sequence's length at the step that computes
        it (dynamic NTK, LongRoPE), not on its position alone."""
        return self.rope_scaling is not None and self.rope_scaling["rope_type"] in LENGTH_SCALED_ROPE_TYPES

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a routed mixture of experts."""
        return self.num_local_experts > 0

    @property
    def is_gemma(self) -> bool:
        """Gemma's embedding scale, ``(1 + w)`` float32 norms and four norms per layer."""
        return self.architecture in GEMMA_ARCHITECTURES

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of global layer ``layer``; None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """``layer_window`` of every layer, in order (the scheduler's ``SlidingLayers.of``)."""
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

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
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        partial_rotary_factor = float(
            (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        )
        if partial_rotary_factor != 1.0 and architecture != "Phi3ForCausalLM":
            raise ValueError(
                f"partial_rotary_factor={partial_rotary_factor} (RoPE on part of each head) is "
                f"supported for Phi3ForCausalLM only, not {architecture}"
            )
        if architecture == "Gemma3ForCausalLM":
            rope_theta, rope_scaling, local_rope_theta = _gemma3_rope(d)
        else:
            (rope_theta, rope_scaling), local_rope_theta = _rope(d), None
        eos = d.get("eos_token_id")
        eos_token_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            architecture=architecture,
            vocab_size=_require(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(d, _intermediate_key(architecture)),
            num_hidden_layers=_require(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(d, architecture, rope_scaling),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM"
            or bool(d.get("attention_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act=_hidden_act(d, architecture),
            local_rope_theta=local_rope_theta,
            partial_rotary_factor=partial_rotary_factor,
            **_gemma_attention(d, architecture),
            **_phi3_attention(d, architecture),
            **_moe(d, architecture),
            **_quantization(d),
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


def _quantization(d: dict[str, Any]) -> dict[str, Any]:
    """An FP8 checkpoint's ``quantization_config``, checked: AutoFP8 / vLLM's ``fp8`` (a scale
    per tensor) or ``compressed-tensors`` float-quantized with 8-bit float weights (a scale per
    tensor or per output channel), ``lm_head`` alone left unquantized. Their activation scheme
    (static input scales, dynamic per token) does not matter: activations are quantized per
    token on the fly (``kernels/fp8.py``). Anything else is an error naming it."""
    q = d.get("quantization_config")
    if not q:
        return {}
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            raise ValueError(
                f"block-wise FP8 checkpoints (weight_block_size={q['weight_block_size']}, a "
                "weight_scale_inv per block) are not supported; per-tensor and per-channel FP8 are"
            )
        return {"quantization": "fp8", "fp8_checkpoint": True}
    if method == "compressed-tensors":
        if q.get("format") not in ("float-quantized", "naive-quantized"):
            raise ValueError(
                f"compressed-tensors format {q.get('format')!r} is not supported (float-quantized FP8 is)"
            )
        for name, group in (q.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("strategy") not in ("tensor", "channel"):
                raise ValueError(
                    f"compressed-tensors group {name!r} quantizes weights as {w.get('type')} "
                    f"{w.get('num_bits')}-bit by {w.get('strategy')!r}; supported: float 8-bit "
                    "by tensor or channel"
                )
        ignored = [i for i in q.get("ignore") or [] if i != "lm_head"]
        if ignored:
            raise ValueError(f"FP8 checkpoints that leave layers besides lm_head unquantized are not supported: {ignored}")
        return {"quantization": "fp8", "fp8_checkpoint": True}
    raise ValueError(
        f"quantization method {method!r} is not supported; FP8 checkpoints (fp8, compressed-tensors "
        "float-quantized) are, and quantization=fp8 quantizes a float checkpoint at load"
    )


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
    params.pop("partial_rotary_factor", None)  # ModelConfig.partial_rotary_factor
    if rope_type in (None, "default"):
        return rope_theta, None
    if rope_type in ("longrope", "su"):  # "su": Phi-3's first name for it
        return rope_theta, _longrope(d, params)
    if rope_type == "dynamic":
        return rope_theta, _dynamic_ntk(d, params)
    return rope_theta, {"rope_type": rope_type, **params}


def _dynamic_ntk(d: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Dynamic NTK's parameters. transformers grows the base for a sequence longer than the
    config's max_position_embeddings (and reads no other length: an
    ``original_max_position_embeddings`` among the parameters does not count), so that length
    becomes original_max_position_embeddings here, and the context extends to factor times it
    (``_max_positions``)."""
    return {**params, "rope_type": "dynamic",
            "original_max_position_embeddings": _require(d, "max_position_embeddings")}


def _longrope(d: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters with its factor made explicit: transformers derives it from the
    config's max_position_embeddings over original_max_position_embeddings (which Phi-3 keeps
    at the top level)."""
    original = params.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("longrope RoPE scaling lacks original_max_position_embeddings")
    factor = params.get("factor") or _require(d, "max_position_embeddings") / original
    return {**params, "rope_type": "longrope", "original_max_position_embeddings": original, "factor": factor}


def _gemma3_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling) of Gemma 3's global layers and the RoPE base of its local
    ones, from transformers 5's per-layer-type ``rope_parameters`` or transformers 4's
    ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` (defaults 1e6 and 1e4)."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:
        lengths = {k: d[k] for k in ("max_position_embeddings", "original_max_position_embeddings") if k in d}
        rope_theta, rope_scaling = _rope({"rope_parameters": params["full_attention"], "rope_theta": 1e6, **lengths})
        local_theta, local_scaling = _rope(
            {"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": 1e4, **lengths}
        )
    else:
        rope_theta, rope_scaling = _rope({"rope_theta": 1e6, **d})
        local_theta, local_scaling = float(d.get("rope_local_base_freq", 1e4)), None
    if local_scaling is not None:
        raise ValueError(
            f"RoPE scaling {local_scaling['rope_type']!r} on the sliding-window layers is not supported"
        )
    return rope_theta, rope_scaling, local_theta


def _hidden_act(d: dict[str, Any], architecture: str) -> str:
    """Gemma names its activation ``hidden_activation`` (``hidden_act`` is Gemma 1's)."""
    if architecture in GEMMA_ARCHITECTURES:
        return d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    return d.get("hidden_act", "silu")


def _phi3_attention(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Phi-3's ``sliding_window`` (Phi-3-mini-4k: 2047) slides over every layer, as
    transformers' Phi-3 masks; {} for other architectures or without a window."""
    if architecture != "Phi3ForCausalLM" or d.get("sliding_window") is None:
        return {}
    num_layers = _require(d, "num_hidden_layers")
    return {"sliding_window": d["sliding_window"], "layer_types": ("sliding_attention",) * num_layers}


def _intermediate_key(architecture: str) -> str:
    """Qwen3-MoE's experts are ``moe_intermediate_size`` wide (its ``intermediate_size`` is
    that of the dense layers we do not support)."""
    return "moe_intermediate_size" if architecture == "Qwen3MoeForCausalLM" else "intermediate_size"


def _moe(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The router's settings as ModelConfig fields; {} for dense architectures. Settings whose
    layers or routing the decoder does not implement are errors: Mixtral's training-time
    ``router_jitter_noise``, Qwen3-MoE's dense layers (``mlp_only_layers``,
    ``decoder_sparse_step`` > 1)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    if architecture == "MixtralForCausalLM":
        if d.get("router_jitter_noise"):
            raise ValueError(f"router_jitter_noise={d['router_jitter_noise']} is not supported (need 0)")
        num_experts, norm_topk_prob = _require(d, "num_local_experts"), True
    else:
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"Qwen3-MoE with dense layers (mlp_only_layers={d.get('mlp_only_layers')}, "
                f"decoder_sparse_step={d.get('decoder_sparse_step')}) is not supported"
            )
        # Hub configs say num_experts; transformers 5 saves it as num_local_experts.
        num_experts = d.get("num_experts") or _require(d, "num_local_experts")
        norm_topk_prob = bool(d.get("norm_topk_prob", False))
    return {"num_local_experts": num_experts, "num_experts_per_tok": _require(d, "num_experts_per_tok"),
            "norm_topk_prob": norm_topk_prob}


def _gemma_attention(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Gemma's attention settings as ModelConfig fields; {} for other architectures. Without
    ``layer_types``, Gemma 2 alternates sliding and global layers (sliding first) and Gemma 3
    makes every ``sliding_window_pattern``-th layer global, as transformers does."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    gemma3 = architecture == "Gemma3ForCausalLM"
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an encoder's attention) is not supported")
    if gemma3 and d.get("attn_logit_softcapping") is not None:
        raise ValueError(
            "attn_logit_softcapping on Gemma 3 is not supported (transformers' Gemma 3 ignores it)"
        )
    pattern = d.get("sliding_window_pattern", 6) if gemma3 else 2
    num_layers = _require(d, "num_hidden_layers")
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    caps = {k: d.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {
        "query_pre_attn_scalar": float(_require(d, "query_pre_attn_scalar")),
        **{k: None if v is None else float(v) for k, v in caps.items()},
        "sliding_window": d.get("sliding_window"),
        "layer_types": tuple(layer_types),
    }


def _check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {rope_type!r}; supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    keys = {
        "llama3": _LLAMA3_ROPE_KEYS,
        "dynamic": ("factor", "original_max_position_embeddings"),
        "yarn": ("original_max_position_embeddings",),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor"),
    }.get(rope_type, ("factor",))
    missing = [k for k in keys if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    if rope_type == "yarn" and rope_scaling.get("factor") is None:
        return  # DeepSeek-style: max_position_embeddings / original_max_position_embeddings
    factor = rope_scaling["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"rope_scaling factor must be a positive number, got {factor!r}")
    if rope_type == "dynamic" and factor < 1:
        raise ValueError(f"dynamic rope_scaling factor must be >= 1 (it extends the context), got {factor}")


def _max_positions(d: dict[str, Any], architecture: str, rope_scaling: dict[str, Any] | None) -> int:
    """The context limit. Dynamic NTK scaling extends config.json's max_position_embeddings by
    its factor (as vLLM does): transformers grows the base only for sequences longer than that,
    so without the extension the scaling would never act. Mistral v0.1, Mixtral and Qwen2 /
    Qwen3(-MoE) with use_sliding_window slide over every layer; they are capped to their
    window, within which full attention is exact (vLLM did the same before it supported
    windows). Gemma's and Phi-3's windows are real (``layer_types``)."""
    max_positions = _require(d, "max_position_embeddings")
    if rope_scaling is not None and rope_scaling["rope_type"] == "dynamic":
        _check_rope_scaling(rope_scaling)  # a clear error for a bad factor before it is used
        max_positions = int(max_positions * rope_scaling["factor"])
    if architecture in GEMMA_ARCHITECTURES + ("Phi3ForCausalLM",):
        return max_positions
    window = d.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not d.get(
        "use_sliding_window", False
    ):
        window = None
    return min(max_positions, window) if window else max_positions
