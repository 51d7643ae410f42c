"""Proposals of several sequences at once, with the passes of their drafters' own models batched.

A drafter that runs a model of its own (a draft model, an EAGLE-3 head) proposes in steps
(:meth:`~quickdraft.speculative.base.Drafter.drafting`): it asks for one pass of its model at a
time and gets the pass's output back. :func:`propose_together` advances every sequence's drafter in
lockstep, and the passes asked for in one round on lanes of the same KV pool (drafters forked
together, :meth:`~quickdraft.speculative.base.Drafter.forks`) run as ONE pass of that model: k draft
tokens for four sequences cost k passes of 4+ rows instead of 4k passes of one row. Every row sees
its own lane's slots in the same order as alone (:class:`~quickdraft.models.forward_pass.RowSlots`), so
each sequence's logits, and so its proposal, are bitwise what it proposes alone. Each kind of pass
(a draft model's, :class:`~quickdraft.speculative.draft_model.ModelPass`; an EAGLE-3 head's,
:class:`~quickdraft.speculative.eagle3.drafter.HeadPass`) says how its asks run together.
"""

from __future__ import annotations

import time

from quickdraft.speculative.base import Drafter, DraftPass, PassOutput, Steps, run_passes
from quickdraft.speculative.tree import DraftTree
from quickdraft.speculative.verify import Draft

Proposal = Draft | DraftTree


def propose_together(wanted: list[tuple[Drafter, int]]) -> list[tuple[Proposal | Exception, float]]:
    """Each ``(drafter, k)``'s proposal (or the error that ended it), and the seconds it took: its
    own work plus an equal share of each pass it took part in."""
    out: dict[int, Proposal | Exception] = {}
    seconds = [0.0] * len(wanted)
    active: dict[int, Steps[Proposal]] = {i: drafter.drafting(k) for i, (drafter, k) in enumerate(wanted)}
    reply: dict[int, PassOutput] = {}  # the output of the pass each drafter asked for last
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
            try:
                outputs = run_passes([asks[i] for i in group])
            except Exception as exc:
                for i in group:
                    out[i] = exc
                    active.pop(i).close()
                continue
            for i, output in zip(group, outputs, strict=True):
                reply[i] = output
                seconds[i] += output.seconds
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
