"""The prefix cache is lossless: a warm request (reusing computed keys/values and drafter state) is
token-identical to a cold one, and its first token's distribution is bitwise the same.

Every drafter (none, n-gram, a draft model, EAGLE-3 chains and trees, the cost-model mix), greedy
and seeded sampling, over conversations that grow turn by turn; a match that ends mid-way through a
stored sequence, an edited earlier message, eviction under a small budget, a request cancelled
mid-generation, fp32 Python layers and the native quantized stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from helpers import GREEDY, MB, perturbed_copy, run, same, tokens
from tiny import hf_to_gguf, make_tiny_hf_model

from quickdraft.cache import KVCache
from quickdraft.engine import Engine
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.prefix_cache import PrefixCache, common_prefix
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter, TreeShape
from quickdraft.speculative.eagle3.head import Eagle3Config, init_head_weights
from quickdraft.speculative.eagle3.io import build_head
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.speculative.policy import Acceptance, AutoDrafter, Candidate, TargetCost
from quickdraft.speculative.suffix import SuffixDrafter

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = TreeShape(top_k=3, max_depth=4, max_nodes=10)
SAMPLED = dataclasses.replace(GREEDY, temperature=0.9, seed=7)
CONTEXT = 512


@dataclasses.dataclass
class Pair:
    """A tiny target and a perturbed copy of it that drafts well (a draft model)."""

    target: LoadedModel
    near: LoadedModel


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("prefix"), "llama", num_hidden_layers=3, seed=11)
    return Pair(load_model(str(folder), dtype="float32", max_context=CONTEXT), perturbed_copy(folder, seed=3, scale=0.02, max_context=CONTEXT))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The same kind of model as GGUF blocks: passes run through the native quantized stack."""
    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    root = tmp_path_factory.mktemp("prefix-gguf")
    folder = make_tiny_hf_model(root, "qwen2", seed=21)
    linears = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q4_0", "attn_v.weight": "Q5_0",
               "attn_output.weight": "Q8_0", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q8_0",
               "ffn_down.weight": "Q5_0"}
    return load_model(str(hf_to_gguf(folder, root / "m.gguf", linears)), dtype="auto", max_context=CONTEXT)


def head_for(target: LoadedModel) -> Any:
    cfg = Eagle3Config.for_target(target.config, aux_layers=(0, 1, 3), draft_vocab_size=200)
    head = build_head(cfg, target.model)
    init_head_weights(head, torch.Generator().manual_seed(1))
    d2t = torch.zeros(200, dtype=torch.long)
    d2t[100:] = target.config.vocab_size - 200
    head.set_vocab_map(d2t)
    return head


def make_drafter(kind: str, pair: Pair, head: Any = None) -> tuple[Any, int]:
    """A fresh drafter of ``kind`` and the k to offer it."""
    vocab = pair.target.config.vocab_size
    if kind == "none":
        return None, 0
    if kind == "ngram":
        return NGramDrafter(max_ngram=3, min_ngram=1), 4
    if kind == "suffix":
        return SuffixDrafter(min_match=1), 8
    if kind == "draft":
        return DraftModelDrafter(pair.near.model, vocab, eager=True), 3
    if kind in ("eagle-chain", "eagle-tree"):
        mode = "chain" if kind == "eagle-chain" else "tree"
        return Eagle3Drafter(head, pair.target.model, mode=mode, shape=SHAPE, cost=TargetCost({1: 1.0, 2: 1.0}),
                             head_seconds=0.0, policy=False), 6
    if kind == "auto":  # n-gram + a windowed draft model under the cost model
        cost = TargetCost({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3})
        draft = DraftModelDrafter(pair.near.model, vocab, eager=True, prefill_window=16)
        cands = [Candidate(SuffixDrafter(), Acceptance(0.6, 32), 0.0, cheap=True),
                 Candidate(draft, Acceptance(0.7, 8), 0.05, cheap=False)]
        return AutoDrafter(cands, cost), 8
    raise AssertionError(kind)


# --------------------------------------------------------------------------- conversations

KINDS = ["none", "ngram", "suffix", "draft", "eagle-chain", "eagle-tree", "auto"]


# Seeded sampling with the cost-model mix is left out: its per-step choices depend on what earlier
# requests taught it (warm or cold alike), so two runs of one prompt may draw differently.
CASES = [(k, False) for k in KINDS] + [(k, True) for k in KINDS if k != "auto"]


@pytest.mark.parametrize(("kind", "sampled"), CASES)
def test_conversation_warm_equals_cold(pair: Pair, kind: str, sampled: bool) -> None:
    """Three turns, each sending the whole history again: every warm turn equals a cold run."""
    params = SAMPLED if sampled else GREEDY
    target, vocab = pair.target, pair.target.config.vocab_size
    head = head_for(target) if kind.startswith("eagle") else None
    engine = Engine(target.model, target.tokenizer, prefix_cache=PrefixCache(64 * MB))
    drafter, k = make_drafter(kind, pair, head)
    history = tokens(1, 150, vocab)  # three prefill chunks
    reused_at_least = 0
    reads: list[int] = []  # prompt tokens the draft model read at each prefill
    if kind == "draft":
        read = drafter._read
        drafter._read = lambda ids: (reads.append(len(ids)), read(ids))[1]
    for turn in range(3):
        warm = run(engine, history, drafter, k, params)
        if kind == "draft":  # the new message (and the answer's last tokens), never the history again
            assert reads[-1] == 149 if turn == 0 else 40 <= reads[-1] <= len(history) - reused_at_least + 1
        ref = run(Engine(target.model, target.tokenizer), history, *make_drafter(kind, pair, head), params)
        same(warm, ref)
        if turn:  # everything before the new message was reused, up to the answer's last token
            assert warm.stats.cached_tokens >= reused_at_least
        else:
            assert warm.stats.cached_tokens == 0
        reused_at_least = len(history) + len(warm.ids) - 1
        history = history + warm.ids + tokens(10 + turn, 40, vocab)
        if kind != "none":
            assert warm.stats.drafted > 0 or kind == "draft"


def test_native_quantized_stack_warm_equals_cold(gguf: LoadedModel) -> None:
    engine = Engine(gguf.model, gguf.tokenizer, prefix_cache=PrefixCache(64 * MB))
    vocab = gguf.config.vocab_size
    history = tokens(2, 200, vocab)
    for turn in range(3):
        for kind, drafter, k in (("none", None, 0), ("ngram", NGramDrafter(), 4)):
            warm = run(engine, history, drafter, k, GREEDY)
            fresh = NGramDrafter() if drafter is not None else None
            same(warm, run(Engine(gguf.model, gguf.tokenizer), history, fresh, k, GREEDY))
            assert (warm.stats.cached_tokens > 0) == (turn > 0 or kind == "ngram"), (turn, kind)
        history = history + warm.ids + tokens(20 + turn, 30, vocab)


def test_q8_0_kv_warm_equals_cold() -> None:
    """--kv-dtype q8_0: a stored prefix restores the same Q8_0 bytes a cold prefill writes."""
    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    from pathlib import Path

    path = Path(__file__).parent / "data" / "tiny-qwen2-256-IQ4_XS.gguf"
    loaded = load_model(str(path), max_context=CONTEXT, kv_dtype="q8_0")
    engine = Engine(loaded.model, loaded.tokenizer, prefix_cache=PrefixCache(64 * MB))
    vocab = loaded.config.vocab_size
    history = tokens(3, 150, vocab)
    for turn in range(3):
        warm = run(engine, history, NGramDrafter(), 4, GREEDY)
        same(warm, run(Engine(loaded.model, loaded.tokenizer), history, NGramDrafter(), 4, GREEDY))
        assert (warm.stats.cached_tokens > 0) == (turn > 0)
        history = history + warm.ids + tokens(30 + turn, 30, vocab)


# --------------------------------------------------------------------------- shapes of reuse


def test_midway_match_edit_and_restore_from_a_stored_copy(pair: Pair) -> None:
    target, vocab = pair.target, pair.target.config.vocab_size
    cache = PrefixCache(64 * MB)
    engine = Engine(target.model, target.tokenizer, prefix_cache=cache)
    drafter, k = make_drafter("draft", pair)
    a = tokens(3, 160, vocab)
    out_a = run(engine, a, drafter, k, GREEDY)

    # An earlier message edited at position 70: reuse stops there, the rest is recomputed.
    b = a[:70] + [(a[70] + 1) % vocab or 3] + a[71:]
    out_b = run(engine, b, drafter, k, GREEDY)
    assert out_b.stats.cached_tokens == 70
    same(out_b, run(Engine(target.model, target.tokenizer), b, *make_drafter("draft", pair), GREEDY))
    assert len(cache.entries) == 1  # a's sequence was copied out before the working cache moved on

    # a's next turn matches the stored copy better than the working cache (which holds b now).
    a2 = a + out_a.ids + tokens(4, 20, vocab)
    out_a2 = run(engine, a2, drafter, k, GREEDY)
    assert out_a2.stats.cached_tokens == len(a) + len(out_a.ids) - 1
    same(out_a2, run(Engine(target.model, target.tokenizer), a2, *make_drafter("draft", pair), GREEDY))

    # A prompt that is a prefix of a stored sequence reuses all but its last token.
    c = a[:100]
    out_c = run(engine, c, drafter, k, GREEDY)
    assert out_c.stats.cached_tokens == 99
    same(out_c, run(Engine(target.model, target.tokenizer), c, *make_drafter("draft", pair), GREEDY))
    assert cache.stats.hits == 3 and cache.stats.requests == 4


def test_eviction_under_a_small_budget(pair: Pair) -> None:
    target, vocab = pair.target, pair.target.config.vocab_size
    per_token = target.model.make_cache(1).bytes_per_token
    cache = PrefixCache(220 * per_token)  # room for one stored sequence of ~190 tokens
    engine = Engine(target.model, target.tokenizer, prefix_cache=cache)
    seqs = [tokens(30 + i, 170, vocab) for i in range(3)]
    outs = [run(engine, s, None, 0, GREEDY) for s in seqs]  # each moves the previous one out
    assert cache.stats.stored == 2 and cache.stats.evicted == 1 and len(cache.entries) == 1
    assert cache.nbytes <= cache.budget_bytes
    # seq1 is stored (seq0 was evicted to make room): it comes back from its copy, and the working
    # seq2 takes its place in the store; seq0 then matches nothing.
    order = [1, 0]
    again = [run(engine, seqs[i] + outs[i].ids, None, 0, GREEDY) for i in order]
    assert again[0].stats.cached_tokens == 170 + 24 - 1
    assert again[1].stats.cached_tokens == 0
    assert cache.stats.evicted == 3  # each store made room by dropping the oldest
    for i, w in zip(order, again, strict=True):
        same(w, run(Engine(target.model, target.tokenizer), seqs[i] + outs[i].ids, None, 0, GREEDY))


def test_a_cancelled_request_leaves_only_committed_state(pair: Pair) -> None:
    target, vocab = pair.target, pair.target.config.vocab_size
    engine = Engine(target.model, target.tokenizer, prefix_cache=PrefixCache(64 * MB))
    drafter, k = make_drafter("ngram", pair)
    a = tokens(5, 120, vocab)
    part = run(engine, a, drafter, k, GREEDY, steps=3)  # the client disconnects after 3 steps
    assert 0 < len(part.ids) < GREEDY.max_tokens
    nxt = a + part.ids + tokens(6, 25, vocab)
    warm = run(engine, nxt, drafter, k, GREEDY)
    assert warm.stats.cached_tokens >= len(a)
    same(warm, run(Engine(target.model, target.tokenizer), nxt, *make_drafter("ngram", pair), GREEDY))


def test_budget_zero_is_off(pair: Pair) -> None:
    target = pair.target
    engine = Engine(target.model, target.tokenizer, prefix_cache=PrefixCache(0))
    a = tokens(7, 90, target.config.vocab_size)
    first = run(engine, a, None, 0, GREEDY)
    second = run(engine, a + first.ids, None, 0, GREEDY)
    assert first.stats.cached_tokens == second.stats.cached_tokens == 0


# --------------------------------------------------------------------------- units


def test_common_prefix() -> None:
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([9])) == 0
    assert common_prefix(a, a, limit=3) == 3
    assert common_prefix(a[:0], a) == 0


def test_kv_snapshot_restore_round_trip() -> None:
    cache = KVCache(2, 1, 4, 16, torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    cache.advance(10)
    kv = cache.snapshot(8)
    assert kv.keys[0].shape == (2, 1, 8, 4) and kv.length == 8 and kv.point(6) == 6
    other = KVCache(2, 1, 4, 16, torch.float32)
    other.restore(kv, 6)
    assert other.length == 6 and torch.equal(other.k[:, :, :6], cache.k[:, :, :6])
    with pytest.raises(ValueError):
        cache.snapshot(11)
    with pytest.raises(ValueError):
        other.restore(kv, 9)


def test_ngram_prefill_extends_or_rebuilds() -> None:
    d = NGramDrafter(max_ngram=3, min_ngram=1)
    d.prefill(torch.tensor([1, 2, 3, 1, 2]), None)
    d.prefill(torch.tensor([1, 2, 3, 1, 2, 3, 1]), None)  # extends
    ref = NGramDrafter(max_ngram=3, min_ngram=1)
    ref.prefill(torch.tensor([1, 2, 3, 1, 2, 3, 1]), None)
    assert d.index._last_end == ref.index._last_end and d.propose(3).tokens.tolist() == [2, 3, 1]
    d.prefill(torch.tensor([5, 2, 3]), None)  # diverges: rebuilt
    assert d.index.tokens == [5, 2, 3] and d.propose(2).tokens.tolist() == []
