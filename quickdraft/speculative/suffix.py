"""Longest-match lookup over the whole context: a suffix automaton of prompt + output.

n-gram lookup (:mod:`quickdraft.speculative.ngram`) matches the last few tokens; when an answer
copies a long stretch of its prompt (editing or refactoring a file, quoting a document) the
longest earlier match predicts far better, and its length says how far to trust it. A suffix
automaton (Blumer et al. 1985; the structure behind SuffixDecoding and TensorRT-LLM's
suffix-automaton drafter) holds every substring of the context in at most 2n states, is extended in
amortised O(1) per token, and a matcher walking it alongside the text always knows the longest
suffix of the text that also occurs earlier, so a proposal costs O(k) at any context length.

Worked example, tokens = [5, 6, 7, 9, 5, 6, 7] (then the matcher has read all seven):
the longest suffix that also occurs earlier is [5, 6, 7] (length 3), first ending at position 3,
so the proposal continues with tokens[3:] = [9, 5, 6, 7][:k]. With an 8 appended the match breaks
back to the longest suffix that still occurs earlier: none ([7, 8] and [8] are new), length 0.

The matcher reads each token before the automaton is extended with it, so a match always ends
strictly before the current end (an occurrence of the suffix itself never counts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.verify import Draft


class SuffixAutomaton:
    """States 0..n: ``next`` transitions, suffix ``link``, ``length`` of the longest string and the
    ``end`` (exclusive) of its first occurrence; plus the matcher (``state``, ``match``)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.end: list[int] = [0]
        self.last = 0
        self.state = 0  # matcher: the state holding the longest suffix that occurs earlier ...
        self.match = 0  # ... and that suffix's length

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int] | Tensor | np.ndarray) -> None:
        for t in (int(x) for x in (new_tokens.tolist() if hasattr(new_tokens, "tolist") else new_tokens)):
            self._advance_matcher(t)
            self._add(t)
            self._normalise_matcher()

    def _advance_matcher(self, t: int) -> None:
        st, n = self.state, self.match
        while st and t not in self.next[st]:
            st = self.link[st]
            n = self.length[st]
        if t in self.next[st]:
            self.state, self.match = self.next[st][t], n + 1
        else:
            self.state, self.match = 0, 0

    def _normalise_matcher(self) -> None:
        # A state split by the last extension keeps its longer strings; a shorter match now lives
        # in the clone (its suffix link).
        st = self.state
        while st and self.length[self.link[st]] >= self.match:
            st = self.link[st]
        self.state = st

    def _add(self, t: int) -> None:
        self.tokens.append(t)
        cur = len(self.length)
        self.next.append({})
        self.length.append(self.length[self.last] + 1)
        self.link.append(0)
        self.end.append(len(self.tokens))
        p = self.last
        while p != -1 and t not in self.next[p]:
            self.next[p][t] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][t]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.length)
                self.next.append(dict(self.next[q]))
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.end.append(self.end[q])
                while p != -1 and self.next[p].get(t) == q:
                    self.next[p][t] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def propose(self, k: int, min_match: int = 1) -> list[int]:
        """Up to k tokens after the first earlier occurrence of the longest suffix that occurs
        earlier; [] when that suffix is shorter than ``min_match``."""
        if k <= 0 or self.match < min_match:
            return []
        start = self.end[self.state]
        return self.tokens[start : start + k]


def longest_earlier_match(tokens: Sequence[int]) -> tuple[int, int]:
    """(length, end) of the longest suffix of ``tokens`` that occurs earlier, and the end
    (exclusive) of its first occurrence; (0, 0) if none. Quadratic: the tests' reference."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = list(tokens[n - length :])
        for end in range(length, n):
            if list(tokens[end - length : end]) == suffix:
                return length, end
    return 0, 0


# Match-length buckets (lower bounds) and the acceptance each starts from: a 64-token match of a
# file being rewritten is nearly always right for many tokens; a 2-token one often is not.
MATCH_BUCKETS = (2, 3, 4, 8, 16, 32, 64)
BUCKET_PRIORS = (0.45, 0.55, 0.6, 0.7, 0.8, 0.85, 0.9)
MAX_PROPOSAL = 32


class SuffixDrafter(Drafter):
    """Prompt lookup with the longest match over the whole context (prompt + output).

    Proposes what followed the first earlier occurrence of the longest suffix that occurs earlier
    (at least ``min_match`` tokens). It learns how often such proposals hold per match-length
    bucket, from every step, used or not: the committed tokens show how many of its proposal a
    greedy verification accepts. ``expected_tokens`` lets the auto drafter size each proposal by
    the current match (long continuations where the match is long). Deterministic drafts (q
    one-hot), so verification stays lossless whatever it proposes.
    """

    name = "ngram"  # the prompt-lookup drafter of --draft ngram / auto
    learns_unused = True  # (commit scores the proposal it made this step against what was emitted)

    def __init__(self, min_match: int = 2) -> None:
        from quickdraft.speculative.policy import Acceptance

        self.min_match = min_match
        self.index = SuffixAutomaton()
        self.acceptance = [Acceptance(p, MAX_PROPOSAL) for p in BUCKET_PRIORS]
        self._last: tuple[int, list[int]] | None = None  # (bucket, proposal) awaiting its outcome

    def forks(self, count: int) -> list[Drafter]:
        twins: list[Drafter] = []
        for _ in range(count):
            twin = SuffixDrafter(self.min_match)
            twin.acceptance = self.acceptance  # what proposals of each match length yield: learned together
            twins.append(twin)
        return twins

    def _bucket(self) -> int:
        return max(i for i, lo in enumerate(MATCH_BUCKETS) if self.index.match >= lo or i == 0)

    def prefill(self, prompt_ids: Tensor, params: SamplingParams, cached: int = 0) -> None:
        # A function of its ids alone: a prompt that extends them (the next turn) adds only the
        # new ids; any other rebuilds it (32k tokens: ~0.2 s).
        ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        held = self.index.tokens
        if len(held) > len(ids) or held != ids[: len(held)]:
            self.index = SuffixAutomaton()
            held = []
        self.index.extend(ids[len(held) :])
        self._last = None

    def snapshot(self) -> list[int]:
        return list(self.index.tokens)  # rebuilt on restore: cheaper to keep than the states

    def restore(self, state: object) -> None:
        tokens = list(state)  # type: ignore[call-overload]
        if tokens != self.index.tokens:
            self.index = SuffixAutomaton()
            self.index.extend(tokens)
        self._last = None

    def propose(self, k: int) -> Draft:
        tokens = self.index.propose(min(k, MAX_PROPOSAL), self.min_match)
        self._last = (self._bucket(), tokens) if tokens else None
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long))

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify pass over the first k proposed tokens should emit (bonus included)."""
        if self._last is None:
            return 1.0
        return self.acceptance[self._last[0]].expected_tokens(min(k, len(self._last[1])))

    @property
    def match_length(self) -> int:
        return self.index.match

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        new = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if self._last is not None:  # how much of the last proposal the committed tokens confirm
            bucket, proposal = self._last
            seen = min(len(proposal), len(new))
            held = next((i for i in range(seen) if proposal[i] != new[i]), seen)
            self.acceptance[bucket].observe(seen, held)
        self._last = None
        self.index.extend(new)

    def reset(self) -> None:
        self.index = SuffixAutomaton()
        self._last = None
