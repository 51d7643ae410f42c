"""Static, preallocated KV cache written by slot.

Slots are filled left to right. A forward pass over T new tokens writes slots
``[length, length + T)`` and then advances ``length``. Rolling back rejected draft tokens is
``truncate(n)``: O(1), because the stale slots are simply overwritten by the next pass.

Worked example (chain speculation, k = 3)::

    before verify:  length = 10   slots 0..9 hold the context
    verify pass:    writes slots 10..13 for [last, d0, d1, d2]; length = 14
    verdict n = 1:  keep last + d0 -> truncate(12); slots 12, 13 are dead and will be overwritten

Models with linear-attention layers (Gated DeltaNet: qwen3_5, qwen3_next) also carry a recurrent
state per sequence, which no slot holds: :class:`HybridCache` composes a :class:`KVCache` and a
:class:`RecurrentState` (each row's state of the last pass, so rollback, ``truncate`` and
``compact``, stays a pointer move within it, and checkpoints at every ``STATE_EVERY``-th position
for the prefix cache) behind the one :class:`SequenceCache` interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from quickdraft.errors import QuickdraftError

Q8_0 = "q8_0"  # --kv-dtype q8_0: keys and values as GGML Q8_0 blocks (32 int8 and an fp16 scale)
KVType = torch.dtype | str  # a torch dtype, or Q8_0
Q8_BLOCK, Q8_BYTES = 32, 34


def kv_value_bytes(kind: KVType) -> float:
    """Bytes one key or value element takes in a cache of this type."""
    if kind == Q8_0:
        return Q8_BYTES / Q8_BLOCK
    assert isinstance(kind, torch.dtype)
    return torch.empty(0, dtype=kind).element_size()


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x float32 [..., D] (D a multiple of 32) -> Q8_0 bytes uint8 [..., D / 32 * 34], as the native
    attention stores rows, bit for bit: per 32 values d = max|x| / 127, q = round-half-even(x * (1 / d))
    (0 where d is 0), then d as fp16 (nearest even) before its 32 q."""
    *lead, d_model = x.shape
    xb = x.to(torch.float32).reshape(*lead, d_model // Q8_BLOCK, Q8_BLOCK)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, torch.div(torch.ones_like(d), d), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    scale = d.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [..., D/32, 2]
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(*lead, d_model // Q8_BLOCK * Q8_BYTES)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes [..., D / 32 * 34] -> float32 [..., D]: q * d, as the native attention reads them."""
    *lead, nbytes = raw.shape
    blocks = raw.reshape(*lead, nbytes // Q8_BYTES, Q8_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [..., D/32, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q * d).reshape(*lead, nbytes // Q8_BYTES * Q8_BLOCK)


State = tuple[torch.Tensor, torch.Tensor]  # a linear-attention layer's (conv window [C, K-1], matrix [Hv, Dk, Dv])


@dataclass(frozen=True)
class KVLayout:
    """Where each layer's keys and values live: storage ``groups`` of one shape each
    ``(layers, kv_heads, head_dim)``, and for every model layer its ``place`` (group, index in
    it). Most models have one group and layer i at (0, i). Models whose layers differ in head
    size or count (Gemma 4's full-attention layers) have one group per shape; a layer that reuses
    an earlier layer's keys and values (Gemma 4's KV sharing) has that layer's place and writes
    nothing (:attr:`writes`)."""

    groups: tuple[tuple[int, int, int], ...]
    places: tuple[tuple[int, int], ...]
    writes: tuple[bool, ...]

    @staticmethod
    def uniform(num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        return KVLayout(((num_layers, num_kv_heads, head_dim),), tuple((0, i) for i in range(num_layers)),
                        (True,) * num_layers)


@dataclass
class CacheSnapshot:
    """A cache's first ``length`` slots (and, for a :class:`HybridCache`, its recurrent states at the
    lengths in ``states``), copied to host memory or viewing a live cache."""

    keys: list[torch.Tensor]  # per storage group [L, Hkv, n, D]
    values: list[torch.Tensor]
    states: dict[int, list[State]] | None = None  # None: no recurrent layers (any length restores)
    nbytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = _nbytes(self.keys + self.values) + sum(
                _nbytes([t for st in s for t in st]) for s in (self.states or {}).values())

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def point(self, m: int) -> int:
        """The longest prefix of at most ``m`` tokens this snapshot can restore."""
        m = min(m, self.length)
        if self.states is None:
            return m
        return max([n for n in self.states if n <= m], default=0)


class SequenceCache(Protocol):
    """What the engine, the prefix cache, the drafters and a :class:`KVPool` use of one sequence's
    cache: :class:`KVCache` (keys and values alone) and :class:`HybridCache` (those and a recurrent
    state beside them) are its two kinds. Rollback and reuse are its methods; what it holds for
    the layers is :attr:`attention` (keys and values) and :attr:`recurrent` (None: no recurrent
    layers)."""

    copyable: bool  # snapshot/restore hold the whole state (a sharded cache's other ranks do not)
    length: int  # tokens held; slots [length, max_len) are free (or dead, after a rollback)

    @property
    def max_len(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes in every layer."""

    @property
    def attention(self) -> KVCache:
        """The keys and values the attention layers write and read."""

    @property
    def recurrent(self) -> RecurrentState | None:
        """The linear-attention layers' recurrent state; None for a model without them."""

    def region(self, base: int, length: int) -> SequenceCache:
        """A cache that IS slots ``[base, base + length)`` of this one (one :class:`KVPool` lane)."""

    def reserve(self, t: int) -> tuple[int, int]:
        """Slots ``[start, end)`` for ``t`` new tokens; raises QuickdraftError when the context is full."""

    def advance(self, t: int) -> None: ...

    def rollback_point(self, m: int) -> int:
        """The longest prefix of at most ``m`` tokens that :meth:`truncate` (or a snapshot) can keep."""

    def hold_from(self, n: int) -> None:
        """Keep every length from ``n`` on that passes end at truncatable, until the next
        :meth:`truncate` (or compact, restore, reset): a caller that runs passes one after another
        and then rolls back among them (a draft model's proposals) holds them first. Keys and
        values are held anyway; a recurrent state otherwise keeps only the last pass's rows."""

    def truncate(self, n: int) -> None:
        r"""Keep the first ``n`` tokens. Keys and values: O(1), a pointer move (later slots are dead
        and get overwritten). A recurrent state is held only at :meth:`rollback_point`\ s: elsewhere
        this raises QuickdraftError and changes nothing. Callers truncate to lengths they know are
        held: the engine to a verified chain's end (the verify pass kept it), the prefix cache and
        drafters to ``rollback_point(m)``. ValueError: ``n`` outside ``[0, length]``."""

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep the last pass's rows ``start + keep[i]`` [n] (a tree path), at ``start + i``."""

    def continue_from(self, source: SequenceCache, row: int) -> None:
        """After :meth:`KVPool.keep` appended rows of ``source``'s last pass, continue after its row ``row``."""

    def reset(self) -> None: ...

    def snapshot(self, n: int, copy: bool = True) -> CacheSnapshot: ...

    def restore(self, snap: CacheSnapshot, n: int) -> None: ...


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class KVCache:
    """Keys and values of every layer: per storage group of its :class:`KVLayout`
    ``[layers, kv_heads, max_len, head_dim]`` each (a q8_0 cache: ``[..., head_dim / 32 * 34]``
    bytes of Q8_0 blocks per slot; :meth:`write` returns them dequantized). ``k_layers[i]`` /
    ``v_layers[i]``: model layer i's ``[Hkv, max_len, D]``."""

    copyable = True  # snapshot/restore hold the whole state (a sharded cache's other ranks do not)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: KVType,
        device: torch.device | str = "cpu",
        layout: KVLayout | None = None,
    ) -> None:
        """One storage group of ``num_layers`` x ``num_kv_heads`` x ``head_dim``, or (``layout``)
        the groups and places it gives (then the first three arguments are not read)."""
        layout = layout or KVLayout.uniform(num_layers, num_kv_heads, head_dim)
        self.kind = dtype
        ks, vs = [], []
        for layers, heads, dim in layout.groups:
            if dtype == Q8_0:
                if dim % Q8_BLOCK:
                    raise QuickdraftError(f"--kv-dtype q8_0 needs a head size that is a multiple of 32, this model's is {dim}")
                shape, elem = (layers, heads, max_len, dim // Q8_BLOCK * Q8_BYTES), torch.uint8
            else:
                assert isinstance(dtype, torch.dtype)
                shape, elem = (layers, heads, max_len, dim), dtype
            ks.append(torch.zeros(shape, dtype=elem, device=device))
            vs.append(torch.zeros(shape, dtype=elem, device=device))
        self._bind(layout, ks, vs)

    def _bind(self, layout: KVLayout, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        self.layout = layout
        self.keys, self.values = ks, vs  # per group [L, Hkv, S, D] (q8_0: bytes)
        # per-layer views [Hkv, S, D], made once (indexing a group tensor costs a torch op per use)
        k_groups, v_groups = [k.unbind(0) for k in ks], [v.unbind(0) for v in vs]
        self.k_layers = [k_groups[g][i] for g, i in layout.places]
        self.v_layers = [v_groups[g][i] for g, i in layout.places]
        self.max_len = ks[0].shape[2]
        self.length = 0

    @property
    def k(self) -> torch.Tensor:
        """All keys ``[L, Hkv, S, D]``, for a cache of one storage group (every layer alike)."""
        if len(self.keys) != 1:
            raise ValueError("this cache's layers differ in shape: read k_layers[i] instead")
        return self.keys[0]

    @property
    def v(self) -> torch.Tensor:
        if len(self.values) != 1:
            raise ValueError("this cache's layers differ in shape: read v_layers[i] instead")
        return self.values[0]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def attention(self) -> KVCache:
        return self

    @property
    def recurrent(self) -> RecurrentState | None:
        return None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type slots are stored in (uint8 for q8_0)."""
        return self.keys[0].dtype

    def region(self, base: int, length: int) -> KVCache:
        """A cache of ``length`` slots that IS slots ``[base, base + length)`` of this one (shared
        storage, its own length): one sequence's part of a :class:`KVPool`."""
        if not (0 <= base and base + length <= self.max_len and length > 0):
            raise ValueError(f"region [{base}, {base + length}) is not inside a cache of {self.max_len} slots")
        view = object.__new__(type(self))
        view.kind = self.kind
        view._bind(self.layout, [k[:, :, base : base + length] for k in self.keys],
                   [v[:, :, base : base + length] for v in self.values])
        return view

    def reserve(self, t: int) -> tuple[int, int]:
        """Slots ``[start, end)`` for ``t`` new tokens; raises when the context is full."""
        start, end = self.length, self.length + t
        if end > self.max_len:
            raise QuickdraftError(
                f"context is full: {end} tokens needed, the cache holds {self.max_len}; "
                "use a shorter prompt, fewer --max-tokens, or a larger --max-context"
            )
        return start, end

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ``[Hkv, T, D]`` at slots ``start..`` and return keys/values up to the end."""
        end = start + k.shape[1]
        kc, vc = self.k_layers[layer], self.v_layers[layer]
        if self.kind == Q8_0:
            kc[:, start:end] = quantize_q8_0(k)
            vc[:, start:end] = quantize_q8_0(v)
        else:
            kc[:, start:end] = k
            vc[:, start:end] = v
        return self.read(layer, end)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values of slots ``[0, end)`` ``[Hkv, end, D]`` (a layer that
        shares another's: that layer's, this pass's rows included once that layer has run)."""
        kc, vc = self.k_layers[layer][:, :end], self.v_layers[layer][:, :end]
        if self.kind == Q8_0:
            return dequantize_q8_0(kc), dequantize_q8_0(vc)
        return kc, vc

    def advance(self, t: int) -> None:
        self.length += t

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots. O(1): later slots are dead and get overwritten. Never fails
        for ``n`` in ``[0, length]`` (ValueError outside)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def move_slots(self, src: torch.Tensor, dst: int) -> None:
        """Copy slots ``src`` [n] of every layer to slots ``[dst, dst + n)`` (a gather first, so the
        ranges may overlap)."""
        n = int(src.numel())
        src = src.to(self.device)
        for k, v in zip(self.keys, self.values, strict=True):
            k[:, :, dst : dst + n] = k.index_select(2, src)
            v[:, :, dst : dst + n] = v.index_select(2, src)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move the slots ``start + keep[i]`` to ``start + i`` and truncate after them (tree paths).

        ``keep`` [n] holds increasing offsets relative to ``start``, so every move goes left or
        stays and an in-place gather is safe.
        """
        self.move_slots(keep.to(self.device) + start, start)
        self.length = start + int(keep.numel())

    def reset(self) -> None:
        self.length = 0

    def rollback_point(self, m: int) -> int:
        """The longest prefix of at most ``m`` slots that :meth:`truncate` (or a :meth:`snapshot` of
        this cache) can keep: any, for keys and values alone."""
        return max(0, min(m, self.length))

    def hold_from(self, n: int) -> None:
        """Nothing to do: keys and values are held at every length."""

    def continue_from(self, source: SequenceCache, row: int) -> None:
        """After :meth:`KVPool.keep` appended rows of ``source``'s last pass to this cache, its state
        is that after pass row ``row``: nothing to do where keys and values are all of it."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes in every layer."""
        return sum(2 * k[:, :, 0].numel() * k.element_size() for k in self.keys)

    def snapshot(self, n: int, copy: bool = True) -> CacheSnapshot:
        """The first ``n`` slots' keys and values, per storage group ``[L, Hkv, n, D]``: a copy in host
        memory (a prefix cache keeps it while this cache serves other sequences), or
        (``copy=False``) views of this cache, to :meth:`restore` into another at once."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot snapshot {n} slots of a cache of length {self.length}")
        ks, vs = [k[:, :, :n] for k in self.keys], [v[:, :, :n] for v in self.values]
        if copy:
            ks, vs = [k.to("cpu", copy=True) for k in ks], [v.to("cpu", copy=True) for v in vs]
        return CacheSnapshot(ks, vs)

    def restore(self, snap: CacheSnapshot, n: int) -> None:
        """Load the first ``n`` slots of a :meth:`snapshot` and truncate after them: the cache is then
        bitwise the state that computed the snapshot had after its first ``n`` tokens."""
        if not 0 <= n <= snap.length or n > self.max_len or snap.point(n) != n:
            raise ValueError(f"cannot restore {n} slots from a snapshot of {snap.length} into a cache of {self.max_len}")
        for k, sk in zip(self.keys, snap.keys, strict=True):
            k[:, :, :n] = sk[:, :, :n]
        for v, sv in zip(self.values, snap.values, strict=True):
            v[:, :, :n] = sv[:, :, :n]
        self.length = n


class KVPool:
    """The KV memory of an engine that runs several sequences at once: one buffer of ``lanes``
    regions of ``lane_len`` slots each (one per running sequence, each a :class:`KVCache` view,
    :meth:`KVCache.region`), then ``staging`` slots.

    A pass over rows of several sequences writes their new keys and values into the staging slots
    (in row order) and each row attends to its own sequence's region slots followed by its own
    staging rows (:class:`~quickdraft.models.layers.RowSlots`): the same keys in the same order as
    when the sequence runs alone, so every row's result is bitwise the same. After the verdict,
    :meth:`keep` copies each sequence's kept rows from staging to the end of its region.
    """

    def __init__(self, buffer: SequenceCache, lanes: int, lane_len: int, staging: int) -> None:
        if lanes * lane_len + staging > buffer.max_len:
            raise ValueError(f"{lanes} lanes of {lane_len} slots and {staging} staging slots do not fit {buffer.max_len}")
        self.buffer = buffer
        self.lane_len = lane_len
        self.staging_start = lanes * lane_len
        self.staging = staging
        self.lanes = [buffer.region(i * lane_len, lane_len) for i in range(lanes)]
        # position held by each region slot: slot j of a lane holds position j
        self._region_pos = torch.arange(lane_len, device=buffer.device).repeat(lanes)

    def base(self, lane: int) -> int:
        """The buffer slot where lane ``lane``'s region starts."""
        return lane * self.lane_len

    def begin_pass(self, rows: int) -> None:
        """Point the buffer's writes at the staging slots for a pass of ``rows`` rows."""
        if rows > self.staging:
            raise ValueError(f"a pass of {rows} rows does not fit {self.staging} staging slots")
        self.buffer.length = self.staging_start

    def slot_positions(self, positions: torch.Tensor, held: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The position every buffer slot up to a staged pass's end holds [staging_start + T]:
        slot j of a lane holds position j, except for the lanes in ``held`` {lane: the positions
        of its first n slots} (a sequence whose cache skipped positions), then the pass's rows."""
        region = self._region_pos
        if held:
            region = region.clone()
            for lane, pos in held.items():
                region[self.base(lane) : self.base(lane) + pos.numel()] = pos.to(region.device)
        return torch.cat([region, positions.to(region.device)])

    def visible(self, lane: int, committed: int, staged: list[torch.Tensor]) -> list[torch.Tensor]:
        """Buffer slots each staged row of lane ``lane`` attends to, row by row: the lane's first
        ``committed`` slots, then its own rows of the pass ``staged[j]`` (offsets into this pass's
        staging slots, in position order)."""
        base = self.base(lane)
        prefix = torch.arange(base, base + committed, device=self.buffer.device)
        return [torch.cat([prefix, own.to(prefix.device) + self.staging_start]) for own in staged]

    def keep(self, lane: int, staged: torch.Tensor) -> None:
        """Append the staged rows ``staged`` [n] (offsets into this pass's staging slots, in the
        order they join the sequence) to lane ``lane``'s region."""
        cache = self.lanes[lane]
        n = int(staged.numel())
        start, _ = cache.reserve(n)
        self.buffer.attention.move_slots(staged.to(self.buffer.device) + self.staging_start, self.base(lane) + start)
        cache.advance(n)
        if n:
            cache.continue_from(self.buffer, int(staged[-1]))  # the pass's rows are its staging slots

    @property
    def nbytes(self) -> int:
        return self.buffer.max_len * self.buffer.bytes_per_token


# A HybridCache keeps its recurrent state at every multiple of this many tokens it passes ...
STATE_EVERY = 64
MAX_CHECKPOINTS = 32  # ... the first this many (a shared system prompt, a preamble: what prefixes share)


@dataclass(frozen=True)
class RecurrentShape:
    """The recurrent state of a model's linear-attention layers (Gated DeltaNet)."""

    layers: int  # linear-attention layers
    conv_channels: int  # the short convolution's channels (q, k and v)
    conv_width: int  # inputs it remembers: kernel size - 1
    heads: int  # value heads
    key_dim: int
    value_dim: int

    def zeros(self, device: torch.device | str, dtype: torch.dtype) -> list[State]:
        """The state of the empty prefix."""
        return [(torch.zeros(self.conv_channels, self.conv_width, dtype=dtype, device=device),
                 torch.zeros(self.heads, self.key_dim, self.value_dim, dtype=dtype, device=device))
                for _ in range(self.layers)]


class RecurrentState:
    """The recurrent state of a hybrid model's linear-attention layers for one sequence, which no
    KV slot holds (its own store, composed beside the keys and values by :class:`HybridCache`).

    A pass records its rows' states per layer (:meth:`begin_rows`, :meth:`record`); each row
    continues its parent's (the pass row before it on its path, or the state at the pass's start).
    Only the rows a caller can reach are kept (:meth:`kept_rows`: the rows the pass returns, its
    last rows and the checkpoints it crosses); a prefill chunk's other rows leave no state.
    Rolling back is then a pointer move, as for keys and values: :meth:`truncate` to a length the
    last pass reached along a chain (or its start), :meth:`keep_path` to a tree path's last row,
    :meth:`continue_from` to a row of a :class:`KVPool` pass. Further back the state is known only
    at the checkpoints (every STATE_EVERY tokens) and at 0: :meth:`rollback_point` says where.
    A caller that runs passes in turn and rolls back among them :meth:`hold_from` s the lengths
    first: the state each pass starts from is kept too, until the next truncate.
    States are never changed in place, so rows, checkpoints and snapshots share tensors freely.
    """

    def __init__(self, shape: RecurrentShape, dtype: torch.dtype, device: torch.device | str) -> None:
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self.clear()

    def clear(self) -> None:
        """The state of the empty prefix, no pass, no checkpoints."""
        self._base: list[State] | None = None  # the state at _base_len (None: zeros)
        self._base_len = 0
        self._base_known = True  # False: a pool's buffer, whose rows continue their lanes' states
        self._parents: list[int] = []  # the last pass's rows' parents (-1: the state at _pass_start) ...
        self._chain = 0  # ... how many of them, from the first, form a chain from the pass's start ...
        self._pass_start = 0
        self._kept: list[bool] = []  # ... which of them keep their states ...
        self._rows: list[list[State | None]] = []  # ... and those states, per layer (None: not kept)
        self.checkpoints: dict[int, list[State]] = {}
        self._release()

    def _release(self) -> None:
        self._held_from: int | None = None  # hold_from's length (None: no hold) ...
        self._held: dict[int, list[State]] = {}  # ... and the states held since, by length

    def hold_from(self, n: int) -> None:
        """Keep the state at ``n`` (where it is held) and at every later base (each next pass's
        start, a pool lane's continued row) until :meth:`truncate`; raises QuickdraftError where
        the state at ``n`` is not held."""
        found, states = self._state_at(n)
        if not found:
            raise QuickdraftError(f"cannot hold a recurrent state at {n} tokens: it holds {self.rollback_point(n)}")
        self._held_from, self._held = n, ({n: states} if states is not None else {})

    # -------------------------------------------------------------- a pass

    def begin_rows(self, start: int, parents: list[int], outputs: list[int] | None = None) -> None:
        """A pass over ``len(parents)`` rows starts after ``start`` tokens: row i continues the state
        of row ``parents[i]`` (< i), or -1: the state at ``start``. ``outputs``: the rows whose
        results the pass returns (None: all), the rows a caller may continue or roll back to."""
        if self._parents:  # the previous pass left no verdict (a prefill's chunks): settle it
            self._settle(start, strict=False)
        self._pass_start, self._parents = start, list(parents)
        self._chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
        self._rows = []
        t = len(parents)
        kept = [outputs is None] * t
        for i in outputs or ():
            kept[i] = True
        for i, p in enumerate(parents):  # leaves, and rows continued out of order
            if p >= 0 and p != i - 1:
                kept[p] = True
            if i + 1 == t or parents[i + 1] != i:
                kept[i] = True
        for i in range(min(self._chain, t)):  # the checkpoints the chain crosses
            if (start + i + 1) % STATE_EVERY == 0:
                kept[i] = True
        self._kept = kept

    def kept_rows(self) -> list[bool]:
        """Which rows of the current pass keep their state (the others' the layer may drop)."""
        return self._kept

    def state(self, layer: int) -> State:
        """Linear-attention layer ``layer``'s state at the start of the current pass."""
        if not self._base_known:
            raise QuickdraftError("this cache's recurrent state is unknown (a pool buffer's rows continue their lanes')")
        if self._base is None:
            self._base = self.shape.zeros(self.device, self.dtype)
        return self._base[layer]

    def record(self, layer: int, states: list[State | None]) -> None:
        """The states after each row of the current pass, for the next linear-attention layer in
        turn: those of :meth:`kept_rows`, None for the others."""
        assert layer == len(self._rows) and len(states) == len(self._parents)
        assert all((s is not None) == k for s, k in zip(states, self._kept, strict=True)), "kept rows only"
        self._rows.append(states)

    def row_states(self, row: int) -> list[State]:
        if not self._kept[row]:
            raise QuickdraftError(f"row {row} of the last pass kept no recurrent state (only the rows it returned do)")
        return [s for layer in self._rows if (s := layer[row]) is not None]

    # -------------------------------------------------------------- moving the state

    def _chain_end(self, n: int) -> int | None:
        """The last pass's row whose state is the one after ``n`` tokens, if its rows up to it are a
        chain from the pass's start; -1: the start itself; None: none."""
        j = n - self._pass_start - 1
        return j if self._complete() and -1 <= j < self._chain and (j < 0 or self._kept[j]) else None

    def _complete(self) -> bool:
        """Whether a pass's rows are all recorded (every linear-attention layer's)."""
        return bool(self._parents) and len(self._rows) == self.shape.layers

    def _state_at(self, n: int) -> tuple[bool, list[State] | None]:
        """(found, the state after ``n`` tokens) from what the store holds."""
        j = self._chain_end(n)
        if j is not None and j >= 0:
            return True, self.row_states(j)
        if self._base_known and n == (self._pass_start if self._parents else self._base_len):
            return True, self._base
        if n in self.checkpoints:
            return True, self.checkpoints[n]
        if n in self._held:
            return True, self._held[n]
        return n == 0, None

    def _settle(self, n: int, strict: bool = True) -> None:
        """Make the state at ``n`` the base (checkpointing the pass's rows at STATE_EVERY multiples)."""
        found, states = self._state_at(n)
        if not found and strict:
            raise QuickdraftError(
                f"cannot roll a recurrent state back to {n} tokens: this cache holds it only at "
                f"{self.rollback_point(n)} (the last pass's rows and every {STATE_EVERY}th token)"
            )
        if self._complete():  # the multiples of STATE_EVERY its chain rows reached
            first = (self._pass_start // STATE_EVERY + 1) * STATE_EVERY
            for at in range(first, min(n, self._pass_start + self._chain) + 1, STATE_EVERY):
                self._checkpoint(at, self.row_states(at - self._pass_start - 1))
        self._set_base(states if found else None, n, known=found)

    def _set_base(self, states: list[State] | None, n: int, known: bool = True) -> None:
        self._base, self._base_len, self._base_known = states, n, known
        self._parents, self._rows, self._chain, self._kept = [], [], 0, []
        self.checkpoints = {c: s for c, s in self.checkpoints.items() if c <= n}
        self._held = {c: s for c, s in self._held.items() if c <= n}
        if known and states is not None and self._held_from is not None and n >= self._held_from:
            self._held[n] = states
        if known and states is not None and n % STATE_EVERY == 0:
            self._checkpoint(n, states)

    def _checkpoint(self, n: int, states: list[State]) -> None:
        if n > 0 and (n in self.checkpoints or len(self.checkpoints) < MAX_CHECKPOINTS):
            self.checkpoints[n] = states

    def rollback_point(self, m: int) -> int:
        """The longest prefix of at most ``m`` tokens (``m`` at most the cache's length) whose state
        this store holds: 0, a checkpoint, the last pass's start or one of its kept chain rows."""
        known = [0, *self.checkpoints, *self._held]
        if self._parents:
            if self._complete():
                known += [self._pass_start + j + 1 for j in range(self._chain) if self._kept[j]]
            if self._base_known:
                known.append(self._pass_start)
        elif self._base_known:
            known.append(self._base_len)
        return max(n for n in known if n <= m)

    def truncate(self, n: int) -> None:
        """Make the state after ``n`` tokens current; raises QuickdraftError (changing nothing)
        where :meth:`rollback_point` ``(n) != n``; ends a :meth:`hold_from`."""
        self._settle(n)
        self._release()

    def keep_path(self, start: int, path: list[int]) -> None:
        """Continue from the last pass's row ``path[-1]`` (a tree path from the pass's start at
        ``start``; empty: the start itself); raises QuickdraftError (changing nothing) where the
        last pass did not start at ``start`` or that row kept no state."""
        if not self._complete() or start != self._pass_start:
            raise QuickdraftError("compact() keeps rows of the last pass; this cache has none from that start")
        states = self.row_states(path[-1]) if path else self._base
        self._release()
        self._set_base(states, start + len(path), known=self._base_known or bool(path))

    def continue_from(self, source: RecurrentState, row: int, n: int) -> None:
        """The state after ``n`` tokens is that after ``source``'s last-pass row ``row``."""
        self._set_base(source.row_states(row), n)

    # -------------------------------------------------------------- copies

    def snapshot(self, n: int, copy: bool = True) -> dict[int, list[State]]:
        """The states a snapshot of the first ``n`` tokens keeps: the checkpoints up to ``n`` and
        the state at ``n`` where it is held; copies in host memory, or (``copy=False``) shared."""
        found, at_n = self._state_at(n)
        states = {c: s for c, s in self.checkpoints.items() if c <= n}
        if found:
            states[n] = at_n if at_n is not None else self.shape.zeros(self.device, self.dtype)
        if copy:
            states = {c: [(a.to("cpu", copy=True), b.to("cpu", copy=True)) for a, b in s] for c, s in states.items()}
        return states

    def restore(self, states: dict[int, list[State]], n: int) -> None:
        """Load the state after ``n`` tokens (which ``states`` holds) and the checkpoints before it."""
        device = self.device
        self.checkpoints = {}
        self._release()
        for c, s in sorted(states.items()):
            if c < n and c % STATE_EVERY == 0:
                self._checkpoint(c, [(a.to(device), b.to(device)) for a, b in s])
        self._set_base([(a.to(device), b.to(device)) for a, b in states[n]] if n else None, n)


class HybridCache:
    """A hybrid model's cache: the keys and values of its attention layers (:attr:`attention`, a
    :class:`KVCache`) and the recurrent state of its linear-attention layers (:attr:`recurrent`, a
    :class:`RecurrentState`), composed behind the one :class:`SequenceCache` interface, as
    llama.cpp's ``llama_memory_hybrid`` composes its KV cache and ``llama_memory_recurrent``.
    Every move (truncate, compact, continue_from, snapshot, restore) goes to both; a recurrent
    state can be rolled back only where it is held (:meth:`rollback_point`)."""

    copyable = True

    def __init__(self, attention: KVCache, recurrent: RecurrentState) -> None:
        self._attention, self._recurrent = attention, recurrent

    @property
    def attention(self) -> KVCache:
        return self._attention

    @property
    def recurrent(self) -> RecurrentState:
        return self._recurrent

    @property
    def length(self) -> int:
        return self._attention.length

    @length.setter
    def length(self, n: int) -> None:
        self._attention.length = n

    @property
    def max_len(self) -> int:
        return self._attention.max_len

    @property
    def device(self) -> torch.device:
        return self._attention.device

    @property
    def bytes_per_token(self) -> int:
        return self._attention.bytes_per_token

    def region(self, base: int, length: int) -> HybridCache:
        """Slots ``[base, base + length)`` of the keys and values, with a recurrent state of its own."""
        rec = self._recurrent
        return HybridCache(self._attention.region(base, length), RecurrentState(rec.shape, rec.dtype, rec.device))

    def reserve(self, t: int) -> tuple[int, int]:
        return self._attention.reserve(t)

    def advance(self, t: int) -> None:
        self._attention.advance(t)

    def rollback_point(self, m: int) -> int:
        return self._recurrent.rollback_point(max(0, min(m, self.length)))

    def hold_from(self, n: int) -> None:
        self._recurrent.hold_from(n)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self._recurrent.truncate(n)  # first: it may refuse, and then nothing has changed
        self._attention.truncate(n)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self._recurrent.keep_path(start, keep.tolist())  # first: it may refuse
        self._attention.compact(start, keep)

    def continue_from(self, source: SequenceCache, row: int) -> None:
        if source.recurrent is None:
            raise ValueError("a hybrid cache continues rows of another hybrid cache only")
        self._recurrent.continue_from(source.recurrent, row, self.length)

    def reset(self) -> None:
        self._attention.reset()
        self._recurrent.clear()

    def snapshot(self, n: int, copy: bool = True) -> CacheSnapshot:
        snap = self._attention.snapshot(n, copy)
        return CacheSnapshot(snap.keys, snap.values, self._recurrent.snapshot(n, copy))

    def restore(self, snap: CacheSnapshot, n: int) -> None:
        if snap.states is None:
            raise ValueError("a snapshot without recurrent states cannot restore a hybrid model's cache")
        self._attention.restore(snap, n)
        self._recurrent.restore(snap.states, n)
