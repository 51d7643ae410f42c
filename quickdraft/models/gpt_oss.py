"""GPT-OSS (HF ``model_type`` "gpt_oss"), as transformers' ``modeling_gpt_oss``.

What differs from the Llama decoder:

* attention with biases on q/k/v/o and a learned **sink** per head: one more logit in each row's
  softmax, with no value (``softmax([scores, sink])`` without the sink's column), so a head can
  attend to "nothing"; layers alternate between a sliding window (``sliding_window`` positions)
  and full attention (``layer_types``); YaRN RoPE;
* every MLP is a mixture of experts: a router with a bias, the top-k logits softmaxed, and experts
  whose gated activation is clamped: ``gate = min(gate, L); up = clamp(up, -L, L);
  out = down((up + 1) * gate * sigmoid(alpha * gate))``, each projection with a bias;
* checkpoints store experts stacked: ``gate_up_proj`` [E, H, 2I] with gate and up columns
  interleaved, ``down_proj`` [E, I, H], their biases, or as MXFP4 blocks (``*_blocks``
  [E, out, K/32, 16]: two FP4 E2M1 values per byte, low nibble first, and ``*_scales``
  [E, out, K/32]: E8M0 exponents), kept in their blocks (as GGML MXFP4) for the native kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from quickdraft.config import (
    ConfigUpdate,
    Family,
    FamilyFields,
    GGUFMetadata,
    ModelConfig,
    hf_layer_types,
    hf_num_experts,
)
from quickdraft.errors import QuickdraftError
from quickdraft.loading.gguf import QuantTensor
from quickdraft.models import causal_lm, layers
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.gemma3 import is_sliding
from quickdraft.models.layers import MLP, Attention, RMSNorm, Rope, embedding
from quickdraft.models.moe import (
    SparseMoE,
    check_moe_config,
    convert_expert_layouts,
    expert_block,
    rowwise,
)
from quickdraft.models.native import PerLayerCacheStack, on_cpu_fp32, weight_spec, weight_specs
from quickdraft.quant.ggml import active_kernels


@dataclass(frozen=True)
class GptOssFields(FamilyFields):
    """GPT-OSS's experts' activation: gate clamped at ``swiglu_limit``, up to [-limit, limit],
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Every MLP routed experts (``num_local_experts``, ``intermediate_size`` wide), biases in
    attention, layers alternating sliding-window / full attention (transformers' defaults)."""
    return {
        "num_experts": hf_num_experts(d, 128),
        "num_experts_per_tok": int(d.get("num_experts_per_tok") or 4),
        "moe_intermediate_size": int(d["intermediate_size"]),
        "attention_bias": bool(d.get("attention_bias", True)),
        "sliding_window": int(d.get("sliding_window") or 128),
        "layer_types": hf_layer_types(d, ("sliding_attention", "full_attention"), every=2),
        "family": GptOssFields(swiglu_alpha=float(d.get("swiglu_alpha") or 1.702),
                               swiglu_limit=float(d.get("swiglu_limit") or 7.0)),
    }


def _gguf_fields(meta: GGUFMetadata, cfg: ModelConfig) -> ConfigUpdate:
    """GPT-OSS as llama.cpp runs it: sliding-window attention on the even layers, biases, experts
    (``expert_*`` keys), the clamped activation's constants (fixed in llama.cpp: 1.702 and 7); YaRN
    as the model was trained (transformers' config), not rounded as llama.cpp's rope does."""
    window = meta.optional("attention.sliding_window")
    experts = int(meta.optional("expert_count") or 0)
    if window is None or not experts:
        raise QuickdraftError("GGUF metadata lacks 'gpt-oss.attention.sliding_window' or 'gpt-oss.expert_count'; "
                              "the file is incomplete")
    return {
        "sliding_window": int(window),
        "layer_types": tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)),
        "attention_bias": True,
        "num_experts": experts,
        "num_experts_per_tok": int(meta.optional("expert_used_count") or 4),
        "moe_intermediate_size": int(meta.optional("expert_feed_forward_length") or cfg.intermediate_size),
        "family": GptOssFields(swiglu_alpha=1.702, swiglu_limit=7.0),
        # YaRN without rounding the ramp's ends (the released configs' "truncate": false, which
        # GGUF keys do not carry)
        "rope_scaling": dict(cfg.rope_scaling, truncate=False) if cfg.rope_scaling else None,
    }


# GPT-OSS's GGUF tensors: sinks, the output projection's bias, the router with its bias, stacked
# experts (gate and up apart, each with a bias; MXFP4 blocks in the released files).
_GGUF_TENSOR_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    **{f"ffn_{p}_exps.{f}": f"mlp.experts.{p}_proj.{f}" for p in ("gate", "up", "down") for f in ("weight", "bias")},
}

FAMILY = Family(model_types=("gpt_oss",), fields=GptOssFields, read_hf=_hf_fields, gguf_archs={"gpt-oss": "gpt_oss"},
                read_gguf=_gguf_fields, gguf_experts=False, gguf_tensor_names={"gpt_oss": _GGUF_TENSOR_NAMES})


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    """A checkpoint's MXFP4 ``blocks`` [E, out, G, 16] (two FP4 codes per byte, element 2i in byte
    i's low nibble) and E8M0 ``scales`` [E, out, G] as GGML MXFP4 blocks (``[e][16 bytes]``: element
    j in byte j's low nibble, j + 16 in its high one), the layout the native kernel computes on:
    the same codes and exponents (GGML's values are the E2M1 ones doubled, its scale 2^(e - 128)
    instead of 2^(e - 127)), so the weights are exactly the checkpoint's."""
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise QuickdraftError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    b = blocks.to(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # [E, out, G, 32] in element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    raw = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1)  # [E, out, G, 17]
    e, out, g = scales.shape
    return QuantTensor(GGMLQuantizationType.MXFP4, raw.reshape(e, out, g * 17).contiguous(), (e, out, g * 32))


class SinkAttention(Attention):
    """Attention with biases and one learned sink logit per head: each row's softmax runs over its
    visible keys plus a key whose score is the sink and whose value is zero (the native kernel's
    ``sinks``; :meth:`sdpa` where torch attends: CUDA, bf16, long passes)."""

    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None) -> None:
        super().__init__(cfg, rope, window=window)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(self.nh))

    def sink_logits(self) -> torch.Tensor:
        return self.sinks

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        t, s = q.shape[1], k.shape[1]
        k = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], dim=1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], dim=1)
        bias = q.new_zeros(self.nh, t, s + 1)
        bias[:, :, s] = self.sinks.to(q.dtype).unsqueeze(1)
        if mask is not None:
            bias[:, :, :s].masked_fill_(~mask.to(torch.bool), float("-inf"))
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=bias.unsqueeze(0), scale=self.scale,
            enable_gqa=self.nkv != self.nh,
        )
        return out[0]


class Expert(MLP):
    """One expert: projections with biases and GPT-OSS's clamped, alpha-scaled gated activation."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = Linear(h, i, bias=True)
        self.up_proj = Linear(h, i, bias=True)
        self.down_proj = Linear(i, h, bias=True)
        own = cfg.family_fields(GptOssFields)
        self.alpha, self.limit = own.swiglu_alpha, own.swiglu_limit

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * rowwise(torch.sigmoid, gate * self.alpha))  # (MXFP4 experts: fp32; finish casts)


class DecoderLayer(layers.DecoderLayer):
    """The Llama layer (pre-norm residuals) with sink attention and the experts as its MLP (built
    on the meta device at load, so the parts replaced cost nothing)."""

    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None) -> None:
        super().__init__(cfg, rope)
        self.self_attn = SinkAttention(cfg, rope, window)
        check_moe_config(cfg)
        moe = SparseMoE(cfg, "topk_softmax")
        moe.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        moe.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))
        self.mlp = moe


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = Rope(cfg, max_len)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rope, cfg.sliding_window if is_sliding(cfg, i) else None)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def build_stack(modules: nn.ModuleList, rope: Rope) -> PerLayerCacheStack | None:
    """GPT-OSS's native stack for these layers, or None where it does not apply: q/k/v/o and every
    expert q8 GGML blocks (with their biases), the router float32 or blocks, fp32 norms, sinks and
    RoPE tables."""
    mod = active_kernels()
    layers = [m for m in modules if isinstance(m, DecoderLayer)]
    if mod is None or not layers or len(layers) != len(modules) or rope.cos.dtype != torch.float32 \
            or not rope.cos.is_cpu:
        return None
    a0, eps = layers[0].self_attn, layers[0].input_layernorm.eps
    stack = mod.GptOssStack(rope.cos.contiguous(), rope.sin.contiguous(), float(eps), a0.nh, a0.nkv, a0.hd,
                            float(a0.scale))
    windows = set()
    for layer in layers:
        a, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
        if type(a) is not SinkAttention or a.rope is not rope or (a.nh, a.nkv, a.hd, a.scale) != (a0.nh, a0.nkv, a0.hd, a0.scale) \
                or a.hd % 8 or a.q_norm is not None or any(type(n) is not RMSNorm or n.eps != eps for n in norms) \
                or not on_cpu_fp32(a.sinks, *[n.weight for n in norms]):
            return None
        qkv, o = weight_specs(a.q_proj, a.k_proj, a.v_proj), weight_spec(a.o_proj)
        mlp = layer.mlp
        if qkv is None or o is None or not isinstance(mlp, SparseMoE) \
                or not all(type(e) is Expert for e in mlp.experts):
            return None
        swiglu = {(float(e.alpha), float(e.limit)) for e in mlp.experts if isinstance(e, Expert)}
        experts = expert_block(mlp, swiglu=next(iter(swiglu))) if len(swiglu) == 1 else None
        if experts is None:
            return None
        if a.window:
            windows.add(a.window)
        stack.add_layer(norms[0].weight.detach(), norms[1].weight.detach(), qkv, o, a.sinks.detach(), a.window or 0,
                        experts)
    if len(windows) > 1:
        return None
    return PerLayerCacheStack(stack, next(iter(windows), None), layer_inputs=False)


class CausalLM(causal_lm.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`."""

    backbone = _Backbone

    def native_stack(self) -> PerLayerCacheStack | None:
        return build_stack(self.model.layers, self.model.rope)
    converts_checkpoint = True

    def convert_checkpoint(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The router as ``mlp.gate``, stacked experts split per expert: float, MXFP4 (kept in their
        blocks for the native kernel), or a GGUF's (gate and up apart, already per projection)."""
        pending: dict[str, torch.Tensor] = {}  # MXFP4 blocks or scales waiting for their other half
        for name, tensor in tensors:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            if name.endswith(("_blocks", "_scales")):
                base, _, part = name.rpartition("_")
                other = base + ("_scales" if part == "blocks" else "_blocks")
                if other not in pending:
                    pending[name] = tensor
                    continue
                blocks, scales = (tensor, pending.pop(other)) if part == "blocks" else (pending.pop(other), tensor)
                yield from self._split(base, mxfp4_blocks(blocks, scales), out_major=True)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj", "_bias")) and ".experts." in name:
                yield from self._split(name, tensor, out_major=False)
            else:
                yield from convert_expert_layouts([(name, tensor)])
        if pending:
            raise QuickdraftError(f"MXFP4 tensors without their other half: {', '.join(sorted(pending))}")

    @staticmethod
    def _split(name: str, w: torch.Tensor | QuantTensor, out_major: bool) -> Iterator[tuple[str, Any]]:
        """``*.experts.gate_up_proj[_bias]`` / ``*.experts.down_proj[_bias]`` -> per expert parameters.
        Matrices come as [E, in, out] (``out_major``: [E, out, in], MXFP4's); gate and up alternate."""
        prefix, _, kind = name.rpartition(".experts.")
        bias = kind.endswith("_bias")
        kind = kind.removesuffix("_bias")
        if kind not in ("gate_up_proj", "down_proj"):
            raise QuickdraftError(f"unexpected GPT-OSS expert tensor {name}")
        suffix = "bias" if bias else "weight"
        for e in range(int(w.shape[0])):
            x: Any
            if isinstance(w, QuantTensor):
                x = w.expert(e)
                rows = torch.arange(x.shape[0])
                parts = (x.select_rows(rows[0::2]), x.select_rows(rows[1::2])) if kind == "gate_up_proj" else (x,)
            else:
                x = w[e] if bias or out_major else w[e].t()
                parts = (x[0::2].contiguous(), x[1::2].contiguous()) if kind == "gate_up_proj" else (x.contiguous(),)
            names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for proj, part in zip(names, parts, strict=True):
                yield f"{prefix}.experts.{e}.{proj}.{suffix}", part
