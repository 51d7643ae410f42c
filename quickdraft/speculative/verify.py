"""Verification of a drafted chain against the target: pure tensor math, no engine, no cache.

Speculative sampling as in Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers
via Speculative Decoding", and Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling". Convention: p is the target distribution, q the draft distribution. A
drafter proposes k tokens x_0..x_{k-1}, x_i drawn from q_i; the target scores all k+1 positions
in one forward pass, giving p_0..p_k (row i predicts the token after draft[:i]).

- accepted tokens: the leading draft tokens that pass the test, n of them (0 <= n <= k);
- bonus token: when all k are accepted, one more token drawn from p_k;
- recovered token: after the first rejection, at position n, a token drawn from
  norm(max(0, p_n - q_n)), the part of p that q under-covers.

Each step therefore emits n + 1 tokens, and their distribution is exactly that of sampling from p
token by token: the method is lossless. A deterministic drafter (n-gram lookup, greedy draft model)
passes ``probs=None``, meaning q_i is one-hot on x_i: then x_i is accepted with probability p_i(x_i)
and a rejection recovers from p_i with x_i removed.

Greedy decoding is the special case where p is one-hot on the argmax: accept the longest prefix that
matches the target's argmax, then emit the target's argmax at the first mismatch (or the bonus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft.sampling import sample_tokens


@dataclass(frozen=True)
class Draft:
    """A chain of k drafted tokens and, for a sampling drafter, the q each was drawn from."""

    tokens: Tensor  # [k] long, k may be 0
    probs: Tensor | None = None  # [k, V] q at each drafted position; None = one-hot (deterministic)

    def __post_init__(self) -> None:
        # Shape checks only: they read metadata and never sync with the device.
        if self.tokens.dim() != 1:
            raise ValueError(f"Draft.tokens must be 1-D [k], got shape {tuple(self.tokens.shape)}")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != self.k):
            raise ValueError(
                f"Draft.probs must be [k, V] with k={self.k}, got shape {tuple(self.probs.shape)}"
            )

    @property
    def k(self) -> int:
        """Number of drafted tokens."""
        return int(self.tokens.shape[0])

    def to(self, device: torch.device) -> Draft:
        """This draft on ``device`` (drafters propose on the host; the target may run on a GPU)."""
        if self.tokens.device == device and (self.probs is None or self.probs.device == device):
            return self
        return Draft(self.tokens.to(device), None if self.probs is None else self.probs.to(device))


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification step."""

    tokens: Tensor  # [n + 1] long: n accepted draft tokens, then the bonus or recovered token
    num_accepted: int  # n


def verify_greedy(target_tokens: Tensor, draft: Draft) -> Verdict:
    """Accept the longest prefix of the draft equal to the target's greedy choices.

    target_tokens [k+1]: the target's argmax at each position (row i follows draft[:i]). The emitted
    tokens are target_tokens[:n+1]: the accepted ones equal the draft, and target_tokens[n] is the
    correction after a mismatch or, when n == k, the bonus token.
    """
    k = draft.k
    if target_tokens.shape != (k + 1,):
        raise ValueError(
            f"target_tokens must be [k+1] = [{k + 1}], got {tuple(target_tokens.shape)}"
        )
    matches = draft.tokens.to(target_tokens.device) == target_tokens[:k]  # [k] bool
    n = int(matches.long().cumprod(0).sum())  # sync: the host needs n to slice and report
    return Verdict(tokens=target_tokens[: n + 1], num_accepted=n)


def verify_sampled(p: Tensor, draft: Draft, generator: torch.Generator) -> Verdict:
    """Speculative sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order.

    p [k+1, V]: target probabilities, processed with the same SamplingParams (and context) as plain
    decoding would use. On the first rejection, at position n, the recovered token is drawn from
    norm(max(0, p_n - q_n)); if all k are accepted the bonus token is drawn from p_k.
    The randomness comes only from ``generator``, never the global RNG.
    """
    k = draft.k
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [k+1, V] = [{k + 1}, V], got {tuple(p.shape)}")
    q = None if draft.probs is None else draft.probs.unsqueeze(0)  # [1, k, V]
    n, last = _verify_sampled_batch(p.unsqueeze(0), q, draft.tokens.unsqueeze(0), generator)
    n_host = int(n[0])  # sync: the only one; the host needs n to slice and report
    tokens = torch.cat([draft.tokens[:n_host].to(last.device), last])  # [n+1]
    return Verdict(tokens=tokens, num_accepted=n_host)


def _verify_sampled_batch(
    p: Tensor,  # [B, k+1, V] target probabilities
    q: Tensor | None,  # [B, k, V] draft probabilities, or None = one-hot on tokens
    tokens: Tensor,  # [B, k] drafted tokens
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:  # n [B] long, last token [B] long
    """B independent verifications at once, without any host sync.

    verify_sampled calls it with B = 1; tests call it with many trials to measure distributions.
    Randomness drawn: k uniforms per trial, then V exponentials per trial for the last token.
    """
    batch, k1, _ = p.shape
    k = k1 - 1
    tokens = tokens.to(p.device).long()
    p_x = p[:, :k].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    if q is None:
        q_x = torch.ones_like(p_x)  # one-hot draft: q_i(x_i) = 1
    else:
        q_x = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(p_x.dtype)  # [B, k]
    u = torch.rand(batch, k, generator=generator, device=p.device, dtype=p_x.dtype)  # [B, k]
    # u in [0, 1): p >= q always accepts (ratio >= 1); q == 0 < p gives inf and accepts;
    # p == 0 never accepts (0 < 0 fails, and 0/0 = nan fails every comparison).
    accepted = u < p_x / q_x  # [B, k]
    n = accepted.long().cumprod(-1).sum(-1)  # [B], leading accepts
    weights = _last_token_weights(p, q, tokens, n)  # [B, V]
    return n, sample_tokens(weights, generator)


def _last_token_weights(p: Tensor, q: Tensor | None, tokens: Tensor, n: Tensor) -> Tensor:
    """Unnormalised distribution of the token after the n accepted ones. [B, V].

    Row n of p minus row n of q, clamped at 0 (recovered), where q at row k is zero (bonus: p_k).
    If max(0, p_n - q_n) has no mass (p_n == q_n up to rounding, so rejection had probability ~0)
    fall back to p_n rather than sample from nothing.
    """
    batch, k1, vocab = p.shape
    k = k1 - 1
    p_row = p.gather(1, n.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    if k == 0:
        return p_row
    rejected = (n < k).to(p_row.dtype).unsqueeze(-1)  # [B, 1]; 0 where the bonus is drawn
    row = n.clamp(max=k - 1)  # [B], a valid draft row even for the bonus (then masked out)
    if q is None:
        x = tokens.gather(1, row.unsqueeze(-1))  # [B, 1]
        q_row = torch.zeros_like(p_row).scatter_(-1, x, rejected)  # [B, V] one-hot or zero
    else:
        index = row.view(batch, 1, 1).expand(batch, 1, vocab)
        q_row = q.gather(1, index).squeeze(1).to(p_row.dtype) * rejected  # [B, V]
    residual = (p_row - q_row).clamp_min(0.0)  # [B, V]
    has_mass = residual.sum(-1, keepdim=True) > 0  # [B, 1]
    return torch.where(has_mass, residual, p_row)


# Public name for many independent trials at once (the selftest's distribution check uses it).
verify_sampled_batch = _verify_sampled_batch
