"""One forward pass as every layer sees it: :class:`Step` (which rows, where their keys and values go,
what each row sees) and the attention backend that pass runs on.

The backend is chosen once per pass (:meth:`Step.backend`), from the pass's shape, the cache and
the kernels; the attention layers call it through one method and never branch on the mode:

* :class:`StaticSlots`: static shapes for CUDA graphs (``Step.slots``): keys written by slot
  tensor, every row over the first L slots under its mask;
* :class:`NativeFused`: the native kernels' fused cache write and attention (CPU fp32, a cache
  type they read), batch invariant by construction;
* :class:`RowByRow`: each row alone over exactly the slots it sees, as a decode step would
  (batch invariant: :mod:`~quickdraft.models.batch_invariance`);
* :class:`WholePass`: one SDPA call under the pass's mask (long passes: fast, not invariant).

A layer tells the backend what it computes through :class:`AttentionLayer`: its heads, scale,
which slots a row sees (``window``, ``chunk``), whether the native kernel computes its variant
(``native``) and its SDPA core (``sdpa``: GPT-OSS adds sinks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from quickdraft.cache import SequenceCache
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS, NATIVE_CHAIN_ROWS, invariant_pass
from quickdraft.quant.ggml import active_kernels

_NATIVE_KV = (torch.float32, torch.float16, torch.uint8)  # cache types the native attention reads (uint8: q8_0)


def fused_ops(x: torch.Tensor, param: torch.Tensor) -> Any | None:
    """The native kernels' fused ops (``rms_norm``, ``rope``, ``attend``) when they apply to ``x``:
    fp32 CPU tensors outside autograd (inference passes; training takes the differentiable torch
    path), the kernels built and not disabled. Else None: the torch formulas."""
    if x.dtype is not torch.float32 or param.dtype is not torch.float32 or not x.is_cpu or torch.is_grad_enabled():
        return None
    return active_kernels()


def causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor | None:
    """``[T, start + T]`` mask where query i sees slots ``<= start + i``; None when T == 1."""
    if t == 1:
        return None
    cols = torch.arange(start + t, device=device)
    rows = torch.arange(start, start + t, device=device)
    return cols.unsqueeze(0) <= rows.unsqueeze(1)


@dataclass(frozen=True)
class RowSlots:
    """What each row of a pass sees, row by row: a tree's rows (:class:`Step` builds them from its
    mask) or, given instead of a mask, a pass over rows of several sequences
    (:class:`~quickdraft.cache.KVPool`), one sequence's rows being such a pass of one. ``slots[i]`` [n_i]: the cache slots row i
    attends to, in position order (its sequence's committed slots, then its own rows of this pass
    that it may see); ``slot_pos`` [start + T]: the position each slot holds. A row's result is
    bitwise what the same row computes alone over its sequence's own cache (same keys, same order).
    ``lanes`` [T]: each row's sequence cache, whose recurrent state (linear-attention layers,
    :class:`~quickdraft.cache.HybridCache`) a row with no earlier row of its own in the pass continues."""

    slots: list[torch.Tensor]
    slot_pos: torch.Tensor | None = None  # None: committed slot j holds position j, the pass's slots its positions
    lanes: list[SequenceCache] | None = None


class AttentionLayer(Protocol):
    """What an attention backend reads of the layer it serves."""

    nh: int  # query heads
    hd: int  # head size
    scale: float
    window: int | None  # sliding window: a row sees the last ``window`` positions (itself included)
    chunk: int | None  # chunked attention: a row sees the earlier positions of its chunk only
    native: bool  # the native fused kernel computes this layer's attention

    def sink_logits(self) -> torch.Tensor | None:
        """[Hq] a learned sink logit per head (GPT-OSS: a key of value zero in each softmax), or None."""

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q ``[Hq, T, D]`` over k, v ``[Hkv, S, D]`` under ``mask`` [T, S] -> ``[Hq, T, D]``."""


class AttentionBackend(Protocol):
    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               index: int, step: Step) -> torch.Tensor:
        """Write this pass's ``k, v`` ``[Hkv, T, D]`` into cache layer ``index`` (None: a layer
        that reuses another's, already written) and attend with q ``[Hq, T, D]`` -> ``[T, Hq * D]``."""


def _heads_last(layer: AttentionLayer, out: torch.Tensor) -> torch.Tensor:
    """``[Hq, T, D]`` -> ``[T, Hq * D]`` (what o_proj takes)."""
    return out.transpose(0, 1).reshape(out.shape[1], layer.nh * layer.hd)


def _keys_values(step: Step, index: int, k: torch.Tensor | None, v: torch.Tensor | None,
                 t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This pass's keys and values written (when given) and cache layer ``index``'s up to the pass's end."""
    cache = step.cache.attention
    if k is not None and v is not None:
        return cache.write(index, step.start, k, v)  # [Hkv, S, D]
    return cache.read(index, step.start + t)


class StaticSlots:
    """Static shapes, no host-side decisions (CUDA graphs): keys and values written at
    ``step.slots``, each row over the first L slots under ``step.mask`` [T, L]."""

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               index: int, step: Step) -> torch.Tensor:
        cache = step.cache.attention
        kc, vc = cache.k_layers[index], cache.v_layers[index]
        assert step.slots is not None and step.mask is not None
        if k is not None and v is not None:
            kc.index_copy_(1, step.slots, k.to(kc.dtype))
            vc.index_copy_(1, step.slots, v.to(vc.dtype))
        n = step.mask.shape[1]
        return _heads_last(layer, layer.sdpa(q, kc[:, :n].to(q.dtype), vc[:, :n].to(q.dtype), step.mask))


class WholePass:
    """One SDPA call over the whole pass under its mask (the layer's window or chunk applied)."""

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               index: int, step: Step) -> torch.Tensor:
        keys, values = _keys_values(step, index, k, v, q.shape[1])
        mask: torch.Tensor | None
        if layer.chunk is not None:
            mask = step.chunked(layer.chunk)
        else:
            mask = step.mask if layer.window is None else step.windowed(layer.window)[0]
        return _heads_last(layer, layer.sdpa(q, keys, values, mask))


class RowByRow:
    """Each row alone over exactly the slots it may see, as one decode-shaped call: the call plain
    decoding makes for that token (same keys, same length), so its result is bitwise the same
    whatever other rows share the pass."""

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               index: int, step: Step) -> torch.Tensor:
        t = q.shape[1]
        keys, values = _keys_values(step, index, k, v, t)
        rows = [self._row(layer, q, keys, values, step, i) for i in range(t)]
        return _heads_last(layer, rows[0] if t == 1 else torch.cat(rows, dim=1))

    @staticmethod
    def _row(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
             i: int) -> torch.Tensor:
        seen = step.rows
        if layer.chunk is not None:
            pos = step.position_list()[i]
            if seen is None:  # a chain: slots and positions advance together, the chunk's slots up to its own
                end = step.start + i + 1
                lo = max(0, end - 1 - pos % layer.chunk)
                return layer.sdpa(q[:, i : i + 1], k[:, lo:end], v[:, lo:end], None)
            idx = seen.slots[i]
            idx = idx[step.slot_positions()[idx] // layer.chunk == pos // layer.chunk]
        elif seen is None:  # a chain: row i sees every slot up to its own (the last `window`)
            end = step.start + i + 1
            lo = 0 if layer.window is None else max(0, end - layer.window)
            return layer.sdpa(q[:, i : i + 1], k[:, lo:end], v[:, lo:end], None)
        else:
            rows = seen.slots if layer.window is None else step.windowed(layer.window)[1]
            assert rows is not None
            idx = rows[i]  # tree: prefix + ancestors + self, in slot order
        return layer.sdpa(q[:, i : i + 1], k.index_select(1, idx), v.index_select(1, idx), None)


ROW_BY_ROW = RowByRow()
WHOLE_PASS = WholePass()
STATIC_SLOTS = StaticSlots()


class NativeFused:
    """The native kernels' cache write and attention in one call (decode and verify rows, prefill
    chains); a layer whose variant they do not compute (``native`` False) runs row by row."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               index: int, step: Step) -> torch.Tensor:
        if not layer.native:
            return ROW_BY_ROW.attend(layer, q, k, v, index, step)
        cache = step.cache.attention
        slots, offsets = step.flat_slots(layer.window)
        return self.ops.attend(
            q, cache.k_layers[index], cache.v_layers[index], step.start, layer.window or 0, layer.scale,
            slots, offsets, k, v, layer.sink_logits(),
        )  # [T, Hq * D]


@dataclass
class Step:
    """What every layer of one forward pass shares: where to write and what each query sees."""

    positions: torch.Tensor  # [T] long, RoPE positions
    start: int  # first cache slot written by this pass
    mask: torch.Tensor | None  # [T, start + T] bool (True = may attend), None = every slot up to the end
    cache: SequenceCache
    tree: bool = False  # mask is not causal: short passes gather each row's visible slots
    # What each row sees, row by row (None: a chain): a tree's rows (from ``mask``, for passes of up to
    # BLOCKED_MAX_ROWS rows) or a pass over rows of several sequences (given, no mask).
    rows: RowSlots | None = None
    # Static shapes (CUDA graphs, :meth:`Step.static`): the cache slots [T] this pass
    # writes; ``mask`` is then [T, L] over the first L slots, and no step depends on host values.
    slots: torch.Tensor | None = None
    # What every layer takes besides the hidden state, computed once per pass by
    # :meth:`CausalLM.layer_inputs` (Gemma 4's per-layer embeddings [T, layers, P]); None for most models.
    layer_inputs: torch.Tensor | None = None
    # The rows whose results the pass returns (None: every row): the only rows a caller can continue
    # or roll back to, so the only ones whose recurrent state a hybrid model's cache must keep.
    outputs: list[int] | None = None
    # The longest chain on the batch-invariant path (CausalLM.chain_rows: a family whose attention
    # takes long passes the plain way says BLOCKED_MAX_ROWS).
    chain_rows: int = NATIVE_CHAIN_ROWS
    _backend: AttentionBackend | None = field(default=None, repr=False)
    _parents: list[int] | None = field(default=None, repr=False)
    _positions: list[int] | None = field(default=None, repr=False)
    _windows: dict[int, tuple[torch.Tensor | None, list[torch.Tensor] | None]] = field(
        default_factory=dict, repr=False
    )
    _chunks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _flat: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.tree and self.mask is not None and self.mask.shape[0] <= BLOCKED_MAX_ROWS:
            self.rows = RowSlots([row.nonzero().squeeze(1) for row in self.mask])  # once per pass, not per layer

    @classmethod
    def of_pass(
        cls, cache: SequenceCache, start: int, positions: torch.Tensor, mask: torch.Tensor | None = None,
        rows: RowSlots | None = None, chain_rows: int = NATIVE_CHAIN_ROWS,
    ) -> Step:
        """The description of a pass over ``positions`` [T] from cache slot ``start``: a chain (no
        ``mask``, no ``rows``: causal), a tree (``mask`` [T, start + T]) or rows that each see the
        slots ``rows`` lists (a pass over several sequences; at most BLOCKED_MAX_ROWS rows)."""
        t = positions.shape[0]
        if rows is not None:
            if t > BLOCKED_MAX_ROWS or mask is not None or len(rows.slots) != t:
                raise ValueError(f"a pass with explicit row slots takes one list per row, no mask, at most {BLOCKED_MAX_ROWS} rows")
            return cls(positions=positions, start=start, mask=None, cache=cache, tree=True, rows=rows,
                       chain_rows=chain_rows)
        tree = mask is not None
        if mask is None:
            mask = causal_mask(start, t, positions.device)
        return cls(positions=positions, start=start, mask=mask, cache=cache, tree=tree, chain_rows=chain_rows)

    @classmethod
    def reserve(
        cls, cache: SequenceCache, t: int, positions: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
        rows: RowSlots | None = None, outputs: list[int] | None = None,
    ) -> Step:
        """The pass that writes the next ``t`` slots of ``cache`` (reserved here; the model advances the
        cache after it): at ``positions`` [t] (default: the slots themselves), a chain, a tree (``mask``)
        or rows of several sequences (``rows``), as :meth:`of_pass` says; ``outputs``: the rows whose
        logits the pass returns (None: every row; []: none)."""
        start, end = cache.reserve(t)
        if positions is None:
            positions = torch.arange(start, end, device=cache.device)
        step = cls.of_pass(cache, start, positions, mask, rows)
        step.outputs = outputs
        return step

    @classmethod
    def static(cls, cache: SequenceCache, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> Step:
        """A pass with static shapes and no host-side decisions (CUDA graphs): it writes cache ``slots``
        [T] at ``positions`` [T] and row i sees slot j of the first L slots where ``mask`` [T, L] is True.
        It leaves ``cache.length`` alone (the caller advances it) and returns every row's logits."""
        return cls(positions=positions, start=0, mask=mask, cache=cache, slots=slots)

    def backend(self, q: torch.Tensor) -> AttentionBackend:
        """The attention backend of this pass (chosen at its first attention layer, from its query
        ``q``'s type: every layer's is the same)."""
        if self._backend is None:
            self._backend = self._choose_backend(q)
        return self._backend

    def _choose_backend(self, q: torch.Tensor) -> AttentionBackend:
        if self.slots is not None:
            return STATIC_SLOTS
        t = q.shape[1]
        if not invariant_pass(t, chain=not self.tree) or (not self.tree and t > self.chain_rows):
            return WHOLE_PASS
        if self.cache.attention.storage_dtype in _NATIVE_KV and (ops := fused_ops(q, q)) is not None:
            return NativeFused(ops)
        return ROW_BY_ROW

    def row_parents(self) -> list[int]:
        """For each row, the row of this pass just before it on its path (-1: none; it continues its
        sequence's state before the pass): what a recurrent layer's state follows. Once per pass."""
        if self._parents is None:
            if self.slots is not None:
                raise ValueError("recurrent layers do not run in static-shape passes")
            if self.rows is None:  # a chain
                self._parents = list(range(-1, self.positions.shape[0] - 1))
            else:  # this pass's rows a row sees are its ancestors, then itself (slot order)
                own = [idx[idx >= self.start] for idx in self.rows.slots]
                self._parents = [int(o[-2]) - self.start if o.numel() > 1 else -1 for o in own]
        return self._parents

    def state_cache(self, row: int) -> SequenceCache:
        """The cache whose recurrent state row ``row`` continues when it has no parent in the pass."""
        lanes = None if self.rows is None else self.rows.lanes
        return lanes[row] if lanes is not None else self.cache

    def position_list(self) -> list[int]:
        """``positions`` as Python ints (once per pass)."""
        if self._positions is None:
            self._positions = self.positions.tolist()
        return self._positions

    def slot_positions(self) -> torch.Tensor:
        """Position of every cache slot this pass can see [start + T] (sliding windows and
        chunked attention cut by position)."""
        if self.rows is not None and self.rows.slot_pos is not None:
            return self.rows.slot_pos
        before = torch.arange(self.start, device=self.positions.device, dtype=self.positions.dtype)
        return torch.cat([before, self.positions])

    def flat_slots(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Tree rows' visible slots as one flat tensor and row offsets [T + 1] (the native
        attention's input), for a window size or None; (None, None) for chains. Once per pass."""
        if self.rows is None:
            return None, None
        key = -1 if window is None else window
        if key not in self._flat:
            rows = self.rows.slots if window is None else self.windowed(window)[1]
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
            if self.mask is not None or self.rows is None:
                near = slot_pos.unsqueeze(0) > self.positions.unsqueeze(1) - size  # [T, start + T]
                mask = near if self.mask is None else self.mask & near
            rows = None
            if self.rows is not None:
                rows = [idx[slot_pos[idx] > p - size] for idx, p in zip(self.rows.slots, self.positions.tolist(), strict=True)]
            self._windows[size] = (mask, rows)
        return self._windows[size]

    def chunked(self, chunk: int) -> torch.Tensor:
        """The pass's mask [T, start + T] restricted to each query's chunk of ``chunk`` positions
        (chunked attention). Once per pass and size."""
        if chunk not in self._chunks:
            same = (self.slot_positions().unsqueeze(0) // chunk) == (self.positions.unsqueeze(1) // chunk)
            self._chunks[chunk] = same if self.mask is None else same & self.mask
        return self._chunks[chunk]
