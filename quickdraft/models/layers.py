"""Building blocks shared by every decoder: RMSNorm, RoPE, attention over the static cache, MLP.

All tensors are for one sequence (batch 1, the single-user case): activations are ``[T, H]``.
Linear layers are the batch-invariant :class:`~quickdraft.models.batch_invariance.Linear`;
``quickdraft.quant`` may swap them for low-bit kernels with the same call signature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.cache import SequenceCache
from quickdraft.config import ModelConfig
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS, Linear, invariant_pass
from quickdraft.quant.ggml import GGMLLinear, active_kernels, ggml_linear_grouped, ggml_linear_multi


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


_NATIVE_KV = (torch.float32, torch.float16, torch.uint8)  # cache types the native attention reads (uint8: q8_0)


def _fused_ops(x: torch.Tensor, param: torch.Tensor):  # noqa: ANN202 (the compiled module)
    """The native kernels' fused ops (``rms_norm``, ``rope``) when they apply to ``x``: fp32 CPU
    tensors outside autograd (inference passes; training takes the differentiable torch path),
    the kernels built and not disabled. Else None: the torch formulas below."""
    if x.dtype is not torch.float32 or param.dtype is not torch.float32 or not x.is_cpu or torch.is_grad_enabled():
        return None
    return active_kernels()


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
        ops = _fused_ops(x, self.weight)
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
        ops = _fused_ops(x, self.cos)
        if ops is not None and x.stride(-1) == 1:  # one call instead of eight per tensor
            return ops.rope(x, self.cos, self.sin, positions)
        cos = self.cos[positions].to(x.dtype)  # [T, D]
        sin = self.sin[positions].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass(frozen=True)
class RowSlots:
    """What each row of a pass sees, given explicitly instead of by a mask: a pass over rows of
    several sequences (:class:`~quickdraft.cache.KVPool`). ``slots[i]`` [n_i]: the cache slots row i
    attends to, in position order (its sequence's committed slots, then its own rows of this pass
    that it may see); ``slot_pos`` [start + T]: the position each slot holds. A row's result is
    bitwise what the same row computes alone over its sequence's own cache (same keys, same order).
    ``lanes`` [T]: each row's sequence cache, whose recurrent state (linear-attention layers,
    :class:`~quickdraft.cache.HybridCache`) a row with no earlier row of its own in the pass continues."""

    slots: list[torch.Tensor]
    slot_pos: torch.Tensor
    lanes: list[SequenceCache] | None = None


@dataclass
class Step:
    """What every layer of one forward pass shares: where to write and what each query sees."""

    positions: torch.Tensor  # [T] long, RoPE positions
    start: int  # first cache slot written by this pass
    mask: torch.Tensor | None  # [T, start + T] bool (True = may attend), None = every slot up to the end
    cache: SequenceCache
    tree: bool = False  # mask is not causal: short passes gather each row's visible slots
    row_slots: list[torch.Tensor] | None = None  # tree only: [n_i] visible slots of row i, in position order
    # The position each slot up to the pass's end holds, where slots are not positions (a pass over
    # rows of several sequences, :class:`~quickdraft.cache.KVPool`); None: committed slot j holds
    # position j and the pass's slots ``positions``.
    slot_pos: torch.Tensor | None = None
    # Static shapes (CUDA graphs, :meth:`CausalLM.forward_static`): the cache slots [T] this pass
    # writes; ``mask`` is then [T, L] over the first L slots, and no step depends on host values.
    slots: torch.Tensor | None = None
    lanes: list[SequenceCache] | None = None  # a pass over several sequences: each row's own cache (RowSlots.lanes)
    # What every layer takes besides the hidden state, computed once per pass by
    # :meth:`CausalLM.layer_inputs` (Gemma 4's per-layer embeddings [T, layers, P]); None for most models.
    layer_inputs: torch.Tensor | None = None
    # The rows whose results the pass returns (None: every row): the only rows a caller can continue
    # or roll back to, so the only ones whose recurrent state a hybrid model's cache must keep.
    outputs: list[int] | None = None
    _parents: list[int] | None = field(default=None, repr=False)
    _windows: dict[int, tuple[torch.Tensor | None, list[torch.Tensor] | None]] = field(
        default_factory=dict, repr=False
    )
    _flat: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.tree and self.mask is not None and self.mask.shape[0] <= BLOCKED_MAX_ROWS:
            self.row_slots = [row.nonzero().squeeze(1) for row in self.mask]  # once per pass, not per layer

    def row_parents(self) -> list[int]:
        """For each row, the row of this pass just before it on its path (-1: none; it continues its
        sequence's state before the pass): what a recurrent layer's state follows. Once per pass."""
        if self._parents is None:
            if self.slots is not None:
                raise ValueError("recurrent layers do not run in static-shape passes")
            if self.row_slots is None:  # a chain
                self._parents = list(range(-1, self.positions.shape[0] - 1))
            else:  # this pass's rows a row sees are its ancestors, then itself (slot order)
                own = [idx[idx >= self.start] for idx in self.row_slots]
                self._parents = [int(o[-2]) - self.start if o.numel() > 1 else -1 for o in own]
        return self._parents

    def state_cache(self, row: int) -> SequenceCache:
        """The cache whose recurrent state row ``row`` continues when it has no parent in the pass."""
        return self.lanes[row] if self.lanes is not None else self.cache

    def slot_positions(self) -> torch.Tensor:
        """Position of every cache slot this pass can see [start + T] (sliding windows and
        chunked attention cut by position)."""
        if self.slot_pos is not None:
            return self.slot_pos
        before = torch.arange(self.start, device=self.positions.device, dtype=self.positions.dtype)
        return torch.cat([before, self.positions])

    def flat_slots(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Tree rows' visible slots as one flat tensor and row offsets [T + 1] (the native
        attention's input), for a window size or None; (None, None) for chains. Once per pass."""
        if self.row_slots is None:
            return None, None
        key = -1 if window is None else window
        if key not in self._flat:
            rows = self.row_slots if window is None else self.windowed(window)[1]
            assert rows is not None
            lens = torch.tensor([0] + [int(r.numel()) for r in rows])
            self._flat[key] = (torch.cat(rows).to(torch.int64), lens.cumsum(0))
        return self._flat[key]

    def windowed(self, size: int) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """``(mask, row_slots)`` for sliding-window layers: each row additionally drops every slot
        whose position is ``size`` or more behind its own (it sees positions ``p-size+1 .. p``, as
        Hugging Face's ``kv > q - size``). Committed slots hold their own position; this pass's
        slots hold ``positions`` (tree depths included). Computed once per pass and size."""
        if size not in self._windows:
            slot_pos = self.slot_positions()
            mask = None  # rows given by slot lists alone (a pass over several sequences) need none
            if self.mask is not None or self.row_slots is None:
                near = slot_pos.unsqueeze(0) > self.positions.unsqueeze(1) - size  # [T, start + T]
                mask = near if self.mask is None else self.mask & near
            rows = None
            if self.row_slots is not None:
                rows = [idx[slot_pos[idx] > p - size] for idx, p in zip(self.row_slots, self.positions.tolist(), strict=True)]
            self._windows[size] = (mask, rows)
        return self._windows[size]


class Attention(nn.Module):
    """Self-attention over the static cache. ``window``: sliding-window attention (a row sees only
    the last ``window`` positions, itself included); None = every earlier position. ``native``:
    decode and verify rows may take the native kernels' fused attention (a variant they do not
    compute, e.g. GPT-OSS's sinks, sets it False)."""

    native = True

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
        """q/k norms, RoPE, this pass's keys and values into cache layer ``layer``, and attention:
        ``[T, Hq * D]``, what o_proj takes. ``k = v = None``: a layer that reuses another layer's
        keys and values (:class:`~quickdraft.cache.KVLayout`), already in the cache for this pass."""
        t = q.shape[1]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self.rope(q, step.positions)
        if k is not None:
            if self.k_norm is not None:
                k = self.k_norm(k)
            k = self.rope(k, step.positions)
        cache = step.cache.attention
        if step.slots is not None:  # static shapes: write by slot tensor, attend over L slots
            kc, vc = cache.k_layers[layer], cache.v_layers[layer]
            if k is not None and v is not None:
                kc.index_copy_(1, step.slots, k.to(kc.dtype))
                vc.index_copy_(1, step.slots, v.to(vc.dtype))
            assert step.mask is not None
            n = step.mask.shape[1]
            out = self._attend(q, kc[:, :n].to(q.dtype), vc[:, :n].to(q.dtype), step.mask)
            return out.transpose(0, 1).reshape(t, self.nh * self.hd)
        invariant = invariant_pass(t, chain=not step.tree)
        if self.native and invariant and cache.storage_dtype in _NATIVE_KV and (ops := _fused_ops(q, q)) is not None:
            # decode / verify rows, prefill chains: cache write and attention in one native call
            slots, offsets = step.flat_slots(self.window)
            return ops.attend(
                q, cache.k_layers[layer], cache.v_layers[layer], step.start, self.window or 0, self.scale,
                slots, offsets, k, v,
            )  # [T, Hq * D]
        if k is not None and v is not None:
            keys, values = cache.write(layer, step.start, k, v)  # [Hkv, S, D]
        else:
            keys, values = cache.read(layer, step.start + t)
        if not invariant:  # the plain way
            mask = step.mask if self.window is None else step.windowed(self.window)[0]
            out = self._attend(q, keys, values, mask)  # [Hq, T, D]
        else:  # each row alone (a chain of up to NATIVE_CHAIN_ROWS: a prefill pass, see CausalLM.prefill_rows)
            rows = [self._attend_row(q, keys, values, step, i) for i in range(t)]
            out = rows[0] if t == 1 else torch.cat(rows, dim=1)
        return out.transpose(0, 1).reshape(t, self.nh * self.hd)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)  # a 16-bit cache under fp32 activations: widened exactly
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, scale=self.scale, enable_gqa=self.nkv != self.nh,
        )  # [1, Hq, T, D]
        return out[0]

    def _attend_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, i: int) -> torch.Tensor:
        """Query row i over exactly the slots it may see, as one decode-shaped call.

        The call is the same one plain decoding makes for that token (same keys, same length),
        so its result is bitwise the same whatever other rows share the pass (batch invariance).
        """
        if step.row_slots is None:  # chain: row i sees every slot up to its own (the last `window`)
            end = step.start + i + 1
            lo = 0 if self.window is None else max(0, end - self.window)
            return self._attend(q[:, i : i + 1], k[:, lo:end], v[:, lo:end], None)
        rows = step.row_slots if self.window is None else step.windowed(self.window)[1]
        assert rows is not None
        idx = rows[i]  # tree: prefix + ancestors + self, in slot order
        return self._attend(q[:, i : i + 1], k.index_select(1, idx), v.index_select(1, idx), None)


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


def causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor | None:
    """``[T, start + T]`` mask where query i sees slots ``<= start + i``; None when T == 1."""
    if t == 1:
        return None
    cols = torch.arange(start + t, device=device)
    rows = torch.arange(start, start + t, device=device)
    return cols.unsqueeze(0) <= rows.unsqueeze(1)
