"""Phi-3 / Phi-4-mini (HF ``model_type`` "phi3"; GGUF architecture "phi3").

The Llama decoder with, as in transformers' ``modeling_phi3``:

* fused weights, kept fused: ``self_attn.qkv_proj`` (rows: q heads, then k, then v) and
  ``mlp.gate_up_proj`` (rows: gate, then up), so one matmul serves each pair and quantized GGUF
  tensors (``attn_qkv``, ``ffn_up``) stay whole;
* partial rotary embeddings (``partial_rotary_factor``: RoPE on the first dims of each head,
  the rest passes through), Phi-4-mini's 0.75;
* LongRoPE (``rope_scaling`` "longrope"/"su") within the original context: frequencies divided
  by ``short_factor``, cos/sin scaled by the attention factor (see :func:`_hf_fields`);
* the sliding window of ``sliding_window`` positions on every layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ConfigUpdate, Family, GGUFMetadata, ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models import causal_lm
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.layers import Attention, RMSNorm, Rope, embedding


class PartialRope(Rope):
    """RoPE over the first ``head_dim * partial_rotary_factor`` dims, with LongRoPE's short factors."""

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device or self.cos.device)
        cfg = self.cfg
        dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
        scaling = cfg.rope_scaling or {}
        scale = 1.0
        if scaling.get("rope_type") == "longrope":
            inv = inv / torch.tensor(scaling["short_factor"], dtype=torch.float64, device="cpu")
            scale = float(scaling["attention_factor"])
        elif scaling:
            raise QuickdraftError(f"Phi-3 rope_scaling {scaling.get('rope_type')!r} is not supported (supported: longrope)")
        if device.type == "meta":  # built before loading: materialize() computes the real tables
            self.cos = self.sin = torch.empty(self.max_len, dim, device=device)
            return
        freqs = torch.outer(torch.arange(self.max_len, dtype=torch.float32, device="cpu"), inv.float())
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, dim]
        self.cos, self.sin = (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dim = self.cos.shape[-1]
        if dim == x.shape[-1]:
            return super().forward(x, positions)
        return torch.cat([super().forward(x[..., :dim], positions), x[..., dim:]], dim=-1)


class Phi3Attention(Attention):
    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None) -> None:
        super().__init__(cfg, rope, window=window)
        del self.q_proj, self.k_proj, self.v_proj
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.reshape(t, self.nh, self.hd).transpose(0, 1),
            k.reshape(t, self.nkv, self.hd).transpose(0, 1),
            v.reshape(t, self.nkv, self.hd).transpose(0, 1),
        )


class Phi3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope) -> None:
        super().__init__()
        self.self_attn = Phi3Attention(cfg, rope, cfg.sliding_window if cfg.layer_types else None)
        self.mlp = Phi3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layer, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = PartialRope(cfg, max_len)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(causal_lm.CausalLM):
    """:class:`causal_lm.CausalLM` (same forward, cache and captures) over Phi-3 layers."""

    backbone = _Backbone


# ------------------------------------------------------------------------------ config


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Phi-3 / Phi-4-mini fields: partial rotary, a sliding window on every layer (computed, so
    it is given as layer types), and LongRoPE.

    LongRoPE switches from ``short_factor`` to ``long_factor`` frequencies once a sequence grows
    past ``original_max_position_embeddings`` (transformers recomputes every position then); only
    the short half is implemented, so the context is limited to the original length, where the
    result equals transformers'. The attention factor (cos/sin scale) is resolved here as
    transformers does: from the config, else from max_position_embeddings / original length.
    """
    activation = d.get("hidden_act", "silu")
    if activation != "silu":
        raise QuickdraftError(f"Phi-3 with hidden_act {activation!r} is not supported (only silu)")
    layers = int(d["num_hidden_layers"])
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    out: ConfigUpdate = {
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


def _gguf_fields(meta: GGUFMetadata, cfg: ModelConfig) -> ConfigUpdate:
    """Partial rotary (``rope.dimension_count`` below head_dim) and the all-layer sliding window.
    LongRoPE files (``rope_factors_short/long`` tensors) are refused: their per-frequency factors
    would have to be read from tensors, which quickdraft does not do for Phi-3 GGUFs."""
    if any(name.startswith("rope_factors_") for name in meta.tensor_names):
        raise QuickdraftError(
            "Phi-3 GGUF files with LongRoPE (rope_factors_short/long, the 128k-context models) are "
            "not supported; use the model's Hugging Face folder, or a 4k-context model"
        )
    rotary = int(meta.optional("rope.dimension_count") or cfg.head_dim)
    window = meta.optional("attention.sliding_window")
    return {
        "partial_rotary_factor": rotary / cfg.head_dim,
        "sliding_window": int(window) if window else None,
        "layer_types": ("sliding_attention",) * cfg.num_hidden_layers if window else None,
    }


# Phi-3 keeps its fused weights (llama.cpp's ffn_up holds gate then up, like gate_up_proj).
FAMILY = Family(model_types=("phi3",), read_hf=_hf_fields, gguf_archs={"phi3": "phi3"}, read_gguf=_gguf_fields,
                gguf_tensor_names={"phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                                            "ffn_up.weight": "mlp.gate_up_proj.weight"}})

