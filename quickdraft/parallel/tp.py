"""Tensor parallelism: one model split over several processes (torch.distributed; gloo on CPU, NCCL on GPUs).

Megatron-style split of every decoder block, with one all-reduce after attention and one after the MLP:

* attention: each rank owns a contiguous range of KV heads and the query heads that read them
  (q/k/v projections split by output rows: column-parallel), computes attention for its heads
  only against its own slice of the KV cache, and multiplies by its columns of ``o_proj``
  (row-parallel); the partial outputs are summed by an all-reduce;
* MLP: ``gate_proj``/``up_proj`` split by output rows, ``down_proj`` by input columns, all-reduce;
* ``lm_head``: split by vocabulary rows, logits all-gathered; embeddings and norms replicated.

Split points may be uneven (e.g. 8960 = 18 + 17 blocks of 256), and for GGUF blocks they fall on
block boundaries so weights stay in their quantized form. The all-reduce of two partial sums is
an exact, order-independent float addition for two ranks, and each rank's linears are
batch-invariant, so speculative greedy output still equals plain greedy output under TP.

Control: rank 0 runs the engine (and the drafter, which is not split). Every forward pass of the
target on rank 0 first broadcasts a small header (which cache, its length, the row count) and the
inputs, and the other ranks replay the same pass on their shard (:func:`worker_loop`). Cache
operations that move data (``compact``) are broadcast the same way; ``truncate``/``reset`` only
change the length, which travels with the next header.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from quickdraft.cache import KVCache
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.forward_pass import Step

OP_FORWARD, OP_COMPACT, OP_NEW_CACHE, OP_FREE_CACHE, OP_STOP = 1, 2, 3, 4, 5
_HEADER = 8  # int64 fields per control message


def split_points(total: int, world: int, align: int = 1, what: str = "dimension") -> list[int]:
    """Boundaries ``0 = b_0 < b_1 < ... < b_world = total``, multiples of ``align``, near even."""
    if total % align:
        raise QuickdraftError(f"cannot split the {what} ({total}) into blocks of {align}")
    units = total // align
    if units < world:
        raise QuickdraftError(
            f"cannot split the {what} ({units} unit(s) of {align}) over {world} ranks; "
            "use a smaller --tensor-parallel"
        )
    base, rem = divmod(units, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + (base + (r < rem)) * align)
    return bounds


# ---------------------------------------------------------------------------------------------
# Slicing one linear layer (quickdraft Linear or GGML blocks)
# ---------------------------------------------------------------------------------------------


def _block_size(mod: nn.Module) -> int:
    """Granularity of an input-column split: the GGML block size, 1 for dense weights."""
    from quickdraft.quant.ggml import GGMLLinear

    if isinstance(mod, GGMLLinear):
        from gguf import GGML_QUANT_SIZES

        return int(GGML_QUANT_SIZES[mod.qtype][0])
    return 1


def slice_rows(mod: nn.Module, a: int, b: int) -> nn.Module:
    """Output rows ``[a, b)`` of a linear layer (column parallelism)."""
    from quickdraft.quant.ggml import GGMLLinear

    if isinstance(mod, GGMLLinear):
        bias = mod.bias[a:b].clone() if mod.bias is not None else None
        return GGMLLinear(mod.qtype, mod.ggml_raw()[a:b].clone(), mod.in_features, bias, activations=mod.activations)
    if isinstance(mod, nn.Linear):
        w = mod.weight
        out = Linear(w.shape[1], b - a, bias=mod.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(w[a:b])
            if mod.bias is not None:
                out.bias.copy_(mod.bias[a:b])
        return out
    raise QuickdraftError(f"tensor parallelism does not support {type(mod).__name__} layers yet")


def slice_cols(mod: nn.Module, a: int, b: int, keep_bias: bool) -> nn.Module:
    """Input columns ``[a, b)`` of a linear layer (row parallelism); the bias stays on one rank."""
    from gguf import GGML_QUANT_SIZES

    from quickdraft.quant.ggml import GGMLLinear

    if isinstance(mod, GGMLLinear):
        bs, ts = GGML_QUANT_SIZES[mod.qtype]
        if a % bs or b % bs:
            raise QuickdraftError(
                f"cannot split {mod.qtype.name} weights at column {a}..{b} (blocks of {bs}); "
                "load with --dtype bfloat16 for this --tensor-parallel"
            )
        raw = mod.ggml_raw()[:, a // bs * ts : b // bs * ts].contiguous()
        bias = mod.bias.clone() if keep_bias and mod.bias is not None else None
        return GGMLLinear(mod.qtype, raw, b - a, bias, activations=mod.activations)
    if isinstance(mod, nn.Linear):
        w = mod.weight
        has_bias = keep_bias and mod.bias is not None
        out = Linear(b - a, w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(w[:, a:b])
            if has_bias:
                out.bias.copy_(mod.bias)
        return out
    raise QuickdraftError(f"tensor parallelism does not support {type(mod).__name__} layers yet")


class RowParallel(nn.Module):
    """A module whose output is a partial sum on each rank (a row-parallel linear, a split MoE
    block): the local result, summed over the group."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).contiguous()
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallel(nn.Module):
    """``lm_head`` split by vocabulary rows; every rank gets the full logits."""

    def __init__(self, inner: nn.Module, bounds: list[int], group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner = inner
        self.bounds = bounds
        self.group = group
        self.width = max(b - a for a, b in itertools.pairwise(bounds))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        n, local = y.shape
        pad = torch.zeros(n, self.width, dtype=y.dtype, device=y.device)  # gather needs equal sizes
        pad[:, :local] = y
        parts = [torch.empty_like(pad) for _ in range(len(self.bounds) - 1)]
        dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p[:, : b - a] for p, (a, b) in zip(parts, itertools.pairwise(self.bounds), strict=True)], 1)


# ---------------------------------------------------------------------------------------------
# Sharding a model in place
# ---------------------------------------------------------------------------------------------


def shard_model(
    model: CausalLM,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None = None,
    ctrl_group: dist.ProcessGroup | None = None,
) -> TPCausalLM:
    """Keep this rank's shard of every block; returns the model, now a :class:`TPCausalLM`.

    ``group`` carries the all-reduces (NCCL on GPUs), ``ctrl_group`` the small control messages
    (CPU tensors: gloo). None = the default group for both."""
    cfg = model.config
    if not isinstance(model, CausalLM) or isinstance(model, TPCausalLM):
        raise QuickdraftError(f"cannot split {type(model).__name__}: not an unsplit quickdraft causal LM")
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    group_size = nh // nkv
    kv = split_points(nkv, world, what="key/value heads")
    kv0, kv1 = kv[rank], kv[rank + 1]
    q0, q1 = kv0 * group_size, kv1 * group_size
    for layer in model.model.layers:
        attn: Any = layer.self_attn
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise QuickdraftError(
                f"tensor parallelism needs separate q/k/v projections; {cfg.model_type} fuses them (not supported yet)"
            )
        attn.q_proj = slice_rows(attn.q_proj, q0 * hd, q1 * hd)
        attn.k_proj = slice_rows(attn.k_proj, kv0 * hd, kv1 * hd)
        attn.v_proj = slice_rows(attn.v_proj, kv0 * hd, kv1 * hd)
        attn.o_proj = RowParallel(slice_cols(attn.o_proj, q0 * hd, q1 * hd, keep_bias=rank == 0), group)
        attn.nh, attn.nkv = q1 - q0, kv1 - kv0
        block: Any = layer
        if _is_moe(block.mlp):
            # Every expert (and the shared expert) split like a dense MLP; the router stays whole.
            # The block's output is linear in the experts' partial outputs: one all-reduce at the end.
            moe: Any = layer.mlp
            for expert in [*moe.experts, *([moe.shared_expert] if moe.shared_expert is not None else [])]:
                _split_mlp(expert, rank, world, cfg.model_type, reduce=None)
            block.mlp = RowParallel(moe, group)
        else:
            _split_mlp(layer.mlp, rank, world, cfg.model_type, reduce=group if group is not None else True)
    vocab = split_points(cfg.vocab_size, world, what="vocabulary")
    model.lm_head = VocabParallel(
        slice_rows(model.lm_head, vocab[rank], vocab[rank + 1]), vocab, group)
    cls = type(model)
    if cls not in _TP_CLASSES:  # the model's own class with the TP control mixed in before it
        _TP_CLASSES[cls] = type(f"TP{cls.__name__}", (TPCausalLM, cls), {"__module__": cls.__module__})
    model.__class__ = _TP_CLASSES[cls]
    assert isinstance(model, TPCausalLM)
    model.tp_setup(rank, world, kv1 - kv0, ctrl_group)
    return model


_TP_CLASSES: dict[type, type] = {}


def _is_moe(mlp: nn.Module) -> bool:
    from quickdraft.models.moe import SparseMoE

    return isinstance(mlp, SparseMoE)


def _split_mlp(mlp: Any, rank: int, world: int, model_type: str, reduce: Any) -> None:
    """Column-split gate/up, row-split down (all-reduced unless ``reduce`` is None: the caller sums)."""
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise QuickdraftError(
            f"tensor parallelism needs separate gate/up projections; {model_type} fuses them (not supported yet)"
        )
    down = mlp.down_proj
    width = int(down.in_features)
    inter = split_points(width, world, _block_size(down), "MLP width")
    i0, i1 = inter[rank], inter[rank + 1]
    mlp.gate_proj = slice_rows(mlp.gate_proj, i0, i1)
    mlp.up_proj = slice_rows(mlp.up_proj, i0, i1)
    local = slice_cols(down, i0, i1, keep_bias=rank == 0)
    mlp.down_proj = local if reduce is None else RowParallel(local, reduce if reduce is not True else None)


class TPKVCache(KVCache):
    """Rank 0's cache: data moves (``compact``) are replayed by the other ranks."""

    tp_id: int
    tp_owner: TPCausalLM
    # the other ranks hold their own slices: a prefix cache reuses this cache by truncation only
    copyable = False

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.tp_owner.send_compact(self, start, keep)
        super().compact(start, keep)


class TPCausalLM(CausalLM):
    """A sharded :class:`CausalLM`; on rank 0 each pass is mirrored by the other ranks."""

    tp_rank: int
    tp_world: int
    tp_kv_heads: int
    tp_group: dist.ProcessGroup | None  # control messages
    tp_ids: itertools.count
    tp_caches: dict[int, KVCache]

    def tp_setup(self, rank: int, world: int, kv_heads: int, group: dist.ProcessGroup | None) -> None:
        self.tp_rank, self.tp_world, self.tp_kv_heads, self.tp_group = rank, world, kv_heads, group
        self.tp_ids = itertools.count(1)
        self.tp_caches = {}

    # ---- rank 0 side ----

    def _send(self, *fields: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.long)
        header[: len(fields)] = torch.tensor(fields, dtype=torch.long)
        dist.broadcast(header, src=0, group=self.tp_group)

    def make_cache(self, max_len: int) -> KVCache:
        cfg = self.config
        if self.tp_rank != 0:  # workers build caches through worker_loop
            return KVCache(cfg.num_hidden_layers, self.tp_kv_heads, cfg.head_dim, max_len, self.dtype, self.device)
        cache = TPKVCache(cfg.num_hidden_layers, self.tp_kv_heads, cfg.head_dim, max_len, self.dtype, self.device)
        cache.tp_id, cache.tp_owner = next(self.tp_ids), self
        self._send(OP_NEW_CACHE, cache.tp_id, max_len)
        weakref.finalize(cache, _free_cache, weakref.ref(self), cache.tp_id)
        return cache

    def send_compact(self, cache: TPKVCache, start: int, keep: torch.Tensor) -> None:
        self._send(OP_COMPACT, cache.tp_id, start, int(keep.numel()))
        dist.broadcast(keep.to(torch.long).cpu().contiguous(), src=0, group=self.tp_group)

    def stop_workers(self) -> None:
        if self.tp_rank == 0 and dist.is_initialized():
            self._send(OP_STOP)

    def run(self, ids: torch.Tensor, step: Step, capture: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rank 0: the pass on this shard, after telling every worker to run it on theirs (one
        sequence's passes: chains and trees; the workers rebuild the same :class:`Step`)."""
        if self.tp_rank == 0:
            cache = step.cache
            if not isinstance(cache, TPKVCache) or cache.tp_owner is not self:
                raise ValueError("a tensor-parallel model runs only with caches from its own make_cache()")
            if step.slots is not None or (step.tree and step.mask is None):  # static shapes, several sequences
                raise ValueError("a tensor-parallel model runs one sequence's passes (chains and trees)")
            t = int(ids.shape[0])
            outputs = step.outputs
            self._send(OP_FORWARD, cache.tp_id, step.start, t, int(step.tree), -1 if outputs is None else len(outputs))
            dist.broadcast(ids.to(torch.long).cpu().contiguous(), src=0, group=self.tp_group)
            dist.broadcast(step.positions.to(torch.long).cpu().contiguous(), src=0, group=self.tp_group)
            if step.tree:
                assert step.mask is not None  # (a tree's mask; Step.of_pass makes it)
                dist.broadcast(step.mask.to(torch.uint8).cpu().contiguous(), src=0, group=self.tp_group)
            if outputs:
                dist.broadcast(torch.tensor(outputs, dtype=torch.long), src=0, group=self.tp_group)
        return super().run(ids, step, capture)  # the model's own


def _free_cache(owner_ref: weakref.ref, cache_id: int) -> None:
    owner = owner_ref()
    if owner is not None and dist.is_initialized():
        try:
            owner._send(OP_FREE_CACHE, cache_id)
        except Exception:  # the group may already be gone at interpreter exit
            pass


def worker_loop(model: TPCausalLM) -> None:
    """Ranks > 0: replay rank 0's passes on this shard until rank 0 sends STOP."""
    group, cfg = model.tp_group, model.config
    caches = model.tp_caches
    while True:
        header = torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, src=0, group=group)
        op, *f = header.tolist()
        if op == OP_STOP:
            return
        if op == OP_NEW_CACHE:
            caches[f[0]] = KVCache(cfg.num_hidden_layers, model.tp_kv_heads, cfg.head_dim, f[1], model.dtype, model.device)
        elif op == OP_FREE_CACHE:
            caches.pop(f[0], None)
        elif op == OP_COMPACT:
            keep = torch.empty(f[2], dtype=torch.long)
            dist.broadcast(keep, src=0, group=group)
            caches[f[0]].compact(f[1], keep)
        elif op == OP_FORWARD:
            cache_id, length, t, tree, n_outputs = f[:5]
            cache = caches[cache_id]
            cache.length = length
            ids = torch.empty(t, dtype=torch.long)
            dist.broadcast(ids, src=0, group=group)
            positions = torch.empty(t, dtype=torch.long)
            dist.broadcast(positions, src=0, group=group)
            mask = None
            if tree:
                m = torch.empty(t, length + t, dtype=torch.uint8)
                dist.broadcast(m, src=0, group=group)
                mask = m.bool().to(model.device)
            outputs: list[int] | None = None if n_outputs < 0 else []
            if n_outputs > 0:
                rows = torch.empty(n_outputs, dtype=torch.long)
                dist.broadcast(rows, src=0, group=group)
                outputs = rows.tolist()
            dev = model.device
            step = Step.reserve(cache, t, positions.to(dev), mask=mask, outputs=outputs)
            super(TPCausalLM, model).run(ids.to(dev), step)
        else:
            raise RuntimeError(f"tensor-parallel worker: unknown op {op}")
