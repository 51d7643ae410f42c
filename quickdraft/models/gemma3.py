"""Gemma 3 text decoder (HF ``model_type`` "gemma3_text"; GGUF architecture "gemma3").

What differs from the Llama decoder, all as in transformers' ``modeling_gemma3``:

* the token embedding is multiplied by sqrt(hidden_size), rounded to the activation dtype first
  (bf16 turns sqrt(640) = 25.298 into 25.25; transformers does the same);
* RMSNorm multiplies by ``1 + weight`` in fp32 (weights are stored zero-centred). llama.cpp's
  converter stores ``1 + weight`` in GGUF files instead, so the GGUF loader subtracts 1
  (``loading/gguf.py``), like transformers' GGUF loader: parameters here always hold the
  Hugging Face value, whatever the source;
* four norms per layer ("sandwich"): before and after attention, before and after the MLP;
* q/k RMSNorm per head, attention scale ``query_pre_attn_scalar ** -0.5``;
* the MLP's gate uses tanh-approximated GELU;
* layers alternate between sliding-window attention (``layer_types`` "sliding_attention": the
  last ``sliding_window`` positions, RoPE base ``rope_local_theta``, no scaling) and full
  attention (RoPE base ``rope_theta`` with ``rope_scaling``);
* optional final logit soft-capping ``c * tanh(logits / c)``;
* the output head is tied to the embedding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import (
    ConfigUpdate,
    Family,
    GGUFMetadata,
    ModelConfig,
    hf_layer_types,
    rope_scaling_of,
)
from quickdraft.errors import QuickdraftError
from quickdraft.models import causal_lm
from quickdraft.models.forward_pass import Step, fused_ops
from quickdraft.models.layers import MLP, Attention, RMSNorm, Rope, embedding

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``, computed in fp32 and cast back at the end (Gemma's order;
    Llama casts before multiplying)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x, self.weight)
        if ops is not None:  # one call instead of eight (decode-step overhead)
            return ops.rms_norm(x.contiguous(), self.weight, self.eps, 1.0)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up


def is_sliding(cfg: ModelConfig, layer: int) -> bool:
    return cfg.layer_types is not None and cfg.layer_types[layer] == SLIDING


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rope, window=window)
        # Gemma's q/k norms are (1 + w) norms too; the scale is query_pre_attn_scalar's.
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.mlp = GemmaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), layer, step))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = Rope(cfg, max_len)  # full-attention layers: rope_theta with rope_scaling
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta, rope_scaling=None)
        self.rope_local = Rope(local, max_len)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rope_local, cfg.sliding_window)
            if is_sliding(cfg, i)
            else DecoderLayer(cfg, self.rope, None)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(causal_lm.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`."""

    backbone: ClassVar[type[nn.Module]] = _Backbone

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
        super().materialize(device, dtype)
        rope_local = self.model.rope_local
        assert isinstance(rope_local, Rope)
        rope_local.reset_tables(device)
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden_size), in the activation dtype."""
        x = self.model.embed_tokens(ids).to(self.dtype)
        return x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=self.dtype, device=x.device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and (if configured) soft-capping -> float32 logits."""
        logits = self.lm_head(self.model.norm(x)).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ------------------------------------------------------------------------------ config


_FULL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig's defaults


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Gemma 3 text fields, with transformers' Gemma3TextConfig defaults for what a config.json
    leaves out. RoPE comes either as transformers 5's ``rope_parameters`` per layer type or in
    the older flat form (``rope_theta`` + ``rope_scaling`` for full layers, ``rope_local_base_freq``
    for sliding ones). Features quickdraft does not compute are refused, not ignored."""
    if d.get("attn_logit_softcapping") is not None:
        raise QuickdraftError("Gemma attention logit soft-capping (attn_logit_softcapping) is not supported")
    if d.get("use_bidirectional_attention"):
        raise QuickdraftError("bidirectional Gemma 3 models (embedding models) cannot generate text")
    activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise QuickdraftError(f"Gemma 3 with hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    layer_types = hf_layer_types(d, (SLIDING, FULL), every=pattern)
    params = d.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {}, rope_theta=d.get("rope_theta") or _FULL_THETA)
        local = {"rope_theta": d.get("rope_local_base_freq") or _LOCAL_THETA}
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise QuickdraftError("Gemma 3 with RoPE scaling on its sliding-window layers is not supported")
    softcap = d.get("final_logit_softcapping")
    return {
        "head_dim": int(d.get("head_dim") or 256),
        "sliding_window": int(d.get("sliding_window") or 4096),
        "layer_types": layer_types,
        "rope_theta": float(full.get("rope_theta") or _FULL_THETA),
        "rope_scaling": rope_scaling_of({"rope_scaling": full}),
        "rope_local_theta": float(local.get("rope_theta") or _LOCAL_THETA),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
        "qk_norm": True,
    }


def _gguf_fields(meta: GGUFMetadata, cfg: ModelConfig) -> ConfigUpdate:
    """What a Gemma 3 GGUF leaves to convention, filled in as llama.cpp does: every 6th layer is
    a full-attention layer (unless the file lists the pattern), sliding layers use RoPE base
    10000 unscaled, and scores are scaled by 1/sqrt(head_dim), except for the 27B model
    (62 layers) whose query_pre_attn_scalar is hidden_size / heads."""
    layers = cfg.num_hidden_layers
    window = meta.get("attention.sliding_window")
    pattern = meta.optional("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        if len(pattern) != layers:
            raise QuickdraftError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    scalar = cfg.hidden_size / cfg.num_attention_heads if layers == 62 else cfg.head_dim
    softcap = meta.optional("final_logit_softcapping")
    return {
        "sliding_window": int(window),
        "layer_types": tuple(SLIDING if s else FULL for s in sliding),
        "rope_local_theta": float(meta.optional("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


# Gemma's four norms per layer in llama.cpp's names: it calls the pre-MLP norm "ffn_norm" (the
# Llama name of post_attention_layernorm).
GGUF_NORM_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

# llama.cpp's converter stores Gemma's zero-centred norm weights as 1 + w: the loader subtracts it
FAMILY = Family(model_types=("gemma3_text",), read_hf=_hf_fields, gguf_archs={"gemma3": "gemma3_text"},
                read_gguf=_gguf_fields, gguf_tensor_names={"gemma3_text": GGUF_NORM_NAMES}, gguf_norm_plus_one=True)

