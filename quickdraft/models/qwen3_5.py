"""Qwen3.5 text decoder (HF ``model_type`` "qwen3_5" and its text model "qwen3_5_text"): a hybrid
of Gated DeltaNet linear attention and gated full attention, as transformers' ``modeling_qwen3_5``.

* ``layer_types``: most layers are "linear_attention" (:class:`GatedDeltaNet`), every
  ``full_attention_interval``-th is "full_attention" (:class:`GatedAttention`);
* Gated DeltaNet (Yang et al., arXiv 2412.06464): projections to q, k, v (through a short causal
  depthwise convolution and SiLU), a gate z, a write strength beta = sigmoid(b) and a decay
  g = -exp(A_log) * softplus(a + dt_bias) per value head; then per token, with q and k
  L2-normalised and q scaled by Dk^-0.5, over a state S [Dk, Dv] per head:
  ``S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q``,
  then an RMSNorm of o gated by SiLU(z) and the output projection;
* full attention: q_proj yields the query and a gate per head (output * sigmoid(gate) before
  o_proj), q/k RMSNorm per head, RoPE on the first ``partial_rotary_factor`` of each head;
* RMSNorms outside the linear-attention block multiply by ``1 + weight`` (Gemma's form).

The recurrent state lives in a :class:`~quickdraft.cache.RecurrentState`, which a
:class:`~quickdraft.cache.HybridCache` composes beside the full-attention layers' keys and
values. Each row of a pass continues its parent's state (:meth:`Step.row_parents`:
the row before it on a chain, its tree parent, or the state before the pass), computed one row at
a time in the same operations whatever the pass holds, so a token's result is bitwise the same
in a prefill chunk, a verification chain, a tree or a pass over several sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.cache import HybridCache, KVCache, RecurrentShape, RecurrentState, State
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
from quickdraft.models import causal_lm
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.gemma3 import GemmaRMSNorm
from quickdraft.models.layers import MLP, Attention, Rope, embedding, linear_group
from quickdraft.models.moe import (
    GGUF_MOE_TENSOR_NAMES,
    SparseMoE,
    check_moe_config,
    convert_expert_layouts,
    expert_block,
)
from quickdraft.models.native import WeightSpec, float_weight, on_cpu_fp32, weight_specs
from quickdraft.models.phi3 import PartialRope
from quickdraft.quant.ggml import active_kernels

# checkpoint names -> the model's (a vision-language checkpoint's text model), and what is not loaded
CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."),)
CHECKPOINT_SKIP = ("model.visual.", "mtp.")


LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclass(frozen=True)
class GatedDeltaNetFields(FamilyFields):
    """The Gated DeltaNet shape of the ``layer_types`` "linear_attention" layers (a short causal
    convolution, then the gated delta rule over a recurrent state)."""

    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    attn_output_gate: bool = False  # q_proj also yields a gate: attention output * sigmoid(gate)
    # Value heads in llama.cpp's tiled order (value head j reads q/k head j % nk; GGUF files), not
    # grouped (j reads q/k head j // (nv / nk); Hugging Face checkpoints).
    linear_value_heads_tiled: bool = False


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text fields (transformers' config defaults where a
    config.json leaves one out): Gated DeltaNet layers between gated full-attention layers (every
    ``full_attention_interval``-th), partial rotary, q/k norms, and the MoE families' experts."""
    activation = d.get("hidden_act", "silu")
    if activation != "silu":
        raise QuickdraftError(f"Qwen3.5 with hidden_act {activation!r} is not supported (only silu)")
    layer_types = hf_layer_types(d, (LINEAR_ATTENTION, FULL_ATTENTION), every=int(d.get("full_attention_interval") or 4))
    params = d.get("rope_parameters") or {}
    scaling = rope_scaling_of(d)
    if scaling is not None:  # (mrope sections are plain RoPE for text: one position per token)
        raise QuickdraftError(f"Qwen3.5 with rope_type {scaling['rope_type']!r} is not supported (only default)")
    return {
        "head_dim": int(d.get("head_dim") or 256),
        "layer_types": layer_types,
        "partial_rotary_factor": float(params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 0.25),
        "qk_norm": True,
        "family": GatedDeltaNetFields(
            attn_output_gate=True,
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim") or 4),
            linear_key_head_dim=int(d.get("linear_key_head_dim") or 128),
            linear_value_head_dim=int(d.get("linear_value_head_dim") or 128),
            linear_num_key_heads=int(d.get("linear_num_key_heads") or 16),
            linear_num_value_heads=int(d.get("linear_num_value_heads") or 32),
        ),
    } | ({} if d["model_type"] == "qwen3_5" else _hf_experts(d))


def _hf_experts(d: dict[str, Any]) -> ConfigUpdate:
    """The MoE models' MLPs: routed experts plus a gated shared one."""
    next_ = d["model_type"] == "qwen3_next"
    return {
        "num_experts": int(d.get("num_experts") or (512 if next_ else 256)),
        "num_experts_per_tok": int(d.get("num_experts_per_tok") or (10 if next_ else 8)),
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or 512),
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 512),
        "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
        # qwen3_next: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not listed
        "decoder_sparse_step": int(d.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    }


# Vision-language checkpoints (and their text models) -> the text model's type
_TEXT_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
               "qwen3_5_moe_text": "qwen3_5_moe"}


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 checkpoint with its vision tower runs as its text model; a Qwen3.5-MoE text
    config has no dense MLP width (every layer is routed): its experts' stands in."""
    out = text_config_of(d, _TEXT_TYPES[str(d["model_type"])])
    if "intermediate_size" not in out and "moe_intermediate_size" in out:
        out["intermediate_size"] = out["moe_intermediate_size"]
    return out


def _gguf_fields(meta: GGUFMetadata, cfg: ModelConfig) -> ConfigUpdate:
    """Qwen3.5's hybrid layout as llama.cpp's converter writes it: the block count includes the
    multi-token-prediction blocks (``nextn_predict_layers``), the layer kinds come as
    ``attention.recurrent_layers`` (or every ``full_attention_interval``-th is full), the Gated
    DeltaNet shape as ``ssm.*`` keys, value heads in tiled order."""
    layers = cfg.num_hidden_layers - int(meta.optional("nextn_predict_layers") or 0)
    recurrent = meta.optional("attention.recurrent_layers")
    if recurrent is not None:
        kinds = [LINEAR_ATTENTION if r else FULL_ATTENTION for r in list(recurrent)[:layers]]
    else:
        interval = int(meta.optional("full_attention_interval") or 4)
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    nv, nk, inner = int(meta.get("ssm.time_step_rank")), int(meta.get("ssm.group_count")), int(meta.get("ssm.inner_size"))
    state, conv = int(meta.get("ssm.state_size")), int(meta.get("ssm.conv_kernel"))
    arch = meta.arch
    for key, value in (("ssm.time_step_rank", nv), ("ssm.group_count", nk), ("ssm.inner_size", inner),
                       ("ssm.state_size", state), ("ssm.conv_kernel", conv)):
        if value <= 0:
            raise QuickdraftError(f"GGUF metadata '{arch}.{key}' is {value}; the file is damaged (it must be positive)")
    if inner % nv or nv % nk:
        raise QuickdraftError(
            f"GGUF metadata is inconsistent: '{arch}.ssm.inner_size' {inner} must be a multiple of "
            f"'{arch}.ssm.time_step_rank' {nv} (value heads), and that of '{arch}.ssm.group_count' {nk} (key heads)")
    return {
        "num_hidden_layers": layers,
        "layer_types": tuple(kinds),
        "partial_rotary_factor": int(meta.get("rope.dimension_count")) / cfg.head_dim,
        "qk_norm": True,
        "family": GatedDeltaNetFields(
            attn_output_gate=True,
            linear_conv_kernel_dim=conv,
            linear_key_head_dim=state,
            linear_num_key_heads=nk,
            linear_num_value_heads=nv,
            linear_value_head_dim=inner // nv,
            linear_value_heads_tiled=arch != "qwen3next",  # (Qwen3-Next's converter keeps them grouped)
        ),
    }


# Qwen3.5's GGUF tensors: the Gated DeltaNet layers' (llama.cpp's ssm_* names), the gated attention's.
_GGUF_TENSOR_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_GGUF_MOE_TENSOR_NAMES = _GGUF_TENSOR_NAMES | GGUF_MOE_TENSOR_NAMES
# Qwen3-Next: Qwen3.5's names, its b / a projections still fused (grouped per key head, split at load)
_GGUF_NEXT_TENSOR_NAMES = _GGUF_MOE_TENSOR_NAMES | {"ssm_ba.weight": "linear_attn.in_proj_ba.weight"}

def _gguf_tensor(name: str, w: np.ndarray) -> np.ndarray:
    """A Gated DeltaNet tensor as the checkpoint holds it."""
    if name.endswith(".A_log"):  # llama.cpp stores A = -exp(A_log)
        return np.log(-w)
    if name.endswith(".conv1d.weight"):  # [C, K] -> the depthwise Conv1d's [C, 1, K]
        return w[:, None, :]
    return w


# GGUFs: the norms outside the Gated DeltaNet's gated one stored as 1 + w (Gemma's form), blocks
# past the model's layers multi-token-prediction ones; top-k weights renormalised (llama.cpp's
# default for the MoE architectures).
FAMILY = Family(
    model_types=("qwen3_5", "qwen3_5_moe", "qwen3_next"), fields=GatedDeltaNetFields, read_hf=_hf_fields,
    hf_wrappers=tuple(_TEXT_TYPES), text_config=_text_config,
    gguf_archs={"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}, read_gguf=_gguf_fields,
    gguf_norm_topk=True,
    gguf_tensor_names={"qwen3_5": _GGUF_TENSOR_NAMES, "qwen3_5_moe": _GGUF_MOE_TENSOR_NAMES,
                       "qwen3_next": _GGUF_NEXT_TENSOR_NAMES},
    gguf_norm_plus_one=True, gguf_norms_as_is=("ssm_norm.weight",), gguf_mtp_blocks=True, gguf_tensor=_gguf_tensor,
)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times SiLU of its gate (weight as is, not 1 + weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; ``index``: its place among the model's linear-attention layers
    (its state in the cache)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        own = cfg.family_fields(GatedDeltaNetFields)
        self.nk, self.nv = own.linear_num_key_heads, own.linear_num_value_heads
        self.dk, self.dv = own.linear_key_head_dim, own.linear_value_head_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads {self.nv} is not a multiple of linear_num_key_heads {self.nk}")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = own.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.nv, bias=False)
        self.in_proj_a = Linear(h, self.nv, bias=False)
        self.tiled = own.linear_value_heads_tiled

    def _per_value_head(self, x: torch.Tensor, rep: int) -> torch.Tensor:
        """q or k [Hk, Dk] for each value head [Hv, Dk]: grouped (head j reads j // rep), or
        tiled (j reads j % Hk: GGUF files, whose value heads llama.cpp's converter reorders)."""
        if rep == 1:
            return x
        return x.repeat(rep, 1) if self.tiled else x.repeat_interleave(rep, dim=0)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        mixed, z, b, a = linear_group([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a], x)
        recurrent = step.cache.recurrent
        if recurrent is None:
            raise ValueError("a hybrid model runs on caches from its own make_cache()")
        parents = step.row_parents()
        starts = pass_starts(step, parents, self.index)
        keep = recurrent.kept_rows()
        mod = active_kernels()
        if mod is not None and mixed.dtype == torch.float32 and not mixed.is_cuda and not torch.is_grad_enabled() \
                and all(s.dtype == torch.float32 for start in starts for s in start):
            out, *rows = mod.gated_delta_rows(
                mixed.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), self.conv1d.weight,
                -self.A_log.float().exp(), self.dt_bias.float(),
                self.norm.weight, self.norm.eps, self.nk, self.dk, self.nv, self.dv, self.tiled, parents,
                [c for c, _ in starts], [m for _, m in starts], keep)
            states = [(c, m) if c is not None and m is not None else None
                      for c, m in zip(rows[: len(parents)], rows[len(parents):], strict=True)]
        else:
            out, every = self._rows(mixed, z, b, a, parents, starts)
            states = [s if kept else None for s, kept in zip(every, keep, strict=True)]
        recurrent.record(self.index, states)
        return self.out_proj(out)

    def _rows(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, parents: list[int],
              starts: list[State]) -> tuple[torch.Tensor, list[State]]:
        """The rows in torch (the reference the native ``gated_delta_rows`` follows; autograd, bf16,
        CUDA): each continues its parent row's state, or the next of ``starts``."""
        # One row at a time, in the same shapes whatever the pass holds: torch computes exp, sigmoid
        # and silu vectorised in the bulk of a tensor and scalar in its tail, so a row's result would
        # otherwise depend on how many rows share its pass.
        w = self.conv1d.weight[:, 0, :]  # [C, K]
        a_scale = -self.A_log.float().exp()
        rep = self.nv // self.nk
        convs: list[torch.Tensor] = []
        mats: list[torch.Tensor] = []
        out = []
        first = iter(starts)
        for i in range(mixed.shape[0]):
            prev_conv, prev = (convs[parents[i]], mats[parents[i]]) if parents[i] >= 0 else next(first)
            window = torch.cat([prev_conv, mixed[i].unsqueeze(1)], dim=1)  # [C, K]: the inputs along its path
            convs.append(window[:, 1:])
            conv = window[:, 0] * w[:, 0]
            for j in range(1, self.kernel):
                conv = conv + window[:, j] * w[:, j]
            q, k, v = F.silu(conv).split([self.key_dim, self.key_dim, self.value_dim])
            q = self._per_value_head(l2norm(q.view(self.nk, self.dk)), rep) / (self.dk**0.5)  # [Hv, Dk]
            k = self._per_value_head(l2norm(k.view(self.nk, self.dk)), rep)
            beta = b[i].sigmoid()  # [Hv]
            decay = (a_scale * F.softplus(a[i].float() + self.dt_bias)).exp()
            # the gated delta rule (never in place: states are shared with the cache's rows)
            s = prev * decay[:, None, None]
            remembered = (s * k[:, :, None]).sum(dim=-2)  # [Hv, Dv]
            delta = (v.view(self.nv, self.dv) - remembered) * beta[:, None]
            s = s + k[:, :, None] * delta[:, None, :]
            mats.append(s)
            o = (s * q[:, :, None]).sum(dim=-2)  # [Hv, Dv]
            out.append(self.norm(o, z[i].view(self.nv, self.dv)).reshape(self.value_dim))
        return torch.stack(out), list(zip(convs, mats, strict=True))


def pass_starts(step: Step, parents: list[int], layer: int) -> list[State]:
    """Linear-attention layer ``layer``'s states that the pass's rows without a parent continue,
    in row order (each from its own sequence's cache)."""
    starts = []
    for i, p in enumerate(parents):
        if p < 0:
            lane = step.state_cache(i).recurrent
            assert lane is not None, "a hybrid model runs on its own make_cache()"
            starts.append(lane.state(layer))
    return starts


class GatedAttention(Attention):
    """Full attention whose q_proj also yields a gate per head: o_proj(attention * sigmoid(gate))."""

    def __init__(self, cfg: ModelConfig, rope: Rope) -> None:
        super().__init__(cfg, rope)
        self.q_proj = Linear(cfg.hidden_size, 2 * self.nh * self.hd, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = linear_group([self.q_proj, self.k_proj, self.v_proj], x)
        qg = qg.view(t, self.nh, 2 * self.hd)
        q = qg[..., : self.hd].transpose(0, 1)  # [Hq, T, D]
        gate = qg[..., self.hd :].reshape(t, self.nh * self.hd)
        k = k.view(t, self.nkv, self.hd).transpose(0, 1)
        v = v.view(t, self.nkv, self.hd).transpose(0, 1)
        return self.o_proj(self.attend(q, k, v, layer, step) * torch.sigmoid(gate))


class DecoderLayer(nn.Module):
    """``index``: the layer's place among its kind (its KV layer, or its recurrent state)."""

    def __init__(self, cfg: ModelConfig, rope: Rope, linear: bool, index: int, sparse: bool = False) -> None:
        super().__init__()
        self.index = index
        self.linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(cfg, index)
        else:
            self.self_attn = GatedAttention(cfg, rope)
        self.mlp: nn.Module
        if sparse:  # routed experts (softmax top-k, renormalised) and a gated shared one
            check_moe_config(cfg)
            self.mlp = SparseMoE(cfg, "softmax_topk", shared_expert_gate=True)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, step) if self.linear else self.self_attn(h, self.index, step)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def is_sparse(cfg: ModelConfig, i: int) -> bool:
    """Whether layer ``i`` (0 for the MTP layer) has routed experts instead of a dense MLP."""
    return bool(cfg.num_experts) and i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0


def _linear_layers(cfg: ModelConfig) -> list[bool]:
    assert cfg.layer_types is not None
    return [t == LINEAR_ATTENTION for t in cfg.layer_types]


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = PartialRope(cfg, max_len)
        linear = _linear_layers(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rope, lin, sum(1 for j in range(i) if linear[j] == lin), is_sparse(cfg, i))
            for i, lin in enumerate(linear)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridStack:
    """Every layer of a pass in one native call (the kernels' ``HybridStack``: bitwise the Python
    layers); the recurrent state stays the cache's, handed in and recorded as the layers do."""

    def __init__(self, native: Any, layers: int) -> None:
        self.native, self.layers = native, layers  # layers: how many are Gated DeltaNet ones

    def run(self, x: torch.Tensor, step: Step, capture: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        recurrent = step.cache.recurrent
        if recurrent is None:
            raise ValueError("a hybrid model runs on caches from its own make_cache()")
        parents = step.row_parents()
        recurrent.begin_rows(step.start, parents, step.outputs)
        starts = [pass_starts(step, parents, i) for i in range(self.layers)]
        slots, offsets = step.flat_slots(None)
        cache = step.cache.attention
        x, captured, rows = self.native.run(
            x, step.positions, cache.k, cache.v, step.start, slots, offsets, list(capture), parents,
            [[c for c, _ in layer] for layer in starts], [[m for _, m in layer] for layer in starts],
            recurrent.kept_rows())
        t = len(parents)
        for i, r in enumerate(rows):
            recurrent.record(i, [(c, m) if c is not None and m is not None else None
                                 for c, m in zip(r[:t], r[t:], strict=True)])
        return x, captured


def build_hybrid_stack(modules: nn.ModuleList, rope: Rope) -> HybridStack | None:
    """Qwen3.5's native stack for these layers, or None where it does not apply: every matrix a q8
    GGML block (Gated DeltaNet's b / a and the routers may be float32; dense MLPs or routed experts
    with the gated shared one), fp32 norms."""
    mod = active_kernels()
    layers = [m for m in modules if isinstance(m, DecoderLayer)]
    if mod is None or not layers or len(layers) != len(modules) or rope.cos.dtype != torch.float32 \
            or not rope.cos.is_cpu:
        return None
    eps = layers[0].input_layernorm.eps

    def norm_ok(*ns: nn.Module | None) -> bool:
        return all(type(n) is GemmaRMSNorm and n.eps == eps and on_cpu_fp32(n.weight) for n in ns)

    attn0 = next((layer.self_attn for layer in layers if not layer.linear), None)
    heads = (attn0.nh, attn0.nkv, attn0.hd, attn0.scale, attn0.window) if attn0 is not None else (1, 1, 8, 1.0, None)
    stack = mod.HybridStack(rope.cos.contiguous(), rope.sin.contiguous(), float(eps), heads[0], heads[1], heads[2],
                            float(heads[3]), heads[4] or 0)
    deltas = 0
    for layer in layers:
        mlp = layer.mlp
        experts = None
        gate_up: list[WeightSpec] | None = []
        down: WeightSpec | None = None
        if type(mlp) is MLP:
            gate_up, down_specs = weight_specs(mlp.gate_proj, mlp.up_proj), weight_specs(mlp.down_proj)
            if gate_up is None or down_specs is None:
                return None
            down = down_specs[0]
        elif (experts := expert_block(mlp)) is None:  # else routed experts and the gated shared one
            return None
        if not norm_ok(layer.input_layernorm, layer.post_attention_layernorm):
            return None
        norms = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
        if layer.linear:
            d = layer.linear_attn
            if type(d) is not GatedDeltaNet or not on_cpu_fp32(d.conv1d.weight, d.A_log, d.dt_bias, d.norm.weight):
                return None
            proj, out = weight_specs(d.in_proj_qkv, d.in_proj_z, d.in_proj_b, d.in_proj_a), weight_specs(d.out_proj)
            b_w = a_w = None
            if proj is None:  # b and a float32 (as llama.cpp's quantizer leaves them)
                proj, b_w, a_w = weight_specs(d.in_proj_qkv, d.in_proj_z), float_weight(d.in_proj_b), float_weight(d.in_proj_a)
                if proj is None or b_w is None or a_w is None:
                    return None
            if out is None or not d.conv1d.weight.is_contiguous():
                return None
            stack.add_delta(*norms, proj, b_w, a_w, d.conv1d.weight.detach(), d.A_log.detach(), d.dt_bias.detach(),
                            d.norm.weight.detach(), d.norm.eps, d.nk, d.dk, d.nv, d.dv, d.tiled, out[0], gate_up, down,
                            experts)
            deltas += 1
        else:
            a = layer.self_attn
            qkv, o = weight_specs(a.q_proj, a.k_proj, a.v_proj), weight_specs(a.o_proj)
            if (type(a) is not GatedAttention or qkv is None or o is None or a.q_norm is None or a.k_norm is None
                    or not norm_ok(a.q_norm, a.k_norm) or a.rope is not rope or not a.native
                    or (a.nh, a.nkv, a.hd, a.scale, a.window) != heads or a.hd % 8):
                return None
            stack.add_attention(*norms, a.q_norm.weight.detach(), a.k_norm.weight.detach(), qkv, o[0], gate_up, down,
                                experts)
    return HybridStack(stack, deltas)


class CausalLM(causal_lm.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`, on
    a :class:`HybridCache`."""

    backbone = _Backbone
    converts_checkpoint = True

    def native_stack(self) -> HybridStack | None:
        return build_hybrid_stack(self.model.layers, self.model.rope)

    def recurrent_shape(self) -> RecurrentShape:
        cfg = self.config
        own = cfg.family_fields(GatedDeltaNetFields)
        return RecurrentShape(
            layers=sum(_linear_layers(cfg)),
            conv_channels=2 * own.linear_num_key_heads * own.linear_key_head_dim
            + own.linear_num_value_heads * own.linear_value_head_dim,
            conv_width=own.linear_conv_kernel_dim - 1,
            heads=own.linear_num_value_heads,
            key_dim=own.linear_key_head_dim,
            value_dim=own.linear_value_head_dim,
        )

    def make_cache(self, max_len: int) -> HybridCache:
        cfg = self.config
        attention_layers = cfg.num_hidden_layers - sum(_linear_layers(cfg))
        attention = KVCache(attention_layers, cfg.num_key_value_heads, cfg.head_dim, max_len, self.kv_dtype or self.dtype,
                            self.device)
        return HybridCache(attention, RecurrentState(self.recurrent_shape(), self.dtype, self.device))

    def convert_checkpoint(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """A vision-language checkpoint's text model: ``model.language_model.`` names, no vision
        tower, stacked experts split per expert; the multi-token-prediction layers kept aside
        (:meth:`mtp_layer`)."""
        self.mtp_weights = {}
        for name, tensor in self._split_fused(convert_expert_layouts(tensors, CHECKPOINT_RENAMES)):
            if name.startswith("mtp."):
                self.mtp_weights[name.removeprefix("mtp.")] = tensor
            elif not name.startswith(CHECKPOINT_SKIP):
                yield name, tensor

    def _split_fused(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Qwen3-Next's fused projections as Qwen3.5's: ``in_proj_qkvz`` holds per q/k head group
        [q, k, v (nv/nk heads), z (nv/nk heads)] and ``in_proj_ba`` [b, a] (nv/nk each); their rows
        regrouped into in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a."""
        own = self.config.family_fields(GatedDeltaNetFields)
        nk, dk, dv, rep = (own.linear_num_key_heads, own.linear_key_head_dim, own.linear_value_head_dim,
                           own.linear_num_value_heads // max(own.linear_num_key_heads, 1))
        group = [dk, dk, rep * dv, rep * dv]  # in_proj_qkvz rows per q/k head: q, k, v, z

        def rows(sizes: list[int], part: int, n: int) -> torch.Tensor:  # rows of ``part`` in every group
            step = sum(sizes)
            lo = sum(sizes[:part])
            return torch.cat([torch.arange(g * step + lo, g * step + lo + sizes[part]) for g in range(n)])

        def take(tensor: Any, ids: torch.Tensor) -> Any:  # (a GGUF's blocks: whole rows each)
            return tensor.index_select(0, ids) if isinstance(tensor, torch.Tensor) else tensor.select_rows(ids)

        for name, tensor in tensors:
            if name.endswith("in_proj_qkvz.weight"):
                prefix = name.removesuffix("in_proj_qkvz.weight")
                qkv = torch.cat([rows(group, part, nk) for part in range(3)])
                yield prefix + "in_proj_qkv.weight", take(tensor, qkv)
                yield prefix + "in_proj_z.weight", take(tensor, rows(group, 3, nk))
            elif name.endswith("in_proj_ba.weight"):  # rows per q/k head: b (rep), a (rep)
                prefix = name.removesuffix("in_proj_ba.weight")
                yield prefix + "in_proj_b.weight", take(tensor, rows([rep, rep], 0, nk))
                yield prefix + "in_proj_a.weight", take(tensor, rows([rep, rep], 1, nk))
            else:
                yield name, tensor

    def mtp_layer(self) -> tuple[nn.Module, type[nn.Module]] | None:
        """Qwen3.5's MTP layer: one gated-attention decoder layer (sparse like layer 0 of an MoE model)."""
        if not self.mtp_weights:
            return None
        cfg = self.config
        return DecoderLayer(cfg, self.model.rope, linear=False, index=0, sparse=is_sparse(cfg, 0)), GemmaRMSNorm
