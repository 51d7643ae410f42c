"""Gemma 4's assistant drafter (Hugging Face ``gemma4_assistant``, ``Gemma4AssistantForCausalLM``).

Google ships Gemma 4 checkpoints with a small "assistant": a few Gemma 4 decoder layers that keep no
keys or values of their own. Each of its layers attends to the TARGET's keys and values: those of the
target's last layer of the same type (sliding-window or full attention) before its KV-sharing
layers, what transformers passes as ``shared_kv_states``. Run the way transformers' assisted
generation runs it (``SinglePositionMultiTokenCandidateGenerator``), with the target having read
positions ``0..p-1`` and token ``t_p`` (the newest, not yet read by the target) to continue::

    x = pre_projection(cat([E(t_p), s_{p-1}]))     E: the target's (scaled) embedding;
                                                   s: the target's last hidden state after its final norm
    h = layers(x)      each one a Gemma 4 layer without k/v projections, its query at RoPE position p,
                       attending to the target's keys and values of positions 0..p-1 (a sliding
                       layer: the last W + 1 of them, as transformers' flipped bidirectional window
                       mask ``|q - kv| <= W`` gives a one-row query)
    z = norm(h)
    logits = lm_head(z)                     or the centroid-masked head (``use_ordered_embeddings``):
                                            the top-k centroids' clusters of tokens scored with
                                            lm_head's rows, every other token the row's lowest
                                            score minus 1
    state = post_projection(z)              [backbone hidden size]: the next drafted row's s

Drafting on, the next row is ``(E(drafted token), state)`` at the SAME position p over the same keys
and values: the assistant never extends the context, so a chain or a tree node is one row that
reads only its parent's state.

The keys are exactly the committed positions 0..p-1. (transformers' generation loop slices the
verify pass's keys to the new length, so after a rejected draft its assistant also sees that
rejected token's keys at position p; quickdraft does not mirror that: the target's cache then holds
the committed tokens only.)

This is EAGLE's alignment with the target's final-norm input captured as the feature, so
:class:`~quickdraft.speculative.eagle3.drafter.Eagle3Drafter` runs it (chains, dynamic trees,
sampled chains, its cost model, several sequences in one pass) with three differences: its root
pass is one row (the newest token and the feature before it) instead of every fed feature's row,
the drafted rows attend to the target's cache, not a cache of the head's, and the head's "cache"
has no layers: it only counts the rows run, so the tree bookkeeping (slots of drafted rows) is the
EAGLE-3 drafter's own. The engine names the target's cache of the drafter's sequence through
:meth:`~quickdraft.speculative.base.Drafter.use_target_cache`; the keys and values are read there
in place (the native attention reads the cache's fp16 / Q8_0 rows directly), nothing is copied per
step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from quickdraft.cache import KVCache, KVPool, SequenceCache
from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.forward_pass import RowSlots, Step
from quickdraft.models.gemma3 import GemmaMLP, is_sliding
from quickdraft.models.gemma4 import Gemma4Attention, Gemma4Fields, RMSNorm, layer_config
from quickdraft.models.layers import Rope
from quickdraft.quant.ggml import GGMLLinear, kernels_active
from quickdraft.speculative.base import DraftPass, PassOutput, Steps
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter, TreeShape, default_shape
from quickdraft.speculative.eagle3.head import DraftHead, Eagle3Config

MODEL_TYPE = "gemma4_assistant"
TARGET_TYPE = "gemma4_text"
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class AssistantConfig:
    """An assistant's config.json: its own Gemma 4 text model and the head around it."""

    text: ModelConfig  # the assistant's decoder (hidden size, layers, heads)
    backbone_hidden_size: int  # the target's hidden size it was trained with
    use_ordered_embeddings: bool  # the centroid-masked head
    num_centroids: int
    centroid_top_k: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> AssistantConfig:
        if d.get("model_type") != MODEL_TYPE:
            raise QuickdraftError(f"config.json has model_type {d.get('model_type')!r}, not {MODEL_TYPE!r}")
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise QuickdraftError("the Gemma 4 assistant's config.json has no text_config")
        # every layer reuses the target's keys and values: none of the assistant's own shares them
        text = {**text, "model_type": TARGET_TYPE, "num_kv_shared_layers": 0}
        text.setdefault("hidden_size_per_layer_input", 0)
        cfg = ModelConfig.from_hf_dict(text)
        own = cfg.family_fields(Gemma4Fields)
        unsupported = [name for name, on in (("per-layer embeddings", own.hidden_size_per_layer_input > 0),
                                             ("routed experts", cfg.num_experts > 0),
                                             ("double-wide MLPs", own.use_double_wide_mlp)) if on]
        if unsupported:  # what transformers' Gemma4AssistantConfig.validate_architecture refuses too
            raise QuickdraftError(f"a Gemma 4 assistant has no {', '.join(unsupported)}; this config.json has them")
        try:
            out = cls(text=cfg, backbone_hidden_size=int(d.get("backbone_hidden_size", 1536)),
                      use_ordered_embeddings=bool(d.get("use_ordered_embeddings", False)),
                      num_centroids=int(d.get("num_centroids", 2048)),
                      centroid_top_k=int(d.get("centroid_intermediate_top_k", 32)),
                      tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))
        except (TypeError, ValueError) as exc:
            raise QuickdraftError(f"the Gemma 4 assistant's config.json has a bad value ({exc})") from None
        if out.use_ordered_embeddings and (out.num_centroids < 1 or cfg.vocab_size % out.num_centroids
                                           or not 0 < out.centroid_top_k <= out.num_centroids):
            raise QuickdraftError(f"the assistant's {out.num_centroids} centroids must split its {cfg.vocab_size} tokens "
                                  f"evenly and keep 1..{out.num_centroids} of them (it keeps {out.centroid_top_k})")
        return out


def kv_source(target: ModelConfig, layer_type: str) -> int | None:
    """The target layer whose keys and values an assistant layer of ``layer_type`` reads: the last
    one of that type before the target's KV-sharing layers (transformers' "store" layer); None
    where the target has none."""
    first_shared = target.num_hidden_layers - target.family_fields(Gemma4Fields).num_kv_shared_layers
    types = target.layer_types or (FULL,) * target.num_hidden_layers
    found = [i for i in range(first_shared) if types[i] == layer_type]
    return found[-1] if found else None


def check_target(cfg: AssistantConfig, target: ModelConfig, name: str = "the assistant") -> list[int]:
    """The target layer each assistant layer reads; a one-line QuickdraftError where ``cfg`` does not
    fit ``target`` (another family, hidden size, vocabulary, key/value shapes)."""
    if target.model_type != TARGET_TYPE:
        raise QuickdraftError(f"{name} is a Gemma 4 assistant ({MODEL_TYPE}): it drafts for Gemma 4 models only, and "
                              f"the target is {target.model_type!r}; use --draft auto, ngram or a draft model")
    text = cfg.text
    if cfg.backbone_hidden_size != target.hidden_size:
        raise QuickdraftError(f"{name} was trained for a Gemma 4 model of hidden size {cfg.backbone_hidden_size}, the "
                              f"target's is {target.hidden_size}: use the assistant released with this model")
    if text.vocab_size != target.vocab_size:
        raise QuickdraftError(f"{name}'s vocabulary has {text.vocab_size} tokens, the target's {target.vocab_size}: "
                              "use the assistant released with this model")
    sources = []
    for i in range(text.num_hidden_layers):
        kind = SLIDING if is_sliding(text, i) else FULL
        src = kv_source(target, kind)
        if src is None:
            raise QuickdraftError(f"{name}'s layer {i} attends to the target's {kind} keys and values, and the target "
                                  f"has no {kind} layer that computes them")
        want, have = layer_config(text, i), layer_config(target, src)
        if (want.num_key_value_heads, want.head_dim) != (have.num_key_value_heads, have.head_dim):
            raise QuickdraftError(
                f"{name}'s layer {i} reads {want.num_key_value_heads} key/value heads of size {want.head_dim}, the "
                f"target's layer {src} has {have.num_key_value_heads} of size {have.head_dim}: use the assistant "
                "released with this model")
        sources.append(src)
    return sources


class AssistantLayer(nn.Module):
    """One of the assistant's decoder layers: Gemma 4's, without key or value projections
    (transformers' KV-"reuse" layers); its attention reads the target's layer ``source``. Parameter
    names are the checkpoint's."""

    def __init__(self, cfg: ModelConfig, index: int, rope: Rope, rope_local: Rope, source: int) -> None:
        super().__init__()
        sliding = is_sliding(cfg, index)
        # A row sits one position past the target's last key; a window of W + 2 keeps the slots
        # within W + 1 positions of it: the last W + 1 keys (see the module doc).
        window = cfg.sliding_window + 2 if sliding and cfg.sliding_window else None
        self.self_attn = Gemma4Attention(layer_config(cfg, index), rope_local if sliding else rope, window,
                                         reuses_kv=True, values_are_keys=False)
        self.mlp = GemmaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.source = source

    def forward(self, x: Tensor, groups: Sequence[tuple[int, Step]]) -> Tensor:
        """``x`` [T, H]: rows in groups of ``(rows, step)``, each group attending over its step's
        target cache (one sequence's)."""
        attn, t = self.self_attn, x.shape[0]
        q = attn.q_proj(self.input_layernorm(x)).view(t, attn.nh, attn.hd).transpose(0, 1)  # [Hq, T, D]
        parts, at = [], 0
        for rows, step in groups:
            parts.append(attn.attend(q[:, at : at + rows], None, None, self.source, step))
            at += rows
        a = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = x + self.post_attention_layernorm(attn.o_proj(a))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class MaskedHead(nn.Module):
    """transformers' ``Gemma4AssistantMaskedEmbedder``: the row's ``top_k`` best centroids pick
    their clusters of tokens (``token_ordering`` viewed as [centroids, vocab / centroids]); those
    tokens are scored with the output head's rows, every other token gets the row's lowest score
    minus 1 (transformers takes the lowest over all rows of a call; per row, a row's logits do not
    depend on the rows beside it, and a one-row call is the same)."""

    token_ordering: Tensor

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = Linear(hidden, centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(vocab, dtype=torch.long))
        self.top_k, self.per_cluster = top_k, vocab // centroids

    def forward(self, z: Tensor, head: Tensor) -> Tensor:
        n = z.shape[0]
        best = self.centroids(z).topk(self.top_k, dim=-1).indices  # [n, k]
        ids = self.token_ordering.view(-1, self.per_cluster)[best].reshape(n, -1)  # [n, k * per]
        rows = head[ids]  # [n, k * per, H]
        scores = (z.unsqueeze(-2) @ rows.transpose(-1, -2)).squeeze(-2)  # [n, k * per]
        floor = scores.amin(dim=-1, keepdim=True) - 1.0
        return floor.expand(n, self.token_ordering.numel()).clone().scatter_(1, ids, scores)


class AssistantDecoder(nn.Module):
    """The assistant's layers and final norm (checkpoint prefix ``model.``)."""

    def __init__(self, layers: list[AssistantLayer], norm: RMSNorm) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.stack = layers  # the same modules, typed

    def forward(self, x: Tensor, groups: Sequence[tuple[int, Step]]) -> Tensor:
        """The last layer's output, normed."""
        for layer in self.stack:
            x = layer(x, groups)
        return self.norm(x)


class Gemma4Assistant(DraftHead):
    """The assistant as a draft head for ``target`` (built for it: each layer knows which target
    layer's keys and values it reads). Checkpoint names: ``pre_projection``, ``post_projection``,
    ``model.layers.N.*``, ``model.norm``, ``lm_head`` (tied to ``model.embed_tokens``),
    ``masked_embedding.{centroids, token_ordering}``."""

    def __init__(self, cfg: AssistantConfig, target: CausalLM, sources: Sequence[int]) -> None:
        super().__init__()
        tcfg, text = target.config, cfg.text
        self.assistant = cfg
        # What the Eagle3Drafter reads: the target's final norm input (capture index L), its vocabulary.
        self.config = Eagle3Config.for_target(tcfg, aux_layers=(tcfg.num_hidden_layers,))
        self.max_len = target.max_len
        self.embed_tokens = None  # the target's (scaled) embedding: the drafter embeds through target.embed
        self._target = (target,)  # not a submodule
        h, hb = text.hidden_size, cfg.backbone_hidden_size
        self.pre_projection = Linear(2 * hb, h, bias=False)
        self.post_projection = Linear(h, hb, bias=False)
        self.rope = Rope(layer_config(text, text.num_hidden_layers - 1), target.max_len)
        local = dataclasses.replace(text, rope_theta=text.rope_local_theta or text.rope_theta, rope_scaling=None)
        self.rope_local = Rope(local, target.max_len)
        self.model = AssistantDecoder([AssistantLayer(text, i, self.rope, self.rope_local, src)
                                       for i, src in enumerate(sources)], RMSNorm(h, text.rms_norm_eps))
        self.lm_head = Linear(h, text.vocab_size, bias=False)
        self.masked_embedding = (MaskedHead(h, text.vocab_size, cfg.num_centroids, cfg.centroid_top_k)
                                 if cfg.use_ordered_embeddings else None)
        self.register_buffer("d2t", torch.zeros(tcfg.vocab_size, dtype=torch.long), persistent=False)

    @property
    def dtype(self) -> torch.dtype:  # (its norms stay float when its matrices are quantized)
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def to_runtime(self, device: torch.device, dtype: torch.dtype) -> Gemma4Assistant:
        """Weights in ``dtype`` on ``device``; RoPE tables recomputed in float32 there."""
        self.to(device=device, dtype=dtype)
        self.rope.reset_tables(device)
        self.rope_local.reset_tables(device)
        return self.eval()

    def quantize_matrices(self) -> int:
        """Its projections (and a plain output head) as Q8_0 blocks run by the q8 kernels: a quarter
        of the bytes a draft row reads in float32. Only on CPU float32 runs with the kernels built;
        a drafter's weights change what it proposes, never the output. Returns how many it replaced
        (the masked head's table stays float: it is gathered by rows)."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not kernels_active():
            return 0
        replaced = 0
        for owner in list(self.modules()):
            for name, child in list(owner.named_children()):
                skip = child is self.lm_head and self.masked_embedding is not None
                if isinstance(child, nn.Linear) and child.in_features % 32 == 0 and not skip:
                    setattr(owner, name, GGMLLinear.from_float(child.weight, child.bias))
                    replaced += 1
        return replaced

    def new_cache(self, max_len: int | None = None) -> SequenceCache:
        """No keys or values of its own: a cache without layers, counting the rows the drafter ran."""
        return KVCache(0, 1, 1, max_len or self.max_len, self.dtype, self.device)

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """The target's final norm of its last layer's output (transformers' ``hidden_states[-1]``)."""
        return self._target[0].model.norm(target_hidden.to(self.dtype))

    def logits(self, z: Tensor) -> Tensor:
        if self.masked_embedding is not None:
            return self.masked_embedding(z, self.lm_head.weight)
        return self.lm_head(z)

    def output(self, h: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(logits of ``rows`` (all if None), the state the next drafted row reads) from the
        decoder's normed output ``h``."""
        return self.logits(h if rows is None else h.index_select(0, rows)), self.post_projection(h)

    @torch.inference_mode()
    def run_rows(self, embeds: Tensor, features: Tensor,
                 groups: Sequence[tuple[int, SequenceCache, int]]) -> tuple[Tensor, Tensor]:
        """Rows ``embeds`` [T, Hb] (the tokens' target embeddings) and ``features`` [T, Hb] (the
        target's normed hidden state or a parent row's state), in groups ``(rows, cache, context)``:
        each group's rows sit at position ``context`` and attend to slots ``0..context-1`` of the
        target cache ``cache``. Returns (logits [T, V] float32, state [T, Hb])."""
        x = self.pre_projection(torch.cat([embeds.to(self.dtype), features.to(self.dtype)], dim=-1))
        steps = [(rows, self._step(cache, context, rows)) for rows, cache, context in groups]
        logits, state = self.output(self.model(x, steps))
        return logits.float(), state

    def check_cache(self, cache: SequenceCache) -> None:
        """A one-line QuickdraftError where ``cache`` lacks the keys and values the layers read."""
        for layer in self.model.stack:
            attn = layer.self_attn
            kv = cache.attention
            have = kv.k_layers[layer.source].shape[0] if len(kv.k_layers) > layer.source else 0
            if have != attn.nkv:
                raise QuickdraftError(f"the Gemma 4 assistant reads {attn.nkv} key/value heads of the target's layer "
                                      f"{layer.source}, its cache holds {have} (under --tensor-parallel each rank "
                                      "holds a part): run it without --tensor-parallel")

    def _step(self, cache: SequenceCache, context: int, rows: int) -> Step:
        """Rows at position ``context`` that each see the target's slots ``0..context-1`` (a
        sliding layer's window then keeps the last of them)."""
        seen = torch.arange(context, device=self.device)
        positions = torch.full((rows,), context, dtype=torch.long, device=self.device)
        return Step.of_pass(cache, context, positions, rows=RowSlots([seen] * rows))


# ------------------------------------------------------------------------------------ loading


def assistant_folder(spec: str | Path) -> Path | None:
    """``spec`` as a folder holding a Gemma 4 assistant (config.json with model_type
    gemma4_assistant), or None."""
    path = Path(spec).expanduser()
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    try:
        d = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return path if isinstance(d, dict) and d.get("model_type") == MODEL_TYPE else None


def load_assistant(spec: str | Path, target: CausalLM, quantize: bool = False) -> Gemma4Assistant:
    """The assistant at ``spec`` (a Hugging Face folder) for ``target``, in its dtype and on its
    device; ``quantize``: its matrices as Q8_0 blocks where the q8 kernels run them
    (:meth:`Gemma4Assistant.quantize_matrices`)."""
    from quickdraft.loading.safetensors import iter_tensors

    folder = Path(spec).expanduser()
    try:
        d = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QuickdraftError(f"{folder / 'config.json'} is not readable JSON ({exc})") from None
    cfg = AssistantConfig.from_hf_dict(d)
    sources = check_target(cfg, target.config, f"the assistant {folder}")
    head = Gemma4Assistant(cfg, target, sources)
    ordering: list[Tensor] = []
    _load_weights(head, _renamed(iter_tensors(folder), cfg, ordering))
    if head.masked_embedding is not None:
        if not ordering:
            raise QuickdraftError(f"the assistant {folder} uses ordered embeddings but has no "
                                  "masked_embedding.token_ordering tensor")
        order = ordering[0].to(torch.long).flatten()
        vocab = cfg.text.vocab_size
        if order.numel() != vocab or int(order.min()) < 0 or int(order.max()) >= vocab:
            raise QuickdraftError(f"the assistant's token_ordering must hold {vocab} token ids, it holds "
                                  f"{order.numel()} in [{int(order.min())}, {int(order.max())}]")
        head.masked_embedding.token_ordering.copy_(order)
    head = head.to_runtime(target.device, target.dtype)
    if quantize:
        head.quantize_matrices()
    return head


def _renamed(tensors: Iterable[tuple[str, Tensor]], cfg: AssistantConfig,
             ordering: list[Tensor]) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors under the head's names: the tied embedding is the output head (an
    untied one is not needed), the token ordering goes to ``ordering``."""
    head = False
    for name, tensor in tensors:
        if name == "masked_embedding.token_ordering":
            ordering.append(tensor)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            if (name == "lm_head.weight" or cfg.tie_word_embeddings) and not head:
                head = True  # tied: the embedding (or a written-out lm_head) is the head
                yield "lm_head.weight", tensor
        elif name.startswith("masked_embedding.") and not cfg.use_ordered_embeddings:
            continue
        else:
            yield name, tensor


def _load_weights(head: Gemma4Assistant, tensors: Iterable[tuple[str, Tensor]]) -> None:
    from quickdraft.loading.weights import load_weights

    load_weights(head, tensors, tied=False)


# ------------------------------------------------------------------------------------ drafting


@dataclass(frozen=True, eq=False)
class AssistantPass(DraftPass):
    """One pass of the assistant: rows (``embeds``, ``features``) at position ``context``, attending
    to slots ``0..context-1`` of the target cache ``target_cache``. Several sequences' asks run as
    one pass (one call of every projection over all their rows; attention per sequence, each over
    its own cache), each row's output what it is alone."""

    head: Gemma4Assistant
    target_cache: SequenceCache
    context: int
    embeds: Tensor
    features: Tensor
    pool: KVPool | None = None  # the row-counting pool the drafter's forks share (groups their asks)
    lane: int = 0

    @property
    def rows(self) -> int:
        return int(self.embeds.shape[0])

    def run(self) -> PassOutput:
        logits, state = self.head.run_rows(self.embeds, self.features, [(self.rows, self.target_cache, self.context)])
        return PassOutput(logits, state)

    @classmethod
    def together(cls, asks: Sequence[AssistantPass]) -> list[PassOutput]:
        logits, state = asks[0].head.run_rows(torch.cat([a.embeds for a in asks]), torch.cat([a.features for a in asks]),
                                              [(a.rows, a.target_cache, a.context) for a in asks])
        outputs, at = [], 0
        for a in asks:
            outputs.append(PassOutput(logits[at : at + a.rows], state[at : at + a.rows]))
            at += a.rows
        return outputs


class AssistantDrafter(Eagle3Drafter):
    """The Eagle3Drafter over a Gemma 4 assistant (see the module doc)."""

    name = "assistant"
    head: Gemma4Assistant
    _target_cache: SequenceCache | None = None

    def use_target_cache(self, cache: SequenceCache) -> None:
        self.head.check_cache(cache)
        self._target_cache = cache

    def _embed(self, target_ids: Tensor) -> Tensor:
        return self.target.embed(target_ids).to(self.head.dtype)

    def _pass(self, embeds: Tensor, features: Tensor) -> AssistantPass:
        assert self._target_cache is not None
        return AssistantPass(self.head, self._target_cache, self.fed, embeds, features, pool=self.pool, lane=self.lane)

    def _catch_up(self) -> Steps[tuple[Tensor, Tensor] | None]:
        """The root row: the newest token (position p = fed) and the feature of position p - 1,
        over the target's keys of positions 0..p-1. None where there is nothing to draft from."""
        p, target = self.fed, self._target_cache
        if p == 0 or len(self.tokens) != p + 1 or self.features is None or target is None or target.length != p:
            return None
        if self.cache.length == p and self._last_row is not None:
            return self._last_row
        if self.cache.max_len - p < self.shape.max_depth * self.shape.top_k:
            return None  # the context is nearly full
        self.cache.truncate(min(self.cache.length, p))
        self.cache.advance(p - self.cache.length)  # drafted rows count from here
        ids = torch.tensor(self.tokens[p : p + 1], dtype=torch.long, device=self.head.device)
        out = yield self._pass(self._embed(ids), self.head.fuse(self.features[p - 1 : p]))
        self._time_pass(out.seconds)
        assert out.hidden is not None
        self._last_row = (out.logits, out.hidden)
        return self._last_row

    def _run_rows(self, draft_ids: Tensor, features: Tensor, position: int, mask: Tensor | None,
                  committed: int) -> Steps[tuple[Tensor, Tensor]]:
        """A drafting pass: rows (a drafted token's embedding, its parent's state), all at the
        newest token's position over the same target keys (``position``, ``mask`` and ``committed``
        place EAGLE rows: not needed here). The rows take slots of the row-counting cache, as an
        EAGLE head's rows do, so the tree bookkeeping stays the EAGLE-3 drafter's."""
        rows = int(draft_ids.shape[0])
        self.cache.reserve(rows)
        out = yield self._pass(self._embed(self.head.to_target_ids(draft_ids)), features)
        self.cache.advance(rows)
        self._time_pass(out.seconds)
        assert out.hidden is not None
        return out.logits, out.hidden


def measure_seconds(head: Gemma4Assistant, target: CausalLM, rows: int, repeats: int = 2) -> float:
    """Seconds of one assistant pass over ``rows`` rows on a short scratch context of the target."""
    context = max(1, min(32, target.max_len - 1))
    cache = target.make_cache(context + 1)
    head.check_cache(cache)
    cache.advance(context)  # keys of zeros: the time does not depend on them
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, head.assistant.backbone_hidden_size, generator=gen).to(head.device, head.dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        head.run_rows(x, x, [(rows, cache, context)])
        if head.device.type == "cuda":
            torch.cuda.synchronize(head.device)
        best = min(best, time.perf_counter() - t0)
    return best


def build_assistant_drafter(
    spec: str | Path,
    target: CausalLM,
    num_draft: int | None = None,
    say: Callable[[str], None] = lambda _m: None,
    mode: str = "auto",
) -> AssistantDrafter:
    """The assistant at ``spec`` as a drafter for ``target``: dynamic trees sized by the cost model
    (``num_draft``: a fixed size, no cost model), chains with ``mode="chain"``."""
    say(f"loading Gemma 4 assistant {spec} ...")
    head = load_assistant(spec, target, quantize=True)
    shape: TreeShape = default_shape(target.device)
    if num_draft is not None:
        shape = dataclasses.replace(shape, max_nodes=num_draft, max_depth=min(shape.max_depth, num_draft))
    drafter = AssistantDrafter(head, target, mode=mode, shape=shape, policy=num_draft is None,
                               head_seconds=measure_seconds(head, target, shape.top_k))
    cfg = head.assistant
    drafter.variant = (f"{cfg.text.num_hidden_layers} layers, centroid-masked head ({cfg.centroid_top_k} of "
                       f"{cfg.num_centroids} clusters)" if cfg.use_ordered_embeddings
                       else f"{cfg.text.num_hidden_layers} layers")
    say(f"drafting with the Gemma 4 assistant ({drafter.variant})")
    return drafter
