"""Every model family through the same checks, one row of FAMILIES each (mlx-lm's tests/test_models.py
runs one ``model_test_runner`` per family the same way).

For each family's tiny random checkpoint (tests/tiny.py): the logits equal transformers' (fp32)
within the row's tolerance, on a text longer than a 64-row pass; every row of any pass is bitwise
plain decoding's (one pass, single rows, chunks, a rollback); so speculation is lossless: greedy
output with scripted chains (right, wrong, partly right, random at k = 1 and 4), trees, n-gram
lookup and draft models (an unrelated llama, a perturbed copy, the model itself) is plain greedy
output, several sequences in one pass each equal alone, and the prefix cache's warm runs equal cold
ones. What only one family has (its layout, its GGUF, its own drafter) stays in its own test file.

Adding a family: its model module, its tiny checkpoint in tests/tiny.py, one row below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    GREEDY,
    MB,
    Case,
    TreeOracle,
    assert_close,
    check_scripted,
    check_together_equals_alone,
    fp32_as_close_as_transformers,
    generate,
    logits,
    make_case,
    perturbed_copy,
    run,
    run_to_end,
    same,
    tokens,
)
from tiny import GEMMA4_MOE, load_reference, make_moe_model, make_tiny_hf_model, reference_logits

from quickdraft.cache import STATE_EVERY
from quickdraft.engine import Engine, Generation
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.prefix_cache import PrefixCache
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NGramDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module

TEXT = (
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i * i)\n"
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"
)


LogitsCheck = Callable[[LoadedModel, Any, list[int]], None]  # (model, transformers' model, ids)


def within(tolerance: float, relative: bool = False) -> LogitsCheck:
    """Max |logit - transformers' fp32 logit| <= ``tolerance`` (``relative``: times the logits'
    scale, max |logit| and at least 1)."""

    def check(loaded: LoadedModel, reference: Any, ids: list[int]) -> None:
        got, want = logits(loaded, ids), reference_logits(reference, ids)
        if relative:
            assert_close(got, want, rel=tolerance)
        else:
            assert (got - want).abs().max() < tolerance

    return check


@dataclass(frozen=True)
class Family:
    """One row: a family's tiny checkpoint and what its model guarantees."""

    name: str
    build: Callable[[Path], Path]  # writes the tiny checkpoint into the folder given, returns its folder
    check_logits: LogitsCheck = field(default=within(1e-4))
    # a recurrent state (Gated DeltaNet) rolls back only within the last pass and to checkpoints
    # every STATE_EVERY tokens; keys and values roll back anywhere
    recurrent: bool = False
    together: tuple[int, int] = (4, 3)  # requests run together, lanes


def hf(model_type: str, seed: int, **overrides: Any) -> Callable[[Path], Path]:
    return lambda root: make_tiny_hf_model(root, model_type, seed=seed, **overrides)


def moe(name: str) -> Callable[[Path], Path]:
    return lambda root: make_moe_model(root, name)


FAMILIES = [
    Family("llama", hf("llama", 21), within(1e-4, relative=True)),
    Family("qwen2", hf("qwen2", 21), within(1e-4, relative=True)),
    Family("qwen3", hf("qwen3", 21), within(1e-4, relative=True)),
    Family("mistral", hf("mistral", 21), within(1e-4, relative=True)),
    Family("phi3", hf("phi3", 21), within(1e-4, relative=True)),
    Family("gemma3", hf("gemma3_text", 21), within(1e-4, relative=True)),
    Family("gemma4", hf("gemma4_text", 1)),
    Family("gemma4-moe", hf("gemma4_text", 2, **GEMMA4_MOE)),
    Family("gpt-oss", hf("gpt_oss", 3)),
    Family("qwen3.5", hf("qwen3_5_text", 3), fp32_as_close_as_transformers, recurrent=True, together=(5, 3)),
    Family("qwen3.5-moe", hf("qwen3_5_moe_text", 4), recurrent=True, together=(3, 2)),
    Family("qwen3-next", hf("qwen3_next", 4), recurrent=True, together=(3, 2)),
    Family("mixtral", moe("mixtral"), within(1e-4, relative=True)),
    Family("qwen2-moe", moe("qwen2_moe"), within(1e-4, relative=True)),
    Family("qwen3-moe", moe("qwen3_moe"), within(1e-4, relative=True)),
    Family("llama4", moe("llama4"), within(1e-4, relative=True)),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request: pytest.FixtureRequest) -> Family:
    return request.param


@pytest.fixture(scope="module")
def folder(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family.build(tmp_path_factory.mktemp(family.name))


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    return load_model(str(folder), dtype="float32", max_context=256)


@pytest.fixture(scope="module")
def case(loaded: LoadedModel) -> Case:
    return make_case(loaded, TEXT[:60], 24)


# ------------------------------------------------------------------------- against transformers


def test_logits_match_transformers(family: Family, folder: Path, loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode(TEXT)
    assert len(ids) > 64  # a pass longer than the batch-invariant blocks, too
    got = logits(loaded, ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), loaded.config.vocab_size)
    family.check_logits(loaded, load_reference(folder), ids)


# ------------------------------------------------------------------------- rows: bitwise decoding


def test_rows_of_any_pass_are_bitwise_decoding(family: Family, loaded: LoadedModel) -> None:
    """One pass == single rows == chunks of 6 or 7 rows; rolled back past the window, the rest == the pass's."""
    ids = loaded.tokenizer.encode(TEXT)[:40]
    whole = logits(loaded, ids)
    cache = loaded.model.new_cache()
    assert torch.equal(torch.cat([logits(loaded, [t], cache) for t in ids]), whole)
    for size in (6, 7):
        cache = loaded.model.new_cache()
        assert torch.equal(torch.cat([logits(loaded, ids[s : s + size], cache) for s in range(0, 40, size)]), whole)
    if not family.recurrent:  # (tests/test_qwen3_5.py rolls the recurrent state back where it can go)
        cache.truncate(17)
        assert torch.equal(logits(loaded, ids[17:], cache), whole[17:])


# ------------------------------------------------------------------------- lossless speculation


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly", "coin"])
def test_scripted_drafters_match_plain_greedy(case: Case, kind: str, k: int) -> None:
    check_scripted(case, kind, k)


@pytest.mark.parametrize("shape", ["right_last", "right_varied", "wrong"])
def test_tree_drafters_match_plain_greedy(case: Case, shape: str) -> None:
    got = generate(case.loaded, case.prompt, TreeOracle(case.truth, case.vocab, shape), 8,
                   max_tokens=len(case.truth), ignore_eos=True)
    assert got.ids == case.truth and got.stats.drafted > 0


@pytest.fixture(scope="module")
def draft_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A dense tiny llama with the same tokenizer: an unrelated draft, right now and then."""
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("draft"), "llama", seed=8)
    return load_model(str(folder), dtype="float32", max_context=256)


@pytest.mark.parametrize("k", [2, 6])
def test_ngram_matches_plain_greedy(loaded: LoadedModel, k: int) -> None:
    prompt = tokens(5, 90, loaded.config.vocab_size)  # repeats: the n-grams find matches
    truth = generate(loaded, prompt, max_tokens=30, ignore_eos=True).ids
    run_ = Case(loaded, prompt, truth).spec(NGramDrafter(max_ngram=3, min_ngram=1), k)
    assert run_.ids == truth and run_.stats.drafted > 0


def test_draft_models_match_plain_greedy(family: Family, case: Case, draft_llama: LoadedModel) -> None:
    run_ = case.spec(DraftModelDrafter(draft_llama.model, case.vocab), 3)
    assert run_.ids == case.truth and run_.stats.drafted > 0
    # the family as a draft model itself (a recurrent one rolls back among its one-row proposal passes)
    near = perturbed_copy(case.loaded.path, seed=5, scale=0.1)  # a draft of the family, often right
    run_ = case.spec(DraftModelDrafter(near.model, case.vocab), 4)
    assert run_.ids == case.truth and 0 < run_.stats.accepted < run_.stats.drafted
    run_ = case.spec(DraftModelDrafter(case.loaded.model, case.vocab), 5)  # itself: all accepted
    assert run_.ids == case.truth and run_.stats.accepted == run_.stats.drafted > 0


def test_draft_models_of_several_sequences_in_one_pass_equal_each_alone(case: Case) -> None:
    """Two sequences, each drafted by a copy of the family that is often right, their draft passes
    run as one pass (a recurrent draft rolls back among the states its pool lane continued)."""
    near = perturbed_copy(case.loaded.path, seed=5, scale=0.1)
    greedy = SamplingParams(max_tokens=len(case.truth), ignore_eos=True)
    second = case.prompt[10:] + case.prompt[:10]
    engine = Engine(case.loaded.model, case.loaded.tokenizer, max_sequences=2)
    gens = {engine.add(p, greedy, DraftModelDrafter(near.model, case.vocab), 3): p for p in (case.prompt, second)}
    got: dict[Generation, list[int]] = {g: [] for g in gens}
    run_to_end(engine, got)
    for gen, prompt in gens.items():
        assert got[gen] == generate(case.loaded, prompt, max_tokens=len(case.truth), ignore_eos=True).ids
    stats = [g.req.stats for g in gens]
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)


def test_several_sequences_in_one_pass_equal_each_alone(family: Family, loaded: LoadedModel) -> None:
    """Rows of several sequences (prompt chunks, chains, trees, draft models) in one pass: each
    continues its own lane (keys and values, or recurrent state); every answer == alone."""
    check_together_equals_alone(loaded, *family.together)


def test_prefix_cache_warm_equals_cold(family: Family, loaded: LoadedModel) -> None:
    """A conversation's next turn reuses everything stored; an edit midway reuses up to the edit
    (a recurrent state: up to the checkpoint before it); each answer == a cold run's."""
    vocab = loaded.config.vocab_size
    engine = Engine(loaded.model, loaded.tokenizer, prefix_cache=PrefixCache(64 * MB))

    def cold(prompt: list[int], drafter: Any = None, k: int = 0) -> Any:
        return run(Engine(loaded.model, loaded.tokenizer), prompt, drafter, k, GREEDY)

    history = tokens(1, 100, vocab)
    first = run(engine, history, None, 0, GREEDY)
    same(first, cold(history))
    turn = history + first.ids + tokens(2, 20, vocab)
    warm = run(engine, turn, NGramDrafter(), 4, GREEDY)
    assert warm.stats.cached_tokens == len(history) + len(first.ids) - 1
    same(warm, cold(turn, NGramDrafter(), 4))
    edited = history[:70] + [(history[70] + 1) % vocab or 3] + history[71:]
    out = run(engine, edited, None, 0, GREEDY)
    assert out.stats.cached_tokens == (STATE_EVERY if family.recurrent else 70)
    same(out, cold(edited))
    if family.recurrent:
        # the same turn again (a regenerated answer): the stored copy of the conversation holds its
        # state at 64, 128 and its end (167): the last checkpoint within the prompt's 143 is 128
        again = run(engine, turn, None, 0, GREEDY)
        assert again.stats.cached_tokens == 2 * STATE_EVERY
        same(again, cold(turn))
