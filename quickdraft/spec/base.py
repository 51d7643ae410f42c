"""The Drafter protocol: what every drafter (draft model, n-gram lookup, EAGLE-3) provides.

The engine calls, per request: ``prefill(prompt)`` once; then per step ``propose(k)`` for up to k
tokens continuing the context, and after the target's verdict ``commit(tokens, n)`` with the
tokens emitted this step (n accepted drafts followed by the bonus or recovered token).
A drafter keeps its own state (its KV cache, an n-gram index) and rolls it back itself.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from quickdraft.sampling import SamplingParams
from quickdraft.spec.verify import Draft


class Drafter(Protocol):
    name: str

    def prefill(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        """Start a request: ``prompt_ids`` [P]. ``params`` shapes q for sampling drafters."""

    def propose(self, k: int) -> Draft:
        """Up to ``k`` tokens that continue the committed context (fewer, even 0, is fine)."""

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        """``tokens`` [n+1] were emitted: the first ``num_accepted`` came from the last proposal."""

    def reset(self) -> None:
        """Forget the request."""
