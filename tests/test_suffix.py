"""Longest-match lookup (quickdraft/speculative/suffix.py): the automaton against a brute-force
reference, proposals and their learned trust, and lossless greedy speculation through the engine."""

from __future__ import annotations

import random
import time

import pytest
import torch

from quickdraft.sampling import SamplingParams
from quickdraft.speculative.suffix import (
    MATCH_BUCKETS,
    SuffixAutomaton,
    SuffixDrafter,
    longest_earlier_match,
)


def test_worked_example() -> None:
    sa = SuffixAutomaton()
    sa.extend([5, 6, 7, 9, 5, 6, 7])
    assert (sa.match, sa.propose(3)) == (3, [9, 5, 6])
    sa.extend([8])
    assert sa.match == 0 and sa.propose(3) == []


@pytest.mark.parametrize("vocab", [2, 3, 7, 50])
def test_automaton_matches_the_reference_on_random_streams(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(60):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 70))]
        sa, i = SuffixAutomaton(), 0
        while i < len(tokens):  # fed in chunks of any size, as prefill and commits do
            j = min(len(tokens), i + rng.randint(1, 6))
            sa.extend(tokens[i:j])
            i = j
            length, end = longest_earlier_match(tokens[:i])
            assert sa.match == length
            if length:
                assert sa.end[sa.state] == end
                assert sa.propose(4) == tokens[:i][end : end + 4]


def test_long_contexts_are_cheap() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(3000) for _ in range(32_000)]
    t0 = time.perf_counter()
    sa = SuffixAutomaton()
    sa.extend(tokens)
    sa.extend(tokens[1000:1040])  # a copied stretch: the match is its whole length
    assert sa.match >= 40 and sa.propose(5) == tokens[1040:1045]
    assert time.perf_counter() - t0 < 10  # ~0.2 s here; generous for slow CI machines
    assert len(sa.length) <= 2 * len(sa.tokens)


def test_drafter_learns_to_trust_long_matches() -> None:
    """Every commit shows how much of the last proposal would have held; a long match's bucket
    learns that its proposals hold, and expected_tokens then favours long proposals there."""
    d = SuffixDrafter()
    text = list(range(100, 160))
    d.prefill(torch.tensor(text + text[:10]), SamplingParams())  # copying the text again
    bucket = max(i for i, lo in enumerate(MATCH_BUCKETS) if lo <= 10)
    before = d.acceptance[bucket].rates[0]
    for i in range(10, 40):
        draft = d.propose(8)
        assert draft.tokens.tolist() == text[i : i + 8][: draft.k]
        d.commit(torch.tensor([text[i]]), 0)  # a plain step: one token, which the proposal had
    assert d.acceptance[-1].rates[0] > before or d.acceptance[bucket].rates[0] > before
    d.propose(16)
    assert d.expected_tokens(16) > d.expected_tokens(2) > 1.0
    d.commit(torch.tensor([7]), 0)  # the copy ends: the match breaks
    assert d.match_length < 2 and d.propose(8).k == 0 and d.expected_tokens(8) == 1.0


def test_prefill_extends_or_rebuilds_and_snapshots_restore() -> None:
    d = SuffixDrafter()
    d.prefill(torch.tensor([1, 2, 3, 1, 2]), SamplingParams())
    index = d.index
    d.prefill(torch.tensor([1, 2, 3, 1, 2, 3, 9]), SamplingParams())  # extends: same automaton
    assert d.index is index and d.index.tokens == [1, 2, 3, 1, 2, 3, 9]
    saved = d.snapshot()
    d.prefill(torch.tensor([4, 4, 4]), SamplingParams())  # another prompt: rebuilt
    assert d.index.tokens == [4, 4, 4] and d.index is not index
    d.restore(saved)
    assert d.index.tokens == [1, 2, 3, 1, 2, 3, 9] and d.index.match == 0


def test_engine_greedy_equals_plain(tiny_engine) -> None:  # noqa: ANN001
    engine, prompt = tiny_engine
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [t for s in engine.generate(prompt, params) for t in s.token_ids]
    for k in (1, 4, 16, 32):
        spec = [t for s in engine.generate(prompt, params, SuffixDrafter(min_match=1), k) for t in s.token_ids]
        assert spec == plain, k


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from tiny import make_tiny_hf_model

    from quickdraft.engine import Engine
    from quickdraft.loading.load import load_model

    folder = make_tiny_hf_model(tmp_path_factory.mktemp("suffix"), "llama", seed=4)
    loaded = load_model(str(folder), dtype="float32", max_context=256)
    ids = loaded.tokenizer.encode("def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(")
    return Engine(loaded.model, loaded.tokenizer), ids
