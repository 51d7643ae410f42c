"""Lossless speculative decoding, end to end through the engine.

Greedy: whatever a drafter proposes (always right, always wrong, right up to a chosen position,
random, n-gram lookup, another model, the target itself), the speculative output must be
token-identical to plain greedy decoding, on tiny random llama/qwen2 models and on the real
SmolLM2-135M, in fp32 and in the shipped bf16. The scripted drafters below also check that the
engine accepts exactly the longest right prefix of every proposal and that the stats report it.

Sampling: the first tokens' marginals under speculative sampling must match the target's exact
distribution (computed by enumerating prefixes) as closely as the sample count allows.

Everything here runs with one compute thread (restored afterwards): on the 2-core test machines a
second OpenMP thread makes tiny passes many times slower as soon as another process is busy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    GGUF_LINEARS,
    TINY_PROMPT,
    Case,
    ConstDrafter,
    OracleDrafter,
    Run,
    WrongDrafter,
    check_scripted,
    generate,
    make_case,
    model_pass,
    perturbed_copy,
)
from tiny import hf_to_gguf, make_tiny_hf_model, write_tokenizer

from quickdraft.api import LLM
from quickdraft.assemble.drafters import build_drafter
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.options import EngineOptions
from quickdraft.sampling import SamplingParams, probs_from_logits, process_logits
from quickdraft.speculative.base import Drafter, Steps
from quickdraft.speculative.draft_model import DraftModelDrafter, check_same_tokenizer
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.speculative.policy import Acceptance, AutoDrafter, Candidate, TargetCost
from quickdraft.speculative.tree import DraftTree, cut_tree
from quickdraft.speculative.verify import Draft
from quickdraft.tokenizer import Tokenizer

KS = [1, 2, 3, 5, 8]
TINY_N = 48  # greedy tokens per tiny run
SMOL_N = 40  # greedy tokens per fp32 SmolLM2 run
BF16_N = 64
SMOL_PROMPT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef"
)
EMPTY = torch.empty(0, dtype=torch.long)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_folder(request: pytest.FixtureRequest, tiny_root: Path) -> Path:
    return make_tiny_hf_model(tiny_root, request.param, seed=21)


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> Case:
    return make_case(
        load_model(str(tiny_folder), dtype="float32", max_context=256), TINY_PROMPT, TINY_N
    )


@pytest.fixture(scope="module")
def tiny_gguf(tiny_root: Path) -> Case:
    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    folder = make_tiny_hf_model(tiny_root, "qwen2", seed=21, name="qwen2-for-gguf")
    path = hf_to_gguf(folder, tiny_root / "qwen2.gguf", GGUF_LINEARS)
    case = make_case(load_model(str(path), dtype="auto", max_context=256), TINY_PROMPT, TINY_N)
    model = case.loaded.model
    assert model._native._stack is not None  # decode passes ran natively
    model._native.get = lambda x: None  # the Python layers give the same greedy output
    try:
        assert generate(case.loaded, case.prompt, max_tokens=TINY_N, ignore_eos=True).ids == case.truth
    finally:
        del model._native.get
    return case


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly", "coin"])
def test_gguf_native_scripted_drafters_match_plain_greedy(tiny_gguf: Case, kind: str, k: int) -> None:
    check_scripted(tiny_gguf, kind, k)


def test_gguf_kv_cache_is_float16_by_default(tiny_gguf: Case, tiny_root: Path) -> None:
    """The CPU kernels' path keeps keys and values in fp16 (every test on tiny_gguf runs on it);
    --kv-dtype float32 keeps fp32, and the two agree to fp16 rounding."""
    model = tiny_gguf.loaded.model
    assert model.kv_dtype == torch.float16 and model.make_cache(8).k.dtype == torch.float16
    fp32 = load_model(str(tiny_root / "qwen2.gguf"), max_context=256, kv_dtype="float32")
    assert fp32.model.make_cache(8).k.dtype == torch.float32
    ids = torch.tensor(tiny_gguf.prompt)
    a = model.prefill(ids, model.make_cache(64))
    b = fp32.model.prefill(ids, fp32.model.make_cache(64))
    torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    with pytest.raises(QuickdraftError, match="KV cache dtype"):
        load_model(str(tiny_root / "qwen2.gguf"), kv_dtype="int4")


def test_gguf_native_ngram_and_rows(tiny_gguf: Case) -> None:
    run = tiny_gguf.spec(NGramDrafter(min_ngram=1), 5)
    assert run.ids == tiny_gguf.truth and run.stats.drafted > 0
    check_rows_bitwise(tiny_gguf.loaded.model, tiny_gguf.prompt, tiny_gguf.truth[:20], [2, 4, 8, 9, 17], [0, 3])


# Every block format beyond the shipped models' (each file: every tensor in that type, written by
# llama.cpp's llama-quantize; tests/data/make_quantized.py), and Q5_1 / F16 / BF16 linears written
# by the gguf package: the same model shape (hidden 256, so K-quant blocks fit) on the kernels.
QUANT_DATA = Path(__file__).parent / "data"
LLAMACPP_QUANTS = ["Q2_K", "Q3_K", "Q5_K", "IQ4_XS", "IQ4_NL"]
_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
GGUF_PACKAGE_QUANTS = {
    "Q5_1": {f"{n}.weight": "Q5_1" for n in (*_LINEARS, "token_embd", "output")},
    "F16+BF16": {f"{n}.weight": "F16" if i % 2 else "BF16" for i, n in enumerate((*_LINEARS, "output"))},
}
QUANT_N = 32


@pytest.fixture(scope="module", params=LLAMACPP_QUANTS + list(GGUF_PACKAGE_QUANTS))
def quant_case(request: pytest.FixtureRequest, tiny_root: Path) -> Case:
    from quickdraft.quant.ggml import GGMLLinear, kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    if request.param in LLAMACPP_QUANTS:
        path = QUANT_DATA / f"tiny-qwen2-256-{request.param}.gguf"
    else:
        folder = tiny_root / "tiny-qwen2-256"
        if not folder.exists():
            make_tiny_hf_model(tiny_root, "qwen2", seed=3, name=folder.name, hidden_size=256,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
        path = hf_to_gguf(folder, tiny_root / f"tiny-qwen2-256-{request.param}.gguf", GGUF_PACKAGE_QUANTS[request.param])
    loaded = load_model(str(path), max_context=256)
    linears = [m for m in loaded.model.modules() if isinstance(m, GGMLLinear)]
    assert len(linears) >= 14 and all(m.qtype.name in request.param for m in linears)
    return make_case(loaded, TINY_PROMPT, QUANT_N)


@pytest.mark.parametrize("kind", ["oracle", "partly", "coin"])
def test_quant_types_scripted_drafters_match_plain_greedy(quant_case: Case, kind: str) -> None:
    check_scripted(quant_case, kind, 4)


def test_quant_types_ngram_and_rows(quant_case: Case) -> None:
    run = quant_case.spec(NGramDrafter(min_ngram=1), 5)
    assert run.ids == quant_case.truth and run.stats.drafted > 0
    check_rows_bitwise(quant_case.loaded.model, quant_case.prompt, quant_case.truth[:12], [2, 5, 9], [0, 3])


# --kv-dtype q8_0: keys and values as Q8_0 blocks (head size 64: the hidden-256 model of tests/data).
@pytest.fixture(scope="module")
def q8_kv_case() -> Case:
    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    loaded = load_model(str(QUANT_DATA / "tiny-qwen2-256-Q5_K.gguf"), max_context=256, kv_dtype="q8_0")
    assert loaded.model.new_cache().kind == "q8_0" and loaded.model.new_cache().k.dtype == torch.uint8
    return make_case(loaded, TINY_PROMPT, QUANT_N)


@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly", "coin"])
@pytest.mark.parametrize("k", [1, 5])
def test_q8_0_kv_scripted_drafters_match_plain_greedy(q8_kv_case: Case, kind: str, k: int) -> None:
    check_scripted(q8_kv_case, kind, k)


def test_q8_0_kv_ngram_rows_and_long_prefill(q8_kv_case: Case) -> None:
    """n-gram drafts, rows bitwise alone or in a pass, and a prompt longer than one native pass
    (its chunks attend through the torch path over the same dequantized keys): plain == speculative."""
    run = q8_kv_case.spec(NGramDrafter(min_ngram=1), 5)
    assert run.ids == q8_kv_case.truth and run.stats.drafted > 0
    check_rows_bitwise(q8_kv_case.loaded.model, q8_kv_case.prompt, q8_kv_case.truth[:12], [2, 5, 9], [0, 3])
    long_case = make_case(q8_kv_case.loaded, TINY_PROMPT * 6, 24)
    assert len(long_case.prompt) > 64
    for kind in ("oracle", "partly"):
        check_scripted(long_case, kind, 4)


def test_q8_0_kv_needs_the_kernels_path() -> None:
    with pytest.raises(QuickdraftError, match="q8_0 needs the CPU kernels"):
        load_model(str(QUANT_DATA / "tiny-qwen2-256-Q5_K.gguf"), dtype="float32", kv_dtype="q8_0")


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly", "random", "coin"])
def test_tiny_scripted_drafters_match_plain_greedy(tiny: Case, kind: str, k: int) -> None:
    check_scripted(tiny, kind, k)


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("min_ngram", [1, 2])
def test_tiny_ngram_matches_plain_greedy(tiny: Case, k: int, min_ngram: int) -> None:
    run = tiny.spec(NGramDrafter(min_ngram=min_ngram), k)
    assert run.ids == tiny.truth
    assert run.stats.drafted > 0


def test_tiny_ngram_through_auto_drafter(tiny: Case) -> None:
    drafter, k = build_drafter(EngineOptions(draft="ngram", dtype="float32"), tiny.loaded)
    assert isinstance(drafter, AutoDrafter) and k > 0
    assert tiny.spec(drafter, k).ids == tiny.truth
    # A fixed k through the policy too (it still picks per step, but drafts min(k, preview)).
    cheap = TargetCost({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    auto = AutoDrafter(
        [Candidate(NGramDrafter(min_ngram=1), Acceptance(0.6, 8), 0.0, cheap=True)],
        cheap,
        fixed_k=3,
    )
    run = tiny.spec(auto, 3)
    assert run.ids == tiny.truth and run.stats.drafted > 0


def test_tiny_rows_are_batch_invariant(tiny: Case) -> None:
    check_rows_bitwise(
        tiny.loaded.model, tiny.prompt, tiny.truth[:20], [2, 4, 8, 9, 16, 17], [0, 3]
    )


PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}


@pytest.fixture(scope="module")
def tiny_penalised(tiny: Case) -> Case:
    """Greedy with every penalty on: row i of a verify pass must count draft[:i] as output."""
    case = make_case(tiny.loaded, TINY_PROMPT, TINY_N, **PENALTIES)
    assert case.truth != tiny.truth  # the penalties change the output
    return case


@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly", "coin"])
def test_tiny_penalties_greedy_match_plain(tiny_penalised: Case, kind: str, k: int) -> None:
    check_scripted(tiny_penalised, kind, k)


def test_tiny_penalties_draft_model(tiny_penalised: Case) -> None:
    """The target drafting for itself, without penalties (the draft lacks the history): it is
    right only where the penalties do not change the choice."""
    case = tiny_penalised
    run = case.spec(DraftModelDrafter(case.loaded.model, case.vocab), 4)
    assert run.ids == case.truth
    assert 0 < run.stats.accepted < run.stats.drafted


def test_speculation_up_to_the_end_of_the_context(tiny_folder: Path) -> None:
    """max_tokens beyond the context: speculation must stop drafting where the cache ends and
    finish with "length" exactly where plain decoding does."""
    small = load_model(str(tiny_folder), dtype="float32", max_context=48)
    prompt = small.tokenizer.encode(TINY_PROMPT)
    room = 48 - len(prompt)
    assert 10 < room < 40
    plain = generate(small, prompt, max_tokens=100, ignore_eos=True)
    assert len(plain.ids) == room and plain.finish_reason == "length"
    drafters: list[tuple[Drafter, int]] = [
        (OracleDrafter(plain.ids, small.config.vocab_size), 8),
        (WrongDrafter(plain.ids, small.config.vocab_size), 5),
        (NGramDrafter(min_ngram=1), 6),
        (DraftModelDrafter(small.model, small.config.vocab_size), 5),
    ]
    for drafter, k in drafters:
        run = generate(small, prompt, drafter, k, max_tokens=100, ignore_eos=True)
        assert (run.ids, run.text, run.finish_reason) == (plain.ids, plain.text, "length"), (
            drafter.name
        )


@pytest.fixture(scope="module")
def tiny_near(tiny_folder: Path) -> LoadedModel:
    """A slightly perturbed copy of the target: a draft model that is right only part of the time."""
    return perturbed_copy(tiny_folder, seed=5, scale=0.5)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_tiny_draft_model_matches_plain_greedy(tiny: Case, tiny_near: LoadedModel, k: int) -> None:
    run = tiny.spec(DraftModelDrafter(tiny_near.model, tiny.vocab), k)
    assert run.ids == tiny.truth
    assert 0 < run.stats.accepted < run.stats.drafted


def test_tiny_draft_model_with_a_cut_output_vocabulary(tiny: Case, tiny_folder: Path) -> None:
    """A draft whose head covers only some token ids (--draft-vocab): the N top-ranked ids, the
    added tokens and the request's prompt ids. Its logits are the full head's on those ids and
    -inf elsewhere, it never drafts another id, and greedy output is unchanged (lossless: the
    target decides), sampled output too for a fixed seed."""
    from quickdraft.assemble.drafters import restrict_draft_vocab

    draft = perturbed_copy(tiny_folder, seed=5, scale=0.5)
    cache = draft.model.new_cache()
    prompt = torch.tensor(tiny.prompt)
    full, _ = draft.model(prompt, cache)
    ranks = torch.arange(tiny.vocab).flip(0)  # "most frequent" = the highest ids
    vocab = restrict_draft_vocab(draft, 120, ranks)
    assert vocab is not None and restrict_draft_vocab(draft, 0, ranks) is None
    added = set(draft.tokenizer.backend.get_added_tokens_decoder())
    top = set(range(tiny.vocab - 120, tiny.vocab)) | set(range(120))  # the top-ranked and the first ids
    assert set(vocab.for_prompt(prompt).tolist()) == top | added | set(tiny.prompt)
    assert torch.equal(vocab.for_prompt(torch.tensor([], dtype=torch.long)), vocab.base)
    assert vocab.apply(draft.model, prompt)
    keep = vocab.current
    assert keep is not None
    cache = draft.model.new_cache()
    cut, _ = draft.model(prompt, cache)
    assert torch.equal(cut[:, keep], full[:, keep])
    others = torch.ones(tiny.vocab, dtype=torch.bool)
    others[keep] = False
    assert bool(others.any()) and bool(torch.isneginf(cut[:, others]).all())
    proposed: list[int] = []

    class Spy(DraftModelDrafter):
        def drafting(self, k: int) -> Steps[Draft]:
            d = yield from super().drafting(k)
            proposed.extend(d.tokens.tolist())
            return d

    drafter = Spy(draft.model, tiny.vocab, vocab=vocab)
    run = tiny.spec(drafter, 4)
    assert run.ids == tiny.truth and run.stats.drafted > 0
    assert proposed and set(proposed) <= set(keep.tolist())
    sampled = dict(temperature=0.8, seed=3, max_tokens=24)
    assert tiny.spec(drafter, 3, **sampled).ids == tiny.spec(drafter, 3, **sampled).ids  # deterministic
    assert draft.model.set_output_vocab(None)
    cache = draft.model.new_cache()
    assert torch.equal(draft.model(prompt, cache)[0], full)
    with pytest.raises(ValueError, match="vocabulary ids"):
        draft.model.set_output_vocab(torch.tensor([0, tiny.vocab]))
    with pytest.raises(QuickdraftError, match="draft-vocab"):
        EngineOptions(draft_vocab=10)


def test_token_ranks_count_a_corpus_and_are_cached(
    tiny: Case, tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks put the corpus's most frequent ids first (ties and unseen ids by id), and the
    stdlib-corpus ranks are computed once per tokenizer, then read from the cache."""
    from quickdraft.speculative import vocab as vocab_mod

    tok = tiny.loaded.tokenizer
    text = "hello hello hello world world x"
    ranks = vocab_mod.rank_tokens(tok, tiny.vocab, [text])
    counts = torch.bincount(torch.tensor(tok.encode(text, add_special_tokens=False)), minlength=tiny.vocab)
    assert sorted(ranks.tolist()) == list(range(tiny.vocab))
    assert counts[ranks].tolist() == sorted(counts.tolist(), reverse=True)  # most frequent first
    unseen = ranks[counts[ranks] == 0]
    assert unseen.tolist() == sorted(unseen.tolist())
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    calls: list[int] = []

    def corpus(max_chars: int = 0) -> list[str]:
        calls.append(1)
        return [text]

    monkeypatch.setattr(vocab_mod, "stdlib_corpus", corpus)
    first = vocab_mod.corpus_token_ranks(tok, tiny.vocab)
    again = vocab_mod.corpus_token_ranks(tok, tiny.vocab)
    assert torch.equal(first, ranks) and torch.equal(again, ranks) and len(calls) == 1
    assert list((tmp_path / "token_ranks").glob("*.npy"))


def test_stdlib_corpus_is_python_source() -> None:
    from quickdraft.speculative.vocab import stdlib_corpus

    texts = stdlib_corpus(max_chars=200_000)
    assert texts and 200_000 <= sum(map(len, texts)) < 2_000_000
    assert sum("def " in t for t in texts) > len(texts) // 2


@pytest.mark.parametrize("k", [1, 4, 8])
def test_tiny_target_as_its_own_draft_is_all_accepted(tiny: Case, k: int) -> None:
    """Same weights, its own cache: in fp32 with batch-invariant passes every draft is right."""
    run = tiny.spec(DraftModelDrafter(tiny.loaded.model, tiny.vocab), k)
    assert run.ids == tiny.truth
    assert run.stats.accepted == run.stats.drafted > 0
    assert run.stats.target_passes == math.ceil((len(tiny.truth) - 1) / (k + 1))


def test_tiny_unrelated_and_padded_vocab_draft_models(
    tiny: Case, tiny_root: Path, tiny_folder: Path
) -> None:
    """A draft from another seed (mostly wrong) and one with a padded vocabulary (400 > 300 ids)."""
    arch = json.loads((tiny_folder / "config.json").read_text())["model_type"]
    drafts: list[tuple[int, dict[str, Any]]] = [(22, {}), (23, {"vocab_size": 400})]
    for seed, extra in drafts:
        folder = make_tiny_hf_model(tiny_root, arch, seed=seed, **extra)
        draft = load_model(str(folder), dtype="float32", max_context=256)
        check_same_tokenizer(tiny.loaded.tokenizer, draft.tokenizer)
        run = tiny.spec(DraftModelDrafter(draft.model, tiny.vocab), 3)
        assert run.ids == tiny.truth and run.stats.drafted > 0


class ScriptedConfidence(DraftModelDrafter):
    """A draft model whose confidence in each drafted token is scripted (from a seeded stream;
    None: its own), recording the length of each proposal."""

    def __init__(self, *args: Any, confidences: Callable[[], float] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.confidences = confidences
        self.lengths: list[int] = []
        self.asked: list[int] = []

    def _confidence(self, logits: torch.Tensor, q: torch.Tensor | None) -> float:
        return super()._confidence(logits, q) if self.confidences is None else self.confidences()

    def drafting(self, k: int) -> Steps[Draft]:
        draft = yield from super().drafting(k)
        self.lengths.append(draft.k)
        self.asked.append(k)
        return draft


@pytest.mark.parametrize("pattern", ["sure", "unsure", "mixed"])
def test_draft_model_confidence_stop_matches_plain_greedy(tiny: Case, tiny_near: LoadedModel, pattern: str) -> None:
    """--draft-confidence: a proposal ends after the first token the draft is unsure of, so
    proposals of every length up to k reach the verifier and the draft's cache is rolled back by
    a varying amount; greedy output stays plain greedy's, and a proposal is k tokens exactly when
    the draft stayed sure."""
    rng = random.Random(7)
    script = {"sure": lambda: 0.95, "unsure": lambda: 0.1, "mixed": lambda: rng.choice([0.95, 0.95, 0.95, 0.3])}[pattern]
    drafter = ScriptedConfidence(tiny_near.model, tiny.vocab, stop_below=0.8, confidences=script)
    run = tiny.spec(drafter, 6)
    assert run.ids == tiny.truth
    assert run.stats.drafted == sum(drafter.lengths) and 0 < run.stats.accepted < run.stats.drafted
    asked = set(drafter.asked)
    assert 6 in asked  # (fewer near the end: max_tokens)
    if pattern == "sure":
        assert drafter.lengths == drafter.asked
    if pattern == "unsure":
        assert set(drafter.lengths) == {1}
    if pattern == "mixed":
        assert all(n <= k for n, k in zip(drafter.lengths, drafter.asked, strict=True))
        assert {1, 6} <= set(drafter.lengths) and len(set(drafter.lengths)) >= 3


def test_draft_model_confidence_is_its_top_probability(tiny: Case, tiny_near: LoadedModel) -> None:
    """Greedy: the softmax maximum of the draft's logits; sampling: the maximum of the q it drew
    from. A threshold above every confidence drafts one token per step, 0 drafts k."""
    drafter = DraftModelDrafter(tiny_near.model, tiny.vocab, stop_below=0.5)
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    assert drafter._confidence(logits, None) == pytest.approx(float(logits.softmax(-1).max()))
    assert drafter._confidence(logits, torch.tensor([[0.2, 0.7, 0.1, 0.0]])) == pytest.approx(0.7)
    prompt = torch.tensor(tiny.prompt)
    for stop, want in ((0.9999, 1), (0.0, 5)):
        d = DraftModelDrafter(tiny_near.model, tiny.vocab, stop_below=stop)
        d.prefill(prompt, SamplingParams())
        assert d.propose(5).k == want
    with pytest.raises(QuickdraftError, match="draft-confidence"):
        DraftModelDrafter(tiny_near.model, tiny.vocab, stop_below=1.0)
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(QuickdraftError, match="--draft-confidence"):
            EngineOptions(draft_confidence=bad)


def test_draft_model_drafter_keeps_up_when_not_asked(tiny: Case, tiny_near: LoadedModel) -> None:
    """Under AutoDrafter the draft model sits out steps (k=0): its pending tokens must catch up."""
    cost = FrozenCost({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    ngram = Candidate(NGramDrafter(min_ngram=1), Acceptance(0.95, 8), 0.0, cheap=True)
    draft = Candidate(
        DraftModelDrafter(tiny_near.model, tiny.vocab), Acceptance(0.5, 8), 0.01, cheap=False
    )
    auto = AutoDrafter([ngram, draft], cost)
    run = tiny.spec(auto, 4)
    assert run.ids == tiny.truth
    assert auto.usage["draft"] > 0 and auto.usage["ngram"] > 0


# ---------------------------------------------------------------- stops inside accepted runs


@pytest.fixture(scope="module")
def llama_case(tiny_root: Path) -> Case:
    folder = make_tiny_hf_model(tiny_root, "llama", seed=31, name="stops")
    return make_case(load_model(str(folder), dtype="float32", max_context=256), TINY_PROMPT, TINY_N)


def same_as_plain(case: Case, tokenizer: Tokenizer | None = None, **params: Any) -> Run:
    """Plain vs oracle k=8 under ``params``: identical ids, text, finish reason and step texts."""
    plain = generate(case.loaded, case.prompt, tokenizer=tokenizer, **params)
    oracle = OracleDrafter(case.truth, case.vocab)
    spec = generate(case.loaded, case.prompt, oracle, 8, tokenizer=tokenizer, **params)
    assert spec.ids == plain.ids
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    assert spec.stats.output_tokens == plain.stats.output_tokens == len(plain.ids)
    assert spec.stats.drafted > 0
    return spec


def mid_run_positions(case: Case) -> list[int]:
    """Output indices strictly inside the first accepted run of an oracle with k=8 (outputs 1..9)."""
    return [j for j in range(2, 9) if case.truth[j] not in case.truth[:j]]


@pytest.mark.parametrize("max_tokens", [3, 5, 10, 11, 17, 23])
def test_max_tokens_ends_mid_run(llama_case: Case, max_tokens: int) -> None:
    run = same_as_plain(llama_case, max_tokens=max_tokens, ignore_eos=True)
    assert run.ids == llama_case.truth[:max_tokens] and run.finish_reason == "length"


def test_stop_token_mid_run(llama_case: Case) -> None:
    j = mid_run_positions(llama_case)[0]
    run = same_as_plain(
        llama_case, max_tokens=TINY_N, ignore_eos=True, stop_token_ids=[llama_case.truth[j]]
    )
    assert run.ids == llama_case.truth[: j + 1] and run.finish_reason == "stop"


def test_eos_mid_run(llama_case: Case, tmp_path: Path) -> None:
    case = llama_case
    j = next(
        j for j in mid_run_positions(case) if case.truth[j] not in case.loaded.tokenizer.eos_ids
    )
    tokenizer = Tokenizer.from_hf_dir(
        write_tokenizer(tmp_path / "tok", eos_token_id=[case.truth[j]])
    )
    assert case.truth[j] in tokenizer.eos_ids
    run = same_as_plain(case, tokenizer, max_tokens=TINY_N)
    assert run.ids == case.truth[: j + 1] and run.finish_reason == "stop"


def test_stop_string_mid_run(llama_case: Case) -> None:
    case, decode = llama_case, llama_case.loaded.tokenizer.decode
    full = decode(case.truth)
    for j in range(2, 9):
        end, before = len(decode(case.truth[: j + 1])), len(decode(case.truth[:j]))
        for width in (2, 3):
            stop = full[max(0, end - width) : end]
            # first seen exactly when token j arrives
            if len(stop) == width and full.find(stop) == end - width and end > before:
                run = same_as_plain(case, max_tokens=TINY_N, ignore_eos=True, stop=[stop])
                assert run.finish_reason == "stop"
                assert run.ids == case.truth[: j + 1]
                assert run.text == full[: end - width]
                return
    pytest.skip("no stop string that completes inside the first run")


# ------------------------------------------------------------------------- public API, tokenizer


def test_api_ngram_and_draft_model_equal_plain(tiny_root: Path) -> None:
    folder = make_tiny_hf_model(tiny_root, "qwen2", seed=41, name="api")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(str(folder), draft="none", dtype="float32", threads=1)
    expected = plain.generate(TINY_PROMPT, params)[0]
    assert expected.stats.drafted == 0 and len(expected.token_ids) == 32
    for draft, k in (("ngram", None), ("ngram", 4), (str(folder), 3), (str(folder), None)):
        llm = LLM(str(folder), draft=draft, num_draft=k, dtype="float32", threads=1)
        got = llm.generate(TINY_PROMPT, params)[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            expected.text,
            expected.token_ids,
            expected.finish_reason,
        ), (draft, k)
        if k is not None:
            assert got.stats.drafted > 0
        if draft == str(folder) and k is not None:
            assert got.stats.accepted == got.stats.drafted  # the target drafting for itself


def _other_tokenizer_folder(root: Path) -> Path:
    """A tiny model whose tokenizer swaps the ids of two ordinary tokens: same size, other meaning."""
    folder = make_tiny_hf_model(root, "llama", seed=51, name="other-tok")
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_draft_with_other_tokenizer_is_refused(tiny_root: Path) -> None:
    target = make_tiny_hf_model(tiny_root, "llama", seed=52, name="tok-target")
    other = _other_tokenizer_folder(tiny_root)
    same = Tokenizer.from_hf_dir(target)
    different = Tokenizer.from_hf_dir(other)
    assert different.vocab_size == same.vocab_size
    check_same_tokenizer(same, Tokenizer.from_hf_dir(target))  # no error
    with pytest.raises(QuickdraftError, match="tokenizer differs"):
        check_same_tokenizer(same, different)
    with pytest.raises(QuickdraftError, match="tokenizer differs"):
        LLM(str(target), draft=str(other), num_draft=3, dtype="float32", threads=1)


# -------------------------------------------------------------------------- real SmolLM2, fp32


@pytest.fixture(scope="module")
def smol32(smollm2_gguf: Path) -> Case:
    loaded = load_model(str(smollm2_gguf), dtype="float32", max_context=256)
    return make_case(loaded, SMOL_PROMPT, SMOL_N)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "k"), [("oracle", 8), ("oracle", 2), ("wrong", 5), ("partly", 5), ("coin", 3)]
)
def test_smollm2_scripted_drafters_match_plain_greedy(smol32: Case, kind: str, k: int) -> None:
    check_scripted(smol32, kind, k)


@pytest.mark.slow
def test_smollm2_as_its_own_draft(smol32: Case) -> None:
    run = smol32.spec(DraftModelDrafter(smol32.loaded.model, smol32.vocab), 3)
    assert run.ids == smol32.truth
    assert run.stats.accepted == run.stats.drafted > 0


# ------------------------------------------------------- real SmolLM2, bf16 (the shipped dtype)


@pytest.fixture(scope="module")
def smol16(smollm2_gguf: Path) -> Case:
    loaded = load_model(str(smollm2_gguf), dtype="bfloat16", max_context=256)
    return make_case(loaded, SMOL_PROMPT, BF16_N)


def check_rows_bitwise(
    model: CausalLM, prompt: list[int], seq: list[int], rows: list[int], offsets: list[int]
) -> None:
    """Logits of each position decoded alone == the same position inside an r-row pass, bitwise."""
    cache = model.new_cache()
    model(torch.tensor(prompt), cache, num_logits=1)
    base = cache.length
    alone = [model(torch.tensor([t]), cache)[0][0] for t in seq]
    for off in offsets:
        for r in rows:
            cache.truncate(base + off)
            logits, _ = model(torch.tensor(seq[off : off + r]), cache)
            for i in range(r):
                assert torch.equal(logits[i], alone[off + i]), f"row {i} of {r} at offset {off}"


@pytest.mark.slow
def test_smollm2_bf16_rows_are_batch_invariant(smol16: Case) -> None:
    assert smol16.loaded.model.lm_head.weight.dtype == torch.bfloat16
    check_rows_bitwise(smol16.loaded.model, smol16.prompt, smol16.truth[:16], [2, 4, 8, 9, 16], [0])
    check_rows_bitwise(smol16.loaded.model, smol16.prompt, smol16.truth[:14], [2, 9], [5])


@pytest.mark.slow
def test_smollm2_bf16_speculative_equals_plain(smol16: Case) -> None:
    check_scripted(smol16, "oracle", 8)
    run = smol16.spec(NGramDrafter(), 4)
    assert run.ids == smol16.truth
    assert run.stats.accepted > 0


@pytest.mark.slow
def test_qwen05_bf16_rows_are_batch_invariant(qwen05_gguf: Path) -> None:
    loaded = load_model(str(qwen05_gguf), dtype="bfloat16", max_context=128)
    prompt = loaded.tokenizer.encode("def fibonacci(n):\n")
    seq = generate(loaded, prompt, max_tokens=16, ignore_eos=True).ids
    check_rows_bitwise(loaded.model, prompt, seq, [2, 4, 8, 9, 16], [0])


# ------------------------------------------------------------------- sampling, end to end


SAMPLE_RUNS = 800
SAMPLE_PROMPT = "for i in"
SAMPLE_DEPTH = 3  # compare the marginals of the first 3 output tokens
SHARPEN = 3.0  # lm_head scale: top probability ~0.3, a handful of likely tokens


class FrozenCost(TargetCost):
    """A cost model that ignores measurements, so a test decides what verification costs."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


def sharp_model(root: Path, seed: int) -> LoadedModel:
    folder = make_tiny_hf_model(root, "llama", seed=seed, num_hidden_layers=1, name=f"sharp-{seed}")
    loaded = load_model(str(folder), dtype="float32", max_context=400)  # room for a 300-leaf tree
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(SHARPEN)
    return loaded


@pytest.fixture(scope="module")
def sampler(tiny_root: Path) -> LoadedModel:
    return sharp_model(tiny_root, 61)


@pytest.fixture(scope="module")
def sampler_draft(sampler: LoadedModel) -> LoadedModel:
    """A perturbed copy of the sampler: q overlaps p but differs from it (TV ~0.6-0.8), so both
    acceptances and the residual max(0, p - q) matter."""
    draft = perturbed_copy(sampler.path, seed=5, scale=0.5, max_context=400)
    with torch.no_grad():
        draft.model.lm_head.weight.mul_(SHARPEN)
    return draft


def exact_marginals(
    model: CausalLM, prompt: list[int], params: SamplingParams
) -> tuple[list[torch.Tensor], float]:
    """The exact marginal distributions [V] (fp64) of the first 3 sampled tokens, and the mass left
    out (first tokens rarer than 1e-7). One pass per first token x1 scores x1 and, as a tree of
    siblings that each see prompt + x1 + itself, every possible second token at once."""
    cache = model.new_cache()
    logits, _ = model(torch.tensor(prompt), cache, num_logits=1)
    base = cache.length
    vocab = logits.shape[-1]

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(process_logits(logits, params, EMPTY, EMPTY)).double()

    p1 = probs(logits)[0]
    m2 = torch.zeros(vocab, dtype=torch.float64)
    m3 = torch.zeros(vocab, dtype=torch.float64)
    children = torch.arange(vocab)
    positions = torch.tensor([base] + [base + 1] * vocab)
    mask = torch.zeros(vocab + 1, base + vocab + 1, dtype=torch.bool)
    mask[:, : base + 1] = True  # prompt and x1
    mask[1 + children, base + 1 + children] = True  # each second token sees itself
    kept = (p1 > 1e-7).nonzero().flatten().tolist()
    for x1 in kept:
        cache.truncate(base)
        tree, _ = model_pass(model, torch.cat([torch.tensor([x1]), children]), cache, positions, mask)
        p = probs(tree)  # row 0: p(x2 | x1); row 1 + x2: p(x3 | x1, x2)
        m2 += p1[x1] * p[0]
        m3 += p1[x1] * (p[0] @ p[1:])
    return [p1, m2, m3], 1.0 - float(p1[kept].sum())


def sample_outputs(
    loaded: LoadedModel, drafter: Drafter | None, k: int, params: SamplingParams, runs: int
) -> list[list[int]]:
    engine = Engine(loaded.model, loaded.tokenizer)
    prompt = loaded.tokenizer.encode(SAMPLE_PROMPT)
    outs = []
    for seed in range(runs):
        p = dataclasses.replace(params, seed=seed)
        outs.append([t for s in engine.generate(prompt, p, drafter, k) for t in s.token_ids])
    return outs


def chi2_z(counts: list[torch.Tensor], expected: torch.Tensor) -> float:
    """Pearson chi-square of observed ``counts`` (one [V] histogram per sample) against
    ``expected`` probabilities [V], as a z-score (stat - df) / sqrt(2 df): bins expecting fewer than
    5 counts are pooled into one. One histogram: goodness of fit; two: homogeneity (pass the
    pooled frequencies as ``expected``)."""
    stat, bins = 0.0, 0
    for obs in counts:
        exp = obs.sum() * expected
        big = exp >= 5
        o = torch.cat([obs[big], obs[~big].sum().view(1)])
        e = torch.cat([exp[big], exp[~big].sum().view(1)])
        o, e = o[e > 0], e[e > 0]
        stat += float(((o - e) ** 2 / e).sum())
        bins = len(o)
    df = bins - 1  # goodness of fit: bins - 1; homogeneity of two samples: (bins - 1) * (2 - 1)
    return (stat - df) / math.sqrt(2 * max(df, 1))


def histogram(samples: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples), minlength=vocab).double()


def check_marginal(samples: list[int], exact: torch.Tensor, label: str) -> None:
    """Samples of one output position follow ``exact``: never outside its support, and a
    chi-square z-score below 5 (deterministic seeds; a real bias gives z of 7 and more here)."""
    counts = histogram(samples, exact.numel())
    outside = (counts > 0) & (exact == 0)
    assert not outside.any(), (
        f"{label}: sampled tokens the target excludes: {outside.nonzero().flatten().tolist()}"
    )
    z = chi2_z([counts], exact)
    assert z < 5, f"{label}: chi-square z = {z:.1f} against the exact marginal"


def check_two_sample(a: list[int], b: list[int], vocab: int, label: str) -> None:
    """Plain and speculative samples of one position come from the same distribution."""
    ca, cb = histogram(a, vocab), histogram(b, vocab)
    z = chi2_z([ca, cb], (ca + cb) / (ca + cb).sum())
    assert z < 5, f"{label}: chi-square homogeneity z = {z:.1f}"


BASE = SamplingParams(max_tokens=SAMPLE_DEPTH + 1, temperature=1.0, ignore_eos=True)
FILTERED = SamplingParams(
    max_tokens=SAMPLE_DEPTH + 1, temperature=1.0, top_k=12, top_p=0.9, ignore_eos=True
)


@pytest.fixture(scope="module")
def exact(sampler: LoadedModel) -> dict[str, tuple[list[torch.Tensor], float]]:
    prompt = sampler.tokenizer.encode(SAMPLE_PROMPT)
    return {
        name: exact_marginals(sampler.model, prompt, params)
        for name, params in (("base", BASE), ("filtered", FILTERED))
    }


@pytest.fixture(scope="module")
def plain_samples(sampler: LoadedModel) -> list[list[int]]:
    return sample_outputs(sampler, None, 0, BASE, SAMPLE_RUNS)


def test_plain_sampling_follows_exact_marginals(
    plain_samples: list[list[int]], exact: dict
) -> None:
    """The harness itself: plain sampling matches the enumerated distribution."""
    marginals, lost = exact["base"]
    assert lost < 1e-4
    for i in range(SAMPLE_DEPTH):
        check_marginal([o[i] for o in plain_samples], marginals[i], f"plain token {i}")


@pytest.mark.parametrize("drafter_kind", ["draft_model", "one_hot", "draft_model_filtered", "draft_model_stops"])
def test_speculative_sampling_follows_exact_marginals(
    sampler: LoadedModel,
    sampler_draft: LoadedModel,
    exact: dict,
    plain_samples: list[list[int]],
    drafter_kind: str,
) -> None:
    """k=2 drafts for the 2nd and 3rd tokens (max_tokens=4): accepted, recovered and bonus paths."""
    key = "filtered" if drafter_kind.endswith("filtered") else "base"
    params = FILTERED if key == "filtered" else BASE
    marginals, lost = exact[key]
    assert lost < 1e-4
    drafter: Drafter
    if drafter_kind == "one_hot":  # the likeliest 2nd and 3rd tokens, proposed every step
        drafter = ConstDrafter([int(marginals[1].argmax()), int(marginals[2].argmax())])
    else:  # "stops": proposals end early where q's top is under 0.6 (both lengths occur here)
        stop = 0.6 if drafter_kind.endswith("stops") else 0.0
        drafter = ScriptedConfidence(sampler_draft.model, sampler.config.vocab_size, stop_below=stop)
    outs = sample_outputs(sampler, drafter, 2, params, SAMPLE_RUNS)
    if isinstance(drafter, ScriptedConfidence):
        cut = [n < k for n, k in zip(drafter.lengths, drafter.asked, strict=True)]
        assert any(cut) and not all(cut) if drafter.stop_below else not any(cut)
    assert all(len(o) == SAMPLE_DEPTH + 1 for o in outs)
    for i in range(SAMPLE_DEPTH):
        check_marginal([o[i] for o in outs], marginals[i], f"{drafter_kind} token {i}")
        if key == "base":
            plain = [o[i] for o in plain_samples]
            check_two_sample(
                [o[i] for o in outs],
                plain,
                sampler.config.vocab_size,
                f"{drafter_kind} vs plain, token {i}",
            )
    if drafter_kind == "draft_model":
        # The test has power: without verification the draft's own distribution would show.
        q, _ = exact_marginals(sampler_draft.model, sampler.tokenizer.encode(SAMPLE_PROMPT), params)
        for i in range(1, SAMPLE_DEPTH):
            assert 0.5 * float((q[i] - marginals[i]).abs().sum()) > 0.3


def test_seeded_speculative_sampling_reproduces(
    sampler: LoadedModel, sampler_draft: LoadedModel
) -> None:
    prompt = sampler.tokenizer.encode(TINY_PROMPT)
    params: dict[str, Any] = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    makers: list[Callable[[], Drafter]] = [
        lambda: DraftModelDrafter(sampler_draft.model, sampler.config.vocab_size),
        lambda: NGramDrafter(min_ngram=1),
    ]
    for make in makers:
        first, again = (generate(sampler, prompt, make(), 3, seed=123, **params) for _ in range(2))
        assert first.ids == again.ids and first.text == again.text
        assert first.stats.drafted > 0
        other = generate(sampler, prompt, make(), 3, seed=124, **params)
        assert other.ids != first.ids


SEEDED = [
    {"temperature": 0.3, "seed": 1},
    {"temperature": 0.7, "top_p": 0.9, "seed": 2},
    {"temperature": 1.0, "top_k": 20, "seed": 3},
    {"temperature": 1.5, "min_p": 0.05, "seed": 2**63 + 5},
    {"temperature": 1.0, "repetition_penalty": 1.2, "seed": -7},
]


@pytest.mark.parametrize("params", SEEDED, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly", "coin"])
def test_seeded_sampling_is_plain_sampling_under_scripted_drafts(sampler: LoadedModel, params: dict, kind: str) -> None:
    """A seed means one answer: the scripted drafters propose plain seeded sampling's own output
    (right, wrong, partly right, at random); the engine must emit exactly that output and accept
    exactly the right prefixes (ScriptedDrafter checks both on every commit)."""
    case = make_case(sampler, TINY_PROMPT, 20, **params)
    assert len(set(case.truth)) > 3  # sampled, not a constant
    for k in (1, 3):
        check_scripted(case, kind, k)


@pytest.mark.parametrize("params", SEEDED[1:3], ids=["t0.7", "t1.0"])
def test_seeded_sampling_is_plain_sampling_under_every_drafter(
    sampler: LoadedModel, sampler_draft: LoadedModel, params: dict
) -> None:
    """n-gram lookup, a sampling draft model (coupled to the target's random numbers) and a tree of
    siblings, at several k: token-identical to --draft none with the same seed, and drafts get accepted."""
    prompt = sampler.tokenizer.encode(TINY_PROMPT)
    run = dict(max_tokens=24, ignore_eos=True, **params)
    plain = generate(sampler, prompt, **run)
    accepted = 0
    makers: list[Callable[[], Drafter]] = [
        lambda: NGramDrafter(min_ngram=1),
        lambda: DraftModelDrafter(sampler_draft.model, sampler.config.vocab_size),
        lambda: DraftModelDrafter(sampler_draft.model, sampler.config.vocab_size, stop_below=0.5),
        lambda: TreeOfSiblings([plain.ids[1], plain.ids[2]]),
    ]
    for make in makers:
        for k in (1, 2, 4):
            got = generate(sampler, prompt, make(), k, **run)
            assert got.ids == plain.ids, f"{make().name} k={k}"
            accepted += got.stats.accepted
    assert accepted > 0


def test_coupled_draft_model_accepts_like_its_overlap(sampler: LoadedModel) -> None:
    """The draft model draws with the target's random numbers: a draft that IS the target proposes
    the target's own choices, so every drafted token is accepted (rejection sampling would accept
    them too, but only in distribution, not the same tokens)."""
    prompt = sampler.tokenizer.encode(TINY_PROMPT)
    run = dict(max_tokens=24, ignore_eos=True, temperature=1.0, seed=11)
    plain = generate(sampler, prompt, **run)
    itself = DraftModelDrafter(sampler.model, sampler.config.vocab_size)  # its own cache, the same weights
    got = generate(sampler, prompt, itself, 3, **run)
    assert got.ids == plain.ids
    assert got.stats.drafted > 0 and got.stats.accepted == got.stats.drafted


class TreeOfSiblings(Drafter):
    """Proposes root children only (a tree of siblings): fixed tokens (deterministic, q one-hot),
    or, with ``q``, tokens drawn i.i.d. from q with the drafter's own seeded generator."""

    name = "siblings"

    def __init__(self, tokens: list[int], q: torch.Tensor | None = None) -> None:
        self.tokens, self.q = tokens, q
        self.gen = torch.Generator()

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        self.gen.manual_seed(0 if params.seed is None else params.seed + 1)

    def propose(self, k: int) -> DraftTree:
        n = len(self.tokens)
        parents = torch.full((n,), -1, dtype=torch.long)
        if self.q is None:
            return cut_tree(DraftTree(torch.tensor(self.tokens), parents), k)
        drawn = torch.multinomial(self.q, n, replacement=True, generator=self.gen)
        return cut_tree(DraftTree(drawn, parents, self.q.expand(n, -1)), k)

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["deterministic", "sampled"])
def test_tree_speculative_sampling_follows_exact_marginals(
    sampler: LoadedModel, exact: dict, kind: str
) -> None:
    """Two sibling drafts per step (max_tokens=4 leaves room for 2 nodes): multi-draft rejection,
    residual and bonus paths through the engine keep the exact marginals."""
    marginals, lost = exact["base"]
    assert lost < 1e-4
    top = marginals[1].topk(2).indices.tolist()  # the likeliest 2nd tokens: often accepted
    if kind == "deterministic":
        drafter = TreeOfSiblings(top)
    else:  # a q unlike p: mass on the likeliest 2nd token and spread over a few unlikely ones
        q = torch.zeros(sampler.config.vocab_size)
        q[top[0]] = 0.5
        q[marginals[1].topk(12).indices[4:]] = 0.5 / 8
        drafter = TreeOfSiblings([0, 0], q)
    outs = sample_outputs(sampler, drafter, 2, BASE, SAMPLE_RUNS)
    assert all(len(o) == SAMPLE_DEPTH + 1 for o in outs)
    for i in range(SAMPLE_DEPTH):
        check_marginal([o[i] for o in outs], marginals[i], f"tree {kind} token {i}")


def test_named_draft_model_reads_the_prompt_at_prefill_and_stays_lossless(tmp_path: Path) -> None:
    """--draft MODEL: the draft model reads the prompt eagerly, so the cost model does not see a
    prompt-long catch-up at its first use (which would keep it from ever drafting)."""
    from quickdraft.api import LLM
    from quickdraft.speculative.draft_model import DraftModelDrafter

    target = make_tiny_hf_model(tmp_path, "llama", seed=3)
    plain = LLM(str(target), draft="none", dtype="float32", max_context=256)
    spec = LLM(str(target), draft=str(target), dtype="float32", max_context=256, num_draft=4)
    assert isinstance(spec.drafter, DraftModelDrafter) and spec.drafter.eager
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompt = "def fibonacci(n): return fibonacci(n - 1)"
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.generate([prompt], params)[0].token_ids
    assert out.stats.accepted > 0  # the model as its own draft: drafts are accepted
    spec.drafter.prefill(torch.tensor(plain.encode(prompt)), params)
    assert len(spec.drafter.pending) == 1  # the prompt but its last token is already in the cache


def test_draft_model_skips_a_long_catch_up_and_stays_lossless(tiny: Case) -> None:
    """After many steps without it (n-gram drafting), the draft model reads only the last
    MAX_CATCH_UP missed tokens, at their true positions (a gap in its context), then drafts:
    the output is still exactly plain greedy, and positions stay aligned with the context."""
    from quickdraft.speculative.draft_model import MAX_CATCH_UP

    inner = DraftModelDrafter(tiny.loaded.model, tiny.vocab, eager=True)
    seen: list[tuple[int, int]] = []  # (cache length + offset, tokens the draft has consumed)

    class Intermittent(Drafter):
        name = "intermittent"

        def __init__(self) -> None:
            self.step = 0
            self.total = 0

        def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
            self.step, self.total = 0, len(prompt_ids)
            inner.prefill(prompt_ids, params)

        def propose(self, k: int) -> Draft:
            self.step += 1
            if self.step <= MAX_CATCH_UP + 6:  # a long stretch without the draft model
                return Draft(tokens=torch.empty(0, dtype=torch.long))
            return inner.propose(k)

        def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
            inner.commit(tokens, num_accepted)
            self.total += len(tokens)
            seen.append((inner.cache.length + inner.offset, self.total - len(inner.pending)))

        def reset(self) -> None:
            inner.reset()

    run = tiny.spec(Intermittent(), 3)
    assert run.ids == tiny.truth
    assert inner.offset >= 6 and run.stats.drafted > 0
    assert all(pos == consumed for pos, consumed in seen)
    assert run.stats.accepted > 0  # the model drafting for itself still hits after the gap


# ------------------------------------------------------------------ long contexts (fp16 KV, lookup)


@pytest.fixture(scope="module")
def long_gguf(tiny_root: Path) -> Case:
    """The quantized tiny model (native stack, fp16 KV) over a ~3,000-token prompt that repeats
    itself, so lookup has long matches to propose from."""
    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    folder = make_tiny_hf_model(tiny_root, "qwen2", seed=23, name="qwen2-long", max_position_embeddings=4096)
    path = hf_to_gguf(folder, tiny_root / "qwen2-long.gguf", GGUF_LINEARS)
    loaded = load_model(str(path), max_context=4096)
    assert loaded.model.kv_dtype == torch.float16
    rng = random.Random(3)
    vocab = loaded.config.vocab_size
    block = [rng.randrange(5, vocab) for _ in range(700)]
    prompt = (block + [rng.randrange(5, vocab) for _ in range(300)]) * 3
    run = generate(loaded, prompt, max_tokens=48, ignore_eos=True)
    return Case(loaded, prompt, run.ids)


@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly"])
def test_long_context_scripted_drafters_match_plain_greedy(long_gguf: Case, kind: str) -> None:
    assert len(long_gguf.prompt) == 3000
    check_scripted(long_gguf, kind, 6)


def test_long_context_lookup_drafters_match_plain_greedy(long_gguf: Case) -> None:
    from quickdraft.speculative.suffix import SuffixDrafter

    for drafter, k in ((SuffixDrafter(), 32), (SuffixDrafter(min_match=1), 4), (NGramDrafter(), 8)):
        run = long_gguf.spec(drafter, k)
        assert run.ids == long_gguf.truth, drafter
    check_rows_bitwise(long_gguf.loaded.model, long_gguf.prompt[:2900], long_gguf.prompt[2900:2920], [1, 8, 15], [0, 5])


# --------------------------------------- real SmolLM2 at a long context (its default: fp16 KV)


@pytest.fixture(scope="module")
def smol_long(smollm2_gguf: Path) -> Case:
    """SmolLM2-135M as users run it (GGUF weights on the native kernels, fp16 KV cache) over a
    ~2,000-token prompt of real Python source that asks for a rewrite, so lookup finds long matches."""
    import sysconfig

    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    loaded = load_model(str(smollm2_gguf), max_context=4096)
    assert loaded.model.kv_dtype == torch.float16
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    prompt = loaded.tokenizer.encode(f"```python\n{source[:7000]}```\nRewrite the code above with type hints:\n```python\n")
    assert 1800 <= len(prompt) <= 3000, len(prompt)
    run = generate(loaded, prompt, max_tokens=32, ignore_eos=True)
    return Case(loaded, prompt, run.ids)


@pytest.mark.slow
def test_smollm2_long_context_drafters_match_plain_greedy(smol_long: Case) -> None:
    """Partly right drafts and the longest-match lookup at ~2k tokens of context: the plain output
    (rows at long contexts are covered bitwise on the tiny model above)."""
    from quickdraft.speculative.suffix import SuffixDrafter

    check_scripted(smol_long, "partly", 6)
    run = smol_long.spec(SuffixDrafter(), 16)
    assert run.ids == smol_long.truth and run.stats.accepted > 0
