"""Prompt lookup: the reference function's rules on hand-made contexts, and the incremental
NGramIndex agreeing with it on random streams fed in random chunks."""

from __future__ import annotations

import random
import time

import pytest
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.speculative.ngram import NGramIndex, ngram_propose


def index_of(tokens: list[int], max_ngram: int = 4, min_ngram: int = 1) -> NGramIndex:
    index = NGramIndex(max_ngram, min_ngram)
    index.extend(tokens)
    return index


CASES = [
    # (tokens, k, max_ngram, expected)
    ([1, 2, 3, 1, 2, 4, 1, 2], 5, 4, [4, 1, 2]),  # most recent earlier [1, 2] wins over the first
    ([7, 8, 9, 1, 5, 9, 2, 7, 8, 9], 3, 4, [1, 5, 9]),  # longest n-gram [7, 8, 9] beats recent [9]
    ([7, 8, 9, 1, 5, 9, 2, 7, 8, 9], 3, 1, [2, 7, 8]),  # with max_ngram=1 only [9] is looked up
    ([1, 2, 3, 4], 3, 4, []),  # no match
    ([4, 1, 4], 5, 4, [1, 4]),  # k larger than what follows
    ([1, 1, 1], 4, 4, [1]),  # occurrence overlapping the suffix
    ([5, 6, 7, 9, 5, 6, 7, 8, 5, 6], 8, 3, [7, 8, 5, 6]),  # the module docstring's example
    ([1, 2, 1], 0, 4, []),  # k = 0
    ([3], 2, 4, []),
    ([], 2, 4, []),
]


@pytest.mark.parametrize(("tokens", "k", "max_ngram", "expected"), CASES)
def test_reference_rules(tokens: list[int], k: int, max_ngram: int, expected: list[int]) -> None:
    assert ngram_propose(tokens, k, max_ngram=max_ngram) == expected
    assert ngram_propose(torch.tensor(tokens, dtype=torch.long), k, max_ngram=max_ngram) == expected


@pytest.mark.parametrize(("tokens", "k", "max_ngram", "expected"), CASES)
def test_index_rules(tokens: list[int], k: int, max_ngram: int, expected: list[int]) -> None:
    assert index_of(tokens, max_ngram).propose(k) == expected


def test_min_ngram_skips_short_matches() -> None:
    tokens = [1, 2, 3, 9, 3]  # only the 1-gram [3] repeats
    assert ngram_propose(tokens, 2, min_ngram=1) == [9, 3]
    assert ngram_propose(tokens, 2, min_ngram=2) == []
    assert index_of(tokens, min_ngram=2).propose(2) == []


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(4, 0), (2, 3), (0, 1)])
def test_invalid_sizes_raise(max_ngram: int, min_ngram: int) -> None:
    with pytest.raises(QuickdraftError, match="min_ngram"):
        ngram_propose([1, 2], 1, max_ngram, min_ngram)
    with pytest.raises(QuickdraftError, match="min_ngram"):
        NGramIndex(max_ngram, min_ngram)


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(4, 1), (3, 2), (1, 1), (6, 3)])
def test_index_matches_reference_on_random_streams(max_ngram: int, min_ngram: int) -> None:
    rng = random.Random(max_ngram * 10 + min_ngram)
    for stream in range(40):
        vocab = rng.choice([2, 3, 5, 20])
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        index, length = NGramIndex(max_ngram, min_ngram), rng.randint(0, 400)
        tokens: list[int] = []
        while len(tokens) < length:
            # Mix fresh random tokens with copies of a pattern, as real text repeats spans.
            chunk = (
                pattern[: rng.randint(1, len(pattern))]
                if rng.random() < 0.5
                else [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            )
            index.extend(chunk)
            tokens.extend(chunk)
            for k in (1, 3, 8):
                expected = ngram_propose(tokens, k, max_ngram, min_ngram)
                assert index.propose(k) == expected, (stream, tokens, k)
        assert len(index) == len(tokens)


def test_index_extend_accepts_tensor_and_reset() -> None:
    index = NGramIndex()
    index.extend(torch.tensor([1, 2, 3, 1, 2]))
    index.extend([])
    assert index.propose(2) == [3, 1]
    assert index.propose_tensor(2).tolist() == [3, 1]
    index.reset()
    assert len(index) == 0 and index.propose(2) == []
    index.extend([4, 5, 4])
    assert index.propose(2) == [5, 4]


def test_index_fast_on_long_context() -> None:
    """8k-token prompt, then 2k decode steps of extend + propose: well under a second."""
    rng = random.Random(0)
    prompt = [rng.randrange(500) for _ in range(8000)]
    start = time.perf_counter()
    index = NGramIndex()
    index.extend(prompt)
    for _ in range(2000):
        index.extend([rng.randrange(500)])
        index.propose(8)
    assert time.perf_counter() - start < 2.0
