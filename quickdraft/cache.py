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


class KVCache:
    """Keys and values of every layer, ``[layers, kv_heads, max_len, head_dim]`` each."""

    copyable = True  # snapshot/restore hold the whole state (a sharded cache's other ranks do not)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, Hkv, S, D]
        # per-layer views [Hkv, S, D], made once (indexing self.k[layer] costs a torch op per use)
        self.k_layers = self.k.unbind(0)
        self.v_layers = self.v.unbind(0)
        self.max_len = max_len
        self.length = 0

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
