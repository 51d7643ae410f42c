"""Proposals of several sequences at once, with the passes of their drafters' own models batched.

A drafter that runs a model of its own (a draft model) proposes in steps
(:meth:`~quickdraft.speculative.base.Drafter.drafting`): it asks for one pass of its model at a
time and gets the pass's logits back. :func:`propose_together` advances every sequence's drafter in
lockstep, and the passes asked for in one round on lanes of the same KV pool (drafters forked
together, :meth:`~quickdraft.speculative.base.Drafter.forks`) run as ONE pass of that model: k draft
tokens for four sequences cost k passes of 4+ rows instead of 4k passes of one row. Every row sees
its own lane's slots in the same order as alone (:class:`~quickdraft.models.layers.RowSlots`), so
each sequence's logits, and so its proposal, are bitwise what it proposes alone.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch
from torch import Tensor

from quickdraft.cache import KVPool
from quickdraft.models.layers import RowSlots
from quickdraft.speculative.base import Drafter, DraftPass
from quickdraft.speculative.tree import DraftTree
from quickdraft.speculative.verify import Draft

Proposal = Draft | DraftTree
Steps = Generator[DraftPass, Tensor, Proposal]


def propose_together(wanted: list[tuple[Drafter, int]]) -> list[tuple[Proposal | Exception, float]]:
    """Each ``(drafter, k)``'s proposal (or the error that ended it), and the seconds it took: its
    own work plus an equal share of each pass it took part in."""
    out: dict[int, Proposal | Exception] = {}
    seconds = [0.0] * len(wanted)
    active: dict[int, Steps] = {i: drafter.drafting(k) for i, (drafter, k) in enumerate(wanted)}
    reply: dict[int, Tensor] = {}  # the logits of the pass each drafter asked for last
    while active:
        asks: dict[int, DraftPass] = {}
        for i, steps in list(active.items()):
            t0 = time.perf_counter()
            try:
                asks[i] = steps.send(reply.pop(i)) if i in reply else next(steps)
            except StopIteration as done:
                out[i] = done.value
                del active[i]
            except Exception as exc:  # this drafter failed; the others go on
                out[i] = exc
                del active[i]
            seconds[i] += time.perf_counter() - t0
        for group in _groups(asks):
            t0 = time.perf_counter()
            try:
                logits = run_passes([asks[i] for i in group])
            except Exception as exc:
                for i in group:
                    out[i] = exc
                    active.pop(i).close()
                continue
            share = (time.perf_counter() - t0) / len(group)
            for i, row in zip(group, logits, strict=True):
                reply[i] = row
                seconds[i] += share
    return [(out[i], seconds[i]) for i in range(len(wanted))]


def _groups(asks: dict[int, DraftPass]) -> list[list[int]]:
    """The asks that run as one pass: those on lanes of the same pool, at most its staging rows
    together; each other ask alone."""
    groups: list[list[int]] = []
    by_pool: dict[int, list[int]] = {}
    for i, ask in asks.items():
        if ask.pool is None:
            groups.append([i])
        else:
            by_pool.setdefault(id(ask.pool), []).append(i)
    for members in by_pool.values():
        group: list[int] = []
        rows = 0
        for i in members:
            pool = asks[i].pool
            assert pool is not None
            if group and rows + asks[i].rows > pool.staging:
                groups.append(group)
                group, rows = [], 0
            group.append(i)
            rows += asks[i].rows
        groups.append(group)
    return groups


def run_passes(asks: list[DraftPass]) -> list[Tensor]:
    """The last row's logits [1, V] of each ask: alone on its own cache, or several asks on lanes of
    one pool as ONE pass of their model over the pool's staging slots (each lane then keeps its
    rows, as its own pass would have appended them)."""
    if len(asks) == 1:
        return [asks[0].run()]
    pool = asks[0].pool
    assert pool is not None and all(a.pool is pool for a in asks)  # as _groups made them
    return _pooled_pass(pool, asks)


def _pooled_pass(pool: KVPool, asks: list[DraftPass]) -> list[Tensor]:
    model = asks[0].model
    device = pool.buffer.k.device
    total = sum(a.rows for a in asks)
    pool.begin_pass(total)
    slots: list[Tensor] = []
    positions: list[Tensor] = []
    held: dict[int, Tensor] = {}
    staged: list[Tensor] = []  # each ask's rows in the pass
    offset = 0
    for a in asks:
        start = a.cache.length
        pos = a.positions if a.positions is not None else torch.arange(start, start + a.rows, device=device)
        positions.append(pos.to(device))
        if a.positions is not None:  # slots lag positions: say which position each slot holds
            held[a.lane] = torch.tensor(a.slot_positions[:start], dtype=torch.long, device=device)
        staged.append(torch.arange(offset, offset + a.rows, device=device))
        slots += pool.visible(a.lane, start, [staged[-1][: j + 1] for j in range(a.rows)])
        offset += a.rows
    at = torch.cat(positions)
    last_rows = torch.stack([rows[-1] for rows in staged])
    ids = torch.cat([a.ids.to(device) for a in asks])
    logits, _ = model(ids, pool.buffer, positions=at, rows=RowSlots(slots, pool.slot_positions(at, held)),
                      logit_rows=last_rows)
    for a, rows in zip(asks, staged, strict=True):
        pool.keep(a.lane, rows)
    return [logits[i : i + 1] for i in range(len(asks))]
