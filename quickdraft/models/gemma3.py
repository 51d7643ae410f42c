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
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models import causal_lm
from quickdraft.models.forward_pass import Step
from quickdraft.models.layers import MLP, Attention, RMSNorm, Rope, embedding

SLIDING = "sliding_attention"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``, computed in fp32 and cast back at the end (Gemma's order;
    Llama casts before multiplying)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
