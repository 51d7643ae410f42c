"""The speculation policy: target pass costs, acceptance estimates, the choice of k, and
AutoDrafter driving real generation (whatever it decides, greedy output stays plain greedy's)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny import make_tiny_hf_model

from quickdraft.engine import Engine
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import ALONE, Drafter, PassLoad, run_alone
from quickdraft.speculative.draft_model import MAX_CATCH_UP, DraftModelDrafter, ModelPass
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.speculative.policy import (
    CONFIDENT_K,
    EMA,
    LOAD_MARGIN,
    PROBE_EVERY,
    PROBE_K,
    Acceptance,
    AutoDrafter,
    Candidate,
    TargetCost,
    best_k,
    measure_pass_seconds,
)
from quickdraft.speculative.suffix import BUCKET_PRIORS, SuffixDrafter
from quickdraft.speculative.verify import Draft

PROMPT = "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i"
N = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module


# ---------------------------------------------------------------------------------- TargetCost


def test_target_cost_interpolates_and_extrapolates() -> None:
    cost = TargetCost({1: 1.0, 2: 2.0, 4: 3.0})
    assert cost(1) == 1.0 and cost(2) == 2.0 and cost(4) == 3.0
    assert cost(3) == pytest.approx(2.5)  # halfway between 2 and 4
    assert cost(0) == 1.0  # below the smallest measured count: that count's cost
    assert cost(6) == pytest.approx(4.0)  # beyond: the last segment's slope (0.5 per row)
    assert cost(8) == pytest.approx(5.0)


def test_target_cost_unsorted_points_and_two_points() -> None:
    cost = TargetCost({8: 4.0, 1: 1.0})
    assert cost(1) == 1.0 and cost(8) == 4.0
    assert cost(4) == pytest.approx(1.0 + 3.0 * 3 / 7)
    assert cost(15) == pytest.approx(7.0)


def test_target_cost_observe_is_an_ema_and_adds_new_counts() -> None:
    cost = TargetCost({1: 1.0, 4: 2.0})
    cost.observe(1, 2.0)
    assert cost(1) == pytest.approx((1 - EMA) * 1.0 + EMA * 2.0)
    cost.observe(2, 5.0)  # a row count never measured is taken as is ...
    assert cost.seconds[2] == 5.0
    assert cost(2) == 5.0 and cost(4) == 5.0 and cost(3) == 5.0  # ... and more rows never cost less
    for _ in range(200):  # repeated observations converge to the new value
        cost.observe(4, 0.5)
    assert cost(4) == pytest.approx(0.5)
    assert cost(1) <= cost(2) <= cost(4)  # an inflated 1- or 2-row cost is pulled down with it


def test_target_cost_adds_attention_for_the_context() -> None:
    cost = TargetCost({1: 1.0, 8: 2.0}, per_key=(1e-4, 1e-5))
    assert cost(1) == 1.0 and cost(8) == 2.0  # no context yet
    cost.context = 10_000
    assert cost(1) == pytest.approx(1.0 + 10_000 * (1e-4 + 1e-5))
    assert cost(8) == pytest.approx(2.0 + 10_000 * (1e-4 + 8e-5))
    for _ in range(300):  # a pass observed at this context updates the short-context part only
        cost.observe(8, 2.5 + 10_000 * (1e-4 + 8e-5))
    assert cost.seconds[8] == pytest.approx(2.5)
    cost.context = 0
    assert cost(8) == pytest.approx(2.5)


def test_auto_drafter_knows_the_context_and_stops_paying_at_long_ones() -> None:
    """The cost curves follow the prompt and the committed tokens; a drafter that pays over a short
    context (verification ~ as cheap as a decode) is not used where attention makes each verified
    row cost as much as a plain step (so auto is never slower than plain at long contexts)."""
    cost = TargetCost({1: 0.030, 2: 0.031, 4: 0.032, 8: 0.034, 16: 0.040}, per_key=(0.0, 1e-5))
    draft = Candidate(EchoDrafter(list(range(100))), Acceptance(0.5, 8), 0.004, cheap=False,
                      pass_cost=TargetCost({1: 0.004, 2: 0.005}))
    auto = AutoDrafter([draft], cost)
    auto.prefill(torch.arange(100), SamplingParams())
    assert cost.context == 100 and draft.pass_cost is not None and draft.pass_cost.context == 100
    assert run_alone(auto._choose(4))[1].k > 0  # short context: drafting pays
    auto.commit(torch.tensor([5, 6]), 1)
    auto._set_context()
    assert cost.context == 102
    auto.prefill(torch.arange(20_000), SamplingParams())
    assert run_alone(auto._choose(4))[1].k == 0  # 20k tokens: every extra row costs 0.2 s of attention


def test_measure_attention_per_key(tmp_path: Path) -> None:
    from quickdraft.speculative.policy import measure_attention_per_key

    loaded = load_model(str(make_tiny_hf_model(tmp_path, "llama", seed=1)), dtype="float32", max_context=512)
    cache_before = loaded.model.make_cache(4).k.shape
    a, b = measure_attention_per_key(loaded.model, repeats=1)
    assert math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0  # (timings: not asserted larger)
    assert loaded.model.make_cache(4).k.shape == cache_before
    short = load_model(str(make_tiny_hf_model(tmp_path / "s", "llama", seed=1)), dtype="float32", max_context=128)
    assert measure_attention_per_key(short.model) == (0.0, 0.0)  # never a long context


def test_measure_pass_seconds_gives_positive_costs(tmp_path: Path) -> None:
    loaded = load_model(
        str(make_tiny_hf_model(tmp_path, "llama", seed=1)), dtype="float32", max_context=128
    )
    seconds = measure_pass_seconds(loaded.model, rows=(1, 2, 4), repeats=1)
    assert set(seconds) == {1, 2, 4} and all(s > 0 for s in seconds.values())


def test_pass_costs_are_kept_between_starts(tmp_path: Path) -> None:
    import json
    import time

    from quickdraft.assemble import pass_costs

    loaded = load_model(str(make_tiny_hf_model(tmp_path, "llama", seed=1)), dtype="float32", max_context=128)
    store = tmp_path / "costs" / "pass_costs.json"
    said: list[str] = []
    first = pass_costs.pass_seconds(loaded, (1, 2), said.append, path=store)
    assert len(said) == 1 and "first run" in said[0] and store.exists()
    [entry] = json.loads(store.read_text()).values()
    assert len(entry["per_key"]) == 2  # attention per cached token, kept with the passes
    assert pass_costs.pass_cost_model(loaded, (1, 2), said.append, path=store).per_key == tuple(entry["per_key"])
    assert pass_costs.pass_seconds(loaded, (1, 2), said.append, path=store) == first  # kept: no measuring
    assert len(said) == 1
    pass_costs.pass_seconds(loaded, (1, 2, 4), said.append, path=store)  # other rows: another entry
    assert len(said) == 2

    entries = json.loads(store.read_text())
    key = pass_costs.cost_key(loaded, (1, 2))
    entries[key]["measured"] = time.time() - 40 * 86400  # stale
    store.write_text(json.dumps(entries))
    pass_costs.pass_seconds(loaded, (1, 2), said.append, path=store)
    assert "stale or damaged" in said[-1]
    entries = json.loads(store.read_text())
    entries[key]["seconds"] = {"1": -1.0, "2": "x"}  # damaged
    store.write_text(json.dumps(entries))
    again = pass_costs.pass_seconds(loaded, (1, 2), said.append, path=store)
    assert "stale or damaged" in said[-1] and all(s > 0 for s in again.values())

    store.write_text("{not json")  # corrupt: measured afresh, saying which file
    pass_costs.pass_seconds(loaded, (1, 2), said.append, path=store)
    assert str(store) in said[-1] and json.loads(store.read_text())

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.warns(RuntimeWarning, match="could not keep"):  # a cache "folder" that is a file
        seconds = pass_costs.pass_seconds(loaded, (1, 2), said.append, path=blocked / "pass_costs.json")
    assert set(seconds) == {1, 2}


# ---------------------------------------------------------------------------------- Acceptance


@pytest.mark.parametrize("a", [0.0, 0.3, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("k", [0, 1, 2, 5, 8])
def test_expected_tokens_closed_form(a: float, k: int) -> None:
    acc = Acceptance(prior=a, max_k=8)
    expected = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    assert acc.expected_tokens(k) == pytest.approx(expected)


def test_expected_tokens_all_accepted_and_per_position() -> None:
    assert Acceptance(prior=1.0, max_k=8).expected_tokens(5) == 6.0
    acc = Acceptance(prior=0.5, max_k=3)
    acc.rates = [0.9, 0.5, 0.2]
    assert acc.expected_tokens(3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)


def test_acceptance_observe_updates_only_positions_reached() -> None:
    acc = Acceptance(prior=0.5, max_k=4)
    acc.observe(k=3, n=1)  # position 0 accepted, position 1 rejected, position 2 never judged
    assert acc.rates[0] == pytest.approx((1 - EMA) * 0.5 + EMA)
    assert acc.rates[1] == pytest.approx((1 - EMA) * 0.5)
    assert acc.rates[2:] == [0.5, 0.5]
    acc = Acceptance(prior=0.5, max_k=4)
    acc.observe(k=2, n=2)  # both accepted; positions beyond k untouched
    assert acc.rates[0] == acc.rates[1] == pytest.approx((1 - EMA) * 0.5 + EMA)
    assert acc.rates[2:] == [0.5, 0.5]


def test_acceptance_learns_the_rate() -> None:
    acc = Acceptance(prior=0.9, max_k=4)
    for _ in range(100):
        acc.observe(k=4, n=0)
    assert acc.rates[0] < 1e-6 and acc.expected_tokens(4) == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------------------------- best_k


def candidate(rate: float, seconds_per_token: float = 0.0, max_k: int = 8) -> Candidate:
    return Candidate(NGramDrafter(), Acceptance(rate, max_k), seconds_per_token, cheap=True)


def test_best_k_zero_when_verification_costs_k_plus_1_passes() -> None:
    linear = TargetCost({r: float(r) for r in (1, 2, 4, 8)})  # cost(k+1) = (k+1) * cost(1)
    for rate in (0.0, 0.5, 0.9, 0.99):
        k, speed = best_k(linear, candidate(rate), 8)
        assert k == 0 and speed == pytest.approx(1.0)


def test_best_k_positive_when_verification_cheap_and_acceptance_high() -> None:
    flat = TargetCost({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1})
    k, speed = best_k(flat, candidate(0.9), 8)
    assert k >= 5 and speed > 3.0
    expected = Acceptance(0.9, 8).expected_tokens(k) / flat(k + 1)
    assert speed == pytest.approx(expected)
    # ... and the k chosen is the best over 0..8.
    assert all(
        Acceptance(0.9, 8).expected_tokens(j) / flat(j + 1) <= speed + 1e-12 for j in range(9)
    )


def test_best_k_grows_with_acceptance_and_respects_max_k() -> None:
    cost = TargetCost({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4})
    ks = [best_k(cost, candidate(a), 8)[0] for a in (0.1, 0.5, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > 0
    assert best_k(cost, candidate(0.95), 3)[0] <= 3
    assert best_k(cost, candidate(0.95), 0)[0] == 0


def test_best_k_zero_when_drafting_is_expensive() -> None:
    flat = TargetCost({1: 1.0, 8: 1.0})
    assert best_k(flat, candidate(0.9, seconds_per_token=2.0), 8)[0] == 0
    assert best_k(flat, candidate(0.9, seconds_per_token=0.01), 8)[0] > 0


# ------------------------------------------------------------------------- AutoDrafter, end to end


class FrozenCost(TargetCost):
    """Ignores measured pass times, so the test decides what verification costs."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, list[int], list[int]]:
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("policy"), "llama", seed=71)
    loaded = load_model(str(folder), dtype="float32", max_context=256)
    prompt = loaded.tokenizer.encode(PROMPT)
    steps = list(
        Engine(loaded.model, loaded.tokenizer).generate(
            prompt, SamplingParams(max_tokens=N, ignore_eos=True)
        )
    )
    return loaded, prompt, [t for s in steps for t in s.token_ids]


def run_auto(
    tiny: tuple[LoadedModel, list[int], list[int]], auto: AutoDrafter, k: int = 8
) -> tuple[list[int], object]:
    loaded, prompt, _ = tiny
    engine = Engine(loaded.model, loaded.tokenizer)
    steps = list(engine.generate(prompt, SamplingParams(max_tokens=N, ignore_eos=True), auto, k))
    return [t for s in steps for t in s.token_ids], steps[-1].stats


def test_auto_with_expensive_verification_only_probes(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    _, _, truth = tiny
    linear = FrozenCost({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
    ngram = Candidate(NGramDrafter(min_ngram=1), Acceptance(0.9, 8), 0.0, cheap=True)
    auto = AutoDrafter([ngram], linear)
    ids, stats = run_auto(tiny, auto)
    assert ids == truth
    steps = stats.target_passes  # type: ignore[attr-defined]
    probes = auto.usage["ngram"]
    assert 1 <= probes <= steps // (PROBE_EVERY + 1) + 1  # only the periodic probes drafted
    # every step asked the policy, except the last ones where the budget left no room to draft
    assert steps - 2 <= auto.usage["none"] + probes <= steps
    assert stats.drafted <= PROBE_K * probes  # type: ignore[attr-defined]


def test_auto_with_cheap_verification_speculates(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    _, _, truth = tiny
    flat = FrozenCost({1: 1.0, 2: 1.0, 4: 1.01, 8: 1.02})
    ngram = Candidate(NGramDrafter(min_ngram=1), Acceptance(0.9, 8), 0.0, cheap=True)
    auto = AutoDrafter([ngram], flat)
    ids, stats = run_auto(tiny, auto)
    assert ids == truth
    assert auto.usage["ngram"] > PROBE_EVERY // 2 and stats.drafted > auto.usage["ngram"]  # type: ignore[attr-defined]


def test_auto_with_measured_costs_equals_plain(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    loaded, _, truth = tiny
    cost = TargetCost(measure_pass_seconds(loaded.model, rows=(1, 2, 4, 8), repeats=1))
    auto = AutoDrafter([Candidate(NGramDrafter(), Acceptance(0.6, 8), 0.0, cheap=True)], cost)
    ids, _ = run_auto(tiny, auto)
    assert ids == truth
    assert sum(auto.usage.values()) > 0


class EchoDrafter(Drafter):
    """Always right: proposes the next tokens of the known greedy output."""

    name = "echo"

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth
        self.out = 0

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        self.out = 0

    def propose(self, k: int) -> Draft:
        return Draft(tokens=torch.tensor(self.truth[self.out : self.out + k], dtype=torch.long))

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        self.out += int(tokens.shape[0])

    def reset(self) -> None:
        self.out = 0


def test_auto_fixed_k_beyond_acceptance_positions(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    """--draft auto --num-draft 12 builds Acceptance(max_k=8) but drafts 12: runs of more than 8
    accepted tokens used to raise IndexError in Acceptance.observe."""
    _, _, truth = tiny
    cost = FrozenCost({1: 1.0, 8: 1.0})
    echo = Candidate(EchoDrafter(truth), Acceptance(0.7, 8), 0.001, cheap=False)
    ngram = Candidate(NGramDrafter(), Acceptance(0.6, 8), 0.0, cheap=True)
    auto = AutoDrafter([ngram, echo], cost, fixed_k=12)
    ids, stats = run_auto(tiny, auto, k=12)
    assert ids == truth
    assert auto.usage["echo"] > 0 and stats.accepted > 8  # type: ignore[attr-defined]
    assert all(0.0 <= r <= 1.0 for r in echo.acceptance.rates)


class BehindDrafter(EchoDrafter):
    """A model drafter that has missed ``len(pending)`` tokens while other drafters were used."""

    name = "behind"

    def __init__(self, truth: list[int], pending: int) -> None:
        super().__init__(truth)
        self.pending = list(range(pending))

    def pending_count(self) -> int:
        return len(self.pending)


def test_auto_charges_a_draft_model_for_catching_up() -> None:
    """Switching to a model drafter that is far behind costs its catch-up pass (before this charge,
    catching up looked free, and n-gram + draft model ran slower than n-gram alone)."""
    cost = FrozenCost({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 32: 5.0})
    truth = list(range(100, 140))

    def chosen(pending: int) -> int:
        cand = Candidate(BehindDrafter(truth, pending), Acceptance(0.9, 8), 0.5, cheap=False)
        auto = AutoDrafter([cand], cost)
        return run_alone(auto._choose(8))[1].k

    assert chosen(1) > 0  # in sync: drafting pays (1.9 tokens for 1.6 one-token passes at k = 1)
    assert chosen(32) == 0  # 32 missed tokens cost a pass worth 5 one-token passes: plain wins
    assert AutoDrafter([], cost)._catch_up_seconds(
        Candidate(BehindDrafter(truth, 32), Acceptance(0.9, 8), 0.5, cheap=False)
    ) == pytest.approx(0.5 * (5.0 - 1.0))


def test_auto_probes_a_stale_drafter_in_place_of_a_plain_step() -> None:
    """A model drafter that looked too costly (low prior, far behind) is not left unmeasured for
    ever: once idle past PROBE_EVERY, a step that would be plain drafts PROBE_K tokens with it
    instead (before, a long catch-up blocked every probe, so the 0.5B draft never drafted in
    --draft auto). A step with a paying drafter is never replaced by a probe."""
    cost = FrozenCost({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 32: 5.0})
    truth = list(range(100, 140))
    behind = Candidate(BehindDrafter(truth, 32), Acceptance(0.3, 8), 0.5, cheap=False)
    auto = AutoDrafter([behind], cost)
    picks = [run_alone(auto._choose(8)) for _ in range(PROBE_EVERY + 1)]
    assert all(c is None and d.k == 0 for c, d in picks[:PROBE_EVERY])
    probe_choice, probe = picks[-1]
    assert probe_choice is behind and probe.k == PROBE_K and behind.idle == 0
    assert run_alone(auto._choose(8))[1].k == 0  # measured now: plain again until the next probe is due

    good = Candidate(EchoDrafter(truth), Acceptance(0.95, 8), 0.0, cheap=True)
    stale = Candidate(BehindDrafter(truth, 32), Acceptance(0.3, 8), 0.5, cheap=False)
    mixed = AutoDrafter([good, stale], cost)
    stale.idle = PROBE_EVERY + 5
    chosen, draft = run_alone(mixed._choose(8))
    assert chosen is good and draft.k > PROBE_K  # the paying drafter keeps the step


def test_auto_takes_a_paying_free_proposal_over_a_draft_model() -> None:
    """n-gram's proposal (already made, free) is drafted when it pays, even where the draft model's
    higher acceptance rates a little better per step; the draft model drafts when n-gram has
    nothing to propose."""
    cost = FrozenCost({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6})
    truth = list(range(100, 140))
    free = Candidate(EchoDrafter(truth), Acceptance(0.7, 8), 0.0, cheap=True)
    model = Candidate(BehindDrafter(truth, 1), Acceptance(0.99, 8), 0.02, cheap=False)
    auto = AutoDrafter([free, model], cost)
    assert best_k(cost, model, 8)[1] > best_k(cost, free, 8)[1]  # per step, the model rates higher
    chosen, draft = run_alone(auto._choose(8))
    assert chosen is free and draft.k > 0
    free.drafter.out = len(truth)  # nothing left to propose: an empty preview
    chosen, draft = run_alone(auto._choose(8))
    assert chosen is model and draft.k > 0


def test_catch_up_follows_the_drafters_own_pass_costs() -> None:
    """With its model's measured pass costs, a catch-up is priced on that curve (a small model's
    16-row pass costs fewer one-row passes than the target's), and at most max_catch_up rows."""
    cost = FrozenCost({1: 1.0, 16: 4.0})
    own = TargetCost({1: 0.2, 16: 0.4})  # 16 rows: 2 one-row passes of the draft
    truth = list(range(100, 140))
    behind = BehindDrafter(truth, 16)
    auto = AutoDrafter([], cost)
    assert auto._catch_up_seconds(Candidate(behind, Acceptance(0.9, 8), 0.2, cheap=False)) == pytest.approx(0.2 * 3.0)
    with_own = Candidate(behind, Acceptance(0.9, 8), 0.2, cheap=False, pass_cost=own)
    assert auto._catch_up_seconds(with_own) == pytest.approx(0.2 * 1.0)
    behind.max_catch_up = 1  # type: ignore[attr-defined]  # reads at most the last token: no catch-up
    assert auto._catch_up_seconds(with_own) == 0.0


class ConfidentDrafter(BehindDrafter):
    """A model drafter that ends proposals itself when unsure (like DraftModelDrafter's stop_below)."""

    name = "confident"
    stop_below = 0.8

    def __init__(self, truth: list[int]) -> None:
        super().__init__(truth, 1)
        self.asked: list[int] = []

    def propose(self, k: int) -> Draft:
        self.asked.append(k)
        return super().propose(k)


def test_auto_offers_a_self_stopping_drafter_at_least_confident_k() -> None:
    """The cost model sizes k for drafts of average confidence; a drafter that stops itself when
    unsure is offered CONFIDENT_K tokens at least (within the step's budget), a plain one the
    cost model's k."""
    cost = FrozenCost({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8})
    truth = list(range(100, 140))
    plain_model = Candidate(BehindDrafter(truth, 1), Acceptance(0.5, 8), 0.1, cheap=False)
    k_cost = run_alone(AutoDrafter([plain_model], cost)._choose(8))[1].k
    assert 0 < k_cost < CONFIDENT_K  # a modest acceptance: the cost model alone drafts a little

    confident = ConfidentDrafter(truth)
    auto = AutoDrafter([Candidate(confident, Acceptance(0.5, 8), 0.1, cheap=False)], cost)
    assert run_alone(auto._choose(8))[1].k == CONFIDENT_K and confident.asked == [CONFIDENT_K]
    assert run_alone(auto._choose(3))[1].k == 3 and confident.asked[-1] == 3  # never past the step's budget
    confident.stop_below = 0.0  # the rule switched off: the cost model's k again
    assert run_alone(auto._choose(8))[1].k == k_cost


def test_the_start_up_line_names_what_auto_chooses_among() -> None:
    from quickdraft.cli.common import describe_drafter

    auto = AutoDrafter(
        [Candidate(NGramDrafter(), Acceptance(0.5, 8), 0.0, cheap=True),
         Candidate(EchoDrafter([1, 2]), Acceptance(0.5, 8), 0.01, cheap=False)],
        FrozenCost({1: 1.0, 8: 1.0}),
    )
    assert [p.name for p in auto.parts()] == ["ngram", "echo"]
    assert describe_drafter(auto) == "auto (ngram, echo)"
    assert describe_drafter(NGramDrafter()) == "ngram" and describe_drafter(None) == "none"


# ------------------------------------------------------------------------------ under load (PassLoad)

# A CPU's pass costs (1.5B target, 2 cores): rows beyond one are cheap, then grow.
LOADED = {1: 0.10, 2: 0.11, 4: 0.13, 8: 0.20, 16: 0.35}


def test_under_load_the_rate_is_the_pass_and_a_draft_model_stops_paying() -> None:
    """Alone, a draft model at a third of a target pass per token pays at 0.8 acceptance; with
    three other sequences in the pass (12 rows, 6 tokens a step) its passes would hold them all
    up, so plain wins; a free n-gram proposal still pays (its rows are cheap in a pass of many)."""
    cost = FrozenCost(LOADED)
    model = Candidate(NGramDrafter(), Acceptance(0.8, 8), 0.033, cheap=False)
    free = candidate(0.8)
    load = PassLoad(sequences=3, rows=12, draft_seconds=0.0, tokens=6.0)
    assert best_k(cost, model, 8)[0] > 0
    k, rate = best_k(cost, model, 8, load=load)
    assert k == 0 and rate == pytest.approx(7.0 / cost(13))  # the whole pass's tokens per second
    k, rate = best_k(cost, free, 8, load=load)
    assert k > 0 and rate == pytest.approx((6.0 + Acceptance(0.8, 8).expected_tokens(k)) / cost(12 + k + 1))
    # the others' drafting time counts in the pass: a pass already slowed by drafting makes rows look cheaper
    busy = PassLoad(sequences=3, rows=12, draft_seconds=0.3, tokens=6.0)
    assert best_k(cost, free, 8, load=busy)[0] >= k
    assert best_k(cost, model, 8, load=ALONE) == best_k(cost, model, 8)  # alone: the rate of before


def test_auto_under_load_neither_probes_a_model_drafter_nor_observes_pass_times() -> None:
    """Under load a probe of a model drafter stalls every sequence (only free proposals are probed),
    and the time from propose to commit includes the others' rows and drafts (not observed: the
    shared pass costs would learn a 1-row pass as slow as four)."""
    cost = TargetCost(dict(LOADED))
    truth = list(range(100, 140))
    behind = Candidate(BehindDrafter(truth, 1), Acceptance(0.3, 8), 0.05, cheap=False)
    auto = AutoDrafter([behind], cost)
    auto.join(PassLoad(sequences=3, rows=12, draft_seconds=0.0, tokens=4.0))
    for _ in range(3 * PROBE_EVERY):
        chosen, draft = run_alone(auto._choose(8))
        assert chosen is None and draft.k == 0
        auto._t_ready = 1.0  # as if a pass ran since (propose sets it)
        auto.commit(torch.tensor([1]), 0)
    assert cost.seconds == LOADED
    auto.join(ALONE)  # alone again: the long-idle drafter is probed at once, its pass observed
    draft = auto.propose(8)
    assert auto._chosen is behind and draft.k == PROBE_K
    auto.commit(torch.tensor([1, 2, 3]), 0)
    assert set(cost.seconds) == set(LOADED) | {PROBE_K + 1}


def _read_priced(tiny: tuple[LoadedModel, list[int], list[int]], prompt: list[int], max_tokens: int,
                 draft_pass: float) -> tuple[AutoDrafter, DraftModelDrafter, list[int]]:
    """A draft model (the target itself, a window of 16 prompt tokens) under the cost model with
    scripted costs: target passes 0.1 s for 1 row, drafting 80% accepted; its own passes
    ``draft_pass`` s for one row, 8 ms more per row. Returns the auto drafter after one answer."""
    loaded, _, _ = tiny
    drafter = DraftModelDrafter(loaded.model, loaded.config.vocab_size, eager=True, prefill_window=16)
    own = FrozenCost({1: draft_pass, 16: draft_pass + 0.008 * 15})
    cand = Candidate(drafter, Acceptance(0.8, 8), draft_pass, cheap=False, pass_cost=own)
    auto = AutoDrafter([cand], FrozenCost({1: 0.1, 2: 0.105, 4: 0.115, 8: 0.135, 16: 0.175}))
    engine = Engine(loaded.model, loaded.tokenizer)
    steps = list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), auto, 8))
    return auto, drafter, [t for s in steps for t in s.token_ids]


def test_a_draft_models_prompt_read_is_paid_only_where_it_pays_back(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    """Before a draft model reads a long prompt, the cost model weighs the read (its own pass
    costs for the rows it would read) against what it saves per token over the answer (the
    requested max_tokens, at most twice what answers bring): a short answer stands it down (it
    reads only its last 16 tokens when first used), a long one pays for the read; the output is
    plain decoding's either way."""
    loaded, prompt, truth = tiny
    long_prompt = (prompt * 8)[:200]
    want = [t for s in Engine(loaded.model, loaded.tokenizer).generate(
        long_prompt, SamplingParams(max_tokens=48, ignore_eos=True)) for t in s.token_ids]
    # the read: max(16, 199 // 4) = 49 rows, 0.03 + 0.008 * 48 = 0.41 s; drafting saves ~0.029 s a token
    short, drafter, ids = _read_priced(tiny, long_prompt, 4, draft_pass=0.03)
    assert ids == want[:4]
    assert short.stand_downs == ["draft: its prompt read would not pay back (49 tokens)"]
    assert all(p >= 200 - MAX_CATCH_UP for p in drafter.slot_positions)  # at most the last tokens, when used
    long, drafter, ids = _read_priced(tiny, long_prompt, 48, draft_pass=0.03)
    assert ids == want and long.stand_downs == []
    assert drafter.slot_positions[:2] == [200 - 1 - 49, 200 - 49]  # the prompt's last 49 tokens, read at prefill
    # what answers bring bounds the payback: after short answers, a long max_tokens alone does not pay
    long.answer_tokens = 2.0
    long.candidates[0].seconds_per_token = 0.03  # (the tiny model's measured passes took its place)
    # (and its measured acceptance, which depends on the CPU's kernels for the random model: back
    # to the prior, 80% a token, so the saving is the scripted one, ~0.031 s a token at k = 3)
    long.candidates[0].acceptance = Acceptance(0.8, 8)
    assert not long._read_pays(long.candidates[0], 149, 10_000)
    assert long._read_pays(long.candidates[0], 2, 10_000)


def test_a_deferred_prompt_read_reads_what_a_loaded_one_does(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    """prompt_read says what prefill would read (0 once deferred, or under load, or for a short prompt)."""
    loaded, prompt, _ = tiny
    drafter = DraftModelDrafter(loaded.model, loaded.config.vocab_size, eager=True, prefill_window=16)
    ids = torch.tensor((prompt * 8)[:200])
    assert drafter.prompt_read(ids) == 49
    assert drafter.prompt_read(ids[:10]) == 9
    drafter.join(PassLoad(sequences=1, rows=2, draft_seconds=0.0, tokens=1.0))
    assert drafter.prompt_read(ids) == 0
    drafter.join(ALONE)
    drafter.defer_prompt()
    drafter.prefill(ids, SamplingParams())
    assert drafter.cache.length == 0 and drafter.pending == ids[-MAX_CATCH_UP:].tolist()
    assert drafter.prompt_read(ids) == 49  # (deferred for one prefill only)


class SureDrafter(EchoDrafter):
    """A cheap drafter always proposing k tokens it expects to be accepted half the time."""

    name = "sure"

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(0.5 ** j for j in range(1, k + 1))

    def forks(self, count: int) -> list[Drafter]:
        return [SureDrafter(self.truth) for _ in range(count)]


def test_under_load_a_draft_row_costs_what_passes_of_many_cost() -> None:
    """Under load a draft is priced on the curve of the engine's whole passes (learned from what
    each join reports, shared by the forks, each pass counted once): where a row added to four
    sequences' pass costs 20% of it, the drafts stop; where rows are cheap, they stay. The alone
    curve is left as it was."""
    alone = {1: 0.10, 2: 0.102, 4: 0.106, 8: 0.114, 16: 0.13}
    truth = list(range(100, 160))
    auto = AutoDrafter([Candidate(SureDrafter(truth), Acceptance(0.5, 8), 0.0, cheap=True)], TargetCost(dict(alone)))
    forks = [auto, *auto.forks(3)]
    assert all(f.shared_cost is auto.shared_cost and f.cost is auto.cost for f in forks)

    def k_under(pass_seconds: dict[int, float]) -> int:
        for _ in range(60):  # each of the four sequences reports each pass
            for rows, seconds in pass_seconds.items():
                for f in forks:
                    f.join(PassLoad(3, rows - 1, 0.0, 3.0, pass_rows=rows, pass_seconds=seconds))
        auto.join(PassLoad(3, 3, 0.0, 3.0))
        return run_alone(auto._choose(8))[1].k

    assert run_alone(auto._choose(8))[1].k > 0  # alone: rows are cheap
    assert k_under({4: 0.10, 5: 0.12, 6: 0.14, 8: 0.18, 12: 0.26}) == 0  # 20% of a pass per row: no draft
    assert auto.shared_cost(4) == pytest.approx(0.10, rel=0.05)
    assert k_under({4: 0.10, 5: 0.101, 6: 0.102, 8: 0.104, 12: 0.108}) > 0  # 1% per row: drafts again
    assert auto.cost.seconds == alone
    # one pass reported by four sequences moves the curve as one observation would
    one = TargetCost({4: 0.1})
    one.observe(4, 0.2)
    shared = AutoDrafter([], TargetCost({4: 0.1}))
    for f in [shared, *shared.forks(3)]:
        f.join(PassLoad(3, 3, 0.0, 3.0, pass_rows=4, pass_seconds=0.2))
    assert shared.shared_cost(4) == pytest.approx(one(4), rel=0.02)


def test_a_drafter_that_learns_unused_is_never_probed(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    """Longest-match lookup scores its proposal against every emitted token, used or not: where
    verification never pays, the cost model does not spend steps probing it (n-gram lookup, which
    learns only when used, is probed: the test above)."""
    _, _, truth = tiny
    lookup = SuffixDrafter()
    assert lookup.learns_unused and not NGramDrafter().learns_unused
    auto = AutoDrafter([Candidate(lookup, Acceptance(0.9, 8), 0.0, cheap=True)],
                       FrozenCost({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}))
    ids, stats = run_auto(tiny, auto)
    assert ids == truth and auto.usage["ngram"] == 0 and stats.drafted == 0  # type: ignore[attr-defined]
    assert auto.usage["none"] >= stats.target_passes - 2  # type: ignore[attr-defined]
    assert sum(b.rates[0] != p for b, p in zip(lookup.acceptance, BUCKET_PRIORS, strict=True)) > 0  # it learned


def test_under_load_a_draft_must_beat_plain_by_a_margin() -> None:
    """A draft expected to raise the pass's rate by 3% is not made under load (its rows slow every
    sequence for sure, its tokens are an estimate); one expected to raise it by 8% is."""
    truth = list(range(100, 160))

    def k_at(five_rows: float) -> int:
        shared = FrozenCost({4: 0.100, 5: five_rows, 6: 0.125, 7: 0.150, 8: 0.175})
        auto = AutoDrafter([Candidate(SureDrafter(truth), Acceptance(0.5, 8), 0.0, cheap=True)],
                           FrozenCost({1: 0.1}), shared_cost=shared)
        auto.join(PassLoad(3, 3, 0.0, 3.0))  # (no whole pass reported: the shared curve stays)
        return run_alone(auto._choose(8))[1].k

    assert LOAD_MARGIN > 1.03
    assert k_at(4.5 / (40 * 1.03)) == 0  # 3 others' tokens + 1.5 expected over cost(5): 3% above 4 / cost(4)
    assert k_at(4.5 / (40 * 1.08)) == 1


def test_a_prompt_left_under_load_is_caught_up_capped_when_drafting_starts_alone(
    tiny: tuple[LoadedModel, list[int], list[int]],
) -> None:
    """A draft model prefilled under load reads no prompt; when it first drafts (alone, after
    tokens it missed), it reads at most its last MAX_CATCH_UP tokens, not the whole context (a
    4-user run's last request paid a 0.4 s pass of 150 rows for one draft)."""
    loaded, prompt, _ = tiny
    drafter = DraftModelDrafter(loaded.model, loaded.config.vocab_size, eager=True, prefill_window=16)
    ids = torch.tensor((prompt * 8)[:200])
    drafter.join(PassLoad(sequences=3, rows=3, draft_seconds=0.0, tokens=3.0))
    drafter.prefill(ids, SamplingParams())
    assert drafter.cache.length == 0
    for t in range(40):  # answer tokens committed while other drafters (or none) ran
        drafter.commit(torch.tensor([t % 7 + 1]), 0)
    drafter.join(ALONE)
    steps = drafter.drafting(2)
    asked = next(steps)
    assert isinstance(asked, ModelPass) and asked.ids.shape[0] == MAX_CATCH_UP
    assert asked.positions is not None and int(asked.positions[-1]) == 200 + 40 - 1  # the latest token's place
