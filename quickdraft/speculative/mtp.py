"""A model's own multi-token-prediction (MTP) layer as its drafter (``--draft mtp``; ``auto`` picks it).

Qwen3.5 and Qwen3-Next checkpoints carry ``mtp.*`` tensors: one decoder layer trained with the
model to predict the token after next, as DeepSeek-V3's MTP modules (arXiv 2412.19437, section 2.2)
and run the way vLLM and llama.cpp run them. Row j of the head (target position j)::

    e = pre_fc_norm_embedding(embed(token j+1))      the target's embedding
    g = pre_fc_norm_hidden(s_j)                      s_j: the target's last hidden state after its final norm
    x = fc(cat([e, g]))                              [2H] -> [H]
    h = layer(x)                                     a full-attention decoder layer of the model's own kind,
                                                     with its own KV cache, RoPE position j
    z = norm(h);  logits = lm_head(z)                the target's output head: token j+2

Drafting on from row j, the next row reads z_j in place of s (one layer chained for k > 1). This is
EAGLE's alignment, so :class:`~quickdraft.speculative.eagle3.drafter.Eagle3Drafter` runs the head
(chains, dynamic trees, rollback, several sequences in one head pass) with the target's
final-norm input captured as the feature.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.layers import Attention
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter
from quickdraft.speculative.eagle3.head import DraftHead, Eagle3Config

if TYPE_CHECKING:
    from quickdraft.models.causal_lm import CausalLM
    from quickdraft.models.forward_pass import Step


class MTPHead(DraftHead):
    """A target's MTP layer with the checkpoint's names (``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``layers.0.*``, ``norm``; without the ``mtp.`` prefix). ``layer`` is
    the decoder layer (the target family's full-attention kind) and ``norm`` the family's RMSNorm;
    the embedding and output head are the target's."""

    def __init__(self, target: CausalLM, layer: nn.Module, norm: type[nn.Module]) -> None:
        super().__init__()
        cfg = target.config
        h = cfg.hidden_size
        # What the drafter reads: the final norm's input (capture index L), one layer's KV shape.
        self.config = Eagle3Config.for_target(cfg, aux_layers=(cfg.num_hidden_layers,))
        self.max_len = target.max_len
        self.embed_tokens = None
        self.fc = Linear(2 * h, h, bias=False)  # (a GGUF may replace it with its quantized matrix)
        self.pre_fc_norm_embedding = norm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.norm = norm(h, cfg.rms_norm_eps)
        self._target = (target,)  # not a submodule: its parameters are the target's
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long), persistent=False)
        self.lm_head: nn.Module | None = None  # the target's head cut to a draft vocabulary (cut_vocab)

    def cut_vocab(self, ids: Tensor) -> bool:
        """Draft only target tokens ``ids`` (e.g. the most frequent ones): the head's logits cover those
        rows of the target's output head, a fraction of its cost (any draft distribution keeps
        speculation lossless). False (nothing changed) where the target's head cannot be cut."""
        ids = torch.as_tensor(ids, dtype=torch.long).unique()
        sub = self._target[0].head_rows(ids)
        if sub is None:
            return False
        n = int(ids.numel())
        self.lm_head = sub
        self.config = dataclasses.replace(self.config, draft_vocab_size=n)
        self.d2t = (ids - torch.arange(n)).to(self.device)
        return True

    @property
    def dtype(self) -> torch.dtype:  # the target's activations (fc may be a quantized GGUF matrix)
        return self._target[0].dtype

    @property
    def device(self) -> torch.device:
        return self._target[0].device

    @property
    def attention(self) -> Attention:
        attn = self.layers[0].self_attn
        assert isinstance(attn, Attention)
        return attn

    def layer_rows(self, embeds: Tensor, features: Tensor, step: Step) -> Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(features)], dim=-1)
        return self.layers[0](self.fc(x), 0, step)

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """The target's final norm of its last layer's output: the hidden state its logits read."""
        return self._target[0].model.norm(target_hidden.to(self.dtype))

    def output(self, h: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        z = self.norm(h)
        head = self.lm_head if self.lm_head is not None else self._target[0].lm_head
        return head(z if rows is None else z.index_select(0, rows)), z


_HEADS: weakref.WeakKeyDictionary[nn.Module, MTPHead] = weakref.WeakKeyDictionary()


def mtp_head(target: CausalLM) -> MTPHead | None:
    """The target checkpoint's MTP layer as a draft head (built once per target), or None where
    it has none; MTP tensors of a layout it does not fit are dropped with a load note."""
    if target in _HEADS:
        return _HEADS[target]
    parts = target.mtp_layer()
    if parts is None:
        return None
    from quickdraft.loading.weights import load_weights

    head = MTPHead(target, *parts)
    head.to(device=target.device, dtype=target.dtype)
    try:
        load_weights(head, target.mtp_weights.items(), tied=False)
    except QuickdraftError as exc:
        target.load_notes.append(f"the checkpoint's multi-token-prediction tensors have a layout quickdraft does "
                                 f"not know ({exc}): the model runs without them")
        target.mtp_weights = {}
        return None
    _HEADS[target] = head.eval()
    return head


class MTPDrafter(Eagle3Drafter):
    """The Eagle3Drafter over a model's own MTP head."""

    name = "mtp"
