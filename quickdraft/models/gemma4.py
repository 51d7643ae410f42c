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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.cache import KVCache, KVLayout, SequenceCache
from quickdraft.config import (
    ConfigUpdate,
    Family,
    FamilyFields,
    GGUFMetadata,
    ModelConfig,
    hf_layer_types,
    rope_scaling_of,
    text_config_of,
)
from quickdraft.errors import QuickdraftError
from quickdraft.models import gemma3, layers
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.gemma3 import FULL, GGUF_NORM_NAMES, SLIDING, GemmaMLP, is_sliding
from quickdraft.models.layers import Attention, Rope, embedding, linear_group
from quickdraft.models.moe import (
    GELU_TANH,
    ROW_LANES,
    RouterScales,
    check_moe_config,
    convert_expert_layouts,
    experts_block,
    mix_experts,
    route,
    rowwise,
)
from quickdraft.models.native import (
    PerLayerCacheStack,
    WeightSpec,
    float_weight,
    on_cpu_fp32,
    weight_spec,
)
from quickdraft.quant.ggml import active_kernels

CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."),)
CHECKPOINT_SKIP = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


@dataclass(frozen=True)
class Gemma4Fields(FamilyFields):
    """Gemma 4's own config fields: full-attention layers with their own head size and KV heads,
    keys that are also the values there, the last layers reusing earlier layers' keys and values,
    a per-layer token embedding fed into every layer."""

    global_head_dim: int = 0  # head size of the full-attention layers (0: head_dim)
    num_global_key_value_heads: int = 0  # their KV heads (0: num_key_value_heads)
    attention_k_eq_v: bool = False  # full-attention layers have no v_proj: values are the keys before k_norm
    num_kv_shared_layers: int = 0  # the last n layers attend to the last earlier layer of their type's keys/values
    hidden_size_per_layer_input: int = 0  # width of each layer's per-layer embedding (0: none)
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False  # the KV-sharing layers' MLPs are twice intermediate_size wide

    def layer_note(self) -> str:
        shared = self.num_kv_shared_layers
        return f", the last {shared} reusing earlier layers' keys and values" if shared else ""


_FULL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma4TextConfig's defaults


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Gemma 4 text fields, with transformers' Gemma4TextConfig defaults for what a config.json
    leaves out; the full-attention layers' RoPE is "proportional" (rotating a part of each head,
    the rest at frequency zero)."""
    if d.get("use_bidirectional_attention") == "all":
        raise QuickdraftError("bidirectional Gemma 4 models (embedding models) cannot generate text")
    activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise QuickdraftError(f"Gemma 4 with hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    layers = int(d["num_hidden_layers"])
    layer_types = list(hf_layer_types(d, (SLIDING, FULL), every=6))
    layer_types[-1] = FULL  # as transformers forces it
    global_dim, global_kv = _hf_global_shape(d, layer_types)
    params = d.get("rope_parameters") or {}
    local = dict(params.get("sliding_attention") or {"rope_theta": _LOCAL_THETA})
    full_rope = dict(params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": _FULL_THETA})
    if (local.get("rope_type") or "default") != "default":
        raise QuickdraftError("Gemma 4 with RoPE scaling on its sliding-window layers is not supported")
    shared = int(d.get("num_kv_shared_layers") or 0)
    if shared and set(layer_types[: layers - shared]) != set(layer_types):
        raise QuickdraftError(f"Gemma 4 with num_kv_shared_layers={shared}: the layers before them must include "
                              "every layer type whose keys and values they reuse")
    moe = bool(d.get("enable_moe_block", False))
    softcap = d.get("final_logit_softcapping")
    return {
        "head_dim": int(d.get("head_dim") or 256),
        "sliding_window": int(d.get("sliding_window") or 512),
        "layer_types": tuple(layer_types),
        "rope_theta": float(full_rope.get("rope_theta") or _FULL_THETA),
        "rope_scaling": rope_scaling_of({"rope_scaling": full_rope}),
        "rope_local_theta": float(local.get("rope_theta") or _LOCAL_THETA),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "num_experts": int(d.get("num_experts") or 0) if moe else 0,
        "num_experts_per_tok": int(d.get("top_k_experts") or 0) if moe else 0,
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or 0) if moe else 0,
        "family": Gemma4Fields(
            global_head_dim=global_dim,
            num_global_key_value_heads=global_kv,
            attention_k_eq_v=bool(d.get("attention_k_eq_v", False)),
            num_kv_shared_layers=shared,
            hidden_size_per_layer_input=int(d.get("hidden_size_per_layer_input", 256) or 0),
            vocab_size_per_layer_input=int(d.get("vocab_size_per_layer_input") or 262_144),
            use_double_wide_mlp=bool(d.get("use_double_wide_mlp", False)),
        ),
    }


def _hf_global_shape(d: dict[str, Any], layer_types: list[str]) -> tuple[int, int]:
    """The full-attention layers' head size and KV heads (0: the sliding layers'), given as
    ``global_head_dim`` / ``num_global_key_value_heads`` (the released configs) or as transformers'
    ``per_layer_config`` (what it saves: {layer: {head_dim, num_key_value_heads}})."""
    global_dim = d.get("global_head_dim")
    global_kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v", False) else None
    if d.get("per_layer_config"):
        overrides = {int(i): dict(o) for i, o in d["per_layer_config"].items()}
        full = [i for i, t in enumerate(layer_types) if t == FULL]
        if sorted(overrides) != full or any(o != overrides[full[0]] for o in overrides.values()):
            raise QuickdraftError("Gemma 4 per_layer_config must give every full-attention layer the same head_dim "
                                  f"and num_key_value_heads (and no other layer); this config.json has {overrides!r}")
        global_dim = overrides[full[0]].get("head_dim", global_dim)
        global_kv = overrides[full[0]].get("num_key_value_heads", global_kv)
    return int(global_dim or 512), int(global_kv or 0)


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A "gemma4" vision-language checkpoint runs as its text model (``text_config``)."""
    return text_config_of(d, "gemma4_text")


def _gguf_fields(meta: GGUFMetadata, cfg: ModelConfig) -> ConfigUpdate:
    """Gemma 4 as llama.cpp's converter writes it: per-layer arrays for the sliding pattern, the KV
    heads and the MLP width (twice as wide on KV-sharing layers with ``use_double_wide_mlp``), the
    full layers' head size as ``key_length`` and the sliding ones' as ``key_length_swa``; keys as
    values where full layers have no ``attn_v``. Proportional RoPE comes from ``rope_freqs``
    (:func:`_with_rope_factors`)."""
    layers = cfg.num_hidden_layers
    window = meta.get("attention.sliding_window")
    sliding = [bool(s) for s in _gguf_per_layer(meta, "attention.sliding_window_pattern", True, layers)]
    kv = _gguf_per_layer(meta, "attention.head_count_kv", cfg.num_key_value_heads, layers)
    ff = _gguf_per_layer(meta, "feed_forward_length", cfg.intermediate_size, layers)
    shared = int(meta.optional("attention.shared_kv_layers") or 0)
    full = [i for i in range(layers) if not sliding[i]]
    if not full:
        raise QuickdraftError("this Gemma 4 GGUF has no full-attention layer; the file is damaged")
    swa_kv = [kv[i] for i in range(layers) if sliding[i]] or [kv[full[0]]]
    k_eq_v = f"blk.{full[0]}.attn_v.weight" not in meta.tensor_names
    wide = [2 * ff[0] if i >= layers - shared else ff[0] for i in range(layers)]
    if len(set(swa_kv)) > 1 or len({kv[i] for i in full}) > 1 or (not k_eq_v and kv[full[0]] != swa_kv[0]) \
            or ff not in ([ff[0]] * layers, wide):
        raise QuickdraftError(f"this Gemma 4 GGUF's per-layer KV heads {kv} or MLP widths {ff} are not a layout "
                              "quickdraft knows (one value per layer type; double-wide sharing layers)")
    experts = int(meta.optional("expert_count") or 0)
    softcap = meta.optional("final_logit_softcapping")
    return {
        "num_key_value_heads": int(swa_kv[0]),
        "head_dim": int(meta.optional("attention.key_length_swa") or cfg.head_dim),
        "sliding_window": int(window),
        "layer_types": tuple(SLIDING if s else FULL for s in sliding),
        "rope_local_theta": float(meta.optional("rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "qk_norm": True,
        "num_experts": experts,
        "num_experts_per_tok": int(meta.optional("expert_used_count") or 0) if experts else 0,
        "moe_intermediate_size": int(meta.optional("expert_feed_forward_length") or 0) if experts else 0,
        "family": Gemma4Fields(
            global_head_dim=cfg.head_dim,
            num_global_key_value_heads=int(kv[full[0]]) if k_eq_v else 0,
            attention_k_eq_v=k_eq_v,
            num_kv_shared_layers=shared,
            use_double_wide_mlp=shared > 0 and ff == wide and ff != [ff[0]] * layers,
            hidden_size_per_layer_input=int(meta.optional("embedding_length_per_layer_input") or 0),
            vocab_size_per_layer_input=cfg.vocab_size,
        ),
    }


def _gguf_per_layer(meta: GGUFMetadata, key: str, default: Any, layers: int) -> list[Any]:
    """A per-layer array (or one value for every layer)."""
    value = meta.optional(key, default)
    values = list(value) if isinstance(value, list | tuple) else [value] * layers
    if len(values) != layers:
        raise QuickdraftError(f"gemma4.{key} has {len(values)} entries for {layers} layers; the file is damaged")
    return values


def _with_rope_factors(cfg: ModelConfig, factors: list[float]) -> ModelConfig:
    """A file's ``rope_freqs`` (1 for the rotating angles, 1e30 for the still ones) as the full
    layers' proportional RoPE."""
    rotating = sum(1 for f in factors if f < 1e29)
    dim = cfg.family_fields(Gemma4Fields).global_head_dim or cfg.head_dim
    return dataclasses.replace(cfg, rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 2 * rotating / dim})


# Gemma 4's GGUF tensors: Gemma 3's four norms, the layer scalar, the per-layer embedding branch,
# and the routed experts' router (its input scale and per-expert scales) and norms.
_GGUF_TENSOR_NAMES = GGUF_NORM_NAMES | {
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}

FAMILY = Family(model_types=("gemma4_text",), fields=Gemma4Fields, read_hf=_hf_fields, hf_wrappers=("gemma4",),
                text_config=_text_config, gguf_archs={"gemma4": "gemma4_text"}, read_gguf=_gguf_fields,
                gguf_experts=False, gguf_tensor_names={"gemma4_text": _GGUF_TENSOR_NAMES},
                with_rope_factors=_with_rope_factors)


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
    own = cfg.family_fields(Gemma4Fields)
    return dataclasses.replace(cfg, head_dim=own.global_head_dim or cfg.head_dim,
                               num_key_value_heads=own.num_global_key_value_heads or cfg.num_key_value_heads)


def kv_sources(cfg: ModelConfig) -> list[int]:
    """For every layer, the layer whose keys and values it attends to: itself, or for the last
    ``num_kv_shared_layers`` the last layer of its type before them."""
    first_shared = cfg.num_hidden_layers - cfg.family_fields(Gemma4Fields).num_kv_shared_layers
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
        fields = cfg.family_fields(Gemma4Fields)
        own = layer_config(cfg, layer)
        self.self_attn = Gemma4Attention(own, rope_local if sliding else rope, cfg.sliding_window if sliding else None,
                                         reuses_kv, values_are_keys=fields.attention_k_eq_v and not sliding)
        wide = 2 if fields.use_double_wide_mlp and reuses_kv else 1
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
        if fields.hidden_size_per_layer_input:
            p = fields.hidden_size_per_layer_input
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
        fields = cfg.family_fields(Gemma4Fields)
        p = fields.hidden_size_per_layer_input
        if p:
            n = cfg.num_hidden_layers
            self.embed_tokens_per_layer = embedding(fields.vocab_size_per_layer_input, n * p)
            self.per_layer_model_projection = Linear(cfg.hidden_size, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)


def build_stack(modules: nn.ModuleList) -> PerLayerCacheStack | None:
    """Gemma 4's native stack for these layers, or None where it does not apply: every attention, MLP
    and expert matrix a q8 GGML block (the per-layer input projections and the router may be float32),
    fp32 norms and RoPE tables, one sliding window."""
    mod = active_kernels()
    layers = [m for m in modules if isinstance(m, DecoderLayer)]
    if mod is None or not layers or len(layers) != len(modules):
        return None
    eps = layers[0].input_layernorm.eps
    stack = mod.Gemma4Stack(float(eps), ROW_LANES)
    windows = {layer.self_attn.window for layer in layers if layer.self_attn.window}
    if len(windows) > 1:
        return None
    for layer in layers:
        args = _stack_layer(layer, eps)
        if args is None:
            return None
        stack.add_layer(*args)
    return PerLayerCacheStack(stack, next(iter(windows), None), layer_inputs=True)


def _norms_ok(eps: float, *ns: nn.Module | None) -> bool:
    return all(type(n) is RMSNorm and n.eps == eps and on_cpu_fp32(n.weight) for n in ns)


def _q8(m: nn.Module | None) -> WeightSpec | None:
    return None if m is None else weight_spec(m)


def _stack_layer(layer: DecoderLayer, eps: float) -> tuple[Any, ...] | None:
    """The arguments of ``Gemma4Stack.add_layer`` for one decoder layer; None where the stack cannot
    compute it."""
    a, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm]
    experts = None
    if layer.router is not None:  # routed experts beside the MLP (26B-A4B)
        r = layer.router
        norms += [layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_1,
                  layer.post_feedforward_layernorm_2]
        if type(r.norm) is not PlainRMSNorm or not all(type(e) is GemmaMLP for e in layer.experts) \
                or not on_cpu_fp32(r.scale, r.per_expert_scale):
            return None
        experts = experts_block(layer.experts, r.proj, "softmax_topk", True, r.top_k, GELU_TANH,
                                scales=RouterScales(r.scale, r.per_expert_scale, r.root, r.norm.eps))
        if experts is None:
            return None
    if type(a) is not Gemma4Attention or type(mlp) is not GemmaMLP \
            or a.q_norm is None or not _norms_ok(eps, *norms, a.q_norm) or not a.native or a.hd % 8 \
            or type(a.v_norm) is not PlainRMSNorm or a.v_norm.eps != eps or not on_cpu_fp32(a.rope.cos, layer.layer_scalar):
        return None
    k = v = None
    if not a.reuses_kv:
        k = _q8(a.k_proj)
        if k is None or not _norms_ok(eps, a.k_norm):
            return None
        if not a.values_are_keys and (v := _q8(a.v_proj)) is None:
            return None
    q, o, gate_up, down = _q8(a.q_proj), _q8(a.o_proj), [_q8(mlp.gate_proj), _q8(mlp.up_proj)], _q8(mlp.down_proj)
    if q is None or o is None or down is None or gate_up[0] is None or gate_up[1] is None:
        return None
    per_layer = _per_layer_input(layer, eps)
    if per_layer is None:
        return None
    return ([n.weight.detach() for n in norms], q, k, v, a.q_norm.weight.detach(),
            None if a.k_norm is None else a.k_norm.weight.detach(), a.nh, a.nkv, a.hd, a.window or 0, float(a.scale),
            a.rope.cos.contiguous(), a.rope.sin.contiguous(), o, gate_up, down, *per_layer,
            layer.layer_scalar.detach(), experts)


def _per_layer_input(layer: DecoderLayer, eps: float) -> tuple[Any, ...] | None:
    """(gate q8, gate float32, projection q8, projection float32, norm weight) of a layer's per-layer
    input (each matrix q8 or float32; all None for a layer without one); None where it cannot run natively."""
    if layer.per_layer_input_gate is None:
        return None, None, None, None, None
    if not _norms_ok(eps, layer.post_per_layer_input_norm):
        return None
    gate_q8, proj_q8 = _q8(layer.per_layer_input_gate), _q8(layer.per_layer_projection)
    gate_w = None if gate_q8 is not None else float_weight(layer.per_layer_input_gate)
    proj_w = None if proj_q8 is not None else float_weight(layer.per_layer_projection)
    if (gate_q8 is None and gate_w is None) or (proj_q8 is None and proj_w is None):
        return None
    return gate_q8, gate_w, proj_q8, proj_w, layer.post_per_layer_input_norm.weight.detach()


class CausalLM(gemma3.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`
    (Gemma 3's scaled embedding and soft-capped head)."""

    backbone = _Backbone
    converts_checkpoint = True

    def native_stack(self) -> PerLayerCacheStack | None:
        return build_stack(self.model.layers)

    def make_cache(self, max_len: int) -> SequenceCache:
        return KVCache(0, 0, 0, max_len, self.kv_dtype or self.dtype, self.device, layout=kv_layout(self.config))

    def layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Per-layer embeddings ``[T, layers, P]``: the token's own (times sqrt(P)) and a projection
        of its embedding ``x`` (times 1/sqrt(H), normed), summed and scaled by 1/sqrt(2)."""
        cfg = self.config
        p = cfg.family_fields(Gemma4Fields).hidden_size_per_layer_input
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
