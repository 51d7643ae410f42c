"""Llama 4 text model (HF ``model_type`` "llama4_text", and the text half of "llama4").

Follows transformers' ``Llama4TextModel``:

* Feed-forward: MoE on the layers in ``moe_layers`` (every ``interleave_moe_layer_step``-th by
  default), a dense MLP of width ``intermediate_size_mlp`` elsewhere. The MoE routes each token to
  its top-k (Llama 4: one) experts by the router logits; ``sigmoid(logit)`` scales the expert's
  INPUT, and an always-on shared expert is added.
* Attention per layer, by ``no_rope_layers`` (1 = RoPE layer, 0 = NoPE layer):
  RoPE layers rotate q/k in interleaved pairs (Meta's complex layout, not rotate-half), then
  L2-normalise them (no weight) when ``use_qk_norm``, and attend only within their chunk of
  ``attention_chunk_size`` positions (a query at position p sees keys at positions
  ``p // C * C .. p``). NoPE layers attend to the whole causal context, their queries scaled by
  ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (attention temperature tuning).
  Where the config lists ``layer_types``, they decide which layers are chunked, as in transformers.

The temperature uses each row's RoPE position; transformers uses the cache length plus the row
index, which is the same for every chain and, for a draft tree, gives a node the scale plain
decoding would give it. Chunks are likewise taken over positions (a committed slot's position is
its slot), so tree rows see what plain decoding would show them.

Checkpoint names: ``feed_forward`` (read as ``mlp``), ``feed_forward.router`` (``mlp.gate``),
stacked input-major experts ``feed_forward.experts.gate_up_proj`` [E, H, 2I] / ``down_proj``
[E, I, H], split per expert at load. A full "llama4" checkpoint's text weights sit under
``language_model.``; its vision tower and projector are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from quickdraft.config import ConfigUpdate, Family, FamilyFields, ModelConfig, hf_num_experts
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS, Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.layers import Attention, Rope
from quickdraft.models.moe import MoECausalLM


@dataclass(frozen=True)
class Llama4Fields(FamilyFields):
    """Llama 4's own config fields: which layers are MoE, and per layer RoPE + chunked attention +
    L2 q/k norm, or NoPE + temperature."""

    moe_layers: tuple[int, ...] | None = None  # the sparse layers; None = every ...
    interleave_moe_layer_step: int = 1  # ... interleave_moe_layer_step-th layer
    attention_chunk_size: int | None = None  # RoPE layers attend within chunks of this many positions
    no_rope_layers: tuple[int, ...] = ()  # 1 = the layer uses RoPE, 0 = NoPE (HF's naming); () = all RoPE
    qk_l2_norm: bool = False  # L2-normalise q and k (no weight) after RoPE, RoPE layers only
    attn_temperature_tuning: bool = False  # scale NoPE layers' queries up with the position
    floor_scale: float = 8192.0
    attn_scale: float = 0.1


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Llama 4's config.json resolved as transformers' Llama4TextConfig resolves it (its experts
    are ``intermediate_size`` wide, its dense layers ``intermediate_size_mlp``)."""
    layers = int(d["num_hidden_layers"])
    step = int(d.get("interleave_moe_layer_step", 1))
    moe_layers = d.get("moe_layers")
    if moe_layers is None:
        moe_layers = range(step - 1, layers, step)
    interval = int(d.get("no_rope_layer_interval", 4))
    no_rope = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    expert = int(d.get("intermediate_size", 8192))
    return {
        "num_experts": hf_num_experts(d, 16),
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 1)),
        "moe_intermediate_size": expert,
        "shared_expert_intermediate_size": expert,
        "intermediate_size": int(d.get("intermediate_size_mlp", 16384)),  # the dense layers' MLP
        # "chunked_attention" / "full_attention" per layer; None: chunked = RoPE layers
        "layer_types": tuple(d["layer_types"]) if d.get("layer_types") else None,
        "attention_bias": bool(d.get("attention_bias", False)),
        "family": Llama4Fields(
            moe_layers=tuple(int(i) for i in moe_layers),
            interleave_moe_layer_step=step,
            attention_chunk_size=d.get("attention_chunk_size", 8192),
            no_rope_layers=tuple(int(i) for i in no_rope),
            qk_l2_norm=bool(d.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(d.get("attn_temperature_tuning", True)),
            floor_scale=float(d.get("floor_scale", 8192)),
            attn_scale=float(d.get("attn_scale", 0.1)),
        ),
    }


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A full Llama 4 checkpoint (model_type "llama4": vision + text) runs as its text model:
    its text_config, keeping model_type "llama4" (the weights carry a ``language_model.`` prefix)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        return d
    tied = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": "llama4", "tie_word_embeddings": tied}


FAMILY = Family(model_types=("llama4", "llama4_text"), fields=Llama4Fields, read_hf=_hf_fields,
                hf_wrappers=("llama4",), text_config=_text_config)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [H, T, D] by angle tables [T, D/2] in interleaved pairs (x[2j], x[2j+1]),
    computed in float32 as transformers' complex multiply is."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Per-row query scale [T] float32 of NoPE layers: grows with log(position / floor_scale).

    Computed per position in Python rather than as one vectorised log1p, whose last bit could
    depend on how many rows share the pass (see :func:`quickdraft.models.moe.rowwise`).
    """
    scales = [math.log1p(math.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0 for p in positions.tolist()]
    return torch.tensor(scales, dtype=torch.float32, device=positions.device)


class Llama4Attention(Attention):
    """Chunked attention (``chunk``), interleaved-pair RoPE, q/k L2 norms and NoPE layers' query
    temperature; the native kernels compute none of these (``native`` False)."""

    native = False

    def __init__(self, cfg: ModelConfig, rope: Rope, layer: int) -> None:
        super().__init__(cfg, rope)
        if cfg.attention_bias:
            self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=True)
        own = cfg.family_fields(Llama4Fields)
        self.use_rope = bool(own.no_rope_layers[layer]) if own.no_rope_layers else True
        chunked = cfg.layer_types[layer] == "chunked_attention" if cfg.layer_types else self.use_rope
        self.chunk = own.attention_chunk_size if chunked else None  # (the backends cut rows' slots by it)
        self.l2_eps = cfg.rms_norm_eps if own.qk_l2_norm and self.use_rope else None
        self.temperature = own.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = own.floor_scale, own.attn_scale

    def encode_positions(
        self, q: torch.Tensor, k: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RoPE on interleaved pairs (RoPE layers), L2 norms of q and k, and (NoPE layers) the
        temperature scaling of q by position."""
        assert k is not None  # (no layer reuses another's keys)
        if self.use_rope:
            half = self.hd // 2  # the Rope tables hold [freqs, freqs]: the first half is each pair's angle
            cos, sin = self.rope.cos[step.positions, :half], self.rope.sin[step.positions, :half]
            q, k = rope_pairs(q, cos, sin), rope_pairs(k, cos, sin)
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature:
            scales = temperature_scales(step.positions, self.floor_scale, self.attn_scale)
            q = (q * scales.unsqueeze(-1)).to(q.dtype)
        return q, k


class CausalLM(MoECausalLM):
    routing = "sigmoid_input"
    chain_rows = BLOCKED_MAX_ROWS  # its attention takes longer passes the plain way
    checkpoint_renames = (
        (r"^language_model\.", ""),
        (r"\.feed_forward\.router\.", ".mlp.gate."),
        (r"\.feed_forward\.", ".mlp."),
    )
    checkpoint_skip = ("vision_model.", "multi_modal_projector.")
    stacked_input_major = True

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Llama4Attention(cfg, self.model.rope, i)

    def is_moe_layer(self, i: int) -> bool:
        own = self.config.family_fields(Llama4Fields)
        if own.moe_layers is not None:
            return i in own.moe_layers
        step = own.interleave_moe_layer_step
        return i % step == step - 1
