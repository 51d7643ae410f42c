"""EAGLE-3 drafter: chains and EAGLE-2 dynamic trees from a head that reads the target's features.

State. The head keeps its own one-layer KV cache whose slot j holds row j = (target feature of
position j, embedding of token j+1), RoPE position j (see ``head.py``). The engine feeds the target
features of every token whose KV it kept (``feed``) before each ``commit``, so after a commit the
drafter has features for every committed token except the newest one. Rows are run lazily: the
fed features wait (``features`` rows from ``cache.length`` to ``fed``) until the next ``propose``
runs them (the "root pass", in PREFILL_CHUNK-row passes); its last row (feature of the
second-newest token + embedding of the newest) predicts the first drafted token. Worked example::

    committed x0..x5, fed features f0..f4, cache rows 0..2      pending f3, f4
    propose:  root pass rows 3 (f3, x4), 4 (f4, x5) -> cache rows 0..4; row 4 predicts x6
              drafting rows (the head's own h as feature) go to slots 5.. and are dropped after
    verify accepts d0 = x6, emits x7: engine feeds f5 (of x5), f6 (of x6), commits [x6, x7]
              -> pending f5, f6, whose rows use tokens x6, x7

Rows drafted from the head's own output are never kept: the target's features replace them once
the target has read those tokens, so "rollback" is only truncating back to the root pass.

Reuse across requests: the drafter keeps every fed feature, so a new prompt that shares m leading
tokens with what it holds (``covered``) keeps rows 0..m-2 (row m-1 embeds token m, which may
differ) and re-runs only the rows after them; ``snapshot`` / ``restore`` copy that state for the
prefix cache.

Trees (EAGLE-2, Li et al. 2024, arXiv 2406.16858). Depth 1 holds the top_k tokens of the root row.
Each further depth runs the top_k nodes of the depth before with the highest path confidence
(product of draft probabilities along the path) and gives each top_k children; the head's tree
attention lets every node see the committed rows and its own ancestors. Finally all candidates are
reranked by path confidence and the best N kept (a path's confidence is never above its parent's,
so the best N always form a tree). Nodes are deterministic (probs=None): verification uses the
multi-draft rule, lossless for greedy and sampled requests alike.

Cost model. EAGLE-2 observes that a node's path confidence approximates the probability that the
target accepts it, so a tree's expected accepted length is about the sum of its nodes' confidences.
We scale that sum by an online calibration factor alpha (observed / predicted accepted tokens,
measured every step on the best candidates, also when the tree was not used, by matching them
against the tokens the target emitted) and pick N maximising

    rate(N) = (1 + alpha * sum of the best N confidences) / (target_cost(N + 1) + head_cost * passes)

(N = 0 is plain decoding). A further depth is drafted only while it can pay: its nodes add at most
alpha * (sum of the expanded nodes' confidences) tokens for one more head pass.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor

from quickdraft.cache import CacheSnapshot, KVPool, SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS, prefill_chunks
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.forward_pass import RowSlots
from quickdraft.sampling import (
    SamplingParams,
    probs_from_logits,
    process_logits,
    sample_at,
)
from quickdraft.speculative.base import (
    Drafter,
    DraftPass,
    PassOutput,
    Steps,
    begin_together,
    run_alone,
)
from quickdraft.speculative.eagle3.head import DraftHead
from quickdraft.speculative.policy import TargetCost
from quickdraft.speculative.tree import DraftTree
from quickdraft.speculative.verify import Draft

_EMPTY = torch.empty(0, dtype=torch.long)
MODES = ("auto", "tree", "chain")
CALIBRATION_EMA = 0.1
ALPHA_RANGE = (0.02, 3.0)
POOL_STAGING = BLOCKED_MAX_ROWS  # rows of one head pass over several sequences' lanes (batch invariant)


@dataclass(frozen=True)
class TreeShape:
    """Limits of the dynamic tree: children per expanded node, depth, nodes sent to the target."""

    top_k: int
    max_depth: int
    max_nodes: int

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.max_depth < 1 or self.max_nodes < 1:
            raise QuickdraftError(f"EAGLE-3 tree limits must be >= 1, got {self}")


CPU_SHAPE = TreeShape(top_k=4, max_depth=5, max_nodes=16)  # a CPU pass grows fast with its rows
GPU_SHAPE = TreeShape(top_k=8, max_depth=7, max_nodes=64)  # a GPU pass costs ~ the same up to ~64 rows


def default_shape(device: torch.device) -> TreeShape:
    return GPU_SHAPE if device.type == "cuda" else CPU_SHAPE


def cost_rows(device: torch.device) -> tuple[int, ...]:
    """Row counts whose target pass cost is measured for sizing trees (interpolated between)."""
    return (1, 8, 16, 32, 64) if device.type == "cuda" else (1, 2, 4, 8, 16)


@dataclass(frozen=True, eq=False)
class HeadPass(DraftPass):
    """One pass of an EAGLE-3 head: rows (``embeds``, ``features``) [T, H] into ``cache`` at
    ``positions`` (None: committed rows at the cache's next slots; else rows of a draft, seeing
    what ``mask`` [T, start + T] allows, ``committed`` being the slots of committed rows below the
    draft). Gives back the logits of the last ``num_logits`` rows (all if None) and every row's h."""

    head: DraftHead
    cache: SequenceCache
    embeds: Tensor
    features: Tensor
    positions: Tensor | None = None
    mask: Tensor | None = None
    committed: int | None = None
    num_logits: int | None = None
    pool: KVPool | None = None
    lane: int = 0

    @property
    def rows(self) -> int:
        return int(self.embeds.shape[0])

    def run(self) -> PassOutput:
        logits, h = self.head(self.embeds, self.features, self.cache, self.positions, self.mask, self.num_logits,
                              self.committed)
        return PassOutput(logits, h)

    @classmethod
    def together(cls, asks: Sequence[HeadPass]) -> list[PassOutput]:
        """The asks' rows as ONE pass of the head over the pool's staging slots: each row sees the
        slots of its lane and of its own ask's rows that it sees alone (:meth:`DraftHead.visible`),
        in the same order; each lane then keeps its rows, as its own pass would have appended them."""
        pool, head = begin_together(asks), asks[0].head
        device = pool.buffer.device
        slots: list[Tensor] = []
        positions: list[Tensor] = []
        staged: list[Tensor] = []  # each ask's rows in the pass
        logit_rows: list[Tensor] = []
        offset = 0
        for a in asks:
            start, t = a.cache.length, a.rows
            seen = head.visible(start, t, a.mask, a.committed).to(device)
            base = pool.base(a.lane)
            for row in seen:
                lane_slots = row[:start].nonzero().squeeze(1) + base
                own = row[start:].nonzero().squeeze(1) + pool.staging_start + offset
                slots.append(torch.cat([lane_slots, own]))
            at = a.positions if a.positions is not None else torch.arange(start, start + t)
            positions.append(at.to(device))
            staged.append(torch.arange(offset, offset + t, device=device))
            logit_rows.append(staged[-1] if a.num_logits is None else staged[-1][t - a.num_logits :])
            offset += t
        at = torch.cat(positions)
        logits, h = head.forward_rows(torch.cat([a.embeds for a in asks]), torch.cat([a.features for a in asks]),
                                      pool.buffer, at, RowSlots(slots, pool.slot_positions(at)), torch.cat(logit_rows))
        outputs = []
        first = 0
        for a, rows, wanted in zip(asks, staged, logit_rows, strict=True):
            pool.keep(a.lane, rows)
            n = int(wanted.numel())
            outputs.append(PassOutput(logits[first : first + n], h[int(rows[0]) : int(rows[0]) + a.rows]))
            first += n
        return outputs


@dataclass
class _Node:
    draft_id: int
    score: float  # log path confidence
    parent: int  # index into the node list, -1 = the root
    depth: int
    slot: int = -1  # head cache slot once expanded
    h: Tensor | None = None  # the head's output for this node's row, once expanded


@dataclass
class _Proposal:
    """What the last propose offered (or would have offered): for calibration and cost tracking."""

    tokens: list[int]  # target ids, topological order
    parents: list[int]
    conf: list[float]  # path confidence of each node
    depths: list[int]
    used: int  # nodes actually returned (0 = plain step)


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 head; see the module docstring.

    mode: "auto"/"tree" (dynamic tree sized by the cost model each step) or "chain" (one path;
    a sampling request then draws each token from q, the head's distribution shaped like p).
    policy=False disables the cost model: always the full shape (tree) or k tokens (chain).
    cost: the target's pass costs (shared with an AutoDrafter, which then observes them: set
    observe_cost=False); head_seconds: cost of one head pass (measured when None).
    """

    name = "eagle3"  # (variant: set by the factory from the load)

    def __init__(
        self,
        head: DraftHead,
        target: CausalLM,
        mode: str = "auto",
        shape: TreeShape | None = None,
        cost: TargetCost | None = None,
        head_seconds: float | None = None,
        policy: bool = True,
        observe_cost: bool = True,
        alpha: float = 1.0,
        lane: tuple[KVPool, int] | None = None,
    ) -> None:
        if mode not in MODES:
            raise QuickdraftError(f"EAGLE-3 mode must be one of {', '.join(MODES)}, got {mode!r}")
        if head.config.vocab_size != target.config.vocab_size:
            raise QuickdraftError("the EAGLE-3 head's vocabulary differs from the target's; load it with load_head")
        self.head = head
        self.target = target
        self.mode = mode
        self.shape = shape or default_shape(head.device)
        self.policy = policy
        self.capture_layers: tuple[int, ...] = head.config.aux_layers
        self._embedding = head.embed_tokens if head.embed_tokens is not None else target.model.embed_tokens
        self.pool: KVPool | None = None  # the KV pool whose lane ``lane`` is the head cache (see forks)
        self.lane = 0
        if lane is None:
            self.cache = head.new_cache(target.max_len + self.shape.max_depth * self.shape.top_k + 1)
        else:
            self.pool, self.lane = lane
            self.cache = self.pool.lanes[self.lane]
        self.cost = cost or TargetCost({1: 1.0, 2: 1.0})
        self.observe_cost = observe_cost
        self.head_seconds = head_seconds if head_seconds is not None else measure_head_seconds(head, self.shape.top_k)
        self.vocab = target.config.vocab_size
        # target id -> draft id (-1 = not in the draft vocabulary), for sampled chains
        index = torch.full((self.vocab,), -1, dtype=torch.long, device=head.device)
        draft_ids = torch.arange(head.config.draft_vocab_size, device=head.device)
        index[head.to_target_ids(draft_ids)] = draft_ids
        self._to_draft = index
        self._obs, self._pred = alpha, 1.0  # calibration EMAs: alpha = obs / pred
        self.params = SamplingParams()
        self.tokens: list[int] = []
        self.fed = 0  # features held: positions 0..fed-1
        self.features: Tensor | None = None  # [capacity, n * Ht], rows 0..fed-1 valid
        self._last: _Proposal | None = None
        self._t_ready = 0.0

    # ------------------------------------------------------------------ protocol

    @property
    def alpha(self) -> float:
        """Calibration factor: observed accepted tokens / sum of predicted confidences."""
        return min(max(self._obs / self._pred, ALPHA_RANGE[0]), ALPHA_RANGE[1])

    def prefill(self, prompt_ids: Tensor, params: SamplingParams, cached: int = 0) -> None:
        """Start a request; the first ``cached`` prompt tokens keep the features held for them
        (at most :meth:`covered`), the engine feeds the rest."""
        # q only has to be shaped like p without penalties (any q keeps verification lossless).
        self.params = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        tokens = [int(t) for t in prompt_ids.tolist()]
        if cached > self.covered(tokens):
            raise ValueError(f"EAGLE-3 drafter holds features for {self.covered(tokens)} prompt tokens, not {cached}")
        self.cache.truncate(min(self.cache.length, max(cached - 1, 0)))  # row j embeds token j + 1
        self.tokens, self.fed = tokens, cached
        self._last, self._t_ready, self._last_row = None, 0.0, None

    def covered(self, prompt_ids: Tensor | np.ndarray | list[int]) -> int:
        """Leading prompt tokens this drafter holds features for (features of position j depend on
        tokens 0..j only)."""
        ids = np.asarray(prompt_ids.tolist() if isinstance(prompt_ids, Tensor) else prompt_ids, dtype=np.int64)
        n = min(self.fed, len(ids), len(self.tokens))
        diff = np.flatnonzero(np.asarray(self.tokens[:n], dtype=np.int64) != ids[:n])
        return int(diff[0]) if diff.size else n

    def feed(self, hidden: Tensor) -> None:
        """Target features [n, len(capture_layers) * Ht] of the next n committed positions."""
        expected = len(self.capture_layers) * self.head.config.target_hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != expected:
            raise ValueError(f"EAGLE-3 features must be [n, {expected}], got {tuple(hidden.shape)}")
        n = int(hidden.shape[0])
        buf = self.features
        if buf is None or buf.shape[0] < self.fed + n or buf.dtype != hidden.dtype:
            grown = hidden.new_empty(max(2 * (self.fed + n), 256), expected)
            if buf is not None and self.fed:
                grown[: self.fed] = buf[: self.fed]
            self.features = buf = grown
        buf[self.fed : self.fed + n] = hidden
        self.fed += n

    def snapshot(self) -> tuple[CacheSnapshot, Tensor, list[int]]:
        """Head rows, features and ids held (a copy, on the host)."""
        feats = self.features[: self.fed].to("cpu", copy=True) if self.features is not None else torch.empty(0)
        return self.cache.snapshot(self.cache.length), feats, self.tokens[: self.fed + 1]

    def restore(self, state: object) -> None:
        kv, feats, tokens = cast(tuple[CacheSnapshot, Tensor, list[int]], state)
        self.cache.restore(kv, kv.length)
        self.features = feats.to(self.head.device, copy=True) if feats.numel() else None
        self.fed, self.tokens = int(feats.shape[0]), list(tokens)
        self._last, self._t_ready, self._last_row = None, 0.0, None

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        emitted = [int(t) for t in tokens.tolist()]
        if self._last is not None:
            if self.observe_cost and self._t_ready:
                self.cost.observe(self._last.used + 1, time.perf_counter() - self._t_ready)
            self._calibrate(self._last, emitted)
        self._last, self._t_ready = None, 0.0
        self.tokens.extend(emitted)

    def forks(self, count: int) -> list[Drafter]:
        """Drafters on the same head for other sequences. This drafter and its forks each own a
        lane of one KV pool for the head's rows (what this one holds moves to the first lane), so
        the engine runs their head passes together (:class:`HeadPass`)."""
        length = self.cache.max_len
        pool = KVPool(self.head.new_cache((count + 1) * length + POOL_STAGING), count + 1, length, POOL_STAGING)
        n = self.cache.length
        pool.lanes[0].restore(self.cache.snapshot(n), n)
        self.cache, self.pool, self.lane = pool.lanes[0], pool, 0
        twins: list[Drafter] = []
        for i in range(1, count + 1):
            twin = type(self)(self.head, self.target, self.mode, self.shape, self.cost, self.head_seconds,
                                 self.policy, self.observe_cost, self.alpha, lane=(pool, i))
            twin.variant = self.variant
            twins.append(twin)
        return twins

    def reset(self) -> None:
        self.cache.reset()
        self.tokens, self.fed = [], 0
        self._last, self._t_ready, self._last_row = None, 0.0, None

    @torch.inference_mode()
    def drafting(self, k: int) -> Steps[Draft | DraftTree]:
        root = (yield from self._catch_up()) if k > 0 else None
        if root is None:
            return Draft(tokens=_EMPTY)
        logits, h = root
        base = self.cache.length
        # drafted rows need cache slots, and positions base-1+depth need RoPE table rows
        room = min(self.cache.max_len - base, self.head.max_len - base)
        draft: Draft | DraftTree
        if self.mode == "chain":
            draft, proposal = yield from self._chain(logits, h, min(k, room))
        else:
            tree, proposal = yield from self._tree(logits, h, k, max(1, room // self.shape.top_k))
            draft = tree if tree.k else Draft(tokens=_EMPTY)
        self.cache.truncate(base)  # drafted rows used the head's own features: never kept
        self._last = proposal
        self._t_ready = time.perf_counter()
        return draft

    # ------------------------------------------------------------------ rows

    @torch.inference_mode()
    def catch_up(self) -> tuple[Tensor, Tensor] | None:
        """Run the waiting feature rows into the cache; (logits [1, Vd], h [1, H]) of the last one.

        None when there is nothing to draft from (no features, or tokens and features out of step).
        """
        return run_alone(self._catch_up())

    def _catch_up(self) -> Steps[tuple[Tensor, Tensor] | None]:
        """:meth:`catch_up` in passes (the root pass of a proposal)."""
        if self.fed == 0 or len(self.tokens) != self.fed + 1 or self.features is None:
            return None
        start = self.cache.length
        if start == self.fed:
            return self._last_row
        if self.cache.max_len - start < self.fed - start + self.shape.max_depth * self.shape.top_k:
            return None  # the context is nearly full: nothing left to draft into
        for s, e in prefill_chunks(start, self.fed):
            ids = torch.tensor(self.tokens[s + 1 : e + 1], dtype=torch.long, device=self.head.device)
            out = yield HeadPass(self.head, self.cache, self._embed(ids), self.head.fuse(self.features[s:e]),
                                 num_logits=1, pool=self.pool, lane=self.lane)
        if self.fed - start <= 2:
            self._time_pass(out.seconds)
        assert out.hidden is not None
        self._last_row = (out.logits, out.hidden[-1:])
        return self._last_row

    _last_row: tuple[Tensor, Tensor] | None = None

    def _embed(self, target_ids: Tensor) -> Tensor:
        return self._embedding(target_ids).to(self.head.dtype)

    def _time_pass(self, seconds: float) -> None:
        self.head_seconds = 0.8 * self.head_seconds + 0.2 * seconds

    def _run_rows(self, draft_ids: Tensor, features: Tensor, position: int, mask: Tensor | None,
                  committed: int) -> Steps[tuple[Tensor, Tensor]]:
        """One drafting pass: rows (h of the parent, embedding of the node) all at ``position``,
        above ``committed`` slots of committed rows."""
        target_ids = self.head.to_target_ids(draft_ids)
        positions = torch.full((draft_ids.shape[0],), position, dtype=torch.long, device=self.head.device)
        out = yield HeadPass(self.head, self.cache, self._embed(target_ids), features, positions, mask, committed,
                             pool=self.pool, lane=self.lane)
        self._time_pass(out.seconds)
        assert out.hidden is not None
        return out.logits, out.hidden

    # ------------------------------------------------------------------ chains

    def _chain(self, logits: Tensor, h: Tensor, k: int) -> Steps[tuple[Draft, _Proposal]]:
        limit = min(k, self.shape.max_depth) if self.policy else k
        base = self.cache.length
        position = base - 1  # the root row's position
        tokens: list[int] = []
        qs: list[Tensor] = []
        conf: list[float] = []
        path_conf, used = 1.0, 0
        sampled = not self.params.greedy
        while len(tokens) < limit:
            token, q, p_tok = self._pick(logits, len(self.tokens) + len(tokens))
            path_conf *= p_tok
            tokens.append(token)
            conf.append(path_conf)
            if q is not None:
                qs.append(q)
            n = len(tokens)
            if self.policy and not self._worth(conf, n, passes=n):
                break
            used = n
            if n == limit:
                break
            draft_id = self._to_draft[token : token + 1]
            logits, h = yield from self._run_rows(draft_id, h, position + n, None, base)
        if not self.policy:
            used = len(tokens)
        n = len(tokens)  # the proposal keeps the token that did not pay, for calibration
        proposal = _Proposal(tokens, list(range(-1, n - 1)), conf, list(range(1, n + 1)), used)
        ids = torch.tensor(tokens[:used], dtype=torch.long, device=self.head.device)
        probs = torch.cat(qs[:used]) if sampled and used else None
        return Draft(tokens=ids, probs=probs), proposal

    def _pick(self, logits: Tensor, position: int) -> tuple[int, Tensor | None, float]:
        """(target token, q [1, V] for a sampled request or None, the token's draft probability).
        A sampled token is drawn with the target's random numbers for sequence ``position``."""
        if self.params.greedy:
            probs = torch.softmax(logits[-1].float(), dim=-1)
            best = int(probs.argmax())
            return int(self.head.to_target_ids(torch.tensor(best, device=probs.device))), None, float(probs[best])
        full = logits.new_full((1, self.vocab), float("-inf"))
        full[0, self.head.to_target_ids(torch.arange(logits.shape[-1], device=logits.device))] = logits[-1]
        q = probs_from_logits(process_logits(full, self.params, _EMPTY, _EMPTY))
        assert self.params.seed is not None  # the engine gives sampled requests a seed
        token = int(sample_at(q, self.params.seed, [position])[0])
        return token, q, float(q[0, token])

    # ------------------------------------------------------------------ trees

    def _tree(self, logits: Tensor, root_h: Tensor, k: int, depth_room: int) -> Steps[tuple[DraftTree, _Proposal]]:
        top_k, max_depth = self.shape.top_k, min(self.shape.max_depth, depth_room, k)
        budget = min(k, self.shape.max_nodes)
        base = self.cache.length
        position = base - 1
        nodes: list[_Node] = []
        logp = torch.log_softmax(logits[-1].float(), dim=-1)
        values, ids = logp.topk(min(top_k, logp.shape[-1]))
        frontier = [self._add(nodes, int(i), float(v), -1, 1) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
        passes = 1
        for depth in range(1, max_depth):
            if self.policy and not self._expand_pays(nodes, frontier, budget, passes):
                break
            parents_h = torch.cat([self._feature_of(nodes, n, root_h) for n in frontier])
            mask = self._tree_mask(nodes, frontier, base)
            draft_ids = torch.tensor([nodes[n].draft_id for n in frontier], dtype=torch.long, device=self.head.device)
            start = self.cache.length
            logits, h = yield from self._run_rows(draft_ids, parents_h, position + depth, mask, base)
            passes += 1
            for row, n in enumerate(frontier):
                nodes[n].slot, nodes[n].h = start + row, h[row : row + 1]
            logp = torch.log_softmax(logits.float(), dim=-1)  # [F, Vd]
            values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            children = []
            for row, n in enumerate(frontier):
                for v, i in zip(values[row].tolist(), ids[row].tolist(), strict=True):
                    children.append(self._add(nodes, int(i), nodes[n].score + float(v), n, depth + 1))
            children.sort(key=lambda c: -nodes[c].score)
            frontier = children[:top_k]
        order = self._ranked(nodes)
        conf = [math.exp(nodes[n].score) for n in order]
        n_used = self._best_n(conf, budget, passes) if self.policy else min(budget, len(order))
        shadow = order[: max(n_used, min(budget, len(order)))]
        proposal = self._proposal(nodes, shadow, n_used)
        tree = self._as_tree(nodes, order[:n_used])
        return tree, proposal

    @staticmethod
    def _add(nodes: list[_Node], draft_id: int, score: float, parent: int, depth: int) -> int:
        nodes.append(_Node(draft_id, score, parent, depth))
        return len(nodes) - 1

    @staticmethod
    def _feature_of(nodes: list[_Node], n: int, root_h: Tensor) -> Tensor:
        """A node's row reads its parent's output h (the root row's for depth-1 nodes)."""
        parent = nodes[n].parent
        h = root_h if parent < 0 else nodes[parent].h
        assert h is not None, "a node is expanded only after its parent"
        return h

    def _tree_mask(self, nodes: list[_Node], frontier: list[int], base: int) -> Tensor:
        """[F, start + F]: each frontier row sees the committed rows, its ancestors' rows, itself."""
        start, f = self.cache.length, len(frontier)
        mask = torch.zeros(f, start + f, dtype=torch.bool)
        mask[:, :base] = True
        for row, n in enumerate(frontier):
            mask[row, start + row] = True
            a = nodes[n].parent
            while a >= 0:
                mask[row, nodes[a].slot] = True
                a = nodes[a].parent
        return mask.to(self.head.device)

    @staticmethod
    def _ranked(nodes: list[_Node]) -> list[int]:
        """All nodes by path confidence, best first, each after its parent (ties: shallower first)."""
        ranked = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth, n))
        taken: set[int] = set()
        out = []
        for n in ranked:
            if nodes[n].parent < 0 or nodes[n].parent in taken:
                taken.add(n)
                out.append(n)
        return out

    def _as_tree(self, nodes: list[_Node], chosen: list[int]) -> DraftTree:
        """Topological order: by depth, siblings by confidence (so the first-child path is greedy)."""
        ordered = sorted(chosen, key=lambda n: (nodes[n].depth, -nodes[n].score, n))
        index = {n: i for i, n in enumerate(ordered)}
        parents = [index[nodes[n].parent] if nodes[n].parent >= 0 else -1 for n in ordered]
        draft_ids = torch.tensor([nodes[n].draft_id for n in ordered], dtype=torch.long, device=self.head.device)
        tokens = self.head.to_target_ids(draft_ids) if ordered else _EMPTY.to(self.head.device)
        return DraftTree(tokens=tokens, parents=torch.tensor(parents, dtype=torch.long, device=self.head.device))

    def _proposal(self, nodes: list[_Node], chosen: list[int], used: int) -> _Proposal:
        ordered = sorted(chosen, key=lambda n: (nodes[n].depth, -nodes[n].score, n))
        index = {n: i for i, n in enumerate(ordered)}
        ids = torch.tensor([nodes[n].draft_id for n in ordered], dtype=torch.long, device=self.head.device)
        tokens = self.head.to_target_ids(ids).tolist() if ordered else []
        return _Proposal(
            tokens=[int(t) for t in tokens],
            parents=[index[nodes[n].parent] if nodes[n].parent >= 0 else -1 for n in ordered],
            conf=[math.exp(nodes[n].score) for n in ordered],
            depths=[nodes[n].depth for n in ordered],
            used=used,
        )

    # ------------------------------------------------------------------ cost model

    def expected_tokens(self, n: int) -> float:
        """Tokens a verify pass over the first ``n`` nodes of the last proposal should emit
        (bonus included): 1 + alpha * their path confidences. Lets an AutoDrafter compare this
        drafter's trees with other drafters' chains on the same footing."""
        last = self._last
        if last is None:
            return 1.0
        return 1.0 + self.alpha * sum(last.conf[: min(n, last.used)])


    def _rate(self, conf_sum: float, n: int, passes: int) -> float:
        return (1.0 + self.alpha * conf_sum) / (self.cost(n + 1) + self.head_seconds * passes)

    def _best_n(self, conf: list[float], budget: int, passes: int) -> int:
        """The N in 0..budget with the highest expected tokens per second (conf sorted best first)."""
        best_n, best_rate, total = 0, self._rate(0.0, 0, passes), 0.0
        for n in range(1, min(budget, len(conf)) + 1):
            total += conf[n - 1]
            rate = self._rate(total, n, passes)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def _expand_pays(self, nodes: list[_Node], frontier: list[int], budget: int, passes: int) -> bool:
        """One more depth adds at most alpha * (sum of the frontier's confidences) tokens and costs
        one head pass: draft it only if that bound beats the best rate so far."""
        conf = sorted((math.exp(n.score) for n in nodes), reverse=True)
        best_n = self._best_n(conf, budget, passes)
        rate = self._rate(sum(conf[:best_n]), best_n, passes)
        gain = self.alpha * sum(math.exp(nodes[n].score) for n in frontier)
        return gain > rate * self.head_seconds

    def _worth(self, conf: list[float], n: int, passes: int) -> bool:
        """Chain: keep the n-th token if it raises the expected rate over n - 1 tokens."""
        with_it = self._rate(sum(conf[:n]), n, passes)
        without = self._rate(sum(conf[: n - 1]), n - 1, passes)
        return with_it > without

    def _calibrate(self, proposal: _Proposal, emitted: list[int]) -> None:
        """Match the proposal against what the target emitted; both sides capped at len(emitted).

        Counts how deep the proposal's tree follows the emitted tokens (the acceptance it got or
        would have got) against the sum of its confidences at depths <= len(emitted), so a step
        whose emitted run was short teaches as much as a long one.
        """
        if not proposal.tokens:
            return
        children: dict[int, list[int]] = {}
        for i, p in enumerate(proposal.parents):
            children.setdefault(p, []).append(i)
        node, matched = -1, 0
        for token in emitted:
            nxt = next((c for c in children.get(node, []) if proposal.tokens[c] == token), None)
            if nxt is None:
                break
            node, matched = nxt, matched + 1
        cap = len(emitted)
        predicted = sum(c for c, d in zip(proposal.conf, proposal.depths, strict=True) if d <= cap)
        self._obs = (1 - CALIBRATION_EMA) * self._obs + CALIBRATION_EMA * matched
        self._pred = (1 - CALIBRATION_EMA) * self._pred + CALIBRATION_EMA * predicted


def measure_head_seconds(head: DraftHead, rows: int, repeats: int = 2) -> float:
    """Seconds of one head pass over ``rows`` rows on a short scratch context."""
    cfg = head.config
    context = 32
    cache = head.new_cache(context + rows)
    gen = torch.Generator(device="cpu").manual_seed(0)
    emb = torch.randn(context + rows, cfg.hidden_size, generator=gen).to(head.device, head.dtype)
    head(emb[:context], emb[:context], cache)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        head(emb[context:], emb[context:], cache)
        if head.device.type == "cuda":
            torch.cuda.synchronize(head.device)
        best = min(best, time.perf_counter() - t0)
        cache.truncate(context)
    return best
