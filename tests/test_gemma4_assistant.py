"""Gemma 4's assistant drafter (``gemma4_assistant``): a few Gemma 4 layers without keys or values
of their own, attending to the target's, drafting from the target's last hidden state.

Its logits (plain output head and the centroid-masked one) equal transformers'
``Gemma4AssistantForCausalLM`` given the target's keys, values and hidden state as transformers'
own Gemma 4 computes them, over a drafted chain; the drafter's proposals inside the engine are
transformers' assisted-generation chain step by step; speculation with it (chains, trees, under the
auto drafter, several sequences at once) gives plain decoding's greedy output and seeded samples;
an assistant that does not fit the target is a one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    GREEDY,
    MB,
    alone,
    assert_words,
    cli_error,
    generate,
    requests,
    run,
    run_to_end,
    same,
    tokens,
)
from tiny import ProposalRecorder, load_reference, make_tiny_hf_model, tiny_config

from quickdraft.assemble.drafters import build_drafter
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.options import EngineOptions
from quickdraft.prefix_cache import PrefixCache
from quickdraft.quant.ggml import GGMLLinear, kernels_active
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.gemma4_assistant import (
    AssistantDrafter,
    AssistantPass,
    Gemma4Assistant,
    load_assistant,
)
from quickdraft.speculative.ngram import NGramDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "def add(a, b):\n    return a + b\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"
LAYERS = ("sliding_attention", "sliding_attention", "full_attention")


def make_assistant(root: Path, name: str, *, seed: int, ordered: bool, backbone: int = 64) -> Path:
    """A random assistant for the tiny Gemma 4 target (hidden 64, 2 KV heads of 16 / 32 on
    sliding / full layers), saved by transformers: hidden 32, 4 query heads, three layers (two
    sliding, one full), tied head; ``ordered``: the centroid-masked head (10 clusters of 30 tokens, 3 kept)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = tiny_config("gemma4_text", hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYERS),
                       layer_types=list(LAYERS), num_kv_shared_layers=len(LAYERS), use_double_wide_mlp=False,
                       hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
                       tie_word_embeddings=True)
    cfg = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=backbone,
                                use_ordered_embeddings=ordered, num_centroids=10, centroid_intermediate_top_k=3)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        for bname, buf in model.named_buffers():
            if bname.endswith("layer_scalar"):
                buf.uniform_(0.5, 1.5)
            elif bname.endswith("token_ordering"):
                buf.copy_(torch.randperm(buf.numel()))
    folder = root / name
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4-assistant")
    return {"target": make_tiny_hf_model(root, "gemma4_text", seed=1, name="target"),
            "plain": make_assistant(root, "plain", seed=3, ordered=False),
            "masked": make_assistant(root, "masked", seed=4, ordered=True),
            "wide": make_assistant(root, "wide", seed=5, ordered=False, backbone=48)}


@pytest.fixture(scope="module")
def target(folders: dict[str, Path]) -> LoadedModel:
    return load_model(str(folders["target"]), dtype="float32", max_context=256)


def reference_assistant(folder: Path) -> Any:
    from transformers import Gemma4AssistantForCausalLM

    return Gemma4AssistantForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def reference_chain(ref_target: Any, ref: Any, context: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' assisted-generation chain (SinglePositionMultiTokenCandidateGenerator) after the
    target read ``context[:-1]``: (the k greedy tokens, each step's logits [V])."""
    p = len(context) - 1
    out = ref_target(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True,
                     return_shared_kv_states=True, use_cache=False)
    shared = {kind: (kv[0][:, :, :p], kv[1][:, :, :p]) for kind, kv in out.shared_kv_states.items()}
    hidden = out.hidden_states[-1][:, -1:]  # after the final norm
    token = torch.tensor([[context[-1]]])
    embed = ref_target.get_input_embeddings()
    tokens, logits = [], []
    for _ in range(k):
        step = ref(inputs_embeds=torch.cat([embed(token), hidden], dim=-1), position_ids=torch.tensor([[p]]),
                   attention_mask=torch.ones(1, p + 1, dtype=torch.long), shared_kv_states=shared, use_cache=False)
        token, hidden = step.logits.argmax(dim=-1), step.last_hidden_state
        tokens.append(int(token))
        logits.append(step.logits[0, -1].float())
    return tokens, logits


@pytest.mark.parametrize("kind", ["plain", "masked"])
def test_logits_equal_transformers(folders: dict[str, Path], target: LoadedModel, kind: str) -> None:
    """Over a context longer than the sliding window, a chain of 4 rows: the quickdraft head's logits
    (from quickdraft's own target cache and features) equal transformers' assistant fed
    transformers' target's shared keys, values and last hidden state."""
    head = load_assistant(folders[kind], target.model)
    assert (head.masked_embedding is not None) == (kind == "masked")
    ids = target.tokenizer.encode(TEXT)[:24]
    p = len(ids) - 1
    model = target.model
    cache = model.new_cache()
    _, captured = model(torch.tensor(ids[:p]), cache, capture=(model.config.num_hidden_layers,))
    want_tokens, want = reference_chain(load_reference(folders["target"]), reference_assistant(folders[kind]), ids, 4)
    token, state = ids[-1], head.fuse(captured[0][-1:])
    got = []
    for _ in range(4):
        logits, state = head.run_rows(model.embed(torch.tensor([token])), state, [(1, cache, p)])
        got.append(logits[0])
        token = int(logits[0].argmax())
    assert [int(g.argmax()) for g in got] == want_tokens
    assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) < 1e-4
    if kind == "masked":  # tokens outside the 3 kept clusters sit at the row's floor
        assert int((got[0] == got[0].min()).sum()) == model.config.vocab_size - 3 * 30
    # rows of one pass (a tree's depth), and two sequences' rows together, are each what they are alone
    two = head.run_rows(model.embed(torch.tensor([ids[-1], 7])), torch.cat([head.fuse(captured[0][-1:])] * 2),
                        [(2, cache, p)])[0]
    assert torch.equal(two[0], got[0])
    short = model.new_cache()
    model(torch.tensor(ids[:9]), short)
    both = head.run_rows(model.embed(torch.tensor([ids[-1], ids[9]])),
                         torch.cat([head.fuse(captured[0][-1:]), head.fuse(captured[0][8:9])]), [(1, cache, p), (1, short, 9)])[0]
    alone9 = head.run_rows(model.embed(torch.tensor([ids[9]])), head.fuse(captured[0][8:9]), [(1, short, 9)])[0]
    assert torch.equal(both[0], got[0]) and torch.equal(both[1], alone9[0])
    assert cache.length == p  # nothing written into the target's cache


def drafter(folder: Path, target: LoadedModel, mode: str) -> AssistantDrafter:
    return AssistantDrafter(load_assistant(folder, target.model), target.model, mode=mode, policy=False,
                            head_seconds=0.0)


def test_proposals_are_transformers_chain_step_by_step(folders: dict[str, Path], target: LoadedModel) -> None:
    d = drafter(folders["masked"], target, "chain")
    rec = ProposalRecorder(d)
    prompt = target.tokenizer.encode(TEXT[:40])
    generate(target, prompt, d, 3, max_tokens=10, ignore_eos=True)
    assert len(rec.log) >= 3
    ref_target, ref = load_reference(folders["target"]), reference_assistant(folders["masked"])
    for context, proposal in rec.log:
        assert proposal == reference_chain(ref_target, ref, context, len(proposal))[0], len(context)
        assert len(proposal) == min(3, len(prompt) + 10 - len(context) - 1)
    # steps that kept drafted tokens (the target's own tokens accepted as if drafted: a random
    # assistant rarely drafts them): the features of every kept row line up with the target's cache
    model, truth = target.model, generate(target, prompt, max_tokens=12, ignore_eos=True).ids
    d = drafter(folders["masked"], target, "chain")
    cache, last = model.new_cache(), model.config.num_hidden_layers
    d.use_target_cache(cache)
    _, feats = model(torch.tensor(prompt), cache, capture=(last,))
    d.prefill(torch.tensor(prompt), SamplingParams())
    d.feed(feats[0])
    d.commit(torch.tensor(truth[:1]), 0)
    at = 1
    for kept in (2, 0, 3, 1):
        context = prompt + truth[:at]
        proposal = d.propose(3).tokens.tolist()
        assert proposal == reference_chain(ref_target, ref, context, 3)[0], at
        _, feats = model(torch.tensor(truth[at - 1 : at + kept]), cache, capture=(last,))
        d.feed(feats[0])
        d.commit(torch.tensor(truth[at : at + kept + 1]), kept)
        at += kept + 1


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_drafting_equals_plain_decoding(folders: dict[str, Path], target: LoadedModel, mode: str) -> None:
    """Greedy for several prompts and k, and seeded sampling (one answer per seed under every drafter)."""
    texts = [TEXT[:40], "for i in range(10):\n    print(", "class Stack:\n"]
    for n, text in enumerate(texts):
        prompt = target.tokenizer.encode(text)
        truth = generate(target, prompt, max_tokens=20, ignore_eos=True).ids
        for k in (1, 3, 5)[n % 3 :] + (1, 3, 5)[: n % 3]:
            got = generate(target, prompt, drafter(folders["plain"], target, mode), k, max_tokens=20, ignore_eos=True)
            assert got.ids == truth and got.stats.drafted > 0, (text, k)
    prompt = target.tokenizer.encode(texts[0])
    for seed in (5, 6):
        params: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "seed": seed, "max_tokens": 20, "ignore_eos": True}
        want = generate(target, prompt, **params).ids
        assert generate(target, prompt, NGramDrafter(max_ngram=3, min_ngram=1), 4, **params).ids == want
        got = generate(target, prompt, drafter(folders["masked"], target, mode), 4, **params)
        assert got.ids == want and got.stats.drafted > 0


def test_draft_path_under_auto_and_several_sequences(folders: dict[str, Path], target: LoadedModel,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--draft PATH``: the assistant beside n-gram lookup under the cost model (fixed k or auto),
    its matrices as Q8_0 blocks where the q8 kernels run; three sequences at once (one assistant
    pass per depth for all of them): each == alone."""
    fixed, k = build_drafter(EngineOptions(draft=str(folders["masked"]), num_draft=3), target)
    assert fixed is not None and k == 3 and {p.name for p in fixed.parts()} == {"ngram", "assistant"}
    if kernels_active():
        assistant = next(p for p in fixed.parts() if isinstance(p, AssistantDrafter))
        quantized = [m for m in assistant.head.modules() if isinstance(m, GGMLLinear)]
        assert quantized and all(m.qtype.name == "Q8_0" for m in quantized)
    prompt = target.tokenizer.encode(TEXT[:40])
    truth = generate(target, prompt, max_tokens=16, ignore_eos=True).ids
    run = generate(target, prompt, fixed, k, max_tokens=16, ignore_eos=True)
    assert run.ids == truth and run.stats.drafted > 0 and fixed.usage_counts()["assistant"] > 0
    auto, k = build_drafter(EngineOptions(draft=str(folders["plain"])), target)
    assert auto is not None and {p.name for p in auto.parts()} == {"ngram", "assistant"}
    reqs = requests(target, 3)
    engine = Engine(target.model, target.tokenizer, max_sequences=3)
    drafters = [auto, *auto.forks(len(reqs) - 1)]
    running = {engine.add(r.prompt, r.params, d, 6): i for i, (r, d) in enumerate(zip(reqs, drafters, strict=True))}
    got: dict[Any, list[int]] = {g: [] for g in running}
    passes: list[int] = []
    inner = AssistantPass.together

    def counted(cls: Any, asks: Any) -> Any:
        passes.append(len(asks))
        return inner(asks)

    monkeypatch.setattr(AssistantPass, "together", classmethod(counted))
    run_to_end(engine, got)
    assert passes and max(passes) > 1  # several sequences' assistant rows in one pass
    for gen, i in running.items():
        reqs[i].drafter = "none"
        assert got[gen] == alone(target, reqs[i]), i


def test_prefix_cache_warm_equals_cold(folders: dict[str, Path], target: LoadedModel) -> None:
    """A conversation's next turn reuses the target's keys and the assistant's features: == cold."""
    vocab = target.config.vocab_size
    engine = Engine(target.model, target.tokenizer, prefix_cache=PrefixCache(64 * MB))
    d = drafter(folders["plain"], target, "tree")
    history = tokens(1, 60, vocab)
    first = run(engine, history, d, 4, GREEDY)
    same(first, run(Engine(target.model, target.tokenizer), history, None, 0, GREEDY))
    turn = history + first.ids + tokens(2, 10, vocab)
    warm = run(engine, turn, d, 4, GREEDY)
    assert warm.stats.cached_tokens == len(history) + len(first.ids) - 1 and warm.stats.drafted > 0
    same(warm, run(Engine(target.model, target.tokenizer), turn, drafter(folders["plain"], target, "tree"), 4, GREEDY))


def test_an_assistant_for_another_target_is_a_one_line_error(folders: dict[str, Path], target: LoadedModel,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_words(_error(lambda: build_drafter(EngineOptions(draft=str(folders["wide"])), target)), "hidden size 48", "64")
    llama = make_tiny_hf_model(tmp_path, "llama")
    capsys.readouterr()  # (transformers' progress bar while saving it)
    threads = str(torch.get_num_threads())
    err = cli_error(["generate", "--raw", "-q", "--model", str(llama), "--dtype", "float32", "--threads", threads,
                "--draft", str(folders["plain"]), "hi"], capsys)
    assert_words(err, "Gemma 4 assistant", "'llama'")
    assert err.strip().count("\n") == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((folders["masked"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"num_centroids": 7}))
    assert_words(_error(lambda: load_assistant(bad, target.model)), "centroids", "evenly")
    assert isinstance(load_assistant(folders["plain"], target.model), Gemma4Assistant)


def _error(fn: Any) -> str:
    with pytest.raises(QuickdraftError) as info:
        fn()
    message = str(info.value)
    assert message and "\n" not in message
    return message
