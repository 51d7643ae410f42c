"""Prompt-lookup drafting: propose the tokens that followed the latest earlier copy of the suffix.

Prompt lookup decoding (Saxena 2023) exploits that outputs often repeat spans of their context
(code edits, quotes, summaries). Take the longest suffix of the context, from max_ngram tokens down
to min_ngram, that also occurs earlier; take its most recent earlier occurrence; propose up to k
tokens that followed it. The draft is deterministic (q one-hot), so verification stays lossless
whatever it proposes.

Worked example, tokens = [5, 6, 7, 9, 5, 6, 7, 8, 5, 6], max_ngram=3:
the 3-gram suffix [8, 5, 6] does not occur earlier; the 2-gram [5, 6] does, ending (exclusive)
at positions 2 and 6; the most recent is 6, so the proposal is tokens[6:6+k] = [7, 8, 5, 6][:k].

:func:`ngram_propose` is the stateless reference (vectorised with numpy); :class:`NGramIndex` is what
the engine uses: it keeps a dict from n-gram to its latest end position and updates it in
O(new tokens * max_ngram), so a proposal costs a few dict lookups whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from torch import Tensor

from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.verify import Draft


def _check_sizes(max_ngram: int, min_ngram: int) -> None:
    if min_ngram < 1 or max_ngram < min_ngram:
        raise QuickdraftError(
            f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
            f"max_ngram={max_ngram}; set e.g. min_ngram=1, max_ngram=4"
        )


def _as_numpy(tokens: Sequence[int] | Tensor) -> np.ndarray:
    if isinstance(tokens, Tensor):
        return tokens.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def ngram_propose(
    tokens: Sequence[int] | Tensor,  # [L]
    k: int,
    max_ngram: int = 4,
    min_ngram: int = 1,
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix.

    Returns [] when no suffix of length min_ngram..max_ngram occurs earlier, or when k <= 0.
    The earlier occurrence may overlap the suffix (in [1, 1, 1] the 2-gram [1, 1] also ends at 2).
    """
    _check_sizes(max_ngram, min_ngram)
    seq = _as_numpy(tokens)  # [L]
    length = len(seq)
    if k <= 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Windows starting at j = 0..L-1-n end at j + n <= L - 1: every occurrence but the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == seq[length - n :]).all(axis=1))
        if hits.size:
            end = int(hits[-1]) + n
            return [int(t) for t in seq[end : end + k]]
    return []


class NGramIndex:
    """Incremental prompt lookup: same proposals as :func:`ngram_propose`, in O(max_ngram) per call.

    The dict maps each n-gram (as a tuple) to the end position (exclusive) of its latest
    occurrence, excluding the occurrence that ends at the last token: that one is the suffix being
    looked up, and it is indexed only once a later token arrives.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        _check_sizes(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        """Forget all tokens (a new request)."""
        self.tokens = []
        self._last_end = {}

    def extend(self, new_tokens: Sequence[int] | Tensor) -> None:
        """Append tokens (prompt at prefill, accepted tokens after each step)."""
        new = [int(t) for t in _as_numpy(new_tokens)]
        if not new:
            return
        start = len(self.tokens)
        self.tokens.extend(new)
        # Ends start..L-1 become indexable: end `start` was the suffix end until now.
        for end in range(max(start, 1), len(self.tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._last_end[tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens after the latest earlier copy of the longest matching suffix; [] if none."""
        if k <= 0:
            return []
        length = len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._last_end.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end : end + k]
        return []

    def propose_tensor(self, k: int, device: str | torch.device = "cpu") -> Tensor:
        """:meth:`propose` as a [<=k] long tensor, ready for a Draft."""
        return torch.tensor(self.propose(k), dtype=torch.long, device=device)


class NGramDrafter(Drafter):
    """Drafter that proposes what followed the latest earlier copy of the context's suffix.

    Training-free and nearly free to run, so it pays whenever the output repeats the prompt or
    itself (code edits, summaries, lists). Deterministic: q is one-hot (Draft.probs None).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.index = NGramIndex(max_ngram, min_ngram)

    def forks(self, count: int) -> list[Drafter]:
        return [NGramDrafter(self.index.max_ngram, self.index.min_ngram) for _ in range(count)]

    def prefill(self, prompt_ids: Tensor, params: SamplingParams, cached: int = 0) -> None:
        # The index is a function of its ids alone: one that the prompt extends (the next turn of
        # a conversation) only needs the new ids; any other is rebuilt.
        ids = _as_numpy(prompt_ids)
        held = np.asarray(self.index.tokens, dtype=np.int64)
        if len(held) > len(ids) or not np.array_equal(held, ids[: len(held)]):
            self.index.reset()
            held = held[:0]
        self.index.extend(ids[len(held) :].tolist())

    def snapshot(self) -> tuple[list[int], dict[tuple[int, ...], int]]:
        return list(self.index.tokens), dict(self.index._last_end)

    def restore(self, state: object) -> None:
        tokens, last_end = cast(tuple[list[int], dict[tuple[int, ...], int]], state)
        self.index.tokens, self.index._last_end = list(tokens), dict(last_end)

    def propose(self, k: int) -> Draft:
        return Draft(tokens=self.index.propose_tensor(k))

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        self.index.extend(tokens)

    def reset(self) -> None:
        self.index.reset()
