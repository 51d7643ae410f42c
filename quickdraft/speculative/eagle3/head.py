"""The EAGLE-3 draft head: one Llama decoder layer that reads the target's hidden states.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) drafts with a single transformer layer whose input is
the target's own features, so it costs a fraction of a draft model's pass and accepts more. Per
row the head sees two things:

* a feature ``[H]``: for the first row of a drafting run, ``fc`` applied to the concatenation of
  the target's hidden states at a few layers (low, middle, high: ``aux_layers``); for a row that
  continues a draft, the head's own output ``h`` of the row before (training-time test makes the
  head robust to that substitution);
* the embedding of the token that FOLLOWS the feature's position.

Alignment (used by the drafter and the trainer alike): row j holds the feature of target position
j, the embedding of token j+1, RoPE position j, and its logits predict token j+2. Drafting on from
row j, the next row holds (h_j, embedding of the drafted token j+2) at position j+1.

Layer math (parameter names are those of the published checkpoints, so safetensors load as is)::

    g = cat(aux hidden states)                                         [T, n * Ht]
        (input_norm(g) if norm_before_fc; cat(fc_norm.i(g_i)) if fc_norm)
    feature = fc(g)                                                    [T, H]
    residual = feature                       (hidden_norm(feature) if norm_before_residual)
    x = cat([input_layernorm(embed), hidden_norm(feature)], -1)        [T, 2H]
    h = residual + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
        (Qwen3 layer, qk_norm: q_norm / k_norm per head before RoPE; sliding_window: the last W positions)
    h = h + mlp(post_attention_layernorm(h))
    z = norm(h)                              (h if not final_norm: SpecForge's norm_output false)
    logits = lm_head(z)                                                [T, draft_vocab]
    state fed to the next drafted row = h    (z if norm_output: speculators' EAGLE-3.1)

The variants are those vLLM's speculators 0.9 and SpecForge define (the parity tests build them with
the references' own classes); both projects use the key ``norm_output``, with two meanings, which
``io.py`` tells apart by the file's layout.

Draft ids map to target ids through ``d2t`` (target = draft + d2t[draft]); ``t2d`` marks the target
ids the draft vocabulary covers. Aux layers use quickdraft's convention: the INPUT hidden state of
decoder layer i (Hugging Face ``output_hidden_states[i]``); see ``io.py`` for the files' conventions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.cache import KVCache, SequenceCache
from quickdraft.config import ModelConfig, rope_scaling_of, rope_theta_of
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import RowSlots, Step
from quickdraft.models.layers import MLP, Attention, RMSNorm, Rope


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head. ``aux_layers`` are INPUT-of-layer ids of the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    target_hidden_size: int
    norm_before_residual: bool = False  # a variant: the residual is hidden_norm(feature)
    norm_output: bool = False  # speculators' EAGLE-3.1: norm(h) feeds lm_head AND the next drafted row
    final_norm: bool = True  # False: logits = lm_head(h) (SpecForge's norm_output: false)
    fc_norm: bool = False  # one RMSNorm per aux hidden state before fc (fc_norm.{i}.weight)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc (input_norm.weight)
    qk_norm: bool = False  # a Qwen3 decoder layer: per-head RMSNorm of q and k before RoPE
    sliding_window: int | None = None  # the layer attends to the last W positions only

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        if not self.aux_layers:
            raise QuickdraftError("an EAGLE-3 head needs at least one aux layer of the target")
        if self.fc_norm and self.norm_before_fc:
            raise QuickdraftError("an EAGLE-3 head has fc_norm or norm_before_fc, not both (speculators refuses both)")
        if self.norm_output and not self.final_norm:
            raise QuickdraftError("norm_output (the normalised state fed back) needs the final norm")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise QuickdraftError(f"the head's sliding window must be at least 1, got {self.sliding_window}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise QuickdraftError(
                f"the head's draft vocabulary ({self.draft_vocab_size}) must be between 1 and the "
                f"target vocabulary ({self.vocab_size})"
            )

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        aux_layers: tuple[int, ...] | None = None,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
    ) -> Eagle3Config:
        """A head shaped like one layer of ``target`` (what trainers build), default aux layers."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            aux_layers=aux_layers if aux_layers is not None else default_aux_layers(target.num_hidden_layers),
            target_hidden_size=target.hidden_size,
        )

    def model_config(self, hidden_size: int | None = None) -> ModelConfig:
        """The quickdraft ModelConfig of the head's layer (for Rope, Attention, MLP)."""
        return ModelConfig(
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=hidden_size or self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            qk_norm=self.qk_norm,
        )

    def to_hf_config(self, aux_convention: str = "output") -> dict[str, Any]:
        """The config.json of the Hugging Face EAGLE-3 layout.

        ``eagle_config.eagle_aux_hidden_state_layer_ids`` is written in ``aux_convention``
        ("output": ids of the layers whose OUTPUT is captured, SpecForge's convention, = ours - 1;
        "input": ours) and the convention is named next to it, so no reader has to guess.
        """
        if aux_convention not in ("input", "output"):
            raise ValueError(f"aux_convention must be 'input' or 'output', got {aux_convention!r}")
        ids = list(self.aux_layers) if aux_convention == "input" else [i - 1 for i in self.aux_layers]
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": ids,
                "quickdraft_aux_layer_convention": aux_convention,
            },
        }
        unsaid = [k for k, on in (("norm_output (the normalised state fed back)", self.norm_output),
                                  ("norm_before_fc", self.norm_before_fc), ("a Qwen3 layer", self.qk_norm),
                                  ("a sliding window", self.sliding_window is not None)) if on]
        if unsaid:
            raise QuickdraftError(
                f"the Hugging Face / SpecForge EAGLE-3 layout cannot say {', '.join(unsaid)}; save the head in "
                "the speculators layout (layout='speculators')"
            )
        d["norm_output"] = self.final_norm  # SpecForge's meaning: norm before lm_head
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        if self.fc_norm:
            d["fc_norm"] = True
        return d

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], aux_layers: tuple[int, ...], **variant: Any) -> Eagle3Config:
        """Read the head's shape from a Hugging Face config dict; ``aux_layers`` (INPUT ids) are
        resolved by the loader, which knows the target and the file's convention, and so are the
        ``variant`` fields (norm_output, final_norm, fc_norm, norm_before_fc, qk_norm,
        sliding_window), whose keys mean different things in different layouts."""
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            vocab = int(d["vocab_size"])
            return cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta_of(d),
                rope_scaling=rope_scaling_of(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                vocab_size=vocab,
                draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
                aux_layers=aux_layers,
                target_hidden_size=int(d.get("target_hidden_size") or hidden),
                norm_before_residual=bool(d.get("norm_before_residual", False)),
                **variant,
            )
        except KeyError as exc:
            raise QuickdraftError(f"the EAGLE-3 head's config lacks the field {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/middle/high layers in the INPUT convention: (2, L//2, L-3), as the EAGLE
    authors' code and vLLM capture them (clamped into range for very shallow test models), in
    layer order: the order the features are collected and fused in."""
    ids = (2, num_layers // 2, num_layers - 3)
    return tuple(sorted(min(max(i, 0), num_layers) for i in ids))


class _HeadAttention(Attention):
    """quickdraft's batch-invariant attention with q/k/v reading 2H inputs and o_proj writing H."""

    def __init__(self, cfg: Eagle3Config, rope: Rope) -> None:
        super().__init__(cfg.model_config(hidden_size=2 * cfg.hidden_size), rope, window=cfg.sliding_window)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rope: Rope) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = _HeadAttention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.model_config())
        self.norm_before_residual = cfg.norm_before_residual

    def attention_input(self, embeds: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """(x [.., 2H] for q/k/v, residual [.., H])."""
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def forward(self, embeds: Tensor, features: Tensor, step: Step) -> Tensor:
        x, residual = self.attention_input(embeds, features)
        h = residual + self.self_attn(x, 0, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """A one-layer head that drafts from the target's features, run by
    :class:`~quickdraft.speculative.eagle3.drafter.Eagle3Drafter`: EAGLE-3's, or a model's own
    multi-token-prediction layer (:mod:`quickdraft.speculative.mtp`). Row j holds the feature of
    target position j (:meth:`fuse` of the layers ``config.aux_layers`` captures), the embedding
    of token j+1 and RoPE position j; its logits predict token j+2, and the state it returns feeds
    the next drafted row. Subclasses give the layer (:meth:`layer_rows`, :attr:`attention`), the
    feature and the output (:meth:`fuse`, :meth:`output`)."""

    config: Eagle3Config
    max_len: int
    fc: Linear  # its weight gives the head's dtype and device
    embed_tokens: nn.Module | None  # None: the target's embedding

    @property
    def attention(self) -> Attention:
        """The layer's attention (its window is lifted while rows give their slots explicitly)."""
        raise NotImplementedError

    def layer_rows(self, embeds: Tensor, features: Tensor, step: Step) -> Tensor:
        """The layer over T rows: embeddings [T, H], features [T, H] -> h [T, H]."""
        raise NotImplementedError

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """Captured target hidden states [.., n * Ht] -> the feature [.., H] of a committed row."""
        raise NotImplementedError

    def output(self, h: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(logits [n, Vd] of ``rows`` (all if None), the state [T, H] the next drafted row reads)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self, max_len: int | None = None) -> SequenceCache:
        cfg = self.config
        return KVCache(1, cfg.num_key_value_heads, cfg.head_dim, max_len or self.max_len, self.dtype, self.device)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]

    d2t: Tensor

    @torch.inference_mode()
    def forward(
        self,
        embeds: Tensor,
        features: Tensor,
        cache: SequenceCache,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        num_logits: int | None = None,
        committed: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run T rows, writing their keys/values into the next T slots of ``cache`` (1 layer).

        embeds [T, H] (token j+1's embedding), features [T, H] (fused target features or the
        head's previous state), positions [T] (default: the slots; rows of a draft give theirs),
        mask [T, start + T] bool for tree rows (default: causal), committed: the slots of committed
        rows below a draft (a sliding head's drafted rows see the last W of them, see
        :meth:`visible`). Returns (draft logits [n, Vd] float32 for the last ``num_logits`` rows
        (all by default), state [T, H]). Row results do not depend on how many rows share the call
        (quickdraft's blocked Linear and per-row attention).
        """
        t = embeds.shape[0]
        start, end = cache.reserve(t)
        if positions is None:
            positions = torch.arange(start, end, device=embeds.device)
        window = self.config.sliding_window
        attn = self.attention
        if committed is not None and window is not None:
            mask, attn.window = self.visible(start, t, mask, committed), None
        step = Step.of_pass(cache, start, positions, mask)
        try:
            h = self.layer_rows(embeds.to(self.dtype), features.to(self.dtype), step)
        finally:
            attn.window = window
        cache.advance(t)
        rows = None if num_logits is None else torch.arange(t - num_logits, t, device=h.device)
        logits, state = self.output(h, rows)
        return logits.float(), state

    def visible(self, start: int, t: int, mask: Tensor | None, committed: int | None) -> Tensor:
        """[T, start + T] bool: the slots each row of a pass over slots ``start..`` sees, its
        sliding window applied. Committed rows (``committed`` None; slot j holds position j): the
        causal slots within W positions. Rows of a draft (their positions are not their slots): as
        the references train a sliding head (speculators' TTT masks), the committed rows within W
        of the draft's root (the last of the ``committed`` slots) and every drafted slot their
        ``mask`` allows, however deep it is."""
        slot = torch.arange(start + t, device=self.device)
        row = torch.arange(start, start + t, device=self.device).unsqueeze(1)
        seen = mask.to(self.device) if mask is not None else slot <= row
        window = self.config.sliding_window
        if window is None:
            return seen
        if committed is None:
            return seen & (slot > row - window)
        return seen & (slot >= committed - window)  # drafted slots lie above the committed ones

    @torch.inference_mode()
    def forward_rows(self, embeds: Tensor, features: Tensor, buffer: SequenceCache, positions: Tensor, rows: RowSlots,
                     logit_rows: Tensor) -> tuple[Tensor, Tensor]:
        """A pass over rows of several sequences (lanes of a :class:`~quickdraft.cache.KVPool`),
        each row seeing exactly the slots ``rows`` lists (its window already applied): keys and
        values go to ``buffer``'s next slots (the pool's staging). Returns (logits [n, Vd] float32
        of ``logit_rows``, state [T, H]); every row bitwise what :meth:`forward` computes for it alone."""
        t = embeds.shape[0]
        start, _ = buffer.reserve(t)
        step = Step.of_pass(buffer, start, positions, rows=rows)
        attn = self.attention
        window, attn.window = attn.window, None
        try:
            h = self.layer_rows(embeds.to(self.dtype), features.to(self.dtype), step)
        finally:
            attn.window = window
        buffer.advance(t)
        logits, state = self.output(h, logit_rows)
        return logits.float(), state


class Eagle3Head(DraftHead):
    """EAGLE-3 head with the published parameter names (``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``, buffers ``d2t``/``t2d``, optional ``embed_tokens``)."""

    def __init__(self, cfg: Eagle3Config, max_len: int | None = None, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.max_len = max_len or cfg.max_position_embeddings
        h = cfg.hidden_size
        self.rope = Rope(cfg.model_config(), self.max_len)
        n, ht = len(cfg.aux_layers), cfg.target_hidden_size
        self.fc = Linear(n * ht, h, bias=False)
        self.input_norm = RMSNorm(n * ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(ht, cfg.rms_norm_eps) for _ in range(n)]) if cfg.fc_norm else None
        self.midlayer = Eagle3Layer(cfg, self.rope)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.d2t: Tensor
        self.t2d: Tensor
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True  # identity map until a vocabulary mapping is loaded
        self.register_buffer("t2d", t2d)

    # ------------------------------------------------------------------ shared helpers

    @property
    def attention(self) -> Attention:
        return self.midlayer.self_attn

    def layer_rows(self, embeds: Tensor, features: Tensor, step: Step) -> Tensor:
        return self.midlayer(embeds, features, step)

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """``[.., n * Ht]`` concatenated aux hidden states -> ``[.., H]`` feature.

        Rows [T, n * Ht] go through the batch-invariant Linear; batches [B, T, n * Ht] (training,
        differentiable) through plain F.linear.
        """
        x = target_hidden.to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = x.chunk(len(self.fc_norm), dim=-1)
            x = torch.cat([norm(c.contiguous()) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x) if x.dim() == 2 else F.linear(x, self.fc.weight)

    def output(self, h: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(logits [n, Vd] of ``rows`` (all if None), the state [T, H] the next drafted row reads):
        lm_head(norm(h)) and h, or the variants' forms (see the module doc)."""
        cfg = self.config
        if cfg.norm_output:
            z = self.norm(h)
            return self.lm_head(z if rows is None else z.index_select(0, rows)), z
        out = h if rows is None else h.index_select(0, rows)
        return self.lm_head(self.norm(out) if cfg.final_norm else out), h

    def set_vocab_map(self, d2t: Tensor) -> None:
        """Install a draft->target offset table and derive t2d from it."""
        with torch.no_grad():
            self.d2t.copy_(d2t.to(self.d2t.device, torch.long))
            self.t2d.zero_()
            self.t2d[self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))] = True

    # ------------------------------------------------------------------ training

    def train_forward(
        self,
        embeds: Tensor,
        features: Tensor,
        positions: Tensor,
        cache: list[tuple[Tensor, Tensor]] | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """Differentiable batched forward for training, with the training-time-test unroll.

        embeds, features [B, T, H]; positions [B, T] or [T] long (RoPE positions; unroll step s
        uses the step-0 positions + s). ``cache``: keys/values [B, Hkv, T, D] returned by the
        previous unroll steps of the same batch, step 0 first. Attention, as in EAGLE-3's
        training-time test: row t attends causally to the step-0 keys 0..t and, from every later
        step including this one, only to the key at its own index t (its own drafted ancestors).
        With no cache (step 0) this is plain causal attention. ``attention_mask`` [B, T] bool
        (True = real token) hides padded keys. Returns (logits [B, T, Vd] float32, h [B, T, H],
        this step's (k, v)): append the latter to ``cache`` for the next unroll step.
        Plain PyTorch ops only (no inference mode, no KV cache), so autograd works.
        """
        layer = self.midlayer
        attn = layer.self_attn
        b, t, _ = embeds.shape
        x, residual = layer.attention_input(embeds.to(self.dtype), features.to(self.dtype))
        q = F.linear(x, attn.q_proj.weight).view(b, t, attn.nh, attn.hd).transpose(1, 2)  # [B, Hq, T, D]
        k = F.linear(x, attn.k_proj.weight).view(b, t, attn.nkv, attn.hd).transpose(1, 2)  # [B, Hkv, T, D]
        v = F.linear(x, attn.v_proj.weight).view(b, t, attn.nkv, attn.hd).transpose(1, 2)
        if attn.q_norm is not None and attn.k_norm is not None:  # a Qwen3 layer: per head, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(b, t)
        q, k = _rope_batched(self.rope, q, pos), _rope_batched(self.rope, k, pos)
        steps = [*(cache or []), (k, v)]
        out = _ttt_attention(q, steps, attn.scale, attention_mask, self.config.sliding_window)  # [B, Hq, T, D]
        a = F.linear(out.transpose(1, 2).reshape(b, t, attn.nh * attn.hd), attn.o_proj.weight)
        h = residual + a
        mlp = layer.mlp
        normed = layer.post_attention_layernorm(h)
        h = h + F.linear(F.silu(F.linear(normed, mlp.gate_proj.weight)) * F.linear(normed, mlp.up_proj.weight),
                         mlp.down_proj.weight)
        z = self.norm(h) if self.config.final_norm else h
        logits = F.linear(z, self.lm_head.weight).float()
        return logits, z if self.config.norm_output else h, (k, v)


def _rope_batched(rope: Rope, x: Tensor, positions: Tensor) -> Tensor:
    """Rotate x [B, heads, T, D] by positions [B, T] (the same rotate-half math as Rope)."""
    cos = rope.cos[positions].to(x.dtype).unsqueeze(1)  # [B, 1, T, D]
    sin = rope.sin[positions].to(x.dtype).unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _ttt_attention(
    q: Tensor, steps: list[tuple[Tensor, Tensor]], scale: float, attention_mask: Tensor | None,
    window: int | None = None,
) -> Tensor:
    """Softmax over [causal step-0 keys, diagonal keys of steps 1..s] per query row; ``window``:
    row t sees the step-0 keys t-W+1 .. t only (speculators' sliding heads; drafted keys always)."""
    b, nh, t, d = q.shape
    k0, v0 = steps[0]
    groups = nh // k0.shape[1]

    def expand(x: Tensor) -> Tensor:  # [B, Hkv, T, D] -> [B, Hq, T, D]
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    scores0 = torch.matmul(q, expand(k0).transpose(-1, -2)) * scale  # [B, Hq, T, T]
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        allowed = allowed.triu(-(window - 1))
    allowed = allowed.view(1, 1, t, t)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool().view(b, 1, 1, t)
    scores0 = scores0.masked_fill(~allowed, float("-inf"))
    diag = [(q * expand(ki)).sum(-1, keepdim=True) * scale for ki, _ in steps[1:]]  # [B, Hq, T, 1] each
    scores = torch.cat([scores0, *diag], dim=-1).float()
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    probs = torch.nan_to_num(probs)  # fully padded rows: no key visible
    out = torch.matmul(probs[..., :t], expand(v0))
    for i, (_, vi) in enumerate(steps[1:]):
        out = out + probs[..., t + i : t + i + 1] * expand(vi)
    return out


def init_head_weights(head: Eagle3Head, generator: torch.Generator | None = None, gain: float = 1.0) -> None:
    """Random weights (std gain/sqrt(fan_in), norms near 1): for tests and as a trainer's start."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator).to(p))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=generator).to(p))
            else:
                p.copy_(torch.randn(p.shape, generator=generator).to(p) * (gain / math.sqrt(p.shape[-1])))
