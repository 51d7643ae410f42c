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
  [E, out, K/32]: E8M0 exponents), dequantized here at load (no native MXFP4 kernel yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models import causal_lm, layers
from quickdraft.models.gemma3 import is_sliding
from quickdraft.models.layers import Attention, Linear, RMSNorm, Rope, embedding, linear_group
from quickdraft.models.moe import SparseMoE, check_moe_config, rowwise

# FP4 (E2M1) values of the 16 codes (MXFP4, the OCP Microscaling spec)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 and E8M0 scales [..., G] -> float32 [..., G * 32]: value
    ``FP4[code] * 2^(scale - 127)``, the low nibble of byte i holding element 2i."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise QuickdraftError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    out = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2)


class SinkAttention(Attention):
    """Attention with biases and one learned sink logit per head, computed by torch (the native
    kernels have no sinks): each row's softmax runs over its visible keys plus a zero key whose
    score is the sink and whose value is zero."""

    native = False

    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None) -> None:
        super().__init__(cfg, rope, window=window)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(self.nh))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
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


class Expert(nn.Module):
    """One expert: projections with biases and GPT-OSS's clamped, alpha-scaled gated activation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = Linear(h, i, bias=True)
        self.up_proj = Linear(h, i, bias=True)
        self.down_proj = Linear(i, h, bias=True)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_group([self.gate_proj, self.up_proj], x)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * rowwise(torch.sigmoid, gate * self.alpha)
        return self.down_proj((up + 1) * glu)


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


class CausalLM(causal_lm.CausalLM):
    """``model(ids, cache) -> (logits, captured)``, the interface of :class:`causal_lm.CausalLM`."""

    backbone = _Backbone

    def convert_checkpoint(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The router as ``mlp.gate``, stacked experts (float or MXFP4) split per expert."""
        pending: dict[str, torch.Tensor] = {}  # MXFP4 blocks or scales waiting for their other half
        dequantized = 0
        for name, tensor in tensors:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            if name.endswith(("_blocks", "_scales")):
                base, _, part = name.rpartition("_")
                other = base + ("_scales" if part == "blocks" else "_blocks")
                if other not in pending:
                    pending[name] = tensor
                    continue
                blocks, scales = (tensor, pending.pop(other)) if part == "blocks" else (pending.pop(other), tensor)
                w = dequantize_mxfp4(blocks, scales)  # [E, out, in]
                dequantized += w.numel()
                yield from self._split(base, w, out_major=True)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj", "_bias")) and ".experts." in name:
                yield from self._split(name, tensor, out_major=False)
            else:
                yield name, tensor
        if pending:
            raise QuickdraftError(f"MXFP4 tensors without their other half: {', '.join(sorted(pending))}")
        if dequantized:
            self.load_notes.append(
                f"MXFP4 experts dequantized at load ({dequantized * 4 / 2**30:.1f} GB as float32): quickdraft has no "
                "native MXFP4 kernel yet"
            )

    @staticmethod
    def _split(name: str, w: torch.Tensor, out_major: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """``*.experts.gate_up_proj[_bias]`` / ``*.experts.down_proj[_bias]`` -> per expert parameters.
        Matrices come as [E, in, out] (``out_major``: [E, out, in], MXFP4's); gate and up alternate."""
        prefix, _, kind = name.rpartition(".experts.")
        bias = kind.endswith("_bias")
        kind = kind.removesuffix("_bias")
        for e, x in enumerate(w.unbind(0)):
            if not bias and not out_major:
                x = x.t()
            x = x.contiguous()
            suffix = "bias" if bias else "weight"
            if kind == "gate_up_proj":
                yield f"{prefix}.experts.{e}.gate_proj.{suffix}", x[0::2].contiguous()
                yield f"{prefix}.experts.{e}.up_proj.{suffix}", x[1::2].contiguous()
            elif kind == "down_proj":
                yield f"{prefix}.experts.{e}.down_proj.{suffix}", x
            else:
                raise QuickdraftError(f"unexpected GPT-OSS expert tensor {name}")
