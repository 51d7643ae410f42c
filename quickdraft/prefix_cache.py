"""Prefix cache: a request whose token ids begin with something already computed computes only the rest.

Design (llama.cpp server's slots + ``--cache-ram``, not vLLM's paged blocks). The engine keeps one
contiguous working KV cache per lane (one lane per sequence it runs at once, regions of one
buffer, :class:`~quickdraft.cache.KVPool`): the native decoder stack and the per-row attention
kernels read each layer's ``[Hkv, S, D]`` slab directly, which is what makes a row's result
bitwise independent of the pass it is in. Paged blocks shared by reference (vLLM, SGLang) would
need a block table in every kernel; copies fit this design better:

- each working cache is an entry of its own (a new request takes the free lane holding the most
  of its prompt): it holds the last request's prompt and output, so a
  conversation's next turn (same history + a new message) truncates it to the common prefix and
  computes only the new tokens, with no copy at all;
- other sequences live as host copies (:meth:`KVCache.snapshot`), each with its drafter's state,
  evicted least-recently-used under a byte budget. When a prompt matches one of them better than
  the working cache, the working sequence is copied out first (if not stored already), then the
  entry's first m slots are copied back in: ~60 ms for 4k tokens of a 1.5B model, against seconds
  to recompute them;
- the sequences running in other lanes count too: a prompt that begins like one of them (a shared
  system prompt, the same question from another user) copies its computed slots lane to lane
  (their drafter state stays theirs).

Matching is on token ids, longest common prefix, never on session objects: a chat template may
render the previous answer with other ids than were generated, an earlier message may be edited,
an agent may branch. Reuse stops at the first differing id; the rest is recomputed. The prompt's
last token is always recomputed (its logits pick the first output token).

Worked example (budget for one stored entry)::

    request A  [sys u1]          cold: compute 6 tokens         working = A + answer a1
    request B  [sys u1 a1 u2]    working matches 6 + |a1|: truncate there, compute u2 only
    request C  [sys v1]          working matches |sys| < |working|: store working (A a1 u2 b2) as
                                 entry E1, truncate to |sys|, compute v1     working = C + c1
    request D  [sys u1 a1 u2 b2 u3]   E1 matches more than working: store working as E2 (the
                                 budget evicts nothing yet), restore E1's slots, compute u3

Losslessness: prefills run in chunks of at most ``model.prefill_rows()`` rows through the same
batch-invariant path as decode and verify passes, so every slot's keys and values are bitwise the
same however the sequence was cut into passes (one long prefill, a restored prefix + the rest, or
decode steps): a restored prefix is exactly the state a cold prefill builds, and every later pass
and token is unchanged. Drafters hold their own state (:meth:`Drafter.snapshot` / ``restore``,
optional) and reuse their longest valid prefix themselves in ``prefill``; a drafter that reads the
target's features can only hold what the target fed it, so the engine never reuses more than its
``covered(prompt)``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from quickdraft.cache import CacheSnapshot, SequenceCache
from quickdraft.speculative.base import Drafter


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """Length of the longest common prefix of two id arrays, at most ``limit``."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if n <= 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def as_ids(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def state_bytes(obj: object) -> int:
    """Approximate host bytes held by a drafter snapshot (tensors, arrays, lists, dicts, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return 100 * len(obj)  # a dict slot, a small tuple key and an int
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(x) if isinstance(x, (torch.Tensor, np.ndarray, list, tuple, dict)) else 8 for x in obj)
    return 0


@dataclass
class CachedSequence:
    """A stored sequence: its ids, the target's keys/values for them, and a drafter's state."""

    tokens: np.ndarray  # [n] int64
    kv: CacheSnapshot  # keys and values [L, Hkv, n, D] (and recurrent states), host memory
    drafter: weakref.ref | None  # the drafter whose state this is
    drafter_state: object | None
    nbytes: int
    last_used: int


@dataclass
class PrefixCacheStats:
    """Counters since start (the server exports them to Prometheus)."""

    requests: int = 0
    hits: int = 0  # requests that reused at least one token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not recomputed
    stored: int = 0
    evicted: int = 0
    from_running: int = 0  # requests whose prefix was copied from a sequence still running


@dataclass
class Working:
    """What a working cache holds: ids whose keys/values fill its first len(held) slots, and the
    drafter whose state follows them."""

    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    drafter: weakref.ref | None = None


@dataclass
class PrefixCache:
    """The working sequence of one engine's cache plus stored copies under ``budget_bytes``.

    ``budget_bytes`` 0 turns reuse off (every request starts from an empty cache, as before).
    A cache that cannot be copied (``KVCache.copyable`` False: tensor parallel) is reused by
    truncation only.
    """

    budget_bytes: int = 0
    entries: list[CachedSequence] = field(default_factory=list)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # each working cache's sequence (an engine of several sequences has one per lane)
    working: weakref.WeakKeyDictionary[SequenceCache, Working] = field(default_factory=weakref.WeakKeyDictionary)
    _tick: itertools.count = field(default_factory=itertools.count)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the stored copies (the working cache is preallocated and not counted)."""
        return sum(e.nbytes for e in self.entries)

    # -------------------------------------------------------------- per request

    def _working(self, cache: SequenceCache) -> Working:
        if cache not in self.working:
            self.working[cache] = Working()
        return self.working[cache]

    def held_prefix(self, prompt: np.ndarray, cache: SequenceCache) -> int:
        """How many leading ``prompt`` ids ``cache`` still holds from its last sequence (an engine
        of several sequences gives a request the lane that holds the most)."""
        if not self.enabled:
            return 0
        return cache.rollback_point(common_prefix(self._working(cache).held, prompt, cache.length))

    def stored_prefix(self, prompt: np.ndarray, cache: SequenceCache) -> int:
        """How many leading ``prompt`` ids :meth:`reuse` finds computed now in ``cache`` or a stored
        entry (the most it would put into ``cache`` without a running sequence's help)."""
        if not self.enabled:
            return 0
        limit = len(prompt) - 1
        stored = self._match(prompt, limit)[1] if cache.copyable else 0
        return max(min(self.held_prefix(prompt, cache), limit), stored)

    def reuse(
        self, prompt: np.ndarray, cache: SequenceCache, drafter: Drafter | None,
        running: Sequence[tuple[np.ndarray, SequenceCache]] = (),
    ) -> int:
        """Put the longest cached prefix of ``prompt`` into ``cache`` (and the drafter's state) and
        return its length m: the caller computes ``prompt[m:]``. m < len(prompt) always.
        ``running``: the (ids, cache) of the sequences running beside it in other lanes, whose
        first ``cache.length`` slots hold ``ids``' keys and values: a longer match there is copied
        lane to lane (a shared system prompt, the same question again)."""
        if not self.enabled:
            cache.reset()
            return 0
        work = self._working(cache)
        limit = len(prompt) - 1  # the last prompt token is always run: its logits pick the next
        m = cache.rollback_point(common_prefix(work.held, prompt, min(limit, cache.length)))
        best, best_m = self._match(prompt, limit) if cache.copyable else (None, 0)
        lane, lane_m = None, 0
        for ids, other in running if cache.copyable else ():
            n = other.rollback_point(common_prefix(ids, prompt, min(limit, other.length)))
            if n > lane_m:
                lane, lane_m = other, n
        if lane is not None and lane_m > max(m, best_m):
            self._store_working(cache)
            cache.restore(lane.snapshot(lane_m, copy=False), lane_m)
            work.drafter = None  # that sequence's drafter state is its own
            work.held, m = prompt[:lane_m].copy(), lane_m
            self.stats.from_running += 1
        elif best is not None and best_m > m:
            self._store_working(cache)
            cache.restore(best.kv, best_m)
            best.last_used = next(self._tick)
            work.drafter = None  # the working drafter state no longer follows ``held``
            made_it = best.drafter is not None and best.drafter() is drafter
            if drafter is not None and made_it:
                drafter.restore(best.drafter_state)  # it made the snapshot
                work.drafter = best.drafter
            work.held, m = best.tokens, best_m
        elif m < len(work.held) and cache.copyable:
            self._store_working(cache)  # a branch: keep what the truncation would lose
        if drafter is not None:  # a feature drafter holds features for fewer tokens, maybe
            m = cache.rollback_point(min(m, drafter.covered(prompt)))  # (a recurrent state: where it is held)
        cache.truncate(min(m, cache.length))
        work.held = work.held[:m]
        self.stats.requests += 1
        self.stats.hits += int(m > 0)
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += m
        return m

    def release(self, tokens: np.ndarray, cache: SequenceCache, drafter: Drafter | None) -> None:
        """A request ended (finished, stopped, cancelled): the working cache holds ``tokens``
        (prompt + committed output) up to its length; remember them for the next request."""
        if not self.enabled:
            return
        work = self._working(cache)
        work.held = tokens[: cache.length]
        work.drafter = weakref.ref(drafter) if drafter is not None else None

    def clear(self) -> None:
        self.entries.clear()
        self.working.clear()

    # -------------------------------------------------------------- entries

    def _match(self, prompt: np.ndarray, limit: int) -> tuple[CachedSequence | None, int]:
        best, best_m = None, 0
        for e in self.entries:
            m = e.kv.point(common_prefix(e.tokens, prompt, limit))
            if m > best_m:
                best, best_m = e, m
        return best, best_m

    def _store_working(self, cache: SequenceCache) -> None:
        """Copy the working sequence out (with its drafter's state) unless a stored entry already
        holds it; entries it extends are dropped, then the least recently used go over budget."""
        work = self._working(cache)
        n = min(len(work.held), cache.length)
        if n == 0:
            return
        tokens = work.held[:n]
        for e in self.entries:
            if common_prefix(e.tokens, tokens) == n and e.kv.point(n) == n:  # already stored (maybe longer)
                e.last_used = next(self._tick)
                return
        drafter = work.drafter() if work.drafter is not None else None
        state = drafter.snapshot() if drafter is not None else None
        if n * cache.bytes_per_token + state_bytes(state) > self.budget_bytes:
            return
        snap = cache.snapshot(n)
        nbytes = snap.nbytes + state_bytes(state)
        if nbytes > self.budget_bytes:
            return
        # entries it extends are dropped (where it restores their whole length: recurrent states)
        self.entries = [e for e in self.entries
                        if common_prefix(e.tokens, tokens) < len(e.tokens) or snap.point(len(e.tokens)) < len(e.tokens)]
        entry = CachedSequence(tokens.copy(), snap, work.drafter if state is not None else None,
                               state, nbytes, next(self._tick))
        self.entries.append(entry)
        self.stats.stored += 1
        while self.nbytes > self.budget_bytes:
            oldest = min(self.entries, key=lambda e: e.last_used)
            self.entries.remove(oldest)
            self.stats.evicted += 1
