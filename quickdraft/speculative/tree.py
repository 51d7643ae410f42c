"""Tree speculation: a drafter proposes several continuations at once, as a tree of tokens, and the
target verifies them all in ONE pass. Pure tensor math here, no engine, no cache.

The root of the tree is the last committed token (already emitted, not yet run through the target);
the N nodes are drafted tokens in topological order, ``parents[i] < i`` (-1 = a child of the root).
A chain of k tokens is the tree with ``parents = [-1, 0, 1, ..., k-2]``. Example, N = 5::

    root (last token, slot start)        node  parent  depth  target row
     +- a (0)                              0     -1      1       1
     |   +- c (2)                          1     -1      1       2
     |   |   +- e (4)                      2      0      2       3
     |   +- d (3)                          3      0      2       4
     +- b (1)                              4      2      3       5

The target pass runs over ``[root] + nodes`` (row 0 is the root, row i+1 is node i) with RoPE
positions ``start + depth`` (:func:`tree_positions`) and a mask where each row sees the committed
prefix, its ancestors and itself (:func:`tree_mask`). Row r's logits then predict the token after
the path root..r, exactly as plain decoding of that path would compute them.

Verification walks down from the root. Greedy (:func:`verify_tree_greedy`): go to the child whose
token equals the target's argmax at the current row; the first row with no such child emits its
argmax (the correction, or the bonus token at a leaf). Sampling (:func:`verify_tree_sampled`):
multi-draft speculative sampling (SpecInfer, Miao et al. 2024; "multi-round" rejection as in
EAGLE-2 and vLLM): with r = p at the current row, try the children in order; child x drawn from q
is accepted with probability min(1, r(x) / q(x)), else r <- norm(max(0, r - q)); when every child
is rejected the emitted token is drawn from r. Each try is an exact rejection-sampling step for the
current r, so the emitted token follows p exactly (lossless), whatever the drafter proposed.
Deterministic nodes (``probs=None``, e.g. top-k expansion) are the case q = one-hot: x is accepted
with probability r(x), else r(x) is set to 0 and r renormalised.

The engine keeps the KV of the accepted path only: ``cache.compact(start, verdict.rows)`` with
``rows = [0] + [1 + node for node in path]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from quickdraft.sampling import sample_tokens
from quickdraft.speculative.verify import Draft, Verdict


@dataclass(frozen=True)
class DraftTree:
    """N drafted tokens in topological order and, for a sampling drafter, the q each was drawn from.

    ``probs[i]`` is the draft distribution at node i's parent that node i was sampled from. Siblings
    may share it (i.i.d. draws) or not (e.g. drawn without replacement: then each sibling's row is
    the distribution it was actually drawn from, given the earlier siblings). A one-hot row marks a
    deterministic node inside a sampled tree. ``probs=None``: every node is deterministic.
    """

    tokens: Tensor  # [N] long
    parents: Tensor  # [N] long, parents[i] in [-1, i)
    probs: Tensor | None = None  # [N, V] or None
    # Host copies of the structure, made once at construction (trees are small: N <= ~64).
    _parents: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"DraftTree.tokens must be 1-D [N], got shape {tuple(self.tokens.shape)}")
        if self.parents.shape != self.tokens.shape:
            raise ValueError(
                f"DraftTree.parents must have the shape of tokens {tuple(self.tokens.shape)}, "
                f"got {tuple(self.parents.shape)}"
            )
        if self.tokens.is_floating_point() or self.parents.is_floating_point():
            raise ValueError("DraftTree.tokens and DraftTree.parents must be integer tensors")
        n = int(self.tokens.shape[0])
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != n):
            raise ValueError(
                f"DraftTree.probs must be [N, V] with N={n}, got shape {tuple(self.probs.shape)}"
            )
        parents = tuple(int(x) for x in self.parents.tolist())  # sync: the structure lives on the host
        children: list[list[int]] = [[] for _ in range(n + 1)]  # index 0 = root, i + 1 = node i
        depths: list[int] = []
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(
                    f"DraftTree.parents[{i}] = {parent}: each node's parent must come before it "
                    f"(-1 = the root, else 0..{i - 1}); order the nodes topologically"
                )
            children[parent + 1].append(i)
            depths.append(1 if parent < 0 else depths[parent] + 1)
        object.__setattr__(self, "_parents", parents)
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "_depths", tuple(depths))

    @property
    def k(self) -> int:
        """Number of drafted nodes N (what the target pass costs: N + 1 rows)."""
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (0 for an empty tree)."""
        return max(self._depths, default=0)

    def parent_list(self) -> tuple[int, ...]:
        return self._parents

    def depths(self) -> tuple[int, ...]:
        """depth(i) for every node: 1 for children of the root."""
        return self._depths

    def children(self, node: int) -> tuple[int, ...]:
        """The children of ``node`` in proposal order; ``node = -1`` is the root."""
        return self._children[node + 1]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` itself (its ancestors and it)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self._parents[node]
        return out[::-1]

    def first_child_path(self) -> list[int]:
        """The chain that always follows the first child: what a chain drafter would have proposed."""
        out, node = [], -1
        while self.children(node):
            node = self.children(node)[0]
            out.append(node)
        return out


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A verdict on a tree: ``tokens`` [n+1] (accepted path, then the bonus or recovered token),
    ``num_accepted`` n, and ``path`` [n] long, the accepted nodes from the root down."""

    path: Tensor

    @property
    def rows(self) -> Tensor:
        """[n+1] long: target rows (= offsets from the pass's first slot) whose KV is kept."""
        return torch.cat([self.path.new_zeros(1), self.path + 1])


def chain_tree(draft: Draft) -> DraftTree:
    """The tree form of a chain: node i is the child of node i - 1."""
    parents = torch.arange(draft.k, dtype=torch.long) - 1
    return DraftTree(tokens=draft.tokens, parents=parents.to(draft.tokens.device), probs=draft.probs)


def tree_chain(tree: DraftTree) -> Draft:
    """The chain along the tree's first children (siblings dropped), as a :class:`Draft`.

    Lossless to verify on its own: each kept node was drawn from its own q given its parent.
    """
    nodes = tree.first_child_path()
    index = torch.tensor(nodes, dtype=torch.long, device=tree.tokens.device)
    probs = None if tree.probs is None else tree.probs.index_select(0, index.to(tree.probs.device))
    return Draft(tokens=tree.tokens.index_select(0, index), probs=probs)


def cut_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first ``n`` nodes: still a tree, because parents come before their children."""
    if n >= tree.k:
        return tree
    probs = None if tree.probs is None else tree.probs[:n]
    return DraftTree(tokens=tree.tokens[:n], parents=tree.parents[:n], probs=probs)


def tree_positions(start: int, tree: DraftTree, device: torch.device | str | None = None) -> Tensor:
    """RoPE positions [N+1] of the target rows: the root at ``start``, node i at start + depth(i)."""
    device = tree.tokens.device if device is None else device
    return torch.tensor((0,) + tree.depths(), dtype=torch.long, device=device) + start


def ancestor_mask(tree: DraftTree) -> Tensor:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    rows: list[list[bool]] = []
    for i, parent in enumerate(tree.parent_list()):
        row = list(rows[parent]) if parent >= 0 else [False] * tree.k
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(tree.k, tree.k)


def tree_mask(start: int, tree: DraftTree, device: torch.device | str | None = None) -> Tensor:
    """[N+1, start+N+1] bool attention mask for the pass over ``[root] + nodes`` at slot ``start``.

    Every row sees the committed prefix (slots < start) and the root (slot start); node i's row
    (i + 1) also sees the slots of its ancestors and itself, and nothing of other branches.
    """
    device = tree.tokens.device if device is None else device
    n = tree.k
    mask = torch.zeros(n + 1, start + n + 1, dtype=torch.bool)
    mask[:, : start + 1] = True
    mask[1:, start + 1 :] = ancestor_mask(tree)
    return mask.to(device)


def _kept_rows(path: list[int], device: torch.device) -> Tensor:
    return torch.tensor([0] + [node + 1 for node in path], dtype=torch.long, device=device)


def verify_tree_greedy(target_tokens: Tensor, tree: DraftTree) -> TreeVerdict:
    """Follow the target's argmax down the tree; emit the argmax where no child matches.

    target_tokens [N+1]: the target's argmax per row (row 0 = the root, row i + 1 = node i). Among
    siblings with the same token the first one is taken. The emitted tokens are the target's argmax
    at the root and at every accepted node, so they are exactly what plain greedy decoding emits.
    """
    n = tree.k
    if target_tokens.shape != (n + 1,):
        raise ValueError(
            f"target_tokens must be [N+1] = [{n + 1}] for a tree of {n} nodes, "
            f"got {tuple(target_tokens.shape)}"
        )
    targets = target_tokens.tolist()  # sync: the walk runs on the host
    drafted = tree.tokens.tolist()
    path: list[int] = []
    node, row = -1, 0
    while True:
        match = next((c for c in tree.children(node) if drafted[c] == targets[row]), None)
        if match is None:
            break
        path.append(match)
        node, row = match, match + 1
    rows = _kept_rows(path, target_tokens.device)
    return TreeVerdict(
        tokens=target_tokens.index_select(0, rows),
        num_accepted=len(path),
        path=rows[1:] - 1,
    )


def verify_tree_sampled(p: Tensor, tree: DraftTree, generator: torch.Generator) -> TreeVerdict:
    """Multi-draft speculative sampling down the tree: the emitted tokens follow p exactly.

    p [N+1, V]: target probabilities per row (row 0 = the root, row i + 1 = node i), processed with
    the same SamplingParams and context as plain decoding would use for that row's path.
    Randomness comes only from ``generator``: N uniforms (one per node, used if the node is tried),
    then V exponentials for the last token.
    """
    n = tree.k
    if p.dim() != 2 or p.shape[0] != n + 1:
        raise ValueError(f"p must be [N+1, V] = [{n + 1}, V] for a tree of {n} nodes, got {tuple(p.shape)}")
    q = tree.probs
    if q is not None and q.shape[1] != p.shape[1]:
        raise ValueError(f"DraftTree.probs has {q.shape[1]} columns but p has {p.shape[1]}; use one vocabulary")
    uniforms = torch.rand(n, generator=generator, device=p.device, dtype=torch.float32).tolist()
    drafted = tree.tokens.tolist()
    path: list[int] = []
    node = -1
    r = p[0].float()  # the distribution still to be matched at the current row
    while True:
        accepted = None
        for child in tree.children(node):
            x = drafted[child]
            q_row = None if q is None else q[child].to(device=p.device, dtype=torch.float32)
            ratio = float(r[x]) if q_row is None else float(r[x] / q_row[x])  # sync per try
            # u in [0, 1): ratio >= 1 always accepts, r(x) == 0 never does (nan also fails).
            if uniforms[child] < ratio:
                accepted = child
                break
            if q_row is None:
                residual = r.clone()
                residual[x] = 0.0
            else:
                residual = (r - q_row).clamp_min(0.0)
            mass = float(residual.sum())
            # No mass left means the rejection had probability ~0 (rounding): keep r as it was.
            if mass > 0:
                r = residual / mass
        if accepted is None:
            last = sample_tokens(r.unsqueeze(0), generator)  # [1]
            break
        path.append(accepted)
        node = accepted
        r = p[accepted + 1].float()
    index = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
    tokens = torch.cat([tree.tokens.index_select(0, index).to(last.device), last])
    return TreeVerdict(tokens=tokens, num_accepted=len(path), path=index.to(p.device))
