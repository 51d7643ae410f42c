"""Tree speculation: structure, masks and positions, greedy and sampled verification (lossless as
a distribution), and the engine end to end: tree drafters must give exactly plain greedy output,
leave the cache as plain decoding does, reproduce seeded sampling, and feed target features.

Everything runs with one compute thread (restored afterwards), as in test_spec.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SHAPES, TINY_PROMPT, RandomTree, Run, TreeOracle, generate, ids, tree
from tiny import make_tiny_hf_model

from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.forward_pass import causal_mask
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import capture_layers_of
from quickdraft.speculative.policy import Acceptance, AutoDrafter, Candidate, TargetCost
from quickdraft.speculative.tree import (
    DraftTree,
    TreeVerdict,
    ancestor_mask,
    chain_tree,
    cut_tree,
    tree_chain,
    tree_mask,
    tree_positions,
    verify_tree_greedy,
    verify_tree_sampled,
)
from quickdraft.speculative.verify import Draft

N = 40  # greedy tokens per tiny run


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module


# The example of quickdraft/speculative/tree.py's docstring:
#   root -+- a(0) -+- c(2) --- e(4)
#         |        +- d(3)
#         +- b(1)
EXAMPLE = tree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2])


# ------------------------------------------------------------------------------ structure


def test_structure_of_a_hand_built_tree() -> None:
    t = EXAMPLE
    assert t.k == 5 and t.depth == 3
    assert t.depths() == (1, 1, 2, 2, 3)
    assert t.children(-1) == (0, 1) and t.children(0) == (2, 3) and t.children(1) == ()
    assert t.path(4) == [0, 2, 4] and t.path(1) == [1] and t.path(-1) == []
    assert t.first_child_path() == [0, 2, 4]
    assert tree([1, 2, 3], [-1, -1, 1]).first_child_path() == [0]


def test_ancestor_mask_positions_and_mask_exact() -> None:
    expected_anc = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [0, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 0, 0, 1, 0],
            [1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_mask(EXAMPLE), expected_anc)
    assert torch.equal(tree_positions(7, EXAMPLE), ids(7, 8, 8, 9, 9, 10))
    # start = 3: prefix slots 0..2, root slot 3, nodes at slots 4..8.
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0, 0, 0],  # root
            [1, 1, 1, 1, 1, 0, 0, 0, 0],  # a
            [1, 1, 1, 1, 0, 1, 0, 0, 0],  # b
            [1, 1, 1, 1, 1, 0, 1, 0, 0],  # c: root, a, c
            [1, 1, 1, 1, 1, 0, 0, 1, 0],  # d: root, a, d
            [1, 1, 1, 1, 1, 0, 1, 0, 1],  # e: root, a, c, e
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_mask(3, EXAMPLE), expected)
    # At the very start of a cache (no prefix) too.
    assert torch.equal(tree_mask(0, EXAMPLE), expected[:, 3:])
    empty = tree([], [])
    assert torch.equal(tree_mask(2, empty), torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(tree_positions(2, empty), ids(2))


def test_chain_tree_is_the_causal_case() -> None:
    draft = Draft(ids(5, 6, 7, 8), probs=torch.full((4, 3), 1 / 3))
    t = chain_tree(draft)
    assert t.parent_list() == (-1, 0, 1, 2) and t.depth == 4
    assert t.probs is draft.probs
    causal = causal_mask(6, 5, torch.device("cpu"))
    assert causal is not None and torch.equal(tree_mask(6, t), causal)
    assert torch.equal(tree_positions(6, t), torch.arange(6, 11))
    back = tree_chain(t)
    assert torch.equal(back.tokens, draft.tokens)
    assert back.probs is not None and torch.equal(back.probs, draft.probs)


def test_tree_chain_and_cut() -> None:
    probs = torch.eye(5)[:, :]  # row i is one-hot on i: tells which nodes were kept
    t = tree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2], probs)
    chain = tree_chain(t)
    assert chain.tokens.tolist() == [10, 12, 14]
    assert chain.probs is not None and chain.probs.argmax(-1).tolist() == [0, 2, 4]
    cut = cut_tree(t, 3)
    assert cut.tokens.tolist() == [10, 11, 12] and cut.parent_list() == (-1, -1, 0)
    assert cut.probs is not None and cut.probs.shape == (3, 5)
    assert cut_tree(t, 9) is t


@pytest.mark.parametrize(
    ("tokens", "parents", "probs", "match"),
    [
        ([1, 2], [-1], None, "parents must have the shape"),
        ([[1, 2]], [[-1, 0]], None, "1-D"),
        ([1, 2, 3], [-1, 1, 0], None, r"parents\[1\] = 1"),
        ([1, 2, 3], [-1, 0, 5], None, r"parents\[2\] = 5"),
        ([1, 2], [-2, 0], None, r"parents\[0\] = -2"),
        ([1, 2], [-1, 0], torch.zeros(3, 4), "probs must be"),
        ([1, 2], [-1, 0], torch.zeros(2), "probs must be"),
    ],
)
def test_invalid_trees_raise(tokens: Any, parents: Any, probs: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DraftTree(torch.tensor(tokens), torch.tensor(parents), probs)


def test_float_tokens_raise() -> None:
    with pytest.raises(ValueError, match="integer"):
        DraftTree(torch.tensor([1.0]), ids(-1))


# ------------------------------------------------------------------------------ greedy


def test_greedy_whole_path_right_gets_bonus() -> None:
    # Target argmax per row (root, a, b, c, d, e): root -> 10 (a), a -> 12 (c), c -> 14 (e),
    # e -> 99 (the bonus); the rows of b and d are not on the path.
    v = verify_tree_greedy(ids(10, 12, 5, 14, 6, 99), EXAMPLE)
    assert isinstance(v, TreeVerdict)
    assert v.num_accepted == 3 and v.path.tolist() == [0, 2, 4]
    assert v.tokens.tolist() == [10, 12, 14, 99]
    assert v.rows.tolist() == [0, 1, 3, 5]


def test_greedy_all_wrong_emits_the_roots_argmax() -> None:
    v = verify_tree_greedy(ids(42, 12, 1, 14, 1, 1), EXAMPLE)
    assert v.num_accepted == 0 and v.path.tolist() == [] and v.tokens.tolist() == [42]
    assert v.rows.tolist() == [0]


def test_greedy_right_path_is_not_the_first_child() -> None:
    # root -> 11 (b, the second child), b is a leaf: its row gives the bonus.
    v = verify_tree_greedy(ids(11, 12, 77, 0, 0, 0), EXAMPLE)
    assert v.num_accepted == 1 and v.path.tolist() == [1] and v.tokens.tolist() == [11, 77]
    # root -> a, a -> 13 (d, a's second child), d's row gives the bonus.
    v = verify_tree_greedy(ids(10, 13, 0, 0, 55, 0), EXAMPLE)
    assert v.path.tolist() == [0, 3] and v.tokens.tolist() == [10, 13, 55]
    assert v.rows.tolist() == [0, 1, 4]


def test_greedy_partly_right_stops_at_the_first_mismatch() -> None:
    # root -> a right, a's row wants 50: neither c (12) nor d (13); e's row is never read.
    v = verify_tree_greedy(ids(10, 50, 0, 0, 0, 14), EXAMPLE)
    assert v.path.tolist() == [0] and v.tokens.tolist() == [10, 50]
    # A right token on a wrong branch does not count: c's row says 14 but c itself is wrong.
    v = verify_tree_greedy(ids(10, 13, 14, 14, 3, 0), EXAMPLE)
    assert v.path.tolist() == [0, 3] and v.tokens.tolist() == [10, 13, 3]


def test_greedy_duplicate_siblings_take_the_first() -> None:
    t = tree([5, 5, 6], [-1, -1, 1])  # node 2 hangs under the second 5
    v = verify_tree_greedy(ids(5, 8, 6, 9), t)
    assert v.path.tolist() == [0] and v.tokens.tolist() == [5, 8]


def test_greedy_empty_tree_and_shape_check() -> None:
    v = verify_tree_greedy(ids(3), tree([], []))
    assert v.num_accepted == 0 and v.tokens.tolist() == [3]
    with pytest.raises(ValueError, match=r"\[N\+1\]"):
        verify_tree_greedy(ids(1, 2), EXAMPLE)


def test_greedy_chain_tree_agrees_with_verify_greedy() -> None:
    from quickdraft.speculative.verify import verify_greedy

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        target = torch.randint(0, 3, (k + 1,), generator=gen)
        draft = Draft(torch.randint(0, 3, (k,), generator=gen))
        chain = verify_greedy(target, draft)
        v = verify_tree_greedy(target, chain_tree(draft))
        assert v.tokens.tolist() == chain.tokens.tolist()
        assert v.num_accepted == chain.num_accepted
        assert v.path.tolist() == list(range(chain.num_accepted))


# ----------------------------------------------------------------------- sampled (lossless)

V = 6
TRIALS = 12_000


def _dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# The "target": the first token follows P1, the second P2[first], the third P3 (any fixed row).
P1 = _dist(0.30, 0.25, 0.0, 0.20, 0.15, 0.10)  # token 2 is excluded (as top-k/top-p would do)
P2 = torch.stack(
    [
        _dist(0.5, 0.1, 0.1, 0.1, 0.1, 0.1),
        _dist(0.0, 0.0, 0.6, 0.4, 0.0, 0.0),
        _dist(1, 1, 1, 1, 1, 1),
        _dist(0.05, 0.05, 0.05, 0.05, 0.4, 0.4),
        _dist(0.2, 0.3, 0.1, 0.1, 0.2, 0.1),
        _dist(0.1, 0.2, 0.3, 0.2, 0.1, 0.1),
    ]
)
P3 = _dist(0.2, 0.2, 0.2, 0.2, 0.1, 0.1)
# A draft that is far from the target (total variation ~0.5), and covers the excluded token.
Q1 = _dist(0.05, 0.05, 0.4, 0.05, 0.05, 0.4)
Q2 = _dist(0.4, 0.3, 0.1, 0.1, 0.05, 0.05)


def target_rows(t: DraftTree) -> torch.Tensor:
    """p for every row of ``t``: what a real target computes from each row's path."""
    rows = [P1]
    tokens = t.tokens.tolist()
    for i, depth in enumerate(t.depths()):
        rows.append(P2[tokens[i]] if depth == 1 else P3)
    return torch.stack(rows)


def pearson_z(samples: list[int], expected: torch.Tensor) -> float:
    """Chi-square goodness of fit as a z-score; bins expecting < 5 pooled. Samples the target
    excludes are an immediate failure."""
    counts = torch.bincount(torch.tensor(samples), minlength=expected.numel()).double()
    assert not ((counts > 0) & (expected == 0)).any(), "sampled a token the target excludes"
    exp = counts.sum() * expected.double()
    big = exp >= 5
    o = torch.cat([counts[big], counts[~big].sum().view(1)])
    e = torch.cat([exp[big], exp[~big].sum().view(1)])
    o, e = o[e > 0], e[e > 0]
    df = len(o) - 1
    stat = float(((o - e) ** 2 / e).sum())
    return (stat - df) / math.sqrt(2 * df)


TreeMaker = Callable[[torch.Generator], DraftTree]


def deterministic_tree(gen: torch.Generator) -> DraftTree:
    """Top-k style: fixed tokens, duplicates and the excluded token among them; q one-hot."""
    # root: 0, 2 (excluded by p), 0 (duplicate), 3; under the first 0: 0, 4; under 3: 5.
    return tree([0, 2, 0, 3, 0, 4, 5], [-1, -1, -1, -1, 0, 0, 3])


def iid_tree(gen: torch.Generator) -> DraftTree:
    """Three root children i.i.d. from Q1, two grandchildren under the first from Q2."""
    first = torch.multinomial(Q1, 3, replacement=True, generator=gen)
    second = torch.multinomial(Q2, 2, replacement=True, generator=gen)
    probs = torch.stack([Q1, Q1, Q1, Q2, Q2])
    return DraftTree(torch.cat([first, second]), ids(-1, -1, -1, 0, 0), probs)


def without_replacement_tree(gen: torch.Generator) -> DraftTree:
    """Root children drawn from Q1 without replacement: each one's q is Q1 minus the earlier ones,
    renormalised (what it was actually drawn from)."""
    tokens, probs, q = [], [], Q1.clone()
    for _ in range(3):
        x = int(torch.multinomial(q, 1, generator=gen))
        tokens.append(x)
        probs.append(q.clone())
        q[x] = 0.0
        q = q / q.sum()
    child = int(torch.multinomial(Q2, 1, generator=gen))
    return DraftTree(ids(*tokens, child), ids(-1, -1, -1, 1), torch.stack(probs + [Q2]))


def mixed_tree(gen: torch.Generator) -> DraftTree:
    """A deterministic (one-hot) first child, then a sampled sibling with a sampled child."""
    x = int(torch.multinomial(Q1, 1, generator=gen))
    y = int(torch.multinomial(Q2, 1, generator=gen))
    one_hot = torch.zeros(V)
    one_hot[3] = 1.0
    return DraftTree(ids(3, x, y), ids(-1, -1, 1), torch.stack([one_hot, Q1, Q2]))


def run_trials(make: TreeMaker, trials: int = TRIALS) -> tuple[list[int], list[int], list[int]]:
    """First tokens, second tokens (completed from P2[first] when a step emitted only one, as the
    next plain step would) and the number of tokens each step accepted."""
    gen = torch.Generator().manual_seed(1234)  # drafts
    verify_gen = torch.Generator().manual_seed(99)  # verification
    firsts, seconds, accepted = [], [], []
    for _ in range(trials):
        t = make(gen)
        v = verify_tree_sampled(target_rows(t), t, verify_gen)
        out = v.tokens.tolist()
        assert len(out) == v.num_accepted + 1 == len(v.path) + 1
        # The accepted path really is a path, and its tokens are the nodes' tokens.
        path = v.path.tolist()
        assert path == t.path(path[-1] if path else -1)
        assert out[:-1] == [int(t.tokens[i]) for i in path]
        if len(out) == 1:
            out.append(int(torch.multinomial(P2[out[0]], 1, generator=gen)))
        firsts.append(out[0])
        seconds.append(out[1])
        accepted.append(v.num_accepted)
    return firsts, seconds, accepted


@pytest.mark.parametrize(
    "make", [deterministic_tree, iid_tree, without_replacement_tree, mixed_tree], ids=lambda f: f.__name__
)
def test_sampled_tree_emits_exactly_p(make: TreeMaker) -> None:
    firsts, seconds, accepted = run_trials(make)
    assert 0 < sum(a > 0 for a in accepted) < TRIALS  # both accept and reject paths ran
    if make is not mixed_tree:
        assert any(a >= 2 for a in accepted)  # and second-level acceptances
    assert pearson_z(firsts, P1) < 5, "first token"
    # The joint of the first two tokens is P1(x) * P2[x](y): check each common x's conditional.
    for x in range(V):
        given = [s for f, s in zip(firsts, seconds, strict=True) if f == x]
        if len(given) > 500:
            assert pearson_z(given, P2[x]) < 5, f"second token after {x}"


def test_the_distribution_check_has_power() -> None:
    """Accepting the first child blindly gives the draft's distribution: the same statistic flags
    it, even with the excluded token filtered out."""
    gen = torch.Generator().manual_seed(5)
    blind = [int(iid_tree(gen).tokens[0]) for _ in range(2000)]
    counts = torch.bincount(torch.tensor(blind), minlength=V).double()
    assert counts[2] > 0  # the draft proposes the excluded token: a fit test would fail outright
    allowed = [b for b in blind if b != 2]
    assert pearson_z(allowed, P1) > 5


def test_sampled_is_reproducible_and_uses_only_its_generator() -> None:
    t = iid_tree(torch.Generator().manual_seed(3))
    p = target_rows(t)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # the global RNG must not matter
        gen = torch.Generator().manual_seed(11)
        runs.append([verify_tree_sampled(p, t, gen).tokens.tolist() for _ in range(30)])
        torch.rand(100)
    assert runs[0] == runs[1]


def test_sampled_certain_paths() -> None:
    """p one-hot on the drafted tokens: the whole path is accepted and the bonus drawn from the
    leaf's row; p zero on every child: nothing is accepted and the residual has no drafted token."""
    t = tree([1, 4, 2], [-1, -1, 1])
    p = torch.zeros(4, V)
    p[0, 4] = 1.0  # root -> node 1 (the second child)
    p[2, 2] = 1.0  # node 1 -> node 2
    p[3, 5] = 1.0  # node 2's row: the bonus
    p[1, 0] = 1.0  # never read
    v = verify_tree_sampled(p, t, torch.Generator().manual_seed(0))
    assert v.path.tolist() == [1, 2] and v.tokens.tolist() == [4, 2, 5]
    p = torch.zeros(4, V)
    p[0] = _dist(0, 0, 0, 1, 0, 1)
    for seed in range(20):
        v = verify_tree_sampled(p, t, torch.Generator().manual_seed(seed))
        assert v.num_accepted == 0 and v.tokens.tolist()[0] in (3, 5)


def test_sampled_shape_checks() -> None:
    gen = torch.Generator()
    with pytest.raises(ValueError, match=r"\[N\+1, V\]"):
        verify_tree_sampled(torch.ones(3, V) / V, EXAMPLE, gen)
    t = tree([1], [-1], torch.ones(1, V + 1) / (V + 1))
    with pytest.raises(ValueError, match="columns"):
        verify_tree_sampled(torch.ones(2, V) / V, t, gen)


# --------------------------------------------------------------------------- engine, tiny model


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tree")


@pytest.fixture(scope="module")
def tiny(tiny_root: Path) -> LoadedModel:
    return load_model(str(make_tiny_hf_model(tiny_root, "llama", seed=21)), dtype="float32", max_context=256)


@pytest.fixture(scope="module")
def prompt(tiny: LoadedModel) -> list[int]:
    return tiny.tokenizer.encode(TINY_PROMPT)


@pytest.fixture(scope="module")
def plain(tiny: LoadedModel, prompt: list[int]) -> Run:
    run = generate(tiny, prompt, max_tokens=N, ignore_eos=True)
    assert len(run.ids) == N
    return run


def cache_of(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    cache = run.engine.cache
    return cache.k[:, :, : cache.length], cache.v[:, :, : cache.length]


def check_tree_run(loaded: LoadedModel, prompt: list[int], plain: Run, shape: str, k: int) -> Run:
    drafter = TreeOracle(plain.ids, loaded.config.vocab_size, shape)
    run = generate(loaded, prompt, drafter, k, max_tokens=len(plain.ids), ignore_eos=True)
    assert run.ids == plain.ids
    stats, log = run.stats, drafter.log
    assert stats.drafted == sum(n for n, _, _ in log) > 0
    assert stats.accepted == sum(a for _, _, a in log)
    assert stats.accepted + stats.target_passes == len(plain.ids) - 1
    depth = max(d for _, d, _ in log)
    assert stats.drafted_per_position == [sum(d > i for _, d, _ in log) for i in range(depth)]
    assert stats.accepted_per_position == [sum(a > i for _, _, a in log) for i in range(depth)]
    # The cache holds exactly what plain decoding wrote, slot for slot, bit for bit.
    (k0, v0), (k1, v1) = cache_of(plain), cache_of(run)
    assert k1.shape == k0.shape
    assert torch.equal(k1, k0) and torch.equal(v1, v0)
    return run


@pytest.mark.parametrize("k", [3, 8, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tiny_tree_drafters_match_plain_greedy(
    tiny: LoadedModel, prompt: list[int], plain: Run, shape: str, k: int
) -> None:
    run = check_tree_run(tiny, prompt, plain, shape, k)
    if shape in ("chain", "right_last", "right_varied") and k >= 8:  # each level holds the truth
        assert run.stats.target_passes < len(plain.ids) // 2  # so paths of depth >= 2 pass
    if shape == "wrong":
        assert run.stats.accepted == 0


def test_tiny_tree_logprobs_are_those_of_the_kept_rows(tiny: LoadedModel, prompt: list[int], plain: Run) -> None:
    """Logprobs come from the accepted path's rows, not from the rows of their tree indices."""
    want = generate(tiny, prompt, max_tokens=N, ignore_eos=True, logprobs=3)
    drafter = TreeOracle(plain.ids, tiny.config.vocab_size, "right_last")
    run = generate(tiny, prompt, drafter, 8, max_tokens=N, ignore_eos=True, logprobs=3)
    assert run.ids == plain.ids and run.stats.accepted > 0
    got_lp = [lp for s in run.steps for lp in s.logprobs or []]
    want_lp = [lp for s in want.steps for lp in s.logprobs or []]
    assert len(got_lp) == len(want_lp) == N
    assert got_lp == want_lp  # bitwise: the kept rows are batch-invariant


PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}


@pytest.mark.parametrize("shape", ["right_last", "right_varied", "partly", "trap"])
def test_tiny_tree_with_penalties_matches_plain(tiny: LoadedModel, prompt: list[int], shape: str) -> None:
    """Penalties see each row's own branch: the decoys put the next true token on a wrong branch,
    so a row that counted its siblings' tokens would be penalised differently from plain decoding."""
    plain = generate(tiny, prompt, max_tokens=N, ignore_eos=True, **PENALTIES)
    unpenalised = generate(tiny, prompt, max_tokens=N, ignore_eos=True)
    assert plain.ids != unpenalised.ids  # the penalties matter
    drafter = TreeOracle(plain.ids, tiny.config.vocab_size, shape)
    run = generate(tiny, prompt, drafter, 8, max_tokens=N, ignore_eos=True, **PENALTIES)
    assert run.ids == plain.ids
    assert run.stats.accepted > 0


class NoRepeat:
    """A constraint that depends on the drafted tokens: never the same token twice in a row, and
    never ``banned``."""

    def __init__(self, last: int, banned: int) -> None:
        self.last, self.banned = last, banned

    def allowed(self, draft: Sequence[int], vocab_size: int) -> torch.Tensor:
        rows = torch.ones(len(draft) + 1, vocab_size, dtype=torch.bool)
        for i, prev in enumerate([self.last, *draft]):
            rows[i, prev] = False
            rows[i, self.banned] = False
        return rows

    def commit(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.last = tokens[-1]

    def is_finished(self) -> bool:
        return False


def test_tiny_tree_with_a_constraint_verifies_the_first_child_chain(
    tiny: LoadedModel, prompt: list[int], plain: Run
) -> None:
    banned = plain.ids[3]
    plain_c = generate(tiny, prompt, max_tokens=N, ignore_eos=True, constraint=NoRepeat(prompt[-1], banned))
    assert plain_c.ids != plain.ids and banned not in plain_c.ids
    drafter = TreeOracle(plain_c.ids, tiny.config.vocab_size, "right_varied", first_child_only=True)
    run = generate(
        tiny, prompt, drafter, 8, max_tokens=N, ignore_eos=True, constraint=NoRepeat(prompt[-1], banned)
    )
    assert run.ids == plain_c.ids
    # Only the first-child chains were verified: one node per level, right where slot(d) == 0.
    assert run.stats.drafted < sum(n for n, _, _ in drafter.log)
    assert run.stats.accepted > 0


def test_tree_larger_than_asked_is_refused(tiny: LoadedModel, prompt: list[int], plain: Run) -> None:
    class Greedy(TreeOracle):
        def propose(self, k: int) -> DraftTree:
            return tree([1] * (k + 1), [-1] * (k + 1))

    with pytest.raises(ValueError, match="more than"):
        generate(tiny, prompt, Greedy(plain.ids, tiny.config.vocab_size, "chain"), 3, max_tokens=8)


def test_tree_drafter_through_auto_drafter(tiny: LoadedModel, prompt: list[int], plain: Run) -> None:
    cost = TargetCost({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    drafter = TreeOracle(plain.ids, tiny.config.vocab_size, "right_last")
    auto = AutoDrafter([Candidate(drafter, Acceptance(0.8, 8), 0.0, cheap=True)], cost, fixed_k=8)
    run = generate(tiny, prompt, auto, 8, max_tokens=N, ignore_eos=True)
    assert run.ids == plain.ids
    assert run.stats.accepted > 0 and auto.usage["tree-oracle"] > 0
    # 8-node trees (3 siblings and a decoy per level) reach depth 3 (the second level's decoy)
    # and accept 2. Acceptance is tracked per depth: position 3 failed every time, positions 4..
    # were never tried and keep their prior, although each proposal had k = 8 nodes.
    rates = auto.candidates[0].acceptance.rates
    assert rates[3:] == [0.8] * 5
    assert rates[2] < 0.1 and rates[0] > 0.5  # (the last, budget-cut trees miss level 1)


# ------------------------------------------------------------------------------- sampling


def test_seeded_sampling_with_a_tree_drafter_reproduces(tiny: LoadedModel, prompt: list[int]) -> None:
    params: dict[str, Any] = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    first, again = (generate(tiny, prompt, RandomTree(tiny.config.vocab_size), 6, seed=5, **params) for _ in range(2))
    assert first.ids == again.ids and len(first.ids) == 24
    assert first.stats.drafted > 0
    other = generate(tiny, prompt, RandomTree(tiny.config.vocab_size), 6, seed=6, **params)
    assert other.ids != first.ids
    # A seed means one answer: plain sampling's, whatever the tree drafted.
    assert first.ids == generate(tiny, prompt, seed=5, **params).ids
    # Penalties on: each row processed with its own history, still plain sampling's answer.
    pen = params | PENALTIES
    a, b = (generate(tiny, prompt, RandomTree(tiny.config.vocab_size), 6, seed=5, **pen) for _ in range(2))
    assert a.ids == b.ids == generate(tiny, prompt, seed=5, **pen).ids


# ---------------------------------------------------------------------------------- feed()


class Recorder(TreeOracle):
    """A tree oracle that takes target features and records each feed, checking the protocol's
    timing: after every commit it holds a feature for every committed token but the newest."""

    def __init__(self, truth: list[int], vocab: int, shape: str, layers: tuple[int, ...]) -> None:
        super().__init__(truth, vocab, shape)
        self.capture_layers = layers
        self.fed: list[torch.Tensor] = []

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        assert cached == 0  # it holds no features across requests (covered is 0)
        super().prefill(prompt_ids, params)
        self.fed = []

    def covered(self, prompt_ids: torch.Tensor) -> int:
        return 0

    def feed(self, hidden: torch.Tensor) -> None:
        self.fed.append(hidden.clone())

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        super().commit(tokens, num_accepted)
        assert sum(h.shape[0] for h in self.fed) == len(self.context) - 1

    def features(self) -> torch.Tensor:
        return torch.cat(self.fed)


class ChainRecorder(Recorder):
    """The same, proposing chains (partly right) instead of trees."""

    def propose(self, k: int) -> Draft | DraftTree:
        t = super().propose(k)
        assert isinstance(t, DraftTree)
        self.proposed = tree(t.tokens.tolist(), list(range(-1, t.k - 1)))  # the nodes as a chain
        return Draft(t.tokens)


def reference_features(loaded: LoadedModel, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The captured inputs of ``layers`` for ``tokens`` decoded one at a time (plain decoding)."""
    model = loaded.model
    cache = model.new_cache()
    order = tuple(sorted(set(layers)))
    rows = []
    for t in tokens:
        _, captured = model(ids(t), cache, capture=order)
        by_layer = dict(zip(order, captured, strict=True))
        rows.append(torch.cat([by_layer[i] for i in layers], dim=-1))
    return torch.cat(rows)


@pytest.mark.parametrize(("shape", "chain"), [("right_varied", False), ("partly", False), ("chain_partly", True)])
def test_feed_gives_the_kept_rows(
    tiny: LoadedModel, prompt: list[int], plain: Run, shape: str, chain: bool
) -> None:
    layers = (2, 0, 1)  # 2 = L: the final norm's input; not in layer order on purpose
    make = ChainRecorder if chain else Recorder
    drafter = make(plain.ids, tiny.config.vocab_size, shape, layers)
    assert capture_layers_of(drafter) == layers
    run = generate(tiny, prompt, drafter, 6, max_tokens=N, ignore_eos=True)
    assert run.ids == plain.ids and run.stats.accepted > 0
    assert drafter.fed[0].shape[0] == len(prompt)  # the prefill's rows come first
    got = drafter.features()
    committed = prompt + plain.ids[:-1]  # every committed token but the newest
    want = reference_features(tiny, committed, layers)
    assert got.shape == want.shape == (len(committed), 3 * tiny.config.hidden_size)
    assert got.dtype == tiny.model.dtype
    # Verify rows are batch-invariant: bitwise what plain decoding computes. The prefill ran as one
    # pass, so its rows only match closely.
    p = len(prompt)
    assert torch.equal(got[p:], want[p:])
    torch.testing.assert_close(got[:p], want[:p], rtol=1e-4, atol=1e-4)


def test_auto_drafter_forwards_features(tiny: LoadedModel, prompt: list[int], plain: Run) -> None:
    cost = TargetCost({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    a = Recorder(plain.ids, tiny.config.vocab_size, "right_last", (2, 0))
    b = Recorder(plain.ids, tiny.config.vocab_size, "partly", (1,))
    auto = AutoDrafter(
        # Not cheap: only the chosen candidate (the first, fixed_k ties) proposes; b never drafts
        # but still gets every feature row.
        [Candidate(a, Acceptance(0.9, 8), 0.0, cheap=False), Candidate(b, Acceptance(0.2, 8), 0.0, cheap=False)],
        cost,
        fixed_k=5,
    )
    assert auto.capture_layers == (0, 1, 2)
    run = generate(tiny, prompt, auto, 5, max_tokens=N, ignore_eos=True)
    assert run.ids == plain.ids
    assert auto.usage["tree-oracle"] > 0 and b.log == []
    committed = prompt + plain.ids[:-1]
    p = len(prompt)
    for rec in (a, b):
        want = reference_features(tiny, committed, rec.capture_layers)
        got = rec.features()
        assert got.shape == want.shape
        assert torch.equal(got[p:], want[p:])


def test_feature_layers_beyond_the_model_are_refused(tiny: LoadedModel, prompt: list[int], plain: Run) -> None:
    drafter = Recorder(plain.ids, tiny.config.vocab_size, "chain", (0, 7))
    with pytest.raises(QuickdraftError, match="layers"):
        generate(tiny, prompt, drafter, 4, max_tokens=8)


# ------------------------------------------------------------------------ real SmolLM2 (GGUF)

SMOL_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef"


@pytest.mark.slow
def test_smollm2_quantized_tree_matches_plain(smollm2_gguf: Path) -> None:
    loaded = load_model(str(smollm2_gguf), max_context=128)  # the default (quantized) mode
    prompt = loaded.tokenizer.encode(SMOL_PROMPT)
    plain = generate(loaded, prompt, max_tokens=20, ignore_eos=True)
    for shape in ("right_last", "partly"):
        check_tree_run(loaded, prompt, plain, shape, 8)
