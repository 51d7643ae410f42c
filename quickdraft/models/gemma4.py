"""Gemma 4 text decoder (HF ``model_type`` "gemma4_text"; a "gemma4" vision-language checkpoint
runs as its text model: ``model.language_model.*``, vision and audio towers skipped).

What differs from Gemma 3 (``gemma3.py``), all as in transformers' ``modeling_gemma4``:

* RMSNorm multiplies by ``weight`` itself (not ``1 + weight``); values get a norm without weight
  (``v_norm``), and the attention scale is 1 (the q/k norms set the scale);
* the full-attention layers have their own head size (``global_head_dim``) and, where keys are
  also the values (``attention_k_eq_v``: no ``v_proj``), their own KV heads; their RoPE is
  "proportional": a quarter of each head's angle pairs rotate, with the frequencies of the whole
  head, the rest stay still. The cache keeps one storage group per shape (:class:`KVLayout`);
* KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values; each attends to
  those of the last earlier layer of its type (same cache place, nothing written), and with
  ``use_double_wide_mlp`` their MLPs are twice as wide;
* per-layer embeddings: a second token embedding ``[vocab, layers * P]`` plus a projection of the
  hidden state's embedding give each layer a ``P``-wide input, which gates a small residual branch
  after its MLP (computed once per pass: :meth:`CausalLM.layer_inputs`);
* MoE variants run routed experts (GELU, router with its own norm and per-expert scales) beside
  the dense MLP, each with its own norms, and every layer's output is scaled by ``layer_scalar``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.cache import KVCache, KVLayout, SequenceCache
from quickdraft.config import ModelConfig
from quickdraft.models import gemma3, layers
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.gemma3 import GemmaMLP, is_sliding
from quickdraft.models.layers import Attention, Rope, embedding, linear_group
from quickdraft.models.moe import (
    check_moe_config,
    convert_expert_layouts,
    mix_experts,
    route,
    rowwise,
)

CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."),)
CHECKPOINT_SKIP = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


class RMSNorm(layers.RMSNorm):
    """Gemma 4's RMSNorm: in fp32, times ``weight`` (not ``1 + weight``), cast back at the end. In
    fp32 that is the Llama norm's function (the fused kernel's, where built)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32:
            return super().forward(x)
        return (_normed(x, self.eps) * self.weight.float()).to(x.dtype)


class PlainRMSNorm(nn.Module):
    """RMSNorm without a weight (Gemma 4's value norm and router norm)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _normed(x, self.eps).to(x.dtype)


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU, bitwise the same for a row whatever rows come with it."""
    return rowwise(lambda t: F.gelu(t, approximate="tanh"), x)


def layer_config(cfg: ModelConfig, layer: int) -> ModelConfig:
    """``cfg`` with layer ``layer``'s head size and KV heads (the full-attention layers' own)."""
    if is_sliding(cfg, layer):
        return cfg
    return dataclasses.replace(cfg, head_dim=cfg.global_head_dim or cfg.head_dim,
                               num_key_value_heads=cfg.num_global_key_value_heads or cfg.num_key_value_heads)


def kv_sources(cfg: ModelConfig) -> list[int]:
    """For every layer, the layer whose keys and values it attends to: itself, or for the last
    ``num_kv_shared_layers`` the last layer of its type before them."""
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    types = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
    return [i if i < first_shared else max(j for j in range(first_shared) if types[j] == types[i])
            for i in range(cfg.num_hidden_layers)]


def kv_layout(cfg: ModelConfig) -> KVLayout:
    """One storage group per (KV heads, head size) among the layers that write keys and values;
    sharing layers take their source's place."""
    sources = kv_sources(cfg)
    shapes: list[tuple[int, int]] = []
    counts: list[int] = []
    places: list[tuple[int, int]] = []
    for i, source in enumerate(sources):
        if source != i:
            places.append(places[source])
            continue
        c = layer_config(cfg, i)
        shape = (c.num_key_value_heads, c.head_dim)
        if shape not in shapes:
            shapes.append(shape)
            counts.append(0)
        g = shapes.index(shape)
        places.append((g, counts[g]))
        counts[g] += 1
    groups = tuple((n, heads, dim) for n, (heads, dim) in zip(counts, shapes, strict=True))
    return KVLayout(groups, tuple(places), tuple(s == i for i, s in enumerate(sources)))


class Gemma4Attention(Attention):
    """Attention with q/k norms, a weightless value norm, scale 1. ``reuses_kv``: no k/v
    projections, it attends to the keys and values another layer wrote at its cache place.
    ``values_are_keys``: no v_proj, values are the projected keys (before k_norm and RoPE)."""

    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None, reuses_kv: bool, values_are_keys: bool) -> None:
        super().__init__(cfg, rope, window=window)
        self.reuses_kv, self.values_are_keys = reuses_kv, values_are_keys
        if reuses_kv:  # the checkpoint has neither projection nor k_norm for these layers
            del self.k_proj, self.v_proj
            self.k_norm = None
        elif values_are_keys:
            del self.v_proj
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        if not reuses_kv:
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.v_norm = PlainRMSNorm(cfg.rms_norm_eps)
        self.scale = 1.0

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        t = x.shape[0]
        if self.reuses_kv:
            q = self.q_proj(x).view(t, self.nh, self.hd).transpose(0, 1)
            return self.o_proj(self.attend(q, None, None, layer, step))
        if self.values_are_keys:
            q, k = linear_group([self.q_proj, self.k_proj], x)
            v = k
        else:
            q, k, v = linear_group([self.q_proj, self.k_proj, self.v_proj], x)
        q = q.view(t, self.nh, self.hd).transpose(0, 1)  # [Hq, T, D]
        k = k.view(t, self.nkv, self.hd).transpose(0, 1)  # [Hkv, T, D]
        v = self.v_norm(v.view(t, self.nkv, self.hd).transpose(0, 1))
        return self.o_proj(self.attend(q, k, v, layer, step))


class Router(nn.Module):
    """Scores experts from the layer's input: a weightless norm, times ``scale`` / sqrt(H), a
    projection; softmax, top k, renormalised, times each chosen expert's ``per_expert_scale``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = PlainRMSNorm(cfg.rms_norm_eps)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.top_k, self.root = cfg.num_experts_per_tok, cfg.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root
        weights, experts = route("softmax_topk", self.proj(h), self.top_k, renormalize=True)
        return weights * self.per_expert_scale[experts].float(), experts


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope, rope_local: Rope, reuses_kv: bool) -> None:
        super().__init__()
        sliding = is_sliding(cfg, layer)
        own = layer_config(cfg, layer)
        self.self_attn = Gemma4Attention(own, rope_local if sliding else rope, cfg.sliding_window if sliding else None,
                                         reuses_kv, values_are_keys=cfg.attention_k_eq_v and not sliding)
        wide = 2 if cfg.use_double_wide_mlp and reuses_kv else 1
        self.mlp = GemmaMLP(dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size * wide))
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.router: Router | None = None
        if cfg.num_experts:
            check_moe_config(cfg)
            self.router = Router(cfg)
            expert = dataclasses.replace(cfg, intermediate_size=cfg.moe_intermediate_size)
            self.experts = nn.ModuleList(GemmaMLP(expert) for _ in range(cfg.num_experts))
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.per_layer_input_gate: Linear | None = None
        if cfg.hidden_size_per_layer_input:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(h, p, bias=False)
            self.per_layer_projection = Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), layer, step))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:  # routed experts beside the MLP, from the same input
            weights, experts = self.router(x)
            routed = mix_experts(self.experts, self.pre_feedforward_layernorm_2(x), weights, experts)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            assert step.layer_inputs is not None
            g = gelu(self.per_layer_input_gate(x)) * step.layer_inputs[:, layer]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        full = layer_config(cfg, cfg.num_hidden_layers - 1)  # the last layer is a full-attention one
        self.rope = Rope(full, max_len)  # full-attention layers: proportional RoPE over their head size
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta, rope_scaling=None)
        self.rope_local = Rope(local, max_len)
        sources = kv_sources(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rope, self.rope_local, reuses_kv=sources[i] != i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        p = cfg.hidden_size_per_layer_input
        if p:
            n = cfg.num_hidden_layers
            self.embed_tokens_per_layer = embedding(cfg.vocab_size_per_layer_input, n * p)
            self.per_layer_model_projection = Linear(cfg.hidden_size, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)


class CausalLM(gemma3.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`
    (Gemma 3's scaled embedding and soft-capped head)."""

    backbone = _Backbone
    converts_checkpoint = True

    def make_cache(self, max_len: int) -> SequenceCache:
        return KVCache(0, 0, 0, max_len, self.kv_dtype or self.dtype, self.device, layout=kv_layout(self.config))

    def layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Per-layer embeddings ``[T, layers, P]``: the token's own (times sqrt(P)) and a projection
        of its embedding ``x`` (times 1/sqrt(H), normed), summed and scaled by 1/sqrt(2)."""
        cfg = self.config
        p = cfg.hidden_size_per_layer_input
        if not p:
            return None
        m = self.model
        t, n = ids.shape[0], cfg.num_hidden_layers
        token = m.embed_tokens_per_layer(ids).to(self.dtype)
        token = token * torch.tensor(p**0.5, dtype=self.dtype, device=token.device)
        context = m.per_layer_model_projection(x) * cfg.hidden_size**-0.5
        context = m.per_layer_projection_norm(context.view(t, n, p))
        return (context + token.view(t, n, p)) * 2.0**-0.5

    def convert_checkpoint(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """A vision-language checkpoint's text model (``model.language_model.`` names, the towers
        skipped) and stacked experts split per expert."""
        for name, tensor in convert_expert_layouts(tensors, CHECKPOINT_RENAMES):
            if not name.startswith(CHECKPOINT_SKIP):
                yield name, tensor
