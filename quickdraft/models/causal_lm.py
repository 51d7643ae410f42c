"""The causal LM every architecture is: :class:`CausalLM`'s one forward pass (embeddings, the
decoder layers over a KV cache, final norm, output head) and the dense backbone most families
share (Llama, Qwen2/3, Mistral: the standard :class:`~quickdraft.models.layers.DecoderLayer`).

Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj.weight`` ...), so
safetensors checkpoints load directly and GGUF tensors are renamed to them at load time.
Families with other layers subclass :class:`CausalLM` with their own ``backbone`` (see
``gemma3.py``, ``phi3.py``, ``moe.py``); variants of the dense one (qwen2 biases, qwen3 q/k norms)
are switched by :class:`ModelConfig` fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from quickdraft.cache import KVCache, KVType, SequenceCache
from quickdraft.config import ModelConfig
from quickdraft.models.batch_invariance import (
    NATIVE_CHAIN_ROWS,
    PREFILL_CHUNK,
    Linear,
    invariant_pass,
    prefill_chunks,
)
from quickdraft.models.forward_pass import Step
from quickdraft.models.layers import DecoderLayer, RMSNorm, Rope, allocate_empty, embedding
from quickdraft.models.native import NativePass, NativeStack, build_stack
from quickdraft.quant.fp8 import FP8Linear
from quickdraft.quant.ggml import GGMLLinear, active_kernels, layout_epoch


class DenseBackbone(nn.Module):
    """Embeddings, RoPE, the standard decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = Rope(cfg, max_len)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``model(ids, cache) -> (logits, captured)`` for one sequence.

    Families with other layers set ``backbone`` (embeddings, rope, layers, final norm) and, where
    they differ, override :meth:`embed` and :meth:`logits`; the forward pass stays this one.
    """

    backbone: ClassVar[type[nn.Module]]
    # True where convert_checkpoint regroups or renames the checkpoint's tensors (MoE experts): the
    # prepared-weights cache, which records tensors as the file has them, is then not written.
    converts_checkpoint: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = cfg
        self.max_len = max_len
        self.dtype = torch.float32  # activation dtype (set by materialize)
        self.kv_dtype: KVType | None = None  # KV cache element type (a dtype or "q8_0"); None: self.dtype
        self.device = torch.device("cpu")
        self.model: Any = self.backbone(cfg, max_len)
        self.lm_head: nn.Module = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # (a GGMLLinear, VocabParallel, ...)
        self.tie_weights()
        rope = self.model.rope
        assert isinstance(rope, Rope), "a backbone's RoPE tables: model.rope"
        self._native = NativeStack(self.native_stack, rope)
        self._prefill_rows: tuple[tuple[int, bool], int] = ((-1, False), PREFILL_CHUNK)  # (when, prefill_rows)
        self._vocab_subset: tuple[torch.Tensor, nn.Module] | None = None  # set_output_vocab
        self.load_notes: list[str] = []  # what loading left out of the checkpoint, for the start-up lines
        self.mtp_weights: dict[str, Any] = {}  # the checkpoint's multi-token-prediction tensors (mtp_layer)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def convert_checkpoint(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's (name, tensor) pairs in this model's layout and names; as they are for the
        families whose parameters match the checkpoint one to one (see converts_checkpoint)."""
        return iter(tensors)

    def mtp_layer(self) -> tuple[nn.Module, type[nn.Module]] | None:
        """The family's multi-token-prediction decoder layer (new, for :attr:`mtp_weights`' ``layers.0.*``)
        and its RMSNorm class, where the checkpoint carried MTP tensors; else None. The draft head
        around it: :func:`quickdraft.speculative.mtp.mtp_head`."""
        return None

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
        """Give a model built on the meta device real (uninitialised) storage in ``dtype``."""
        allocate_empty(self, device, dtype)
        self.model.rope.reset_tables(device)
        self.tie_weights()
        self.dtype, self.device = dtype, torch.device(device)
        return self

    def new_cache(self) -> SequenceCache:
        return self.make_cache(self.max_len)

    # Families whose layers run every pass mode on the shared Step path (chains of up to
    # NATIVE_CHAIN_ROWS rows batch invariant where the kernels run them); a family that handles
    # long passes itself says BLOCKED_MAX_ROWS.
    chain_rows = NATIVE_CHAIN_ROWS

    def prefill_rows(self) -> int:
        """The most rows of one prefill pass: ``chain_rows`` where every pass runs on the native
        kernels' batch-invariant path (CPU float32, the kernels built, every matrix a q8 GGML block
        or a blocked :class:`Linear`), else PREFILL_CHUNK. Any cut gives the same bits; longer passes
        read the weights fewer times (a 256-expert MoE layer's experts once per 256 rows, not 64)."""
        key = (layout_epoch(), active_kernels() is not None)
        if self._prefill_rows[0] != key:
            self._prefill_rows = (key, self._measure_prefill_rows())
        return self._prefill_rows[1]

    def _measure_prefill_rows(self) -> int:
        if self.chain_rows <= PREFILL_CHUNK or self.dtype != torch.float32 or self.device.type != "cpu" \
                or active_kernels() is None:
            return PREFILL_CHUNK
        for m in self.modules():
            plain = isinstance(m, nn.Linear) and not isinstance(m, Linear)
            if plain or (isinstance(m, GGMLLinear) and m.activation_mode != "q8") or isinstance(m, FP8Linear):
                return PREFILL_CHUNK
        return self.chain_rows

    def make_cache(self, max_len: int) -> SequenceCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_len, self.kv_dtype or self.dtype,
                       self.device)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: SequenceCache, positions: torch.Tensor | None = None,
        capture: Sequence[int] = (), num_logits: int | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One chain of ``ids`` [T] on one sequence: :meth:`run` over the next T slots of ``cache``
        (RoPE ``positions`` [T], default the slots themselves), logits of the last ``num_logits`` rows
        (None: every row; 0: none, a prefill chunk before the last)."""
        t = ids.shape[0]
        outputs = None if num_logits is None else list(range(t - num_logits, t))
        return self.run(ids, Step.reserve(cache, t, positions, outputs=outputs), capture)

    def prefill(
        self, ids: torch.Tensor, cache: SequenceCache, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`forward` over ``ids`` [T] in passes of at most :meth:`prefill_rows` rows (bitwise the keys
        and values of any other cut); logits [1, V] of the last row."""
        logits = torch.empty(0)
        t = ids.shape[0]
        for s, e in prefill_chunks(0, t, self.prefill_rows()):
            pos = None if positions is None else positions[s:e]
            logits, _ = self(ids[s:e], cache, positions=pos, num_logits=1 if e == t else 0)
        return logits

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, step: Step, capture: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The one forward pass, whatever ``step`` describes (:mod:`quickdraft.models.forward_pass`: a
        chain, a tree, rows of several sequences, static shapes): ``ids`` [T] through every layer,
        their keys / values written where ``step`` says (a dynamic pass then advances its cache).
        capture: layer indices whose INPUT hidden state [T, H] is returned (index L = the final
        norm's input). Returns float32 logits [n, V] of ``step.outputs`` (every row where None) and
        the captured hidden states."""
        t = ids.shape[0]
        step.chain_rows = self.chain_rows
        x = self.embed(ids)  # [T, H]
        step.layer_inputs = self.layer_inputs(ids, x)
        # a dynamic chain (causal: not a tree, not rows of several sequences) of up to
        # NATIVE_CHAIN_ROWS rows runs in the native stack too (a prompt's prefill passes of up to 256 rows)
        dynamic = step.slots is None
        stack = self._native.get(x) if dynamic and invariant_pass(t, chain=not step.tree) else None
        if stack is not None:  # every layer in one native call: bitwise the loop below
            x, captured = stack.run(x, step, capture)
        else:
            x, captured = self._layers(x, step, capture)
        if dynamic:
            step.cache.advance(t)
        rows = step.outputs
        if rows is not None:
            if not rows:  # keys and values only
                return x.new_zeros(0, self.config.vocab_size, dtype=torch.float32), captured
            tail = rows == list(range(rows[0], t))
            x = x[rows[0]:] if tail else x.index_select(0, torch.tensor(rows, device=x.device))
        return self.logits(x), captured

    def _layers(self, x: torch.Tensor, step: Step, capture: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every decoder layer in turn (Python), with the inputs of the ``capture`` layers."""
        if (recurrent := step.cache.recurrent) is not None:  # linear-attention layers record their rows' states
            recurrent.begin_rows(step.start, step.row_parents(), step.outputs)
        captured = []
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                captured.append(x)
            x = layer(x, i, step)
        if len(self.model.layers) in capture:
            captured.append(x)
        return x, captured

    def native_stack(self) -> NativePass | None:
        """Every layer of a pass in one native call (:mod:`quickdraft.models.native`), or None where
        the kernels do not compute these layers (a family with other layers overrides this)."""
        return build_stack(self.model.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H]."""
        return self.model.embed_tokens(ids)

    def layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """What every decoder layer of a pass over ``ids`` (embedded: ``x``) takes besides the hidden
        state, as :attr:`Step.layer_inputs` (Gemma 4's per-layer embeddings); None: nothing."""
        return None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output head -> float32 logits [n, V] (-inf outside an output vocabulary
        set by :meth:`set_output_vocab`)."""
        if self._vocab_subset is not None:
            ids, head = self._vocab_subset
            sub = head(self.model.norm(x)).float()
            out = sub.new_full((sub.shape[0], self.config.vocab_size), float("-inf"))
            return out.index_copy_(1, ids, sub)
        return self.lm_head(self.model.norm(x)).float()

    def set_output_vocab(self, ids: torch.Tensor | None) -> bool:
        """Compute logits only for token ``ids`` (the rest -inf): a drafter's cheaper output head,
        e.g. a draft model's most frequent tokens (any draft distribution keeps speculation
        lossless). None restores the full head. Returns False (and changes nothing) where the
        model's head cannot be cut this way."""

        if ids is None:
            self._vocab_subset = None
            return True
        if type(self).logits is not CausalLM.logits:  # a family with its own head (e.g. softcapping)
            return False
        ids = torch.as_tensor(ids, dtype=torch.long).unique()  # sorted
        sub = self.head_rows(ids)
        if sub is None:
            return False
        self._vocab_subset = (ids.to(self.device), sub)
        return True

    def head_rows(self, ids: torch.Tensor) -> nn.Module | None:
        """A new output head computing only rows ``ids`` of this one's (in that order), or None where
        the head cannot be cut so (a bias, another layer type)."""
        from quickdraft.quant.ggml import GGMLLinear

        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"output vocabulary ids must lie in [0, {self.config.vocab_size})")
        head = self.lm_head
        if isinstance(head, GGMLLinear):
            return head.select_rows(ids)
        if type(head) in (Linear, nn.Linear) and head.bias is None:
            sub = Linear(head.in_features, ids.numel(), bias=False, device=head.weight.device, dtype=head.weight.dtype)
            with torch.no_grad():
                sub.weight.copy_(head.weight.index_select(0, ids.to(head.weight.device)))
            return sub
        return None


CausalLM.backbone = DenseBackbone
