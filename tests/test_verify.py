"""Verification: greedy prefix rules, and the lossless promise of speculative sampling measured as
distributions. Draft tokens are drawn from q in every trial (the theorem's premise); the emitted
tokens must then follow p, whatever q is. Trials run batched through the same helper that
verify_sampled calls with a batch of one; a separate test ties the two together."""

from __future__ import annotations

import pytest
import torch

from quickdraft.sampling import SamplingParams, make_generator, probs_from_logits, process_logits
from quickdraft.speculative.verify import (
    Draft,
    _last_token_weights,
    _verify_sampled_batch,
    verify_greedy,
    verify_sampled,
)

EMPTY = torch.zeros(0, dtype=torch.long)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation between the empirical histogram of samples and p."""
    freq = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_all_accepted_gets_bonus() -> None:
    verdict = verify_greedy(ids(4, 5, 6, 7), Draft(ids(4, 5, 6)))
    assert verdict.num_accepted == 3
    assert verdict.tokens.tolist() == [4, 5, 6, 7]


def test_greedy_all_wrong_emits_target_first() -> None:
    verdict = verify_greedy(ids(4, 5, 6, 7), Draft(ids(1, 5, 6)))  # later matches do not count
    assert verdict.num_accepted == 0
    assert verdict.tokens.tolist() == [4]


@pytest.mark.parametrize("j", [0, 1, 2, 3, 4])
def test_greedy_first_mismatch_at_j(j: int) -> None:
    target = ids(10, 11, 12, 13, 14, 15)
    drafted = target[:5].clone()
    drafted[j] = 99
    drafted[j + 1 :] = target[j + 1 : 5]  # right again after j: still rejected
    verdict = verify_greedy(target, Draft(drafted))
    assert verdict.num_accepted == j
    assert verdict.tokens.tolist() == drafted[:j].tolist() + [int(target[j])]


def test_greedy_k0() -> None:
    verdict = verify_greedy(ids(9), Draft(EMPTY))
    assert verdict.num_accepted == 0
    assert verdict.tokens.tolist() == [9]


def test_greedy_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="k\\+1"):
        verify_greedy(ids(1, 2), Draft(ids(1, 2)))


def test_draft_shape_checks() -> None:
    assert Draft(ids(1, 2)).k == 2
    with pytest.raises(ValueError):
        Draft(ids(1, 2), probs=torch.zeros(3, 5))
    with pytest.raises(ValueError):
        Draft(torch.zeros(1, 2, dtype=torch.long))


# --- sampled: helpers -------------------------------------------------------------------------


def first_tokens(
    p: torch.Tensor, q: torch.Tensor | None, fixed: torch.Tensor | None, trials: int
) -> torch.Tensor:
    """First emitted token of `trials` verifications; drafts drawn from q (rows independent of the
    drafted prefix), or the fixed chain `fixed` when q is None (a deterministic drafter)."""
    gen = make_generator(1234)
    k = p.shape[0] - 1
    if q is None:
        assert fixed is not None
        tokens = fixed.expand(trials, k)
        q_b = None
    else:
        tokens = torch.multinomial(q, trials, replacement=True, generator=gen).T  # [trials, k]
        q_b = q.expand(trials, k, -1)
    n, last = _verify_sampled_batch(p.expand(trials, k + 1, -1), q_b, tokens, gen)
    if k == 0:
        return last
    return torch.where(n >= 1, tokens[:, 0], last)  # [trials]


def assert_converges(samples: torch.Tensor, p0: torch.Tensor) -> None:
    small, large = tv(samples[:5000], p0), tv(samples, p0)
    assert large < 0.01, f"TV({samples.numel()}) = {large:.4f}"
    assert large < small, f"TV did not shrink: {small:.4f} -> {large:.4f}"


P0 = dist(0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02)
P1 = dist(0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10)
P2 = dist(1, 1, 1, 1, 1, 1, 1, 1)
P = torch.stack([P0, P1, P2])  # [k+1=3, V=8]
TRIALS = 80_000


@pytest.mark.parametrize(
    "q0",
    [
        pytest.param(dist(0.28, 0.26, 0.16, 0.09, 0.09, 0.05, 0.05, 0.02), id="q-close-to-p"),
        pytest.param(dist(0.01, 0.01, 0.02, 0.06, 0.10, 0.20, 0.25, 0.35), id="q-far-from-p"),
        pytest.param(dist(0, 0, 0.5, 0.5, 0, 0, 0, 0), id="q-zero-where-p-has-mass"),
        pytest.param(dist(1, 1, 1, 1, 1, 1, 1, 1), id="q-uniform"),
    ],
)
def test_sampled_first_token_follows_p(q0: torch.Tensor) -> None:
    q = torch.stack([q0, P2])  # [k=2, V]
    samples = first_tokens(P, q, None, TRIALS)
    assert_converges(samples, P0)


@pytest.mark.parametrize("token", [0, 3, 7], ids=["likely", "middling", "unlikely"])
def test_sampled_first_token_follows_p_with_one_hot_draft(token: int) -> None:
    samples = first_tokens(P, None, ids(token, 2), TRIALS)
    assert_converges(samples, P0)


def test_one_hot_draft_on_token_target_excludes_is_never_emitted() -> None:
    p = torch.stack([dist(0.5, 0.5, 0.0, 0.0), dist(1, 1, 1, 1)])
    samples = first_tokens(p, None, ids(2), TRIALS)
    assert int((samples == 2).sum()) == 0
    assert_converges(samples, p[0])


def test_sampled_k0_samples_from_p() -> None:
    samples = first_tokens(P0.unsqueeze(0), None, EMPTY, TRIALS)
    assert_converges(samples, P0)


def test_far_q_would_fail_without_verification() -> None:
    """Power check: the drafts themselves are far from p, so passing above means something."""
    q0 = dist(0.01, 0.01, 0.02, 0.06, 0.10, 0.20, 0.25, 0.35)
    drafts = torch.multinomial(q0, TRIALS, replacement=True, generator=make_generator(0))
    assert tv(drafts, P0) > 0.3


def test_sampled_with_processed_target_and_draft() -> None:
    """p from top-k + top-p through process_logits (zeros on filtered tokens); q from a hotter,
    unfiltered draft that often proposes tokens the target filtered out."""
    gen = torch.Generator().manual_seed(9)
    target_logits = torch.randn(3, 12, generator=gen) * 2  # [k+1, V]
    draft_logits = target_logits[:2] + torch.randn(2, 12, generator=gen)  # [k, V]
    tp = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    p = probs_from_logits(process_logits(target_logits, tp, EMPTY, EMPTY, draft=ids(0, 0)))
    q = probs_from_logits(
        process_logits(draft_logits, SamplingParams(temperature=1.5), EMPTY, EMPTY)
    )
    assert int((p[0] == 0).sum()) >= 6 and float(q[0][p[0] == 0].sum()) > 0.1
    samples = first_tokens(p, q, None, TRIALS)
    assert int((p[0][samples] == 0).sum()) == 0  # never a filtered token
    assert_converges(samples, p[0])


# --- sampled: the first two tokens jointly -----------------------------------------------------


V2 = 5
JP0 = dist(0.35, 0.25, 0.2, 0.15, 0.05)  # p(x)
JP1 = torch.softmax(
    torch.randn(V2, V2, generator=torch.Generator().manual_seed(10)) * 1.5, -1
)  # p(y | x)
JQ0 = dist(0.1, 0.4, 0.1, 0.2, 0.2)  # q(x)
JQ1 = torch.softmax(
    torch.randn(V2, V2, generator=torch.Generator().manual_seed(11)), -1
)  # q(y | x)


def first_two_tokens(one_hot: bool, trials: int) -> torch.Tensor:
    """Emitted (t0, t1) per trial as t0 * V + t1, drafting k=2 from (JQ0, JQ1) and continuing with
    plain sampling from p(. | t0) when the first draft token was rejected."""
    gen = make_generator(77)
    if one_hot:  # deterministic drafter: x0 = 1, x1 = (x0 + 2) % V, always
        x0 = torch.full((trials,), 1, dtype=torch.long)
        x1 = (x0 + 2) % V2
        q = None
    else:
        x0 = torch.multinomial(JQ0, trials, replacement=True, generator=gen)  # [T]
        x1 = torch.multinomial(JQ1[x0], 1, generator=gen).squeeze(-1)  # [T], depends on x0
        q = torch.stack([JQ0.expand(trials, -1), JQ1[x0]], dim=1)  # [T, 2, V]
    p = torch.stack([JP0.expand(trials, -1), JP1[x0], torch.full((trials, V2), 1 / V2)], dim=1)
    n, last = _verify_sampled_batch(p, q, torch.stack([x0, x1], dim=1), gen)
    t0 = torch.where(n >= 1, x0, last)
    plain = torch.multinomial(JP1[t0], 1, generator=gen).squeeze(-1)  # next step, no draft
    t1 = torch.where(n >= 2, x1, torch.where(n == 1, last, plain))
    return t0 * V2 + t1


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-draft", "one-hot-draft"])
def test_sampled_first_two_tokens_follow_joint(one_hot: bool) -> None:
    joint = (JP0.unsqueeze(1) * JP1).flatten()  # [V*V], p(x) p(y | x)
    samples = first_two_tokens(one_hot, 160_000)
    small, large = tv(samples[:10_000], joint), tv(samples, joint)
    assert large < 0.012, f"TV = {large:.4f}"
    assert large < small


# --- sampled: the public function -------------------------------------------------------------


def test_verify_sampled_matches_batch_helper() -> None:
    q = torch.stack([JQ0, JQ1[1]])
    draft = Draft(ids(1, 3), probs=q)
    p = torch.stack([JP0, JP1[1], JP1[3]])
    for seed in range(20):
        verdict = verify_sampled(p, draft, make_generator(seed))
        n, last = _verify_sampled_batch(p[None], q[None], draft.tokens[None], make_generator(seed))
        assert verdict.num_accepted == int(n[0])
        assert verdict.tokens.tolist() == draft.tokens[: int(n[0])].tolist() + [int(last[0])]


def test_verify_sampled_loop_distribution() -> None:
    """The public path, one call per trial (fewer trials, looser bound)."""
    q0 = dist(0.01, 0.01, 0.02, 0.06, 0.10, 0.20, 0.25, 0.35)
    q = torch.stack([q0, P2])
    gen, draw_gen = make_generator(5), make_generator(6)
    first = []
    for _ in range(4000):
        tokens = torch.multinomial(q, 1, generator=draw_gen).squeeze(-1)  # [k]
        verdict = verify_sampled(P, Draft(tokens, probs=q), gen)
        assert verdict.tokens.shape == (verdict.num_accepted + 1,)
        assert (
            verdict.tokens[: verdict.num_accepted].tolist()
            == tokens[: verdict.num_accepted].tolist()
        )
        first.append(int(verdict.tokens[0]))
    assert tv(torch.tensor(first), P0) < 0.035


def test_verify_sampled_reproducible_and_leaves_global_rng() -> None:
    draft = Draft(ids(6, 6))
    state = torch.get_rng_state()
    a = [verify_sampled(P, draft, make_generator(s)).tokens.tolist() for s in range(30)]
    b = [verify_sampled(P, draft, make_generator(s)).tokens.tolist() for s in range(30)]
    assert a == b
    assert torch.equal(torch.get_rng_state(), state)


def test_verify_sampled_k0() -> None:
    verdict = verify_sampled(P0.unsqueeze(0), Draft(EMPTY), make_generator(0))
    assert verdict.num_accepted == 0 and verdict.tokens.shape == (1,)


def test_one_hot_target_reduces_to_greedy() -> None:
    p = torch.eye(6)[[2, 4, 1, 5]]  # [k+1=4, V]; target always picks 2, 4, 1, 5
    for drafted, n in [((2, 4, 1), 3), ((2, 0, 1), 1), ((3, 4, 1), 0)]:
        for seed in range(5):
            verdict = verify_sampled(p, Draft(ids(*drafted)), make_generator(seed))
            assert verdict.num_accepted == n
            assert verdict.tokens.tolist() == [2, 4, 1, 5][: n + 1]


def test_residual_without_mass_falls_back_to_p() -> None:
    p = dist(0.2, 0.3, 0.5).expand(1, 2, 3)  # [B=1, k+1=2, V]
    q = p[:, :1].clone()  # q == p: max(0, p - q) is all zero
    weights = _last_token_weights(p, q, ids(1)[None], n=ids(0))
    assert torch.equal(weights, p[:, 0])


def test_recovered_token_excludes_rejected_one_hot_token() -> None:
    p = dist(0.2, 0.3, 0.5).expand(1, 2, 3)
    weights = _last_token_weights(p, None, ids(2)[None], n=ids(0))
    torch.testing.assert_close(weights, torch.tensor([[0.2, 0.3, 0.0]]))
