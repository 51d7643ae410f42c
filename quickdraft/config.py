"""Typed configuration: the model's shape, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from quickdraft.errors import QuickdraftError

# --dtype values: "auto" keeps GGUF weights quantized (CPU kernels); the rest dequantize.
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")


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
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json``."""
        model_type = d.get("model_type")
        if not model_type:
            raise QuickdraftError("config.json has no 'model_type'; is this a Hugging Face model folder?")
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
