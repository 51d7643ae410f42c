"""Qwen3.5, a hybrid model: Gated DeltaNet linear attention (a recurrent state per sequence) between
gated full-attention layers.

The hybrid checkpoint and the MoE ones (qwen3_5_moe, qwen3_next) are rows of
tests/test_families.py: logits equal transformers', decode rows == pass rows, speculative greedy ==
plain with every drafter, several sequences in one pass (each row continuing its own lane's state)
== each alone, the prefix cache warm == cold. Here what is the recurrent state's own: logits from a
vision-language checkpoint and transformers' default layout; rollback to any row of the last pass
(chains), a tree path kept by compact, checkpoints every 64 tokens (rollback and prefix reuse
there, a clear error elsewhere), trees leaving plain decoding's state; the MTP drafter; GGUF.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    GREEDY,
    MB,
    Case,
    Request,
    TreeOracle,
    alone,
    check_scripted,
    fp32_as_close_as_transformers,
    generate,
    logits,
    make_case,
    model_pass,
    request_drafter,
    requests,
    run,
    run_to_end,
    same,
    tokens,
)
from safetensors.torch import load_file, save_file
from tiny import (
    ProposalRecorder,
    load_reference,
    make_tiny_hf_model,
    qwen3_5_to_gguf,
    reference_logits,
    write_tokenizer,
)

from quickdraft import kernels
from quickdraft.cache import STATE_EVERY, HybridCache
from quickdraft.config import ModelConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.qwen3_5 import GatedDeltaNet
from quickdraft.prefix_cache import PrefixCache
from quickdraft.quant.ggml import active_kernels, reference_mode
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.mtp import mtp_head
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.speculative.tree import DraftTree, tree_mask, tree_positions

pytestmark = pytest.mark.usefixtures("one_thread")

LIN, FULL = "linear_attention", "full_attention"
TEXT = (
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i * i)\n"
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"
)
# tiny.py's qwen3_5_text (3 layers: linear, full, linear; grouped value heads) and a variant with
# transformers' default layout (every 4th layer full), as many value as q/k heads, a tied head.
CASES: dict[str, dict[str, Any]] = {
    "hybrid": {},
    "interval": {"num_hidden_layers": 4, "layer_types": None, "linear_num_value_heads": 2, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    return {name: make_tiny_hf_model(root, "qwen3_5_text", seed=3, name=name, **over) for name, over in CASES.items()}


@pytest.fixture(scope="module")
def hybrid(folders: dict[str, Path]) -> LoadedModel:
    return load_model(str(folders["hybrid"]), dtype="float32", max_context=256)


def states(cache: HybridCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [cache.recurrent.state(i) for i in range(cache.recurrent.shape.layers)]


def same_states(a: HybridCache, b: HybridCache) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(states(a), states(b), strict=True))


# ------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("name", list(CASES))
def test_layer_types_are_transformers(folders: dict[str, Path], name: str) -> None:
    loaded = load_model(str(folders[name]), dtype="float32", max_context=256)
    assert loaded.config.layer_types == tuple(load_reference(folders[name]).config.layer_types)


def test_interval_layout_logits_match_transformers(folders: dict[str, Path]) -> None:
    """transformers' default layout (every 4th layer full), a tied head: the rule the hybrid row
    of tests/test_families.py is held to (there with rows, speculation and the prefix cache)."""
    loaded = load_model(str(folders["interval"]), dtype="float32", max_context=256)
    ids = loaded.tokenizer.encode(TEXT)
    assert len(ids) > 64  # a pass longer than the batch-invariant blocks, too
    fp32_as_close_as_transformers(loaded, load_reference(folders["interval"]), ids)


def test_each_part_changes_the_logits(folders: dict[str, Path], hybrid: LoadedModel) -> None:
    """The test above has power: zeroing the recurrent decay's bias, the conv or the attention
    gate each moves the logits far beyond its tolerance."""
    ids = hybrid.tokenizer.encode(TEXT)[:30]
    base = logits(hybrid, ids)
    layer0, layer1 = hybrid.model.model.layers[0], hybrid.model.model.layers[1]
    for param in (layer0.linear_attn.dt_bias, layer0.linear_attn.conv1d.weight, layer1.self_attn.q_proj.weight):
        saved = param.detach().clone()
        with torch.no_grad():
            param.mul_(0.5)
        assert (logits(hybrid, ids) - base).abs().max() > 1e-2
        with torch.no_grad():
            param.copy_(saved)
    assert torch.equal(logits(hybrid, ids), base)


def test_vision_language_checkpoint_runs_its_text_model(tmp_path: Path, folders: dict[str, Path],
                                                         hybrid: LoadedModel) -> None:
    """A Qwen3.5 checkpoint as published (model_type "qwen3_5", text_config, ``model.language_model.``
    names, a vision tower and MTP layers beside it) loads as the same text model."""
    src = folders["hybrid"]
    text = json.loads((src / "config.json").read_text())
    folder = tmp_path / "vl"
    write_tokenizer(folder)
    config = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    weights |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(64, 128)}
    save_file(weights, str(folder / "model.safetensors"))
    vl = load_model(str(folder), dtype="float32", max_context=256)
    assert vl.config.model_type == "qwen3_5" and vl.config.layer_types == (LIN, FULL, LIN)
    assert vl.config.layer_pattern() == "3 layers: 2 linear_attention + 1 full_attention (every 2nd)"
    # its MTP tensors are not Qwen3.5's layout (a lone fc): the model runs without them, and says so
    assert mtp_head(vl.model) is None and mtp_head(hybrid.model) is None
    assert len(vl.model.load_notes) == 1 and "layout quickdraft does not know" in vl.model.load_notes[0]
    assert "lacks 14 tensor(s)" in vl.model.load_notes[0] and hybrid.model.load_notes == []
    ids = hybrid.tokenizer.encode(TEXT)[:40]
    assert torch.equal(logits(vl, ids), logits(hybrid, ids))


def test_the_start_up_line_names_the_layer_pattern() -> None:
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": {
            "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 24,
            "num_attention_heads": 2, "full_attention_interval": 4}})
    assert cfg.model_type == "qwen3_5" and cfg.tie_word_embeddings and cfg.partial_rotary_factor == 0.25
    assert cfg.layer_pattern() == "24 layers: 18 linear_attention + 6 full_attention (every 4th)"


def test_unsupported_layer_types_are_refused() -> None:
    d = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 2, "layer_types": [LIN, "mamba"]}
    with pytest.raises(QuickdraftError, match="layer_types"):
        ModelConfig.from_hf_dict(d)


# ------------------------------------------------------------------------- the recurrent state


def test_rollback_within_the_last_pass_and_to_checkpoints(hybrid: LoadedModel) -> None:
    ids = hybrid.tokenizer.encode(TEXT * 2)[: STATE_EVERY + 20]
    n = len(ids)
    cache = hybrid.model.new_cache()
    logits(hybrid, ids[:STATE_EVERY - 4], cache)  # passes [0, 60), [60, 72), [72, 84)
    logits(hybrid, ids[STATE_EVERY - 4 : STATE_EVERY + 8], cache)
    last = logits(hybrid, ids[STATE_EVERY + 8 :], cache)
    assert cache.length == n
    assert cache.rollback_point(n - 3) == n - 3  # a row of the last pass
    assert cache.rollback_point(STATE_EVERY + 5) == STATE_EVERY  # the checkpoint (passed inside a pass)
    assert cache.rollback_point(STATE_EVERY - 1) == 0
    with pytest.raises(QuickdraftError, match="cannot roll a recurrent state back to 70 tokens"):
        cache.truncate(70)
    for keep in (STATE_EVERY + 8, n - 3, STATE_EVERY):  # the last pass's start, one of its rows, a checkpoint
        cache.truncate(keep)
        again = logits(hybrid, ids[keep:], cache)
        assert torch.equal(again, last[keep - n :] if keep >= STATE_EVERY + 8 else again)
        fresh = hybrid.model.new_cache()
        hybrid.model.prefill(torch.tensor(ids[:keep]), fresh)  # in passes of at most 64 rows, as the engine
        assert torch.equal(again, logits(hybrid, ids[keep:], fresh)), keep
        assert same_states(cache, fresh)
    # a snapshot restores at its checkpoints and its own length, nowhere else
    snap = cache.snapshot(n)
    assert sorted(snap.states or {}) == [STATE_EVERY, n] and snap.point(n - 1) == STATE_EVERY
    other = hybrid.model.new_cache()
    other.restore(snap, STATE_EVERY)
    assert torch.equal(logits(hybrid, ids[STATE_EVERY:], other), again)
    with pytest.raises(ValueError):
        other.restore(snap, STATE_EVERY + 1)


def test_a_prefill_keeps_the_states_a_caller_can_reach_and_nothing_else(hybrid: LoadedModel) -> None:
    """A prefill chunk returns its last row: it keeps that row's state and the checkpoints it
    crosses (not one state per row and layer), rolls back only to those, and continues from
    them with the bits of a cache that kept every row."""
    ids = hybrid.tokenizer.encode(TEXT * 2)[: STATE_EVERY + 30]
    n = len(ids)
    lean = hybrid.model.new_cache()
    hybrid.model(torch.tensor(ids), lean, num_logits=1)  # one pass of n rows, its last row returned
    kept = [i for i, k in enumerate(lean.recurrent.kept_rows()) if k]
    assert kept == [STATE_EVERY - 1, n - 1]
    assert lean.rollback_point(n - 3) == STATE_EVERY and lean.rollback_point(n) == n
    with pytest.raises(QuickdraftError, match="cannot roll a recurrent state back"):
        lean.truncate(n - 3)
    full = hybrid.model.new_cache()
    logits(hybrid, ids, full)  # every row returned: every row kept
    assert all(full.recurrent.kept_rows())
    for cache in (lean, full):
        cache.truncate(STATE_EVERY)
    assert torch.equal(logits(hybrid, ids[STATE_EVERY:], lean), logits(hybrid, ids[STATE_EVERY:], full))
    assert same_states(lean, full)


def test_tree_pass_and_compact_match_decoding_each_path(hybrid: LoadedModel) -> None:
    """Each row of a tree pass continues its parent's state: its logits are plain decoding's of its
    own path; compact() keeps a path's state, and the next pass continues from it."""
    ids = hybrid.tokenizer.encode(TEXT)
    prefix, start = ids[:12], 12
    # rows [r, a, b, c, d]: a, b children of the root r; c of a; d of c
    draft = DraftTree(tokens=torch.tensor([11, 12, 13, 14]), parents=torch.tensor([-1, -1, 0, 2]))
    toks = [ids[12], 11, 12, 13, 14]
    cache = hybrid.model.new_cache()
    logits(hybrid, prefix, cache)
    tree, _ = model_pass(hybrid.model, torch.tensor(toks), cache, tree_positions(start, draft), tree_mask(start, draft))
    paths = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4]}
    for row, path in paths.items():
        assert torch.equal(tree[row], logits(hybrid, prefix + [toks[r] for r in path])[-1]), row
    with pytest.raises(QuickdraftError, match="cannot roll"):
        cache.truncate(start + 3)  # rows 0..2 are not a chain: no state after 3 of them
    cache.compact(start, torch.tensor([0, 1, 3]))
    nxt = logits(hybrid, [15], cache)
    assert torch.equal(nxt[0], logits(hybrid, prefix + [toks[0], toks[1], toks[3], 15])[-1])


# ------------------------------------------------------------------------- speculation


@pytest.fixture(scope="module")
def case(hybrid: LoadedModel) -> Case:
    return make_case(hybrid, TEXT[:60], 24)


@pytest.mark.parametrize("shape", ["chain", "right_last", "right_varied", "wrong"])
def test_tree_drafters_match_plain_greedy(case: Case, shape: str) -> None:
    drafter = TreeOracle(case.truth, case.vocab, shape)
    plain = generate(case.loaded, case.prompt, max_tokens=len(case.truth), ignore_eos=True)
    got = generate(case.loaded, case.prompt, drafter, 8, max_tokens=len(case.truth), ignore_eos=True)
    assert got.ids == case.truth == plain.ids and got.stats.drafted > 0
    a, b = plain.engine.cache, got.engine.cache
    assert isinstance(a, HybridCache) and isinstance(b, HybridCache) and a.length == b.length
    assert torch.equal(a.attention.k[:, :, : a.length], b.attention.k[:, :, : b.length]) and same_states(a, b)


# ------------------------------------------------------------------------- MTP: the model's own drafter


@pytest.fixture(scope="module")
def with_mtp(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The hybrid checkpoint plus random ``mtp.*`` tensors of Qwen3.5's layout (one gated-attention layer)."""
    from quickdraft.models.gemma3 import GemmaRMSNorm
    from quickdraft.models.qwen3_5 import DecoderLayer
    from quickdraft.speculative.mtp import MTPHead

    src = folders["hybrid"]
    folder = tmp_path_factory.mktemp("mtp") / "hybrid-mtp"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_text((src / f).read_text())
    plain = load_model(str(src), dtype="float32", max_context=256)
    head = MTPHead(plain.model, DecoderLayer(plain.config, plain.model.model.rope, linear=False, index=0), GemmaRMSNorm)
    gen = torch.Generator().manual_seed(11)
    weights = load_file(str(src / "model.safetensors"))
    for name, p in head.state_dict().items():
        scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5  # norms around 1 + w, matrices of unit gain
        weights["mtp." + name] = torch.randn(p.shape, generator=gen) * scale
    save_file(weights, str(folder / "model.safetensors"))
    return load_model(str(folder), dtype="float32", max_context=256)


def reference_chain(ref: Any, mtp: dict[str, torch.Tensor], context: list[int], k: int) -> list[int]:
    """The MTP chain from the published equations, with transformers' own Qwen3.5 decoder layer:
    row j reads fc([norm_e(embed(t_{j+1})), norm_h(s_j)]) (s: the target's last hidden states after
    its final norm), the layer attends causally over the rows (RoPE position j), logits =
    lm_head(norm(h)); each drafted row reads the previous row's norm(h) and the drafted token."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    cfg = ref.config
    eps = cfg.rms_norm_eps

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # Qwen3.5's zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    layer = Qwen3_5DecoderLayer(cfg, layer_idx=cfg.layer_types.index(FULL)).eval()
    layer.load_state_dict({n.removeprefix("layers.0."): t for n, t in mtp.items() if n.startswith("layers.0.")})
    rotary = ref.model.rotary_emb
    with torch.inference_mode():
        out = ref(input_ids=torch.tensor([context]), output_hidden_states=True, use_cache=False)
        s = out.hidden_states[-1][0]  # [n, H], after the final norm
        states = [s[j] for j in range(len(context) - 1)]
        tokens = context[1:]
        drafted: list[int] = []
        for _ in range(k):
            e = ref.model.embed_tokens(torch.tensor(tokens))
            g = torch.stack(states)
            x = torch.cat([norm(e, mtp["pre_fc_norm_embedding.weight"]), norm(g, mtp["pre_fc_norm_hidden.weight"])], -1)
            x = (x @ mtp["fc.weight"].T).unsqueeze(0)
            n = x.shape[1]
            pos = torch.arange(n).unsqueeze(0)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            h = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)[0]
            z = norm(h[-1], mtp["norm.weight"])
            d = int((z @ ref.lm_head.weight.T).argmax())
            drafted.append(d)
            states.append(z)
            tokens.append(d)
    return drafted


def test_mtp_proposals_equal_the_equations_step_by_step(with_mtp: LoadedModel, folders: dict[str, Path]) -> None:
    from quickdraft.speculative.mtp import MTPDrafter

    head = mtp_head(with_mtp.model)
    assert head is not None and with_mtp.model.load_notes == []
    drafter = MTPDrafter(head, with_mtp.model, mode="chain", policy=False, head_seconds=0.0)
    rec = ProposalRecorder(drafter)
    prompt = with_mtp.tokenizer.encode(TEXT[:50])
    generate(with_mtp, prompt, drafter, 3, max_tokens=12, ignore_eos=True)
    assert len(rec.log) >= 3
    ref = load_reference(folders["hybrid"])
    mtp = {n: t.float() for n, t in with_mtp.model.mtp_weights.items()}
    for context, proposal in rec.log:
        assert proposal == reference_chain(ref, mtp, context, len(proposal)), len(context)
        assert len(proposal) == min(3, len(prompt) + 12 - len(context) - 1)  # what the engine asked for


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_mtp_drafting_matches_plain_greedy(with_mtp: LoadedModel, mode: str) -> None:
    from quickdraft.speculative.mtp import MTPDrafter

    head = mtp_head(with_mtp.model)
    assert head is not None
    prompt = with_mtp.tokenizer.encode(TEXT[:60])
    truth = generate(with_mtp, prompt, max_tokens=30, ignore_eos=True).ids
    for seed in (None, 5):  # greedy, and seeded sampling: one answer per seed
        params: dict[str, Any] = {} if seed is None else {"temperature": 0.8, "seed": seed}
        want = truth if seed is None else generate(with_mtp, prompt, max_tokens=30, ignore_eos=True, **params).ids
        drafter = MTPDrafter(head, with_mtp.model, mode=mode, policy=False, head_seconds=0.0)
        got = generate(with_mtp, prompt, drafter, 4, max_tokens=30, ignore_eos=True, **params)
        assert got.ids == want and got.stats.drafted > 0


def test_mtp_is_the_drafter_auto_and_mtp_pick(with_mtp: LoadedModel, hybrid: LoadedModel) -> None:
    from quickdraft.assemble.drafters import build_drafter
    from quickdraft.options import EngineOptions
    from quickdraft.speculative.mtp import MTPDrafter

    drafter, k = build_drafter(EngineOptions(draft="mtp", num_draft=3), with_mtp)
    assert isinstance(drafter, MTPDrafter) and k == 3
    auto, _ = build_drafter(EngineOptions(), with_mtp)
    assert auto is not None and {p.name for p in auto.parts()} == {"ngram", "mtp"}
    with pytest.raises(QuickdraftError, match="carries no multi-token-prediction layers"):
        build_drafter(EngineOptions(draft="mtp"), hybrid)
    # three sequences drafting with it at once (n-gram and MTP forks, one head pass per depth): each == plain
    reqs = requests(with_mtp, 3)
    engine = Engine(with_mtp.model, with_mtp.tokenizer, max_sequences=3)
    drafters = [auto, *auto.forks(len(reqs) - 1)]
    running = {engine.add(r.prompt, r.params, d, 6): i for i, (r, d) in enumerate(zip(reqs, drafters, strict=True))}
    got: dict[Any, list[int]] = {g: [] for g in running}
    run_to_end(engine, got)
    for gen, i in running.items():
        reqs[i].drafter = "none"
        assert got[gen] == alone(with_mtp, reqs[i]), i


# ------------------------------------------------------------------------- GGUF (llama.cpp's "qwen35")

QUANT = {name: "Q8_0" for name in ("attn_qkv.weight", "attn_gate.weight", "ssm_out.weight", "attn_q.weight",
                                   "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                                   "ffn_up.weight", "ffn_down.weight", "nextn.eh_proj.weight")}


def test_gguf_matches_transformers_and_carries_its_mtp_layer(with_mtp: LoadedModel, folders: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """A GGUF as llama.cpp writes Qwen3.5 (tiled value heads, A as -exp(A_log), 1 + w norms, the
    MTP layer as a nextn block) gives transformers' logits and the same MTP drafts as the folder."""
    from quickdraft.speculative.mtp import MTPDrafter

    path = qwen3_5_to_gguf(with_mtp.path, tmp_path / "q35.gguf")
    g = load_model(str(path), dtype="float32", max_context=256)
    assert g.config.model_type == "qwen3_5" and g.config.num_hidden_layers == 3
    assert g.config.layer_types == (LIN, FULL, LIN) and g.config.family.linear_value_heads_tiled
    ids = g.tokenizer.encode(TEXT)[:32]
    want = reference_logits(load_reference(folders["hybrid"]), ids)
    assert (logits(g, ids) - want).abs().max() < 1e-4
    prompt = g.tokenizer.encode(TEXT[:50])
    logs = []
    for loaded in (with_mtp, g):
        head = mtp_head(loaded.model)
        assert head is not None
        drafter = MTPDrafter(head, loaded.model, mode="chain", policy=False, head_seconds=0.0)
        rec = ProposalRecorder(drafter)
        generate(loaded, prompt, drafter, 3, max_tokens=12, ignore_eos=True)
        logs.append(rec.log)
    assert logs[0] == logs[1] and len(logs[0]) >= 3


def test_quantized_gguf_speculation_matches_plain(with_mtp: LoadedModel, tmp_path: Path) -> None:
    from quickdraft.quant.ggml import kernels_active
    from quickdraft.speculative.mtp import MTPDrafter

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    q = load_model(str(qwen3_5_to_gguf(with_mtp.path, tmp_path / "q35-q8.gguf", QUANT)), dtype="auto", max_context=256)
    from quickdraft.quant.ggml import GGMLLinear

    assert isinstance(q.model.model.layers[0].linear_attn.in_proj_qkv, GGMLLinear)
    prompt = tokens(5, 60, q.config.vocab_size)
    truth = generate(q, prompt, max_tokens=24, ignore_eos=True).ids
    head = mtp_head(q.model)
    assert head is not None and isinstance(head.fc, GGMLLinear)
    for drafter, k in ((NGramDrafter(max_ngram=3, min_ngram=1), 4),
                       (MTPDrafter(head, q.model, mode="chain", policy=False, head_seconds=0.0), 3),
                       (MTPDrafter(head, q.model, mode="tree", policy=False, head_seconds=0.0), 6)):
        got = generate(q, prompt, drafter, k, max_tokens=24, ignore_eos=True)
        assert got.ids == truth and got.stats.drafted > 0, drafter.name


# ------------------------------------------------------------------------- Qwen3.5-MoE


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_moe_families_load_from_folders_and_gguf(tmp_path: Path, model_type: str) -> None:
    """qwen3_5_moe: the hybrid layers with routed experts and a gated shared expert in every layer;
    qwen3_next: the same family with fused in_proj_qkvz / in_proj_ba (regrouped at load) and
    sparse layers every second one (a dense MLP between). Both are rows of tests/test_families.py
    (logits against transformers, rows, speculation, several sequences, the prefix cache); here
    their layers and llama.cpp's GGUF layout."""
    folder = make_tiny_hf_model(tmp_path, model_type, seed=4)
    moe = load_model(str(folder), dtype="float32", max_context=256)
    assert moe.config.model_type == model_type.removesuffix("_text") and moe.config.num_experts == 4
    layers = moe.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == (
        ["SparseMoE"] * 3 if model_type == "qwen3_5_moe_text" else ["MLP", "SparseMoE", "MLP"])
    ids = moe.tokenizer.encode(TEXT)[:40]
    # llama.cpp's qwen35moe / qwen3next GGUF: stacked experts; Qwen3-Next's b/a projection fused (grouped
    # heads); Q8_0 experts and fused projection kept in blocks, rows regrouped
    path = qwen3_5_to_gguf(folder, tmp_path / "moe.gguf")
    gguf_moe = load_model(str(path), dtype="float32", max_context=256)
    assert gguf_moe.config.model_type == moe.config.model_type and gguf_moe.config.norm_topk_prob
    assert gguf_moe.config.mlp_only_layers == ((0, 2) if model_type == "qwen3_next" else ())
    assert (logits(gguf_moe, ids) - reference_logits(load_reference(folder), ids)).abs().max() < 1e-4
    quant = load_model(str(qwen3_5_to_gguf(folder, tmp_path / "q8.gguf", {"exps.weight": "Q8_0", "ssm_ba.weight": "Q8_0"})),
                       dtype="auto", max_context=256)
    assert type(quant.model.model.layers[1].mlp.experts[2].up_proj).__name__ == "GGMLLinear"
    check_scripted(make_case(quant, TEXT[:60], 20), "partly", 4)


def test_prefix_cache_with_the_mtp_drafter_warm_equals_cold(with_mtp: LoadedModel) -> None:
    """The cache holds a prompt's state at a checkpoint (64) that the MTP drafter, which last read
    another prompt sharing 6 tokens, holds no features for: reuse falls back to where both hold
    theirs (0: no state at 6), never to a length the recurrent state cannot return to."""
    from quickdraft.speculative.mtp import MTPDrafter

    head = mtp_head(with_mtp.model)
    assert head is not None
    vocab = with_mtp.config.vocab_size
    engine = Engine(with_mtp.model, with_mtp.tokenizer, prefix_cache=PrefixCache(64 * MB))

    def mtp() -> MTPDrafter:
        return MTPDrafter(head, with_mtp.model, mode="chain", policy=False, head_seconds=0.0)

    drafter = mtp()
    a = tokens(1, 90, vocab)
    b = a[:6] + tokens(2, 80, vocab)
    first = run(engine, a, drafter, 3, GREEDY)  # the drafter holds a's features
    run(engine, b, None, 0, GREEDY)  # the cache holds b, checkpointed at 64
    for prompt, cached in ((b, 0), (a + first.ids + tokens(3, 10, vocab), len(a) + len(first.ids) - 1)):
        warm = run(engine, prompt, drafter, 3, GREEDY)
        same(warm, run(Engine(with_mtp.model, with_mtp.tokenizer), prompt, mtp(), 3, GREEDY))
        assert warm.stats.cached_tokens == cached


def test_requests_arriving_together_share_a_prompt_at_its_checkpoints(hybrid: LoadedModel) -> None:
    """Requests whose prompts share 80 tokens arrive together: the followers wait for the first,
    then copy its lane up to the last recurrent checkpoint in the shared part (64) and read the
    rest; every answer == alone."""
    vocab = hybrid.config.vocab_size
    system = tokens(4, 80, vocab)
    reqs = [Request(system + tokens(5 + i, 6, vocab), SamplingParams(max_tokens=8, ignore_eos=True), kind)
            for i, kind in enumerate(["none", "ngram", "const"])]
    engine = Engine(hybrid.model, hybrid.tokenizer, max_sequences=3, prefix_cache=PrefixCache(64 << 20))
    gens = [engine.add(r.prompt, r.params, request_drafter(r.drafter, hybrid), r.k) for r in reqs]
    assert [g.follows is gens[0] for g in gens] == [False, True, True]
    got: dict[Any, list[int]] = {g: [] for g in gens}
    run_to_end(engine, got)
    assert [g.cached for g in gens] == [0, STATE_EVERY, STATE_EVERY]
    for g, r in zip(gens, reqs, strict=True):
        assert got[g] == alone(hybrid, r)


def test_mtp_with_a_cut_output_vocabulary_stays_lossless(with_mtp: LoadedModel) -> None:
    """The MTP head's logits cut to a draft vocabulary (as --draft-vocab cuts a draft model's): it
    proposes only those tokens, and greedy and seeded output stay plain decoding's."""
    from quickdraft.speculative.mtp import MTPDrafter, MTPHead

    full = mtp_head(with_mtp.model)
    assert full is not None
    layer = type(full.layers[0])(with_mtp.config, with_mtp.model.model.rope, linear=False, index=0)
    head = MTPHead(with_mtp.model, layer, type(full.norm))
    head.load_state_dict(full.state_dict())
    prompt = with_mtp.tokenizer.encode(TEXT[:60])
    truth = generate(with_mtp, prompt, max_tokens=30, ignore_eos=True).ids
    ids = torch.tensor(sorted(set(range(0, 300, 2)) | set(truth[:10])))
    assert head.cut_vocab(ids) and head.config.draft_vocab_size == len(ids)
    drafter = MTPDrafter(head, with_mtp.model, mode="chain", policy=False, head_seconds=0.0)
    rec = ProposalRecorder(drafter)
    got = generate(with_mtp, prompt, drafter, 3, max_tokens=30, ignore_eos=True)
    assert got.ids == truth and got.stats.drafted > 0
    assert {t for _, proposal in rec.log for t in proposal} <= set(ids.tolist())
    seeded = {"temperature": 0.8, "seed": 9}
    want = generate(with_mtp, prompt, max_tokens=30, ignore_eos=True, **seeded).ids
    drafter = MTPDrafter(head, with_mtp.model, mode="tree", policy=False, head_seconds=0.0)
    assert generate(with_mtp, prompt, drafter, 4, max_tokens=30, ignore_eos=True, **seeded).ids == want


# ------------------------------------------------------------- the native Gated DeltaNet step


@pytest.mark.skipif(active_kernels() is None, reason="the native Gated DeltaNet step is one of the CPU kernels")
@pytest.mark.parametrize("tiled", [False, True])
def test_native_delta_rows_equal_the_torch_rows_and_each_row_alone(hybrid: LoadedModel, tiled: bool) -> None:
    """``gated_delta_rows`` (one native call per layer and pass) against the torch rows it replaces,
    on random inputs and random start states, for a pass holding a chain, a tree and a second
    sequence: the same results within fp32 rounding. Each row computed alone, handed its parent's
    state, gives bitwise the row of the pass (batch invariance; a row continued by the next is read in
    the pass that writes it), and the AVX2 build gives the AVX-512 build's bits."""
    layer = copy.deepcopy(next(m for m in hybrid.model.modules() if isinstance(m, GatedDeltaNet)))
    layer.tiled = tiled
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in (layer.A_log, layer.dt_bias, layer.norm.weight):
            p.copy_(torch.randn(p.shape, generator=gen))
    parents = [-1, 0, 1, 1, 3, -1, 5]  # a chain, a branch at row 1, and a second sequence from row 5
    t, c, v = len(parents), layer.conv_dim, layer.value_dim
    mixed, z = torch.randn(t, c, generator=gen), torch.randn(t, v, generator=gen)
    b, a = torch.randn(t, layer.nv, generator=gen), torch.randn(t, layer.nv, generator=gen) * 3
    starts = [(torch.randn(c, layer.kernel - 1, generator=gen), torch.randn(layer.nv, layer.dk, layer.dv, generator=gen))
              for _ in range(2)]
    mod = active_kernels()

    def native(rows: list[int], parents: list[int], starts: list[Any],
               keep: list[bool] | None = None) -> tuple[torch.Tensor, list[Any]]:
        out, *s = mod.gated_delta_rows(
            mixed[rows].contiguous(), z[rows].contiguous(), b[rows].contiguous(), a[rows].contiguous(),
            layer.conv1d.weight, -layer.A_log.exp(), layer.dt_bias, layer.norm.weight, layer.norm.eps,
            layer.nk, layer.dk, layer.nv, layer.dv, tiled, parents, [x for x, _ in starts], [m for _, m in starts],
            [True] * len(rows) if keep is None else keep)
        return out, list(zip(s[: len(rows)], s[len(rows):], strict=True))

    with torch.no_grad():
        out, got = native(list(range(t)), parents, starts)
        want_out, want = layer._rows(mixed, z, b, a, parents, starts)
    assert out.abs().max() > 0.1  # (not vanishing: the comparison below means something)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for (gc, gm), (wc, wm) in zip(got, want, strict=True):
        assert torch.equal(gc, wc)  # (the window moves on: copies, no arithmetic)
        torch.testing.assert_close(gm, wm, rtol=1e-5, atol=1e-5)
    for i, p in enumerate(parents):  # each row alone, continuing the state its parent left
        start = got[p] if p >= 0 else starts[parents[:i].count(-1)]
        alone, [state] = native([i], [-1], [start])
        assert torch.equal(alone[0], out[i]) and torch.equal(state[1], got[i][1]), i
    # Keeping only some rows' states (a prefill chunk keeps its last): the same bits, the others'
    # states continued in place. Row 1, continued by row 3 out of order, is kept anyway.
    keep = [False, False, False, False, True, False, True]
    few, some = native(list(range(t)), parents, starts, keep)
    assert torch.equal(few, out)
    assert [s is not None for s, _ in some] == [False, True, False, False, True, False, True]
    for (fc, fm), (gc, gm) in zip(some, got, strict=True):
        assert fc is None or (torch.equal(fc, gc) and torch.equal(fm, gm))
    # The AVX2 build of the delta rule (QUICKDRAFT_ISA=avx2) gives the AVX-512 build's bits.
    prev = kernels.set_isa("avx2")
    try:
        narrow, states = native(list(range(t)), parents, starts)
    finally:
        kernels.set_isa(prev)
    assert torch.equal(narrow, out)
    assert all(torch.equal(nm, gm) for (_, nm), (_, gm) in zip(states, got, strict=True))


@pytest.mark.skipif(active_kernels() is None, reason="the native Gated DeltaNet step is one of the CPU kernels")
def test_native_delta_rows_refuse_bad_shapes_with_a_message(hybrid: LoadedModel) -> None:
    layer = next(m for m in hybrid.model.modules() if isinstance(m, GatedDeltaNet))
    mod = active_kernels()
    z = torch.zeros(1, layer.value_dim)
    b = a = torch.zeros(1, layer.nv)
    bad_state = torch.zeros(layer.nv, layer.dk, layer.dv + 1)
    with pytest.raises(RuntimeError, match="start state"):
        mod.gated_delta_rows(torch.zeros(1, layer.conv_dim), z, b, a, layer.conv1d.weight, layer.A_log, layer.dt_bias,
                             layer.norm.weight, 1e-6, layer.nk, layer.dk, layer.nv, layer.dv, False, [-1],
                             [torch.zeros(layer.conv_dim, layer.kernel - 1)], [bad_state], [True])
    with pytest.raises(RuntimeError, match="parent comes before"):
        mod.gated_delta_rows(torch.zeros(1, layer.conv_dim), z, b, a, layer.conv1d.weight, layer.A_log, layer.dt_bias,
                             layer.norm.weight, 1e-6, layer.nk, layer.dk, layer.nv, layer.dv, False, [0], [], [], [True])


def test_the_native_and_torch_steps_give_the_same_logits(hybrid: LoadedModel) -> None:
    """A whole forward on the native step (where the kernels are built) and on the torch rows
    (reference mode): the same logits within fp32 rounding."""
    ids = [(7 * i + 3) % hybrid.config.vocab_size for i in range(40)]
    native = logits(hybrid, ids)
    with reference_mode():
        ref = logits(hybrid, ids)
    torch.testing.assert_close(native, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("ssm.time_step_rank", None, ["lacks", "qwen35.ssm.time_step_rank"]),
    ("ssm.inner_size", 33, ["inconsistent", "qwen35.ssm.inner_size", "33", "time_step_rank"]),
    ("ssm.group_count", 3, ["inconsistent", "qwen35.ssm.group_count", "3"]),
    ("ssm.state_size", 0, ["qwen35.ssm.state_size", "positive"]),
])
def test_inconsistent_hybrid_metadata_is_one_line_naming_the_key_and_file(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    key: str, value: Any, words: list[str],
) -> None:
    """A Qwen3.5 GGUF whose Gated DeltaNet keys are missing or disagree: ``quickdraft generate``
    says so in one line naming the key and the file, exit 2, no traceback."""
    from quickdraft.cli.main import main
    from quickdraft.loading import gguf as gguf_io

    path = qwen3_5_to_gguf(folders["hybrid"], tmp_path / "broken.gguf")
    real = gguf_io.metadata

    def edited(reader: Any) -> dict[str, Any]:
        meta = dict(real(reader))
        if value is None:
            del meta[f"qwen35.{key}"]
        else:
            meta[f"qwen35.{key}"] = value
        return meta

    monkeypatch.setattr(gguf_io, "metadata", edited)
    assert main(["generate", "--model", str(path), "--max-tokens", "2", "hello"]) == 2
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if not line.startswith("loading ")]
    assert line.startswith("error: broken.gguf:") and "Traceback" not in err, err
    for word in words:
        assert word in line, (word, line)
