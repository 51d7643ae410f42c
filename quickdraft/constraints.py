"""Constraints on which tokens may come next (structured output), as a seam for the engine.

A constraint masks the target's logits at every position, the same way in plain decoding and in
verification: row i of a verify pass is masked with the state reached after ``draft[:i]``. A
drafted token the constraint forbids gets p = 0 there and is rejected like any other wrong draft,
so speculative decoding stays lossless and never leaves the grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


class Constraint(Protocol):
    def allowed(self, draft: Sequence[int], vocab_size: int) -> Tensor:
        """[len(draft) + 1, V] bool: row i = tokens allowed after the committed tokens + draft[:i].

        Rows after a draft token the constraint rejects may be anything (they are never used:
        verification stops at that token).
        """

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the state by tokens that were emitted."""

    def is_finished(self) -> bool:
        """True when the constraint admits only end-of-sequence from here."""


def apply_mask(logits: Tensor, allowed: Tensor) -> Tensor:
    """Forbidden tokens get -inf. logits [N, V'] (V' >= V may be a padded vocabulary)."""
    v = allowed.shape[-1]
    out = logits.clone()
    out[:, :v].masked_fill_(~allowed.to(out.device), float("-inf"))
    out[:, v:] = float("-inf")
    return out
