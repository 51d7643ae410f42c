"""EAGLE-3 heads: the head's math, its files, the drafter (chains and EAGLE-2 trees), the canary.

Targets are tiny random fp32 models. Two kinds of head:

* random heads (``init_head_weights``): they almost never guess right, so they exercise rejection
  and rollback, and the canary must refuse them;
* an oracle head for a "bigram" target: every attention output of the target is zeroed, so each
  layer's input at a position is a function of that position's token alone, and the target's
  lm_head is set so that its greedy choice after token t is perm[t]. The head reads one aux layer
  (fc = [I, 0, 0]), passes it through (its own attention and MLP outputs zeroed) and its lm_head
  predicts perm[perm[t]] from the feature of t: exactly the token after next. Its first drafted
  token is therefore always right and the deeper ones (fed the head's own output) are not, so
  tau is about 2 with any tree or chain.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import make_tiny_hf_model

from quickdraft.assemble.drafters import build_drafter, build_eagle3_drafter
from quickdraft.assemble.eagle3_canary import MIN_TAU, canary_tau
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.options import EngineOptions
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.batch import propose_together
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter, TreeShape
from quickdraft.speculative.eagle3.head import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layers,
    init_head_weights,
)
from quickdraft.speculative.eagle3.io import (
    SPECULATORS_LAYOUT,
    build_head,
    is_head,
    load_head,
    save_head,
)
from quickdraft.speculative.policy import AutoDrafter, TargetCost
from quickdraft.speculative.tree import DraftTree


def flat() -> TargetCost:
    """Every pass costs the same: the cost model drafts big trees. A new one per drafter: drafters
    observe real pass times into their TargetCost, which must not leak into the next test."""
    return TargetCost({1: 1.0, 2: 1.0})
SHAPE = TreeShape(top_k=3, max_depth=4, max_nodes=10)
PROMPT = "def fibonacci(n):\n    if n < 2:"


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny matrices: one thread is fastest, and keeps timing noise of a shared machine out."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def random_target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("e3target"), "llama", num_hidden_layers=4, seed=5)
    return load_model(str(folder), dtype="float32", max_context=256)


def random_head(target: LoadedModel, seed: int = 1, draft_vocab: int = 200, **kw: Any) -> Eagle3Head:
    """A random head with a non-trivial vocabulary map: draft ids 100.. map to target ids 150.."""
    cfg = Eagle3Config.for_target(target.config, aux_layers=(0, 2, 4), draft_vocab_size=draft_vocab, **kw)
    head = build_head(cfg, target.model)
    init_head_weights(head, torch.Generator().manual_seed(seed))
    d2t = torch.zeros(draft_vocab, dtype=torch.long)
    d2t[100:] = target.config.vocab_size - draft_vocab
    head.set_vocab_map(d2t)
    return head


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


class Bigram:
    """A target whose greedy next token after t is perm[t], and per-token features of each layer."""

    def __init__(self, folder: Path, mlp_scale: float) -> None:
        self.loaded = load_model(str(folder), dtype="float32", max_context=512)
        model = self.loaded.model
        vocab = self.loaded.config.vocab_size
        self.perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()  # no mixing between positions
                layer.mlp.down_proj.weight.mul_(mlp_scale)
            layers = model.config.num_hidden_layers
            ids = torch.arange(vocab)
            _, captured = model(ids, model.make_cache(vocab), capture=tuple(range(layers + 1)))
            self.features = [c.clone() for c in captured]  # features[i][t]: input of layer i at token t
            final = model.model.norm(self.features[layers])
            model.lm_head.weight[self.perm] = _unit(final) * 10.0

    def oracle_head(self, aux: tuple[int, ...], read: int) -> Eagle3Head:
        """A head whose first draft is always right when fc reads the input of layer ``read``
        (aux slot 0 = ``aux[0]``); the draft vocabulary is the target's in another order."""
        model, cfg_t = self.loaded.model, self.loaded.config
        vocab, hidden = cfg_t.vocab_size, cfg_t.hidden_size
        head = build_head(Eagle3Config.for_target(cfg_t, aux_layers=aux), model)
        init_head_weights(head, torch.Generator().manual_seed(7), gain=0.3)
        sigma = torch.randperm(vocab, generator=torch.Generator().manual_seed(4))  # draft id d = target sigma[d]
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, :hidden] = torch.eye(hidden)
            head.midlayer.self_attn.o_proj.weight.zero_()
            head.midlayer.mlp.down_proj.weight.zero_()
            head.norm.weight.fill_(1.0)
            inverse = torch.argsort(sigma)
            after_next = self.perm[self.perm]  # the token two steps after t
            head.lm_head.weight[inverse[after_next]] = _unit(self.features[read]) * 10.0
        head.set_vocab_map(sigma - torch.arange(vocab))
        return head


@pytest.fixture(scope="module")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> Bigram:
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("e3bigram"), "llama", num_hidden_layers=2, seed=6)
    return Bigram(folder, mlp_scale=30.0)


def plain(target: LoadedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = Engine(target.model, target.tokenizer)
    return [t for step in engine.generate(prompt, params) for t in step.token_ids]


def speculative(target: LoadedModel, prompt: list[int], params: SamplingParams, drafter: Any, k: int) -> tuple[list[int], Any]:
    engine = Engine(target.model, target.tokenizer)
    out, stats = [], None
    for step in engine.generate(prompt, params, drafter, k):
        out += step.token_ids
        stats = step.stats
    return out, stats


# ------------------------------------------------------------------------------------ the head's math


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_head(head: Eagle3Head, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                   visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 layer written out with plain tensor ops; visible [T, T] = who attends to whom."""
    cfg, sd = head.config, {k: v.double() for k, v in head.state_dict().items()}
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, f = embeds.double(), feats.double()
    x = torch.cat([_rms(e, sd["midlayer.input_layernorm.weight"], eps), _rms(f, sd["midlayer.hidden_norm.weight"], eps)], -1)
    t = x.shape[0]
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, nh, hd)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, hd)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions.double()[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]

    def rot(z: torch.Tensor) -> torch.Tensor:
        return z * cos + torch.cat([-z[..., hd // 2 :], z[..., : hd // 2]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * hd)
    h = f + out @ sd["midlayer.self_attn.o_proj.weight"].T
    n = _rms(h, sd["midlayer.post_attention_layernorm.weight"], eps)
    h = h + (F.silu(n @ sd["midlayer.mlp.gate_proj.weight"].T) * (n @ sd["midlayer.mlp.up_proj.weight"].T)) @ sd["midlayer.mlp.down_proj.weight"].T
    logits = _rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    return logits.float(), h.float()


def test_head_forward_matches_a_plain_reimplementation(random_target: LoadedModel) -> None:
    head = random_head(random_target)
    gen = torch.Generator().manual_seed(0)
    t, hidden = 11, head.config.hidden_size
    embeds, feats = torch.randn(t, hidden, generator=gen), torch.randn(t, hidden, generator=gen)
    ref_logits, ref_h = reference_head(head, embeds, feats, torch.arange(t), torch.ones(t, t).tril().bool())
    # inference: in two chunks through the KV cache
    cache = head.new_cache(32)
    la, ha = head(embeds[:7], feats[:7], cache)
    lb, hb = head(embeds[7:], feats[7:], cache)
    torch.testing.assert_close(torch.cat([la, lb]), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([ha, hb]), ref_h, atol=1e-4, rtol=1e-4)
    # a tree pass: rows 7.. see the first 5 rows, some of each other, at chosen positions
    cache.truncate(5)
    positions = torch.tensor([5, 6, 6, 7, 7, 8])
    visible = torch.zeros(6, 11, dtype=torch.bool)
    visible[:, :5] = True
    for row, ancestors in enumerate([[], [0], [0], [0, 1], [0, 2], [0, 1, 3]]):
        visible[row, 5 + row] = True
        visible[row, [5 + a for a in ancestors]] = True
    lt, _ = head(embeds[5:], feats[5:], cache, positions=positions, mask=visible)
    full_pos, full_vis = torch.cat([torch.arange(5), positions]), torch.ones(11, 11).tril().bool()
    full_vis[5:] = visible
    ref_tree, _ = reference_head(head, embeds, feats, full_pos, full_vis)
    torch.testing.assert_close(lt, ref_tree[5:], atol=1e-4, rtol=1e-4)
    # training: same rows, batched, with autograd
    logits, h, _ = head.train_forward(embeds[None], feats[None], torch.arange(t))
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h[0], ref_h, atol=1e-4, rtol=1e-4)


def test_head_rows_are_batch_invariant(random_target: LoadedModel) -> None:
    """A row's result does not depend on how many rows share its pass (as for the target)."""
    head = random_head(random_target, seed=9)
    gen = torch.Generator().manual_seed(5)
    embeds, feats = torch.randn(10, 64, generator=gen), torch.randn(10, 64, generator=gen)
    together, _ = head(embeds, feats, head.new_cache(16))
    cache = head.new_cache(16)
    one_by_one = torch.cat([head(embeds[i : i + 1], feats[i : i + 1], cache)[0] for i in range(10)])
    assert torch.equal(together, one_by_one)


def test_train_forward_unroll_equals_drafting(random_target: LoadedModel) -> None:
    """Training-time test: unroll step 1 row t is the head drafting from the committed row t."""
    head = random_head(random_target, seed=2)
    gen = torch.Generator().manual_seed(1)
    t, hidden = 9, head.config.hidden_size
    embeds, feats, next_embeds = (torch.randn(1, t, hidden, generator=gen) for _ in range(3))
    with torch.enable_grad():
        for p in head.parameters():
            p.requires_grad_(True)
        logits0, h0, kv0 = head.train_forward(embeds, head.fuse(torch.cat([feats] * 3, -1)), torch.arange(t))
        logits1, _, _ = head.train_forward(next_embeds, h0, torch.arange(t) + 1, cache=[kv0])
        (logits0.logsumexp(-1).sum() + logits1.logsumexp(-1).sum()).backward()
    grads = {n: p.grad for n, p in head.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), "every weight gets a gradient"
    fused = head.fuse(torch.cat([feats] * 3, -1)).detach()
    for row in (0, 4, t - 1):
        cache = head.new_cache(32)
        head(embeds[0, : row + 1], fused[0, : row + 1], cache)
        drafted, _ = head(next_embeds[0, row : row + 1], h0[0, row : row + 1].detach(), cache,
                          positions=torch.tensor([row + 1]), committed=row + 1)
        torch.testing.assert_close(drafted[0], logits1[0, row].detach(), atol=1e-4, rtol=1e-4)


def test_train_forward_padding_mask(random_target: LoadedModel) -> None:
    """A padded batch row gives the same logits for its real tokens as the unpadded row."""
    head = random_head(random_target, seed=3)
    gen = torch.Generator().manual_seed(2)
    hidden = head.config.hidden_size
    e, f = torch.randn(1, 6, hidden, generator=gen), torch.randn(1, 6, hidden, generator=gen)
    alone, _, _ = head.train_forward(e, f, torch.arange(6))
    pad = torch.zeros(1, 3, hidden)
    batch_e, batch_f = torch.cat([torch.cat([e, pad], 1), torch.randn(1, 9, hidden, generator=gen)]), torch.cat([torch.cat([f, pad], 1), torch.randn(1, 9, hidden, generator=gen)])
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    batched, _, _ = head.train_forward(batch_e, batch_f, torch.arange(9), attention_mask=mask)
    torch.testing.assert_close(batched[0, :6], alone[0], atol=1e-5, rtol=1e-5)


def test_default_aux_layers_use_the_input_convention() -> None:
    assert default_aux_layers(32) == (2, 16, 29)  # the EAGLE authors' and vLLM's Llama-3.1-8B layers
    assert all(0 <= i <= 2 for i in default_aux_layers(2))


# ------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("layout", ["hf", "speculators"])
def test_save_load_round_trip(random_target: LoadedModel, tmp_path: Path, layout: str) -> None:
    head = random_head(random_target, seed=4)
    folder = save_head(head, tmp_path / layout, layout=layout, verifier="tiny")
    assert is_head(folder) and is_head(folder / "model.safetensors")
    loaded, info = load_head(folder, random_target.model)
    assert info.layout == layout and loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # the weights file alone carries its config
    alone, _ = load_head(folder / "model.safetensors", random_target.model)
    assert alone.config == head.config
    # identical drafts from identical features
    prompt = random_target.tokenizer.encode(PROMPT)
    _, captured = random_target.model(torch.tensor(prompt), random_target.model.make_cache(64), capture=(0, 2, 4))
    trees = []
    for h in (head, loaded):
        drafter = Eagle3Drafter(h, random_target.model, shape=SHAPE, cost=flat(), head_seconds=0.0, policy=False)
        drafter.prefill(torch.tensor(prompt), SamplingParams())
        drafter.feed(torch.cat(captured, dim=-1))
        drafter.commit(torch.tensor([7]), 0)
        tree = drafter.propose(10)
        assert isinstance(tree, DraftTree) and tree.k == 10
        trees.append(tree)
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)


def test_file_names_and_conventions_of_each_layout(random_target: LoadedModel, tmp_path: Path) -> None:
    head = random_head(random_target, seed=4)
    hf = json.loads((save_head(head, tmp_path / "hf") / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["draft_vocab_size"] == 200
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 1, 3]  # OUTPUT ids = ours - 1
    assert hf["eagle_config"]["quickdraft_aux_layer_convention"] == "output"
    names = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    sp = json.loads((save_head(head, tmp_path / "sp", layout="speculators") / "config.json").read_text())
    assert sp["speculators_model_type"] == "eagle3" and sp["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(tmp_path / "sp" / "model.safetensors"))


def _edit_config(folder: Path, edit: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(tensors, str(folder / "model.safetensors"))  # drop the copy of the config in the header


def test_aux_layer_conventions_are_explicit(random_target: LoadedModel, tmp_path: Path) -> None:
    head = random_head(random_target, seed=4)
    logs: list[str] = []
    # HF layout without a convention: its ids are OUTPUT ids (SpecForge / ModelOpt / SGLang)
    hf = save_head(head, tmp_path / "hf")
    _edit_config(hf, lambda c: (c["eagle_config"].pop("quickdraft_aux_layer_convention"),
                                c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])))
    loaded, info = load_head(hf, random_target.model, log=logs.append)
    assert loaded.config.aux_layers == (1, 2, 3) and not info.convention_given
    assert "variant: Llama decoder layer, residual = features" in logs[-1]
    assert "OUTPUT-of-layer" in logs[-1] and "default" in logs[-1]
    # the same file read with an explicit override
    loaded, _ = load_head(hf, random_target.model, aux_convention="input")
    assert loaded.config.aux_layers == (0, 1, 2)
    # a default that would put the ids out of range: the other convention, said so in the log
    _edit_config(hf, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3, 4]))
    loaded, info = load_head(hf, random_target.model, log=logs.append)
    assert loaded.config.aux_layers == (2, 3, 4) and "out of range" in logs[-1]
    # speculators layout without a convention: INPUT ids (vLLM)
    sp = save_head(head, tmp_path / "sp", layout="speculators")
    _edit_config(sp, lambda c: c.pop("quickdraft_aux_layer_convention"))
    loaded, info = load_head(sp, random_target.model, log=logs.append)
    assert loaded.config.aux_layers == (0, 2, 4) and "INPUT-of-layer" in logs[-1]
    # no ids at all: EAGLE's default layers (2, L//2, L-3) in the input convention
    _edit_config(sp, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    loaded, info = load_head(sp, random_target.model, log=logs.append)
    assert loaded.config.aux_layers == default_aux_layers(4) and "EAGLE default" in logs[-1]


def test_eagle_authors_layout_bin_without_embedding(random_target: LoadedModel, tmp_path: Path) -> None:
    """pytorch_model.bin + a config without aux ids: the target's embedding, EAGLE's layers."""
    head = random_head(random_target, seed=5)
    folder = save_head(head, tmp_path / "authors")
    _edit_config(folder, lambda c: c.pop("eagle_config"))
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    loaded, _ = load_head(folder, random_target.model)
    assert loaded.embed_tokens is None and loaded.config.aux_layers == default_aux_layers(4)
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)


def test_own_embedding_is_loaded(random_target: LoadedModel, tmp_path: Path) -> None:
    cfg = Eagle3Config.for_target(random_target.config, aux_layers=(0, 2, 4))
    head = Eagle3Head(cfg, max_len=300, own_embedding=True)
    init_head_weights(head, torch.Generator().manual_seed(6))
    loaded, _ = load_head(save_head(head, tmp_path / "emb"), random_target.model)
    assert loaded.embed_tokens is not None
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)  # type: ignore[union-attr]


def _mutations() -> list[tuple[str, Any, str]]:
    def cfg(edit: Any) -> Any:
        return ("config", edit)

    def tensors(edit: Any) -> Any:
        return ("tensors", edit)

    return [
        ("vocab", cfg(lambda c: c.update(vocab_size=c["vocab_size"] + 8)), "vocabulary of"),
        ("target hidden", cfg(lambda c: c.update(target_hidden_size=96)), "hidden states of size 96"),
        ("aux range", cfg(lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[8, 9, 10])),
         "target has 4 layers.*convention"),
        ("aux count", cfg(lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1])),
         "fc.weight takes 192 inputs, but 2 aux layers"),
        ("layers", cfg(lambda c: c.update(num_hidden_layers=2)), "single-layer"),
        ("eagle1", cfg(lambda c: c["eagle_config"].update(use_aux_hidden_state=False)), "EAGLE-1/2"),
        ("d2t range", tensors(lambda t: t["d2t"].fill_(10_000)), "outside the target vocabulary"),
        ("d2t shape", tensors(lambda t: t.update(d2t=t["d2t"][:10])), "d2t has shape"),
        ("t2d", tensors(lambda t: t["t2d"].__setitem__(0, not bool(t["t2d"][0]))), "different draft vocabularies"),
        ("q_proj", tensors(lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(32, 128)})),
         "q_proj.weight has shape"),
        ("missing", tensors(lambda t: t.pop("midlayer.mlp.up_proj.weight")), "lacks tensor"),
        ("second layer", tensors(lambda t: t.update({"layers.1.mlp.up_proj.weight": torch.zeros(1)})), "more than one decoder layer"),
        ("fc_norm tensor", tensors(lambda t: t.update({"fc_norm.0.weight": torch.zeros(64)})), "lacks tensor.*fc_norm.1"),
        ("fc_norm key", cfg(lambda c: c.update(fc_norm=True)), "fc_norm is true but the file lacks"),
        ("norm_before_fc key", cfg(lambda c: c.update(norm_before_fc=False)), None),
        ("qwen3 layer", tensors(lambda t: t.update({"midlayer.self_attn.k_norm.weight": torch.zeros(16)})),
         "has no per-head q/k norms, but the tensors have"),
        ("layer type", cfg(lambda c: c.update(model_type="mistral")), "model_type is 'mistral'"),
    ]


@pytest.mark.parametrize("name, mutation, message", _mutations(), ids=[m[0] for m in _mutations()])
def test_mismatched_heads_are_refused(random_target: LoadedModel, tmp_path: Path, name: str, mutation: Any, message: str) -> None:
    head = random_head(random_target, seed=4)
    folder = save_head(head, tmp_path / "bad")
    kind, edit = mutation
    if kind == "config":
        _edit_config(folder, edit)
    else:
        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    if message is None:  # the key agrees with the tensors: loads
        load_head(folder, random_target.model)
        _edit_config(folder, lambda c: c.update(norm_before_fc=False))
        t = load_file(str(folder / "model.safetensors"))
        t["input_norm.weight"] = torch.ones(192)
        save_file(t, str(folder / "model.safetensors"))
        message = "norm_before_fc is false but the file has input_norm.weight"
    with pytest.raises(QuickdraftError, match=message):
        load_head(folder, random_target.model)


def test_unsorted_layer_ids_are_taken_in_layer_order(random_target: LoadedModel, tmp_path: Path) -> None:
    head = random_head(random_target, seed=4)
    folder = save_head(head, tmp_path / "h")
    ids = json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    _edit_config(folder, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids[::-1]))
    loaded, _ = load_head(folder, random_target.model)
    assert list(loaded.config.aux_layers) == sorted(loaded.config.aux_layers)
    assert loaded.config.aux_layers == head.config.aux_layers  # the same features, same order


def test_norm_output_is_read_by_the_layouts_meaning(random_target: LoadedModel, tmp_path: Path) -> None:
    """speculators' norm_output feeds norm(h) back (the next drafted row's input changes, the first
    row's logits do not); SpecForge's (HF layout) is the default final norm."""
    head = random_head(random_target, seed=4)
    folder = save_head(head, tmp_path / "spec", layout=SPECULATORS_LAYOUT)
    plain, _ = load_head(folder, random_target.model)
    _edit_config(folder, lambda c: c.update(norm_output=True))
    fed, info = load_head(folder, random_target.model)
    assert fed.config.norm_output and "norm(h) fed back" in info.variant
    x = torch.randn(3, plain.config.hidden_size, generator=torch.Generator().manual_seed(0))
    lp, hp = plain(x, x, plain.new_cache(16))
    lf, hf_state = fed(x, x, fed.new_cache(16))
    assert torch.equal(lp, lf) and torch.allclose(hf_state, fed.norm(hp)) and not torch.allclose(hp, hf_state)
    # In the HF/EAGLE layout the same key (SpecForge's, true = norm before lm_head) is standard.
    hf = save_head(head, tmp_path / "hf")
    _edit_config(hf, lambda c: c.update(norm_output=True))
    load_head(hf, random_target.model)


def test_a_model_folder_is_not_a_head(tmp_path: Path) -> None:
    folder = make_tiny_hf_model(tmp_path / "model", "llama")
    assert not is_head(folder) and not is_head(folder / "model.safetensors") and not is_head(tmp_path / "nothing")


# ------------------------------------------------------------------------------------ drafting


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("policy", [False, True])
def test_greedy_equivalence_random_head(random_target: LoadedModel, mode: str, policy: bool) -> None:
    prompt = random_target.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    drafter = Eagle3Drafter(random_head(random_target), random_target.model, mode=mode, shape=SHAPE,
                            cost=flat(), head_seconds=0.0, policy=policy)
    out, stats = speculative(random_target, prompt, params, drafter, 10)
    assert out == plain(random_target, prompt, params)
    assert stats.drafted > 0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_forked_heads_draft_for_sequences_generated_together(random_target: LoadedModel, mode: str) -> None:
    """A server runs several requests at once with one head: forks (a head cache each) draft for
    three sequences in the same target passes, and each answer equals plain decoding alone."""
    base = Eagle3Drafter(random_head(random_target), random_target.model, mode=mode, shape=SHAPE,
                         cost=flat(), head_seconds=0.0, policy=False)
    drafters = [base, *base.forks(2)]
    assert all(isinstance(d, Eagle3Drafter) and d.head is base.head for d in drafters)
    assert len({id(d.cache) for d in drafters if isinstance(d, Eagle3Drafter)}) == 3
    engine = Engine(random_target.model, random_target.tokenizer, max_sequences=3)
    texts = [PROMPT, "def add(a, b):", "x = 1\ny = 2\n"]
    prompts = [random_target.tokenizer.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=16 + 2 * i, ignore_eos=True) for i in range(3)]
    running = {engine.add(p, sp, d, 6): i for i, (p, sp, d) in enumerate(zip(prompts, params, drafters, strict=True))}
    got: dict[int, list[int]] = {i: [] for i in range(3)}
    drafted = 0
    while running:
        for gen, step in engine.step():
            assert not isinstance(step, Exception), step
            got[running[gen]] += step.token_ids
            if step.finished:
                drafted += step.stats.drafted
                engine.remove(gen)
                del running[gen]
    assert drafted > 0
    for i in range(3):
        assert got[i] == plain(random_target, prompts[i], params[i])


class HeadPasses:
    """Counts a head's passes: ("alone", rows) on one drafter's cache, ("pooled", rows) over a pool's lanes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, head: Eagle3Head) -> None:
        self.calls: list[tuple[str, int]] = []
        forward, forward_rows = head.forward, head.forward_rows

        def alone(embeds: torch.Tensor, *args: Any, **kw: Any) -> Any:
            self.calls.append(("alone", int(embeds.shape[0])))
            return forward(embeds, *args, **kw)

        def pooled(embeds: torch.Tensor, *args: Any) -> Any:
            self.calls.append(("pooled", int(embeds.shape[0])))
            return forward_rows(embeds, *args)

        monkeypatch.setattr(head, "forward", alone)
        monkeypatch.setattr(head, "forward_rows", pooled)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_forked_heads_propose_in_one_head_pass_per_depth_bitwise_as_alone(
        random_target: LoadedModel, monkeypatch: pytest.MonkeyPatch, mode: str, window: int | None) -> None:
    """Four sequences' EAGLE-3 drafters forked onto lanes of one head KV pool propose together: the
    head runs ONE pass per round for all of them (the root rows, then each depth), and each
    proposal (tokens, tree, draft probabilities) and head cache afterwards are bitwise what a
    drafter of its own computes alone: greedy and sampled, after rejections, with a sliding head."""
    cfg = Eagle3Config.for_target(random_target.config, aux_layers=(0, 2, 4), draft_vocab_size=200)
    head = build_head(dataclasses.replace(cfg, sliding_window=window), random_target.model)
    init_head_weights(head, torch.Generator().manual_seed(3))

    def drafter(**kw: Any) -> Eagle3Drafter:
        return Eagle3Drafter(head, random_target.model, mode=mode, shape=SHAPE, cost=flat(), head_seconds=0.0,
                             policy=False, **kw)

    base = drafter()
    pooled = [base] + [f for f in base.forks(3) if isinstance(f, Eagle3Drafter)]
    assert base.pool is not None and [d.lane for d in pooled] == [0, 1, 2, 3]
    solo = [drafter() for _ in pooled]
    gen = torch.Generator().manual_seed(11)
    width = 3 * random_target.config.hidden_size

    def features(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen)

    lengths = [9, 14, 6, 80]  # the last one's first root pass is more rows than a pooled pass takes
    for i, (p, s, n) in enumerate(zip(pooled, solo, lengths, strict=True)):
        prompt = torch.randint(0, random_target.config.vocab_size, (n,), generator=gen)
        params = SamplingParams(temperature=0.9, seed=40 + i) if i % 2 and mode == "chain" else SamplingParams()
        fed = features(n)
        for d in (p, s):
            d.prefill(prompt, params)
            d.feed(fed)
            d.commit(torch.tensor([7 + i]), 0)
    counter = HeadPasses(monkeypatch, head)
    accepted_before = [0] * 4
    for rnd, (k, accepted) in enumerate([(4, [0, 3, 1, 2]), (4, [2, 0, 4, 1]), (3, [1, 1, 0, 3])]):
        before = len(counter.calls)
        together = propose_together([(p, k) for p in pooled])
        rows = 1 if mode == "chain" else SHAPE.top_k  # per sequence and depth
        if rnd == 0:
            # the long prompt's root rows (64 + 16) run alone and then with the others' first depth:
            # it drafts one round behind them, and its last depth runs alone
            assert counter.calls[before:] == [("pooled", 9 + 14 + 6), ("alone", 64), ("pooled", 3 * rows + 16),
                                              *[("pooled", 4 * rows)] * (k - 2), ("alone", rows)]
        else:  # one pass for the four root passes, then one per depth
            roots = sum(a + 1 for a in accepted_before)
            assert counter.calls[before:] == [("pooled", roots), *[("pooled", 4 * rows)] * (k - 1)]
        for i, ((draft, _), s) in enumerate(zip(together, solo, strict=True)):
            alone = s.propose(k)
            assert type(draft) is type(alone), f"sequence {i}, round {rnd}"
            assert torch.equal(draft.tokens, alone.tokens), f"sequence {i}, round {rnd}"
            if isinstance(draft, DraftTree):
                assert isinstance(alone, DraftTree) and torch.equal(draft.parents, alone.parents)
            else:
                assert not isinstance(alone, DraftTree) and (draft.probs is None) == (alone.probs is None)
                assert draft.probs is None or (alone.probs is not None and torch.equal(draft.probs, alone.probs))
        for i, (p, s) in enumerate(zip(pooled, solo, strict=True)):
            draft = together[i][0]
            assert not isinstance(draft, Exception)
            path = _first_child_path(draft)
            n = min(accepted[i], len(path))
            accepted_before[i] = n
            emitted = torch.tensor(path[:n] + [20 + i + rnd])
            fed = features(n + 1)
            for d in (p, s):
                d.feed(fed)
                d.commit(emitted, n)
            pkv, pf, ptok = p.snapshot()
            skv, sf, stok = s.snapshot()
            assert ptok == stok and torch.equal(pf, sf) and torch.equal(pkv.keys[0], skv.keys[0]) and torch.equal(pkv.values[0], skv.values[0])


def _first_child_path(draft: Any) -> list[int]:
    """The tokens of a chain, or of a tree's first-child path from the root."""
    tokens = [int(t) for t in draft.tokens.tolist()]
    if not isinstance(draft, DraftTree):
        return tokens
    parents = [int(x) for x in draft.parents.tolist()]
    path, node = [], -1
    while (child := next((c for c, p in enumerate(parents) if p == node), None)) is not None:
        path.append(tokens[child])
        node = child
    return path


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_oracle_head_first_draft_always_accepted(bigram: Bigram, mode: str) -> None:
    target = bigram.loaded
    prompt = target.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    reference = plain(target, prompt, params)
    assert all(bigram.perm[a] == b for a, b in zip(reference, reference[1:], strict=False)), "the bigram target"
    drafter = Eagle3Drafter(bigram.oracle_head((1, 0, 2), read=1), target.model, mode=mode, shape=SHAPE,
                            cost=flat(), head_seconds=0.0, policy=False)
    out, stats = speculative(target, prompt, params, drafter, 10)
    assert out == reference
    # every step that drafted had its first token accepted (the last step may have had no room)
    assert stats.accepted_per_position[0] == stats.drafted_per_position[0] >= stats.target_passes - 1
    assert 1.8 < stats.tau <= 2.0
    # the calibration learns that one token per step is accepted out of a larger predicted sum
    assert drafter.alpha < 0.9


def test_cost_model_sizes_trees(bigram: Bigram) -> None:
    """Expensive wide passes give small trees; nearly free ones, trees up to the limit."""
    target = bigram.loaded
    prompt = target.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sizes = {}
    for name, cost in {"steep": TargetCost({1: 1.0, 2: 2.0}), "flat": flat()}.items():
        drafter = Eagle3Drafter(bigram.oracle_head((1, 0, 2), read=1), target.model, shape=SHAPE,
                                cost=cost, head_seconds=0.001, policy=True, observe_cost=False)
        # the head's cost stays the given 1 ms (no timing of this machine's head passes: on a
        # fast, quiet machine they are ~0.1 ms, which changes the sizes this test pins down)
        drafter._time_pass = lambda t0: None  # type: ignore[method-assign]
        out, stats = speculative(target, prompt, params, drafter, 10)
        assert out == plain(target, prompt, params)
        sizes[name] = stats.drafted / stats.target_passes
    assert sizes["steep"] <= 1.0 + 1e-9 and sizes["flat"] > 3.0


def test_sampled_chain_carries_q_and_runs(bigram: Bigram) -> None:
    target = bigram.loaded
    prompt = target.tokenizer.encode(PROMPT)
    drafter = Eagle3Drafter(bigram.oracle_head((1, 0, 2), read=1), target.model, mode="chain", shape=SHAPE,
                            cost=flat(), head_seconds=0.0, policy=False)
    drafter.prefill(torch.tensor(prompt), SamplingParams(temperature=0.9, seed=3))
    _, captured = target.model(torch.tensor(prompt), target.model.make_cache(64), capture=(0, 1, 2))
    drafter.feed(torch.cat(captured, dim=-1))
    drafter.commit(torch.tensor([int(bigram.perm[prompt[-1]])]), 0)
    draft = drafter.propose(4)
    assert not isinstance(draft, DraftTree) and draft.k == 4 and draft.probs is not None
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens.tolist()))
    # and through the engine, chains with q and deterministic trees (test_tree checks that sampled
    # verification keeps p's distribution)
    # A seed means one answer: chains (drawn with the target's random numbers) and trees give
    # plain seeded sampling's tokens.
    for seed in (3, 4):
        params = SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)
        want = plain(target, prompt, params)
        out, stats = speculative(target, prompt, params, drafter, 4)
        assert out == want and stats.accepted > 0
        tree_drafter = Eagle3Drafter(bigram.oracle_head((1, 0, 2), read=1), target.model, shape=SHAPE,
                                     cost=flat(), head_seconds=0.0, policy=False)
        out, stats = speculative(target, prompt, params, tree_drafter, 10)
        assert out == want and stats.accepted > 0


def test_quantized_real_target(smollm2_gguf: Path) -> None:
    """SmolLM2 with its GGUF blocks kept quantized: the head reads the dequantized embedding rows
    of the target, drafts trees, and greedy output stays that of plain decoding."""
    target = load_model(str(smollm2_gguf), max_context=256)
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=4096)
    head = build_head(cfg, target.model)
    init_head_weights(head, torch.Generator().manual_seed(0))
    drafter = Eagle3Drafter(head, target.model, shape=TreeShape(3, 3, 6), cost=flat(), head_seconds=0.0, policy=False)
    assert head.embed_tokens is None and drafter.capture_layers == default_aux_layers(target.config.num_hidden_layers)
    prompt = target.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about caches."}])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out, stats = speculative(target, prompt, params, drafter, 6)
    assert out == plain(target, prompt, params) and stats.drafted > 0


def test_kv_cache_stays_aligned_after_rejections(random_target: LoadedModel) -> None:
    """After steps with rejections the head's cache equals one recomputed from scratch, and the
    features it was fed equal the target's own hidden states of the committed tokens."""
    target = random_target
    prompt = target.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    head = random_head(target, seed=8)
    drafter = Eagle3Drafter(head, target.model, mode="tree", shape=SHAPE, cost=flat(), head_seconds=0.0, policy=False)
    fed: list[torch.Tensor] = []
    feed = drafter.feed
    drafter.feed = lambda hidden: (fed.append(hidden.clone()), feed(hidden))[1]  # type: ignore[method-assign]
    out, stats = speculative(target, prompt, params, drafter, 10)
    assert stats.drafted > stats.accepted  # there were rejections
    assert drafter.catch_up() is not None
    tokens = prompt + out
    features = torch.cat(fed)
    assert len(tokens) == features.shape[0] + 1 == drafter.fed + 1
    _, captured = target.model(torch.tensor(tokens[:-1]), target.model.make_cache(128), capture=(0, 2, 4))
    torch.testing.assert_close(features, torch.cat(captured, dim=-1), atol=1e-5, rtol=1e-5)
    fresh = head.new_cache(128)
    ids = torch.tensor(tokens[1:])
    head(drafter._embed(ids), head.fuse(features), fresh)
    n = drafter.cache.length
    assert n == features.shape[0]
    torch.testing.assert_close(drafter.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ canary and wiring


def test_canary_refuses_a_random_head_and_falls_back(random_target: LoadedModel, tmp_path: Path) -> None:
    folder = save_head(random_head(random_target), tmp_path / "random")
    assert canary_tau(random_target, load_head(folder, random_target.model)[0]) < MIN_TAU
    logs: list[str] = []
    with pytest.warns(UserWarning, match="drafts badly"):
        drafter, k = build_drafter(EngineOptions(draft=str(folder), dtype="float32"), random_target, logs.append)
    assert isinstance(drafter, AutoDrafter) and [c.drafter.name for c in drafter.candidates] == ["ngram"]
    assert any(line.startswith("WARNING") for line in logs) and k > 0


def test_canary_passes_a_working_head_and_fixes_a_wrong_convention(bigram: Bigram, tmp_path: Path) -> None:
    target = bigram.loaded
    good = bigram.oracle_head((0, 0, 0), read=0)  # reads the input of layer 0 (the embeddings)
    assert canary_tau(target, good) >= MIN_TAU
    # unlabeled INPUT ids in the HF layout are first read as OUTPUT ids (the input of layer 1, a very
    # different vector here): the canary fails there, and the other convention is tried and kept
    folder = save_head(good, tmp_path / "oracle")
    _edit_config(folder, lambda c: (c["eagle_config"].pop("quickdraft_aux_layer_convention"),
                                    c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 0, 0])))
    misread, _ = load_head(folder, target.model)
    assert misread.config.aux_layers == (1, 1, 1) and canary_tau(target, misread) < MIN_TAU
    logs: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = build_eagle3_drafter(folder, target, say=logs.append)
    assert drafter is not None and drafter.capture_layers == (0, 0, 0)
    assert any("input convention instead" in line for line in logs)


def test_llm_drafts_with_a_head(bigram: Bigram, tmp_path: Path) -> None:
    """``LLM(model, draft=HEAD)``: the head drafts beside n-gram lookup, output unchanged."""
    from quickdraft.api import LLM

    target = bigram.loaded
    model_dir = tmp_path / "bigram-model"
    model_dir.mkdir()
    for f in target.path.iterdir():
        if f.name != "model.safetensors":
            (model_dir / f.name).write_bytes(f.read_bytes())
    state = {k: v.contiguous() for k, v in target.model.state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"))
    head_dir = save_head(bigram.oracle_head((0, 1, 2), read=0), tmp_path / "head")  # layer order
    llm = LLM(str(model_dir), draft=str(head_dir), dtype="float32", max_context=256, threads=1)
    assert isinstance(llm.drafter, AutoDrafter)
    assert [c.drafter.name for c in llm.drafter.candidates] == ["ngram", "eagle3"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == plain(target, target.tokenizer.encode(PROMPT), params)
    assert out.stats.tau > 1.5 and llm.drafter.usage["eagle3"] > 0


def test_bench_eagle3_method(random_target: LoadedModel, tmp_path: Path) -> None:
    from quickdraft.bench.runner import MethodOptions, build_in_process, parse_methods

    folder = save_head(random_head(random_target), tmp_path / "head")
    methods = parse_methods(f"none,eagle3={folder}")
    assert methods == ["none", f"eagle3={folder}"]
    with pytest.raises(QuickdraftError, match="eagle3=PATH"):
        parse_methods("eagle3")
    contenders = build_in_process(methods, "tiny", random_target, MethodOptions(EngineOptions(dtype="float32", prefix_cache_mb=0)), lambda _m: None)
    assert contenders[1].name == f"eagle3={folder}" and isinstance(contenders[1].drafter, Eagle3Drafter)
    trace = contenders[1].run([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=8), None)
    assert trace.output_tokens == 8 or trace.finish_reason == "stop"
