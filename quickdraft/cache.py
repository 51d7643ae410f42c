"""Static, preallocated KV cache written by slot.

Slots are filled left to right. A forward pass over T new tokens writes slots
``[length, length + T)`` and then advances ``length``. Rolling back rejected draft tokens is
``truncate(n)``: O(1), because the stale slots are simply overwritten by the next pass.

Worked example (chain speculation, k = 3)::

    before verify:  length = 10   slots 0..9 hold the context
    verify pass:    writes slots 10..13 for [last, d0, d1, d2]; length = 14
    verdict n = 1:  keep last + d0 -> truncate(12); slots 12, 13 are dead and will be overwritten
"""

from __future__ import annotations

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


class KVCache:
    """Keys and values of every layer, ``[layers, kv_heads, max_len, head_dim]`` each (a q8_0 cache:
    ``[..., head_dim / 32 * 34]`` bytes of Q8_0 blocks per slot; :meth:`write` returns them dequantized)."""

    copyable = True  # snapshot/restore hold the whole state (a sharded cache's other ranks do not)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: KVType,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kind = dtype
        if dtype == Q8_0:
            if head_dim % Q8_BLOCK:
                raise QuickdraftError(f"--kv-dtype q8_0 needs a head size that is a multiple of 32, this model's is {head_dim}")
            shape = (num_layers, num_kv_heads, max_len, head_dim // Q8_BLOCK * Q8_BYTES)
            dtype = torch.uint8
        else:
            shape = (num_layers, num_kv_heads, max_len, head_dim)
        assert isinstance(dtype, torch.dtype)
        self._bind(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def _bind(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k  # [L, Hkv, S, D] (q8_0: bytes)
        self.v = v  # [L, Hkv, S, D]
        # per-layer views [Hkv, S, D], made once (indexing self.k[layer] costs a torch op per use)
        self.k_layers = self.k.unbind(0)
        self.v_layers = self.v.unbind(0)
        self.max_len = k.shape[2]
        self.length = 0

    def region(self, base: int, length: int) -> KVCache:
        """A cache of ``length`` slots that IS slots ``[base, base + length)`` of this one (shared
        storage, its own length): one sequence's part of a :class:`KVPool`."""
        if not (0 <= base and base + length <= self.max_len and length > 0):
            raise ValueError(f"region [{base}, {base + length}) is not inside a cache of {self.max_len} slots")
        view = object.__new__(type(self))
        view.kind = self.kind
        view._bind(self.k[:, :, base : base + length], self.v[:, :, base : base + length])
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
        if self.kind == Q8_0:
            self.k[layer, :, start:end] = quantize_q8_0(k)
            self.v[layer, :, start:end] = quantize_q8_0(v)
            return dequantize_q8_0(self.k[layer, :, :end]), dequantize_q8_0(self.v[layer, :, :end])
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]  # [Hkv, end, D]

    def advance(self, t: int) -> None:
        self.length += t

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots. O(1): later slots are dead and get overwritten."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move the slots ``start + keep[i]`` to ``start + i`` and truncate after them (tree paths).

        ``keep`` [n] holds increasing offsets relative to ``start``, so every move goes left or
        stays and an in-place gather is safe.
        """
        n = int(keep.numel())
        src = keep.to(self.k.device) + start
        self.k[:, :, start : start + n] = self.k.index_select(2, src)
        self.v[:, :, start : start + n] = self.v.index_select(2, src)
        self.length = start + n

    def reset(self) -> None:
        self.length = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes in every layer."""
        num_layers, num_kv_heads, _, head_dim = self.k.shape
        return 2 * num_layers * num_kv_heads * head_dim * self.k.element_size()

    def snapshot(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the first ``n`` slots' keys and values, ``[L, Hkv, n, D]`` each, on the host
        (a prefix cache keeps it while this cache serves other sequences)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot snapshot {n} slots of a cache of length {self.length}")
        return self.k[:, :, :n].to("cpu", copy=True), self.v[:, :, :n].to("cpu", copy=True)

    def restore(self, kv: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
        """Load the first ``n`` slots of a :meth:`snapshot` and truncate after them: the cache is then
        bitwise the state that computed the snapshot had after its first ``n`` tokens."""
        k, v = kv
        if not 0 <= n <= k.shape[2] or n > self.max_len:
            raise ValueError(f"cannot restore {n} slots from a snapshot of {k.shape[2]} into a cache of {self.max_len}")
        self.k[:, :, :n] = k[:, :, :n]
        self.v[:, :, :n] = v[:, :, :n]
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

    def __init__(self, buffer: KVCache, lanes: int, lane_len: int, staging: int) -> None:
        if lanes * lane_len + staging > buffer.max_len:
            raise ValueError(f"{lanes} lanes of {lane_len} slots and {staging} staging slots do not fit {buffer.max_len}")
        self.buffer = buffer
        self.lane_len = lane_len
        self.staging_start = lanes * lane_len
        self.staging = staging
        self.lanes = [buffer.region(i * lane_len, lane_len) for i in range(lanes)]
        # position held by each region slot: slot j of a lane holds position j
        self._region_pos = torch.arange(lane_len, device=buffer.k.device).repeat(lanes)

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
        prefix = torch.arange(base, base + committed, device=self.buffer.k.device)
        return [torch.cat([prefix, own.to(prefix.device) + self.staging_start]) for own in staged]

    def keep(self, lane: int, staged: torch.Tensor) -> None:
        """Append the staged rows ``staged`` [n] (offsets into this pass's staging slots, in the
        order they join the sequence) to lane ``lane``'s region."""
        cache = self.lanes[lane]
        n = int(staged.numel())
        start, end = cache.reserve(n)
        src = staged.to(self.buffer.k.device) + self.staging_start
        dst = slice(self.base(lane) + start, self.base(lane) + end)
        self.buffer.k[:, :, dst] = self.buffer.k.index_select(2, src)
        self.buffer.v[:, :, dst] = self.buffer.v.index_select(2, src)
        cache.advance(n)

    @property
    def nbytes(self) -> int:
        return self.buffer.max_len * self.buffer.bytes_per_token
