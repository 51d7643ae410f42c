"""Sampling: parameter validation, each logit transform on hand-made examples, and the property
speculative decoding relies on: row i of a multi-row process_logits call is bitwise the single-row
call with draft[:i] appended to the output."""

from __future__ import annotations

import math

import pytest
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.sampling import (
    SamplingParams,
    greedy_tokens,
    make_generator,
    probs_from_logits,
    process_logits,
    sample_tokens,
)

EMPTY = torch.zeros(0, dtype=torch.long)
NEG_INF = float("-inf")


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def kept(processed: torch.Tensor) -> set[int]:
    """Token ids a single-row processed logits tensor keeps (not -inf)."""
    return set(torch.isfinite(processed[0]).nonzero().flatten().tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()  # [1, V]


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("seed", 1.5),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
    ],
)
def test_invalid_value_raises_with_field_name(field: str, value: object) -> None:
    with pytest.raises(QuickdraftError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_error_message_shows_range_and_value() -> None:
    with pytest.raises(QuickdraftError, match=r"temperature must be >= 0.*got -1"):
        SamplingParams(temperature=-1)


def test_boundary_values_are_valid() -> None:
    SamplingParams(max_tokens=1, top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2.0)
    SamplingParams(top_p=1e-9, min_p=0.0, frequency_penalty=2.0, repetition_penalty=1e-3, seed=0)


def test_lists_become_tuples_and_params_hash() -> None:
    params = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[2, 7])  # type: ignore[arg-type]
    assert params.stop == ("\n\n", "END")
    assert params.stop_token_ids == (2, 7)
    hash(params)


def test_greedy_and_needs_history_flags() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams().needs_history
    assert SamplingParams(repetition_penalty=1.1).needs_history
    assert SamplingParams(presence_penalty=0.5).needs_history
    assert SamplingParams(frequency_penalty=-0.5).needs_history


# --- penalties --------------------------------------------------------------------------------


def test_penalties_hand_computed() -> None:
    """Repetition 2 over prompt+output (HF), then frequency 0.5 and presence 0.25 over output."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = process_logits(logits, params, prompt_ids=ids(0), output_ids=ids(1, 3, 3))
    # id 0: prompt only -> 2 / 2 = 1.0 (no frequency/presence: those count output only)
    # id 1: output once -> -1 * 2 = -2, - 0.5 * 1 - 0.25 = -2.75
    # id 2, 4: unseen -> unchanged
    # id 3: output twice -> 3 / 2 = 1.5, - 0.5 * 2 - 0.25 = 0.25
    assert torch.equal(out, torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0]]))


def test_penalties_off_leave_logits_untouched() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    out = process_logits(logits, SamplingParams(), ids(1, 2), ids(3), draft=ids(4, 5))
    assert torch.equal(out, logits)


def test_repetition_penalty_matches_transformers() -> None:
    hf = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=gen)
    prompt, output = (
        torch.randint(0, 64, (20,), generator=gen),
        torch.randint(0, 64, (9,), generator=gen),
    )
    ours = process_logits(logits, SamplingParams(repetition_penalty=1.3), prompt, output)
    history = torch.cat([prompt, output]).unsqueeze(0)
    theirs = hf.RepetitionPenaltyLogitsProcessor(penalty=1.3)(history, logits.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


# --- filters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("logits", "top_k", "expected"),
    [
        ([1.0, 4.0, 3.0, 0.5, 2.0], 2, {1, 2}),
        ([1.0, 4.0, 3.0, 0.5, 2.0], 1, {1}),
        ([1.0, 4.0, 3.0, 3.0, 2.0], 2, {1, 2, 3}),  # ties with the k-th are kept
        ([1.0, 4.0, 3.0, 0.5, 2.0], 5, {0, 1, 2, 3, 4}),
        ([1.0, 4.0, 3.0, 0.5, 2.0], 99, {0, 1, 2, 3, 4}),
        ([1.0, 4.0, 3.0, 0.5, 2.0], -1, {0, 1, 2, 3, 4}),
    ],
)
def test_top_k_keeps_expected_set(logits: list[float], top_k: int, expected: set[int]) -> None:
    out = process_logits(
        torch.tensor([logits]), SamplingParams(temperature=1.0, top_k=top_k), EMPTY, EMPTY
    )
    assert kept(out) == expected


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1e-9, {1}),
        (0.4, {1}),
        (0.75, {1, 3}),
        (0.85, {0, 1, 3}),
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, expected: set[int]) -> None:
    logits = log_probs(0.15, 0.5, 0.05, 0.3)  # vocab order differs from rank order on purpose
    out = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p), EMPTY, EMPTY)
    assert kept(out) == expected
    assert torch.equal(out[0, list(expected)], logits[0, list(expected)])  # kept values unchanged


@pytest.mark.parametrize(
    ("min_p", "expected"), [(0.35, {1, 3}), (0.2, {0, 1, 3}), (1.0, {1}), (0.0, {0, 1, 2, 3})]
)
def test_min_p_keeps_tokens_above_fraction_of_top(min_p: float, expected: set[int]) -> None:
    logits = log_probs(0.15, 0.5, 0.05, 0.3)
    out = process_logits(logits, SamplingParams(temperature=1.0, min_p=min_p), EMPTY, EMPTY)
    assert kept(out) == expected


def test_temperature_applies_before_top_p() -> None:
    """At T=2 the probs flatten to ~[.379, .294, .208, .120]; top_p=0.7 then needs three tokens
    (on the untempered [.5, .3, .15, .05] it would need two)."""
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    out = process_logits(logits, SamplingParams(temperature=2.0, top_p=0.7), EMPTY, EMPTY)
    assert kept(out) == {0, 1, 2}
    torch.testing.assert_close(out[0, :3], logits[0, :3] / 2.0, rtol=0, atol=0)


def test_top_k_applies_before_top_p() -> None:
    """After top-2 the kept probs renormalise to [.625, .375], so top_p=0.6 keeps one token
    (on the full [.5, .3, .15, .05] it would keep two)."""
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), EMPTY, EMPTY)
    assert kept(out) == {0}


def test_greedy_ignores_filters() -> None:
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    out = process_logits(logits, SamplingParams(top_k=1, top_p=0.1, min_p=0.9), EMPTY, EMPTY)
    assert torch.equal(out, logits)


def test_matches_transformers_warper_chain() -> None:
    hf = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 200, generator=gen) * 3
    prompt = torch.randint(0, 200, (30,), generator=gen)
    params = SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2
    )
    ours = process_logits(logits, params, prompt, EMPTY, draft=EMPTY.new_zeros(3) + prompt[0])
    chain = [
        hf.RepetitionPenaltyLogitsProcessor(1.2),
        hf.TemperatureLogitsWarper(0.8),
        hf.TopKLogitsWarper(50),
        hf.TopPLogitsWarper(0.9),
        hf.MinPLogitsWarper(0.05),
    ]
    theirs = logits.clone()
    history = prompt.expand(4, -1)  # draft repeats prompt[0]: no new ids for repetition penalty
    for processor in chain:
        theirs = processor(history, theirs)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    finite = torch.isfinite(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])


# --- rows see the draft -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            temperature=0.7,
            top_k=20,
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.3,
        ),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.7),  # greedy
        SamplingParams(temperature=1.3, presence_penalty=-1.5),
    ],
)
def test_row_i_equals_single_row_call_with_draft_prefix(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 40, 6
    logits = torch.randn(rows, vocab, generator=gen) * 2  # [N, V]
    prompt = torch.randint(0, vocab, (25,), generator=gen)
    output = torch.randint(0, vocab, (7,), generator=gen)
    draft = torch.cat([output[:2], torch.randint(0, vocab, (rows - 3,), generator=gen)])  # repeats
    batched = process_logits(logits, params, prompt, output, draft=draft)  # [N, V]
    for i in range(rows):
        context = torch.cat([output, draft[:i]])
        single = process_logits(logits[i : i + 1], params, prompt, context)  # [1, V]
        assert torch.equal(batched[i : i + 1], single), f"row {i} differs"
        assert torch.equal(probs_from_logits(batched)[i : i + 1], probs_from_logits(single))


def test_penalties_over_rows_need_draft() -> None:
    with pytest.raises(ValueError, match="draft"):
        process_logits(torch.zeros(3, 5), SamplingParams(presence_penalty=1.0), EMPTY, EMPTY)


def test_does_not_modify_input() -> None:
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.5, repetition_penalty=2.0)
    process_logits(logits, params, ids(1, 2), ids(3), draft=ids(4))
    assert torch.equal(logits, before)


def test_at_least_one_token_survives_every_filter() -> None:
    logits = torch.randn(50, 30, generator=torch.Generator().manual_seed(5)) * 10
    params = SamplingParams(temperature=0.05, top_k=1, top_p=1e-9, min_p=1.0)
    out = process_logits(logits, params, EMPTY, EMPTY)
    assert torch.isfinite(out).sum(-1).min() >= 1
    assert torch.equal(greedy_tokens(out), logits.argmax(-1))


# --- choosing tokens --------------------------------------------------------------------------


def test_greedy_ties_go_to_lowest_id() -> None:
    processed = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [NEG_INF, 0.0, 0.0, NEG_INF]]
    )
    assert greedy_tokens(processed).tolist() == [1, 0, 1]


def test_probs_from_logits_zero_for_filtered() -> None:
    probs = probs_from_logits(torch.tensor([[0.0, NEG_INF, 0.0]]))
    assert torch.equal(probs, torch.tensor([[0.5, 0.0, 0.5]]))


def test_seeded_sampling_reproduces_and_seeds_differ() -> None:
    probs = torch.softmax(torch.randn(64, 100, generator=torch.Generator().manual_seed(6)), -1)
    a = sample_tokens(probs, make_generator(123))
    b = sample_tokens(probs, make_generator(123))
    c = sample_tokens(probs, make_generator(124))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_unseeded_generators_differ() -> None:
    probs = torch.full((64, 100), 0.01)
    assert not torch.equal(
        sample_tokens(probs, make_generator(None)), sample_tokens(probs, make_generator(None))
    )


def test_sampling_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    sample_tokens(torch.full((4, 10), 0.1), make_generator(0))
    assert torch.equal(torch.get_rng_state(), state)


def test_sample_tokens_follows_probs_and_skips_zeros() -> None:
    p = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.4])
    draws = sample_tokens(p.expand(200_000, -1), make_generator(7))  # [200k]
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    assert freq[1] == 0
    assert 0.5 * (freq - p.double()).abs().sum() < 0.005


def test_sample_tokens_accepts_unnormalised_weights() -> None:
    w = torch.tensor([2.0, 0.0, 6.0])
    draws = sample_tokens(w.expand(100_000, -1), make_generator(8))
    freq = torch.bincount(draws, minlength=3).double() / draws.numel()
    torch.testing.assert_close(
        freq, torch.tensor([0.25, 0.0, 0.75], dtype=torch.double), atol=0.01, rtol=0
    )
