"""Building blocks shared by every decoder: RMSNorm, RoPE, attention over the static cache, MLP.

All tensors are for one sequence (batch 1, the single-user case): activations are ``[T, H]``.
Linear layers are the batch-invariant :class:`~quickdraft.models.batch_invariance.Linear`;
``quickdraft.quant`` may swap them for low-bit kernels with the same call signature.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step, fused_ops
from quickdraft.quant.ggml import GGMLLinear, ggml_linear_grouped, ggml_linear_multi


def linear_grouped(groups: list[list[nn.Module]], x: torch.Tensor, counts: list[int]) -> list[list[torch.Tensor]]:
    """Group g's modules on the g-th of ``x``'s consecutive groups of ``counts[g]`` rows; quantized
    GGML layers run as ONE kernel call, with bitwise the same results."""
    if groups and groups[0] and isinstance(groups[0][0], GGMLLinear):
        return ggml_linear_grouped(groups, x, counts)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return [[m(x[starts[g] : starts[g + 1]]) for m in ms] for g, ms in enumerate(groups)]


def linear_group(modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``; quantized GGML layers that share ``x`` run as ONE kernel call
    (activations quantized once, one thread team), with bitwise the same results."""
    if isinstance(modules[0], GGMLLinear):
        return ggml_linear_multi(modules, x)
    return [m(x) for m in modules]


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)`` without its random init: the weights are loaded next, and a normal
    init costs ~1 s for a 151936 x 1536 table even on the meta device (torch 2.13)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class QuantEmbedding(nn.Module):
    """Token embedding read from a block-quantized matrix (dequantizes only the rows looked up)."""

    def __init__(self, linear: GGMLLinear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H] float32
        return self.linear.embedding(ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x, self.weight)
        if ops is not None:  # one call instead of six (decode-step overhead)
            return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        # Computed in fp32 and cast back, as Hugging Face does, so bf16 runs stay close to fp32.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def allocate_empty(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Give a module built on the meta device uninitialised storage on ``device``, floating
    tensors in ``dtype``: ``module.to(dtype).to_empty(device)`` without its cost, since empty_like
    of a meta tensor runs torch's Python reference ops, whose first use imports sympy (~1 s of a
    cold start)."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` including the rope_scaling variants we support."""
    dim = cfg.head_dim
    # Always on the CPU (also under ``torch.device("meta")``: meta-device arithmetic goes through
    # torch's Python references, whose first use imports torch._dynamo, 1.5 s of cold start).
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3_scale(inv, scaling)
    elif kind == "freq_factors":  # GGUF's rope_freqs tensor: llama.cpp divides each frequency
        inv = inv / torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, dim, cfg, scaling)
    elif kind == "proportional":  # Gemma 4: the first angles of a head rotate (as if the head were whole), the rest do not
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv = torch.cat([inv[:angles], torch.zeros(dim // 2 - angles, dtype=inv.dtype, device="cpu")]) / float(scaling.get("factor", 1.0))
    elif kind != "default":
        from quickdraft.errors import QuickdraftError

        raise QuickdraftError(
            f"rope_scaling type {kind!r} is not supported yet (supported: default, linear, llama3, yarn, proportional)"
        )
    return inv.float()


def yarn_factors(cfg: ModelConfig, scaling: dict) -> tuple[float, int]:
    """(factor, original context length) of a YaRN config, as transformers resolves them."""
    original = int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = scaling.get("factor")
    return (float(factor) if factor is not None else cfg.max_position_embeddings / original), original


def _yarn_inv_freq(inv: torch.Tensor, dim: int, cfg: ModelConfig, s: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies that rotate fewer than
    beta_slow times over the original context are interpolated (divided by the factor), those
    rotating more than beta_fast times kept, a linear ramp between."""
    factor, original = yarn_factors(cfg, s)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    base = cfg.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    return (inv / factor) * (1 - extrapolation) + inv * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are scaled by: 1, or YaRN's attention factor (0.1 ln(factor) + 1 by default)."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, _ = yarn_factors(cfg, s)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
    return mscale(factor)


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


class Rope(nn.Module):
    """Rotary embedding in Hugging Face's rotate-half layout, tables precomputed for max_len."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the fp32 tables, e.g. after the model was built on the meta device."""
        device = torch.device(device or self.cos.device)
        inv = rope_inv_freq(self.cfg)  # on the CPU; also checks the scaling type on the meta device
        if device.type == "meta":  # built before loading: materialize() computes the real tables
            self.cos = self.sin = torch.empty(self.max_len, 2 * inv.numel(), device=device)
            return
        freqs = torch.outer(torch.arange(self.max_len, dtype=torch.float32, device="cpu"), inv)  # [S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
        cos, sin = emb.cos(), emb.sin()
        if (scale := rope_attention_factor(self.cfg)) != 1.0:  # YaRN scales both
            cos, sin = cos * scale, sin * scale
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [heads, T, D]; positions [T]
        ops = fused_ops(x, self.cos)
        if ops is not None and x.stride(-1) == 1:  # one call instead of eight per tensor
            return ops.rope(x, self.cos, self.sin, positions)
        cos = self.cos[positions].to(x.dtype)  # [T, D]
        sin = self.sin[positions].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    """Self-attention over the static cache. ``window``: sliding-window attention (a row sees only
    the last ``window`` positions, itself included); None = every earlier position. ``native``:
    decode and verify rows may take the native kernels' fused attention (a variant they do not
    compute, e.g. GPT-OSS's sinks, sets it False). How a pass attends (native, row by row, one
    call, static slots) is its backend's business (:mod:`~quickdraft.models.forward_pass`)."""

    native = True
    chunk: int | None = None  # chunked attention (Llama 4): a row sees the earlier positions of its chunk

    def __init__(self, cfg: ModelConfig, rope: Rope, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.nh * self.hd, bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.nkv * self.hd, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.nkv * self.hd, bias=cfg.attention_bias)
        self.o_proj = Linear(self.nh * self.hd, h, bias=False)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rope = rope
        self.scale = 1.0 / math.sqrt(self.hd)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[Hq, T, D]``, k and v ``[Hkv, T, D]`` (models with a fused qkv weight override this)."""
        t = x.shape[0]
        q, k, v = linear_group([self.q_proj, self.k_proj, self.v_proj], x)  # one kernel call when quantized
        q = q.view(t, self.nh, self.hd).transpose(0, 1)  # [Hq, T, D]
        k = k.view(t, self.nkv, self.hd).transpose(0, 1)  # [Hkv, T, D]
        v = v.view(t, self.nkv, self.hd).transpose(0, 1)  # [Hkv, T, D]
        return q, k, v

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.o_proj(self.attend(q, k, v, layer, step))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, step: Step
    ) -> torch.Tensor:
        """Positions encoded, this pass's keys and values into cache layer ``layer``, and attention
        by the pass's backend: ``[T, Hq * D]``, what o_proj takes. ``k = v = None``: a layer that
        reuses another layer's keys and values (:class:`~quickdraft.cache.KVLayout`), already in
        the cache for this pass."""
        q, k = self.encode_positions(q, k, step)
        return step.backend(q).attend(self, q, k, v, layer, step)

    def sink_logits(self) -> torch.Tensor | None:
        """A learned sink logit per head (a family with sinks overrides this); None: no sinks."""
        return None

    def encode_positions(
        self, q: torch.Tensor, k: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q/k norms and RoPE (a family with another position encoding overrides this)."""
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self.rope(q, step.positions)
        if k is not None:
            if self.k_norm is not None:
                k = self.k_norm(k)
            k = self.rope(k, step.positions)
        return q, k

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q ``[Hq, T, D]`` over k, v ``[Hkv, S, D]`` under ``mask`` [T, S] -> ``[Hq, T, D]``."""
        k, v = k.to(q.dtype), v.to(q.dtype)  # a 16-bit cache under fp32 activations: widened exactly
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, scale=self.scale, enable_gqa=self.nkv != self.nh,
        )  # [1, Hq, T, D]
        return out[0]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def in_projections(self) -> list[nn.Module]:
        """The projections of the input (they share it: one kernel call; routed experts of a
        one-token step join theirs in one call, quickdraft.models.moe.mix_experts)."""
        return [self.gate_proj, self.up_proj]

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The down projection's input from the input projections' results."""
        return F.silu(gate) * up

    def finish(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The output from the input projections' results (activation, down projection), in x's dtype."""
        return self.down_proj(self.activate(gate, up)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(x, *linear_group(self.in_projections(), x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        self.mlp: nn.Module = MLP(cfg)  # (MoE families put their experts here)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layer, step)
        return x + self.mlp(self.post_attention_layernorm(x))
