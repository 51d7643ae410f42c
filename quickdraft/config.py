"""Typed configuration: the model's shape, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    import torch

# --dtype values: "auto" keeps GGUF weights quantized (CPU kernels); the rest dequantize.
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
# KV cache element types: auto = float16 where the CPU kernels run the model (fp32 activations;
# the native attention widens each key and value exactly), else the activation dtype.
KV_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "q8_0")
DEVICES = ("auto", "cpu", "cuda")  # --device (and cuda:N)
CUDA_GRAPH_MODES = ("auto", "on", "off")  # --cuda-graphs
# A draft model's output head covers its this many most frequent tokens, as many first ids, each
# prompt's tokens and the special tokens (quickdraft.speculative.vocab); 0 = the whole vocabulary.
DEFAULT_DRAFT_VOCAB = 16384
# A draft model stops a proposal after a token it gives less than this probability (0 = never).
DEFAULT_DRAFT_CONFIDENCE = 0.8
# Host memory for stored prefix-cache copies (quickdraft.prefix_cache), capped at a quarter of the
# machine's memory: 8 conversations of 4k tokens of Qwen2.5-Coder-1.5B + its 0.5B draft take ~2.7 GB.
DEFAULT_PREFIX_CACHE_MB = 4096
# quickdraft serve generates this many requests at once by default (fewer where their KV does not fit)
DEFAULT_MAX_CONCURRENCY = 4


def prefix_cache_bytes(mb: int | None, total_bytes: int) -> int:
    """The prefix cache's byte budget for ``--prefix-cache-mb`` (None: the default); 0 = off."""
    if mb is None:
        return min(DEFAULT_PREFIX_CACHE_MB << 20, total_bytes // 4)
    if mb < 0:
        raise QuickdraftError(f"--prefix-cache-mb must be 0 (off) or a positive number of MB, got {mb}")
    if mb << 20 > total_bytes:
        raise QuickdraftError(
            f"--prefix-cache-mb {mb} is more than this machine's memory ({total_bytes >> 20} MB); "
            f"use at most a fraction of it, e.g. {total_bytes >> 22}"
        )
    return mb << 20


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer, with Hugging Face field names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (qwen3)
    sliding_window: int | None = None
    # Mixture of experts (quickdraft/models/moe.py); the defaults describe a dense model.
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # width of one routed expert's MLP
    shared_expert_intermediate_size: int = 0  # width of the always-on shared expert; 0 = none
    norm_topk_prob: bool = False  # qwen MoE: renormalise the top-k softmax weights to sum to 1
    decoder_sparse_step: int = 1  # qwen MoE: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    moe_layers: tuple[int, ...] | None = None  # llama4: the sparse layers; None = every
    interleave_moe_layer_step: int = 1  # ... interleave_moe_layer_step-th layer
    # Llama 4 attention: per layer, RoPE + chunked attention + L2 q/k norm, or NoPE + temperature.
    attention_chunk_size: int | None = None  # RoPE layers attend within chunks of this many positions
    no_rope_layers: tuple[int, ...] = ()  # 1 = the layer uses RoPE, 0 = NoPE (HF's naming); () = all RoPE
    qk_l2_norm: bool = False  # L2-normalise q and k (no weight) after RoPE, RoPE layers only
    attn_temperature_tuning: bool = False  # scale NoPE layers' queries up with the position
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    # Gemma 3 (quickdraft/models/gemma3.py); the defaults describe every other model.
    layer_types: tuple[str, ...] | None = None  # per layer "sliding_attention" (uses sliding_window) or "full_attention"
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (rope_theta / rope_scaling: the full ones)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this dims of each head (phi3)
    # Hybrid models (quickdraft/models/qwen3_5.py): layer_types "linear_attention" layers are Gated
    # DeltaNet (a short causal convolution, then the gated delta rule over a recurrent state).
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    attn_output_gate: bool = False  # q_proj also yields a gate: attention output * sigmoid(gate)
    # GPT-OSS experts (quickdraft/models/gpt_oss.py): gate clamped at swiglu_limit, up to
    # [-limit, limit], activation (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Value heads in llama.cpp's tiled order (value head j reads q/k head j % nk; GGUF files), not
    # grouped (j reads q/k head j // (nv / nk); Hugging Face checkpoints).
    linear_value_heads_tiled: bool = False
    # Gemma 4 (quickdraft/models/gemma4.py): full-attention layers with their own head size and KV
    # heads, keys that are also the values there, the last layers reusing earlier layers' keys and
    # values, a per-layer token embedding fed into every layer, routed experts beside the MLP.
    global_head_dim: int = 0  # head size of the full-attention layers (0: head_dim)
    num_global_key_value_heads: int = 0  # their KV heads (0: num_key_value_heads)
    attention_k_eq_v: bool = False  # full-attention layers have no v_proj: values are the keys before k_norm
    num_kv_shared_layers: int = 0  # the last n layers attend to the last earlier layer of their type's keys/values
    hidden_size_per_layer_input: int = 0  # width of each layer's per-layer embedding (0: none)
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False  # the KV-sharing layers' MLPs are twice intermediate_size wide
    extra: dict[str, Any] = field(default_factory=dict)

    def layer_pattern(self) -> str:
        """The layers as the start-up line names them: "24 layers" or, for models with several
        kinds, "24 layers: 18 linear_attention + 6 full_attention (every 4th)"."""
        shared = self.num_kv_shared_layers
        return self._layer_kinds() + (f", the last {shared} reusing earlier layers' keys and values" if shared else "")

    def _layer_kinds(self) -> str:
        n = self.num_hidden_layers
        if not self.layer_types or len(set(self.layer_types)) == 1:
            return f"{n} layers" + (f" of {self.layer_types[0]}" if self.layer_types else "")
        kinds = sorted(set(self.layer_types), key=self.layer_types.index)
        counts = " + ".join(f"{self.layer_types.count(k)} {k}" for k in kinds)
        rarest = min(kinds, key=self.layer_types.count)
        at = [i for i, t in enumerate(self.layer_types) if t == rarest]
        step = at[0] + 1
        every = f" (every {step}{'st' if step == 1 else 'nd' if step == 2 else 'rd' if step == 3 else 'th'})" \
            if at == list(range(step - 1, n, step)) else ""
        return f"{n} layers: {counts}{every}"

    def to_json_dict(self) -> dict[str, Any]:
        """The fields as JSON values (:meth:`from_json_dict` reads them back equal)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read :meth:`to_json_dict` back: JSON lists become the tuples the fields hold."""
        tuples = {f.name for f in fields(cls) if "tuple" in str(f.type)}
        values: dict[str, Any] = {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in d.items()}
        return cls(**values)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], supported: Sequence[str] | None = None) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json``; ``supported``: the model types that may
        be built (others are refused by name, before their fields are read)."""
        d = _text_config(_llama4_text_config(d))
        model_type = d.get("model_type")
        if not model_type:
            raise QuickdraftError("config.json has no 'model_type'; is this a Hugging Face model folder?")
        if supported is not None and model_type not in supported:  # before its fields: a nested config has none at the top
            raise QuickdraftError(f"architecture {model_type!r} is not supported; supported: {', '.join(supported)}")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            cfg = dict(
                model_type=str(model_type),
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(d)),
                rope_scaling=_rope_scaling(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                sliding_window=d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None,
            )
            cfg.update(_moe_fields(str(model_type), d, int(d["num_hidden_layers"])))
            cfg.update(_gemma3_fields(str(model_type), d))
            cfg.update(_phi3_fields(str(model_type), d))
            cfg.update(_qwen3_5_fields(str(model_type), d))
            cfg.update(_gpt_oss_fields(str(model_type), d))
            cfg.update(_gemma4_fields(str(model_type), d))
        except KeyError as exc:
            raise QuickdraftError(f"config.json lacks the field {exc}; the model folder looks incomplete") from None
        known = {f.name for f in fields(cls)}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**cfg, extra=extra)  # type: ignore[arg-type]


def _rope_theta(d: dict[str, Any]) -> float:
    params = d.get("rope_parameters") or {}
    return float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    scaling = d.get("rope_scaling") or d.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


# Hugging Face config defaults of the MoE families, used where a config.json leaves a field out.
_QWEN_MOE_DEFAULTS = {
    "qwen2_moe": {"num_experts_per_tok": 4, "moe_intermediate_size": 1408},
    "qwen3_moe": {"num_experts_per_tok": 8, "moe_intermediate_size": 768},
}
_QWEN_MOE_EXPERTS = {"qwen2_moe": 60, "qwen3_moe": 128}


def _num_experts(d: dict[str, Any], default: int) -> int:
    """Routed experts: configs name them num_experts or num_local_experts (transformers aliases
    one to the other for mixtral and qwen3_moe, and saves whichever the class stores)."""
    for key in ("num_experts", "num_local_experts"):
        if d.get(key) is not None:
            return int(d[key])
    return default


def _moe_fields(model_type: str, d: dict[str, Any], layers: int) -> dict[str, Any]:
    """The MoE / Llama 4 fields of a Hugging Face config (and the dense fields these families
    name differently), resolved the way transformers' config classes resolve them."""
    if model_type == "mixtral":
        return {
            "num_experts": _num_experts(d, 8),
            "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
            "moe_intermediate_size": int(d["intermediate_size"]),
            "sliding_window": d.get("sliding_window"),  # Mixtral has no use_sliding_window switch
        }
    if model_type in _QWEN_MOE_DEFAULTS:
        defaults = _QWEN_MOE_DEFAULTS[model_type]
        out: dict[str, Any] = {
            key: int(d.get(key, default)) for key, default in defaults.items()
        } | {
            "num_experts": _num_experts(d, _QWEN_MOE_EXPERTS[model_type]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        }
        if model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size", 5632))
            out["attention_bias"] = bool(d.get("qkv_bias", True))
        else:
            out["qk_norm"] = True
        return out
    if model_type in ("llama4", "llama4_text"):
        step = int(d.get("interleave_moe_layer_step", 1))
        moe_layers = d.get("moe_layers")
        if moe_layers is None:
            moe_layers = range(step - 1, layers, step)
        interval = int(d.get("no_rope_layer_interval", 4))
        no_rope = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        expert = int(d.get("intermediate_size", 8192))
        return {
            "num_experts": _num_experts(d, 16),
            "num_experts_per_tok": int(d.get("num_experts_per_tok", 1)),
            "moe_intermediate_size": expert,
            "shared_expert_intermediate_size": expert,
            "intermediate_size": int(d.get("intermediate_size_mlp", 16384)),  # the dense layers' MLP
            "moe_layers": tuple(int(i) for i in moe_layers),
            "interleave_moe_layer_step": step,
            "attention_chunk_size": d.get("attention_chunk_size", 8192),
            # "chunked_attention" / "full_attention" per layer; None: chunked = RoPE layers
            "layer_types": tuple(d["layer_types"]) if d.get("layer_types") else None,
            "no_rope_layers": tuple(int(i) for i in no_rope),
            "qk_l2_norm": bool(d.get("use_qk_norm", True)),
            "attn_temperature_tuning": bool(d.get("attn_temperature_tuning", True)),
            "floor_scale": float(d.get("floor_scale", 8192)),
            "attn_scale": float(d.get("attn_scale", 0.1)),
            "attention_bias": bool(d.get("attention_bias", False)),
        }
    return {}


def _llama4_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A full Llama 4 checkpoint (model_type "llama4": vision + text) runs as its text model:
    its text_config, keeping model_type "llama4" (the weights carry a ``language_model.`` prefix)."""
    text = d.get("text_config")
    if d.get("model_type") != "llama4" or not isinstance(text, dict):
        return d
    tied = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": "llama4", "tie_word_embeddings": tied}


# Vision-language checkpoints whose text model quickdraft runs: model_type -> the text model's.
_TEXT_MODELS = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
                "qwen3_5_moe_text": "qwen3_5_moe", "gemma4": "gemma4_text"}
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # Gated DeltaNet + gated attention (models/qwen3_5.py)


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of a model with a vision tower (Qwen3.5) runs as its text model: its text_config
    (the weights carry a ``language_model.`` prefix, dropped at load), under the text model's type."""
    model_type = d.get("model_type")
    if model_type not in _TEXT_MODELS:
        return d
    text = d.get("text_config")
    out = dict(text) if isinstance(text, dict) else dict(d)
    if isinstance(text, dict) and "tie_word_embeddings" in d:
        out.setdefault("tie_word_embeddings", d["tie_word_embeddings"])
    if "intermediate_size" not in out and "moe_intermediate_size" in out:  # Qwen3.5-MoE: experts only
        out["intermediate_size"] = out["moe_intermediate_size"]
    return {**out, "model_type": _TEXT_MODELS[str(model_type)]}


def _qwen3_5_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text fields (transformers' config defaults where a
    config.json leaves one out): Gated DeltaNet layers between gated full-attention layers (every
    ``full_attention_interval``-th), partial rotary, q/k norms, and the MoE families' experts."""
    if model_type not in HYBRID_TYPES:
        return {}
    activation = d.get("hidden_act", "silu")
    if activation != "silu":
        raise QuickdraftError(f"Qwen3.5 with hidden_act {activation!r} is not supported (only silu)")
    layers = int(d["num_hidden_layers"])
    interval = int(d.get("full_attention_interval") or 4)
    layer_types = d.get("layer_types") or [
        LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)
    ]
    unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown or len(layer_types) != layers:
        raise QuickdraftError(
            f"config.json has layer_types {layer_types!r}; expected {layers} of {LINEAR_ATTENTION}/{FULL_ATTENTION}"
        )
    params = d.get("rope_parameters") or {}
    scaling = _rope_scaling(d)
    if scaling is not None:  # (mrope sections are plain RoPE for text: one position per token)
        raise QuickdraftError(f"Qwen3.5 with rope_type {scaling['rope_type']!r} is not supported (only default)")
    return {
        "head_dim": int(d.get("head_dim") or 256),
        "layer_types": tuple(str(t) for t in layer_types),
        "partial_rotary_factor": float(params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 0.25),
        "qk_norm": True,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": int(d.get("linear_conv_kernel_dim") or 4),
        "linear_key_head_dim": int(d.get("linear_key_head_dim") or 128),
        "linear_value_head_dim": int(d.get("linear_value_head_dim") or 128),
        "linear_num_key_heads": int(d.get("linear_num_key_heads") or 16),
        "linear_num_value_heads": int(d.get("linear_num_value_heads") or 32),
    } | ({} if model_type == "qwen3_5" else {  # MLPs of routed experts plus a gated shared one
        "num_experts": int(d.get("num_experts") or (512 if model_type == "qwen3_next" else 256)),
        "num_experts_per_tok": int(d.get("num_experts_per_tok") or (10 if model_type == "qwen3_next" else 8)),
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or 512),
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 512),
        "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
        # qwen3_next: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not listed
        "decoder_sparse_step": int(d.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    })


def _gpt_oss_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS: every MLP routed experts (``num_local_experts``, ``intermediate_size`` wide), biases
    in attention, layers alternating sliding-window / full attention (transformers' defaults)."""
    if model_type != "gpt_oss":
        return {}
    layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise QuickdraftError(f"config.json has layer_types {layer_types!r}; expected {layers} of sliding_attention/full_attention")
    return {
        "num_experts": _num_experts(d, 128),
        "num_experts_per_tok": int(d.get("num_experts_per_tok") or 4),
        "moe_intermediate_size": int(d["intermediate_size"]),
        "attention_bias": bool(d.get("attention_bias", True)),
        "sliding_window": int(d.get("sliding_window") or 128),
        "layer_types": tuple(str(t) for t in layer_types),
        "swiglu_alpha": float(d.get("swiglu_alpha") or 1.702),
        "swiglu_limit": float(d.get("swiglu_limit") or 7.0),
    }


_GEMMA3_FULL_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig's defaults


def _gemma3_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text fields, with transformers' Gemma3TextConfig defaults for what a config.json
    leaves out. RoPE comes either as transformers 5's ``rope_parameters`` per layer type or in
    the older flat form (``rope_theta`` + ``rope_scaling`` for full layers, ``rope_local_base_freq``
    for sliding ones). Features quickdraft does not compute are refused, not ignored."""
    if model_type != "gemma3_text":
        return {}
    if d.get("attn_logit_softcapping") is not None:
        raise QuickdraftError("Gemma attention logit soft-capping (attn_logit_softcapping) is not supported")
    if d.get("use_bidirectional_attention"):
        raise QuickdraftError("bidirectional Gemma 3 models (embedding models) cannot generate text")
    activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise QuickdraftError(f"Gemma 3 with hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    layers = int(d["num_hidden_layers"])
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise QuickdraftError(f"config.json has layer_types {layer_types!r}; expected {layers} of sliding_attention/full_attention")
    params = d.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {}, rope_theta=d.get("rope_theta") or _GEMMA3_FULL_THETA)
        local = {"rope_theta": d.get("rope_local_base_freq") or _GEMMA3_LOCAL_THETA}
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise QuickdraftError("Gemma 3 with RoPE scaling on its sliding-window layers is not supported")
    softcap = d.get("final_logit_softcapping")
    return {
        "head_dim": int(d.get("head_dim") or 256),
        "sliding_window": int(d.get("sliding_window") or 4096),
        "layer_types": tuple(str(t) for t in layer_types),
        "rope_theta": float(full.get("rope_theta") or _GEMMA3_FULL_THETA),
        "rope_scaling": _rope_scaling({"rope_scaling": full}),
        "rope_local_theta": float(local.get("rope_theta") or _GEMMA3_LOCAL_THETA),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
        "qk_norm": True,
    }


_GEMMA4_FULL_THETA, _GEMMA4_LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma4TextConfig's defaults


def _gemma4_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 text fields, with transformers' Gemma4TextConfig defaults for what a config.json
    leaves out. The full-attention layers' head size and KV heads come as ``global_head_dim`` /
    ``num_global_key_value_heads`` (the released configs) or as transformers' ``per_layer_config``
    (what it saves); their RoPE is "proportional" (rotating a part of each head, the rest at
    frequency zero)."""
    if model_type != "gemma4_text":
        return {}
    if d.get("use_bidirectional_attention") == "all":
        raise QuickdraftError("bidirectional Gemma 4 models (embedding models) cannot generate text")
    activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise QuickdraftError(f"Gemma 4 with hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    layers = int(d["num_hidden_layers"])
    layer_types = list(d.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)
    ])
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise QuickdraftError(f"config.json has layer_types {layer_types!r}; expected {layers} of sliding_attention/full_attention")
    layer_types[-1] = "full_attention"  # as transformers forces it
    head_dim = int(d.get("head_dim") or 256)
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    global_dim = d.get("global_head_dim")
    global_kv = d.get("num_global_key_value_heads") if k_eq_v else None
    if d.get("per_layer_config"):  # transformers' saved form: {layer: {head_dim, num_key_value_heads}}
        overrides = {int(i): dict(o) for i, o in d["per_layer_config"].items()}
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        if sorted(overrides) != full or any(o != overrides[full[0]] for o in overrides.values()):
            raise QuickdraftError("Gemma 4 per_layer_config must give every full-attention layer the same head_dim "
                                  f"and num_key_value_heads (and no other layer); this config.json has {overrides!r}")
        global_dim = overrides[full[0]].get("head_dim", global_dim)
        global_kv = overrides[full[0]].get("num_key_value_heads", global_kv)
    params = d.get("rope_parameters") or {}
    local = dict(params.get("sliding_attention") or {"rope_theta": _GEMMA4_LOCAL_THETA})
    full_rope = dict(params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": _GEMMA4_FULL_THETA})
    if (local.get("rope_type") or "default") != "default":
        raise QuickdraftError("Gemma 4 with RoPE scaling on its sliding-window layers is not supported")
    shared = int(d.get("num_kv_shared_layers") or 0)
    if shared and set(layer_types[: layers - shared]) != set(layer_types):
        raise QuickdraftError(f"Gemma 4 with num_kv_shared_layers={shared}: the layers before them must include "
                              "every layer type whose keys and values they reuse")
    moe = bool(d.get("enable_moe_block", False))
    softcap = d.get("final_logit_softcapping")
    return {
        "head_dim": head_dim,
        "global_head_dim": int(global_dim or 512),
        "num_global_key_value_heads": int(global_kv or 0),
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(d.get("hidden_size_per_layer_input", 256) or 0),
        "vocab_size_per_layer_input": int(d.get("vocab_size_per_layer_input") or 262_144),
        "use_double_wide_mlp": bool(d.get("use_double_wide_mlp", False)),
        "sliding_window": int(d.get("sliding_window") or 512),
        "layer_types": tuple(str(t) for t in layer_types),
        "rope_theta": float(full_rope.get("rope_theta") or _GEMMA4_FULL_THETA),
        "rope_scaling": _rope_scaling({"rope_scaling": full_rope}),
        "rope_local_theta": float(local.get("rope_theta") or _GEMMA4_LOCAL_THETA),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "num_experts": int(d.get("num_experts") or 0) if moe else 0,
        "num_experts_per_tok": int(d.get("top_k_experts") or 0) if moe else 0,
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or 0) if moe else 0,
    }


def _phi3_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini fields: partial rotary, a sliding window on every layer (computed, so
    it is given as layer types), and LongRoPE.

    LongRoPE switches from ``short_factor`` to ``long_factor`` frequencies once a sequence grows
    past ``original_max_position_embeddings`` (transformers recomputes every position then); only
    the short half is implemented, so the context is limited to the original length, where the
    result equals transformers'. The attention factor (cos/sin scale) is resolved here as
    transformers does: from the config, else from max_position_embeddings / original length.
    """
    if model_type != "phi3":
        return {}
    activation = d.get("hidden_act", "silu")
    if activation != "silu":
        raise QuickdraftError(f"Phi-3 with hidden_act {activation!r} is not supported (only silu)")
    layers = int(d["num_hidden_layers"])
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    out: dict[str, Any] = {
        "partial_rotary_factor": float(params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0),
        "sliding_window": None,
        "layer_types": None,
    }
    window = d.get("sliding_window")
    if window:
        out["sliding_window"] = int(window)
        out["layer_types"] = ("sliding_attention",) * layers
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind in ("longrope", "su", "yarn"):  # transformers reads all three as LongRoPE for phi3
        max_pos = int(d.get("max_position_embeddings", 4096))
        original = int(scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or max_pos)
        factor = float(scaling.get("factor") or max_pos / original)
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [float(x) for x in scaling["short_factor"]],
            "attention_factor": float(attention),
            "original_max_position_embeddings": original,
        }
        out["max_position_embeddings"] = min(max_pos, original)
    elif kind != "default":
        raise QuickdraftError(f"Phi-3 rope_scaling type {kind!r} is not supported (supported: longrope)")
    return out


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a clear
    error when CUDA is asked for but not usable here."""
    import torch

    key = name.strip().lower()
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if key == "cpu":
        return torch.device("cpu")
    if key == "cuda" or key.startswith("cuda:"):
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise QuickdraftError(
                f"--device {name}: CUDA is not available ({why}; torch {torch.__version__}); "
                "use --device cpu, or --device auto to pick CUDA only when it is there"
            )
        try:
            device = torch.device(key)
        except RuntimeError:
            raise QuickdraftError(f"--device {name!r} is not a device name like cuda or cuda:0") from None
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise QuickdraftError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        return device
    raise QuickdraftError(f"--device must be one of {', '.join(DEVICES)} (or cuda:N), got {name!r}")
