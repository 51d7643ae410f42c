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

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.cache import HybridCache, KVCache, RecurrentShape, RecurrentState, State
from quickdraft.config import LINEAR_ATTENTION, ModelConfig
from quickdraft.models import causal_lm
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.gemma3 import GemmaRMSNorm
from quickdraft.models.layers import MLP, Attention, Rope, embedding, linear_group
from quickdraft.models.moe import SparseMoE, check_moe_config, convert_expert_layouts
from quickdraft.models.phi3 import PartialRope
from quickdraft.quant.ggml import active_kernels

# checkpoint names -> the model's (a vision-language checkpoint's text model), and what is not loaded
CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."),)
CHECKPOINT_SKIP = ("model.visual.", "mtp.")


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
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads {self.nv} is not a multiple of linear_num_key_heads {self.nk}")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
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
        self.tiled = cfg.linear_value_heads_tiled

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

        def before(i: int) -> State:  # the state a row without a parent in the pass continues
            lane = step.state_cache(i).recurrent
            assert lane is not None, "a hybrid model runs on its own make_cache()"
            return lane.state(self.index)

        starts = [before(i) for i, p in enumerate(parents) if p < 0]
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


class CausalLM(causal_lm.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`, on
    a :class:`HybridCache`."""

    backbone = _Backbone
    converts_checkpoint = True

    def recurrent_shape(self) -> RecurrentShape:
        cfg = self.config
        return RecurrentShape(
            layers=sum(_linear_layers(cfg)),
            conv_channels=2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
            conv_width=cfg.linear_conv_kernel_dim - 1,
            heads=cfg.linear_num_value_heads,
            key_dim=cfg.linear_key_head_dim,
            value_dim=cfg.linear_value_head_dim,
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
        cfg = self.config
        nk, dk, dv, rep = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                           cfg.linear_num_value_heads // max(cfg.linear_num_key_heads, 1))
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
