"""Mixture-of-experts models: mixtral, qwen2_moe, qwen3_moe and the Llama 4 text model.

Tiny random checkpoints are built and saved by transformers and loaded by quickdraft's own
loader, so config parsing, the checkpoint layouts (per-expert, stacked, Llama 4's fused experts),
routing and the forward pass are checked together against transformers' logits (fp32). Then the
cache paths (prefill + decode, chunks crossing Llama 4's attention chunks, rollback), the batch
invariance that keeps speculation lossless (the MoE block and the whole model, bitwise, in fp32
and bf16). mixtral, qwen2_moe, qwen3_moe and llama4 are rows of tests/test_families.py, which
runs greedy speculative decoding through the engine (scripted drafts, trees, n-gram lookup, draft
models) against plain decoding for every family.

One compute thread, as in test_spec.py: tiny passes on a busy 2-core machine are faster so.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_close, check_scripted, make_case, model_pass
from safetensors.torch import save_file
from tiny import (
    MOE_CASES,
    hf_to_gguf,
    load_reference,
    make_moe_model,
    moe_config,
    randomize,
    reference_logits,
    write_tokenizer,
)

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.layers import MLP
from quickdraft.models.moe import SparseMoE, convert_expert_layouts, route
from quickdraft.quant.ggml import GGMLLinear

TEXT = "def fibonacci(n):\n    return the quick brown fox!"



pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module


class Tiny:
    """One tiny MoE checkpoint loaded by quickdraft and by transformers, with reference logits."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.loaded: LoadedModel = load_model(str(folder), dtype="float32", max_context=256)
        self.reference = load_reference(folder)
        self.ids = self.loaded.tokenizer.encode(TEXT)
        self.expected = reference_logits(self.reference, self.ids)

    @property
    def model(self) -> Any:
        return self.loaded.model

    def full(self, ids: list[int] | None = None) -> torch.Tensor:
        logits, _ = self.model(torch.tensor(self.ids if ids is None else ids), self.model.new_cache())
        return logits


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe")


_TINY: dict[str, Tiny] = {}


@pytest.fixture(scope="module")
def tiny(root: Path) -> Iterator[Any]:
    """``tiny(name)``: MOE_CASES[name] built and loaded once per module."""

    def get(name: str) -> Tiny:
        if name not in _TINY:
            _TINY[name] = Tiny(make_moe_model(root, name))
        return _TINY[name]

    yield get
    _TINY.clear()


# ----------------------------------------------------------------------- logits vs transformers


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_logits_match_transformers(tiny: Any, name: str) -> None:
    t = tiny(name)
    assert 12 <= len(t.ids) <= 20
    logits = t.full()
    assert logits.dtype == torch.float32
    assert logits.shape == (len(t.ids), t.loaded.config.vocab_size)
    assert_close(logits, t.expected)
    assert torch.equal(logits.argmax(-1), t.expected.argmax(-1))


def sparse_layers(model: CausalLM) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]


def test_cases_exercise_what_they_claim(tiny: Any) -> None:
    """Guards against silent defaults: the configs and built models have the features named."""
    mixtral = tiny("mixtral").model
    assert sparse_layers(mixtral) == [0, 1]
    assert mixtral.model.layers[0].mlp.routing == "topk_softmax"
    assert len(mixtral.model.layers[0].mlp.experts) == 4

    qwen2 = tiny("qwen2_moe")
    assert sparse_layers(qwen2.model) == [0, 2] and isinstance(qwen2.model.model.layers[1].mlp, MLP)
    block = qwen2.model.model.layers[0].mlp
    assert block.shared_expert is not None and block.shared_expert_gate is not None
    assert qwen2.loaded.config.attention_bias and not qwen2.loaded.config.norm_topk_prob
    step2 = tiny("qwen2_moe-step2")
    assert sparse_layers(step2.model) == [1] and step2.loaded.config.norm_topk_prob
    assert step2.model.lm_head.weight.data_ptr() == step2.model.model.embed_tokens.weight.data_ptr()

    qwen3 = tiny("qwen3_moe").loaded.config
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.num_experts == 8
    assert qwen3.shared_expert_intermediate_size == 0
    assert tiny("qwen3_moe").model.model.layers[0].mlp.shared_expert is None

    llama4 = tiny("llama4")
    cfg = llama4.loaded.config
    assert sparse_layers(llama4.model) == [1, 3] and cfg.intermediate_size == 128
    assert cfg.family.attention_chunk_size == 8 < len(llama4.ids)
    attn = [layer.self_attn for layer in llama4.model.model.layers]
    assert [a.use_rope for a in attn] == [True, False, True, True]
    assert [a.chunk for a in attn] == [8, None, None, 8]
    assert attn[0].l2_eps is not None and attn[1].l2_eps is None and attn[1].temperature
    top2 = tiny("llama4-top2")
    assert sparse_layers(top2.model) == [0, 2] and top2.loaded.config.num_experts_per_tok == 2
    assert top2.model.model.layers[0].self_attn.o_proj.bias is not None


def test_llama4_features_change_the_logits(tiny: Any) -> None:
    """Each Llama 4 feature the tiny case has (chunked attention, a NoPE layer, temperature tuning,
    L2 q/k norm) changes transformers' logits when switched off, so matching them tests it."""
    from transformers import AutoModelForCausalLM

    t = tiny("llama4")
    switches = {
        "layer_types": ["full_attention"] * 4,  # no chunks
        "no_rope_layers": [1, 1, 1, 1],
        "attn_temperature_tuning": False,
        "use_qk_norm": False,
    }
    for key, value in switches.items():
        config = t.reference.config.__class__.from_pretrained(str(t.folder))
        setattr(config, key, value)
        plain = AutoModelForCausalLM.from_pretrained(str(t.folder), config=config, dtype=torch.float32)
        other = reference_logits(plain.eval(), t.ids)
        assert float((other - t.expected).abs().max()) > 1e-2, key


def test_router_variants() -> None:
    """The three routings on hand-made logits: which experts, which weights."""
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    w, e = route("softmax_topk", logits, 2)
    p = torch.softmax(logits, -1)[0]
    assert e.tolist() == [[0, 2]] and torch.allclose(w[0], p[[0, 2]])
    w, e = route("softmax_topk", logits, 2, renormalize=True)
    assert torch.allclose(w[0], p[[0, 2]] / p[[0, 2]].sum())
    w, e = route("topk_softmax", logits, 2)
    assert e.tolist() == [[0, 2]] and torch.allclose(w[0], torch.softmax(torch.tensor([2.0, 1.0]), -1))
    w, e = route("sigmoid_input", logits, 1)
    assert e.tolist() == [[0]] and torch.allclose(w[0], torch.sigmoid(torch.tensor([2.0])))


# ------------------------------------------------------------------------ checkpoint layouts


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_stacked_expert_checkpoint_loads(tiny: Any, root: Path, name: str) -> None:
    """transformers 5 keeps experts stacked in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]);
    ``save_pretrained`` writes them per expert. A checkpoint written from the in-memory state dict
    loads to the very same model."""
    t = tiny(name)
    state = t.reference.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)  # the stacked layout really is tested
    folder = root / f"{name}-stacked"
    folder.mkdir(exist_ok=True)
    shutil.copy(t.folder / "config.json", folder / "config.json")
    write_tokenizer(folder)
    tied = t.loaded.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}, str(folder / "model.safetensors"))
    stacked = load_model(str(folder), dtype="float32", max_context=256)
    logits, _ = stacked.model(torch.tensor(t.ids), stacked.model.new_cache())
    assert torch.equal(logits, t.full())


def test_expert_layout_conversion_by_hand() -> None:
    """Names and slices of every layout: mixtral's w1/w3/w2, stacked [E, 2I, H], Llama 4's
    input-major [E, H, 2I], a full Llama 4 checkpoint's prefixes and vision tower."""
    from quickdraft.models import llama4, mixtral

    w = [torch.randn(3, 2) for _ in range(3)]
    legacy = [(f"model.layers.0.block_sparse_moe.experts.1.{n}.weight", x) for n, x in zip(("w1", "w3", "w2"), w, strict=True)]
    out = dict(convert_expert_layouts(legacy, mixtral.CausalLM.checkpoint_renames))
    assert list(out) == [f"model.layers.0.mlp.experts.1.{p}_proj.weight" for p in ("gate", "up", "down")]
    assert all(torch.equal(a, b) for a, b in zip(out.values(), w, strict=True))

    gate_up = torch.randn(2, 6, 4)  # E=2, I=3, H=4
    out = dict(convert_expert_layouts([("m.layers.0.mlp.experts.gate_up_proj", gate_up)]))
    assert torch.equal(out["m.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out["m.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])

    fused = torch.randn(2, 4, 6)  # Llama 4: [E, H, 2I]
    down = torch.randn(2, 3, 4)  # [E, I, H]
    names = [
        ("language_model.model.layers.1.feed_forward.experts.gate_up_proj", fused),
        ("language_model.model.layers.1.feed_forward.experts.down_proj", down),
        ("language_model.model.layers.1.feed_forward.router.weight", torch.randn(2, 4)),
        ("vision_model.patch_embedding.linear.weight", torch.randn(2, 2)),
        ("multi_modal_projector.linear_1.weight", torch.randn(2, 2)),
    ]
    cls = llama4.CausalLM
    out = dict(convert_expert_layouts(names, cls.checkpoint_renames, cls.checkpoint_skip, cls.stacked_input_major))
    assert torch.equal(out["model.layers.1.mlp.experts.0.gate_proj.weight"], fused[0, :, :3].T)
    assert torch.equal(out["model.layers.1.mlp.experts.1.up_proj.weight"], fused[1, :, 3:].T)
    assert torch.equal(out["model.layers.1.mlp.experts.1.down_proj.weight"], down[1].T)
    assert "model.layers.1.mlp.gate.weight" in out
    assert not any("vision" in k or "projector" in k for k in out)


def test_full_llama4_checkpoint_runs_its_text_model(root: Path) -> None:
    """A "llama4" checkpoint (vision + text, text weights under ``language_model.``) loads as its
    text model and computes transformers' text-only logits."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    _, text = MOE_CASES["llama4"]
    text_config = moe_config("llama4_text", **text).to_dict()
    vision = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
    )
    torch.manual_seed(3)
    config = Llama4Config(text_config=text_config, vision_config=vision)
    model = Llama4ForConditionalGeneration(config).float().eval()
    randomize(model.language_model)
    folder = root / "llama4-full"
    model.save_pretrained(folder)
    write_tokenizer(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama4"
    loaded = load_model(str(folder), dtype="float32", max_context=256)
    ids = loaded.tokenizer.encode(TEXT)
    logits, _ = loaded.model(torch.tensor(ids), loaded.model.new_cache())
    # The text model inside (transformers 5.24's text-only call of the full model fails on its
    # output class; for text it runs exactly this module).
    expected = reference_logits(model.language_model, ids)
    assert_close(logits, expected)


def test_bad_moe_config_is_refused(root: Path) -> None:
    folder = make_moe_model(root, "mixtral", seed=9)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = 5  # more than the 4 experts
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuickdraftError, match="num_experts_per_tok"):
        load_model(str(folder), dtype="float32")


def test_missing_expert_tensor_is_reported(tiny: Any, root: Path) -> None:
    t = tiny("qwen3_moe")
    from safetensors.torch import load_file

    folder = root / "qwen3_moe-missing"
    folder.mkdir(exist_ok=True)
    shutil.copy(t.folder / "config.json", folder / "config.json")
    write_tokenizer(folder)
    state = load_file(str(t.folder / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(QuickdraftError, match="experts.5.up_proj"):
        load_model(str(folder), dtype="float32")


# ---------------------------------------------------------------------------------- cache paths


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_prefill_then_decode_equals_full_forward(tiny: Any, name: str) -> None:
    t = tiny(name)
    full = t.full()
    cache = t.model.new_cache()
    ids = torch.tensor(t.ids)
    parts = [t.model(ids[:5], cache)[0]]
    parts += [t.model(ids[i : i + 1], cache)[0] for i in range(5, len(t.ids))]
    assert_close(torch.cat(parts), full, rel=1e-5)


def test_llama4_chunks_across_passes_and_rollback(tiny: Any) -> None:
    """Chunk boundaries (every 8 positions) falling inside and between passes, and a rollback
    past a boundary: the logits stay those of the full forward."""
    t = tiny("llama4")
    full = t.full()
    ids = torch.tensor(t.ids)
    cache = t.model.new_cache()
    a, _ = t.model(ids[:6], cache)
    b, _ = t.model(ids[6:11], cache)  # crosses position 8
    c, _ = t.model(ids[11:], cache)  # crosses position 16
    assert_close(torch.cat([a, b, c]), full, rel=1e-5)
    cache.truncate(7)
    t.model((ids[7:] + 5) % t.loaded.tokenizer.vocab_size, cache)  # wrong tokens past the boundary
    cache.truncate(7)
    again = torch.cat([t.model(ids[i : i + 1], cache)[0] for i in range(7, len(t.ids))])
    assert_close(again, full[7:], rel=1e-5)


@pytest.mark.parametrize("name", ["llama4", "qwen2_moe"])
def test_long_prefill_matches_transformers(tiny: Any, name: str) -> None:
    """Over 64 rows the pass takes the one-matmul path (Llama 4: the chunk mask over 9 chunks);
    decoding on from there uses the per-row path. Both match transformers."""
    t = tiny(name)
    ids = (t.ids * 6)[:80]
    expected = reference_logits(t.reference, ids)
    cache = t.model.new_cache()
    head, _ = t.model(torch.tensor(ids[:70]), cache)
    tail = [t.model(torch.tensor(ids[i : i + 1]), cache)[0] for i in range(70, 80)]
    assert_close(torch.cat([head, *tail]), expected)


# ------------------------------------------------------------------------------ batch invariance


def block_config(routing: str) -> ModelConfig:
    return ModelConfig(
        model_type="test", vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=1 if routing == "sigmoid_input" else 2, moe_intermediate_size=64,
        shared_expert_intermediate_size=0 if routing == "topk_softmax" else 128, norm_topk_prob=True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax", "sigmoid_input"])
def test_moe_block_rows_are_batch_invariant(routing: str, dtype: torch.dtype) -> None:
    """A row's output is bitwise the same alone, among 8 others, or in any other group of rows
    (40 rows in groups of every size: narrow sigmoids, e.g. of the [T, 1] shared-expert gate,
    differ in the last bit with T unless computed row-padded)."""
    torch.manual_seed(0)
    block = SparseMoE(block_config(routing), routing, shared_expert_gate=routing == "softmax_topk")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    block = block.to(dtype)
    x = torch.randn(40, 64, dtype=dtype)
    with torch.inference_mode():
        alone = torch.cat([block(x[i : i + 1]) for i in range(40)])
        groups = {(a, b): block(x[a:b]) for a in range(0, 40, 7) for b in range(a + 1, 41, 2)}
    used = {e for row in route(routing, block.gate(x), block.top_k)[1].tolist() for e in row}
    assert len(used) > 2  # the rows really are spread over several experts
    assert torch.equal(groups[(0, 9)], alone[:9])  # one row among 8 others
    for (a, b), out in groups.items():
        assert torch.equal(out, alone[a:b]), f"rows {a}:{b}"


def check_rows_bitwise(model: CausalLM, prompt: list[int], seq: list[int], rows: list[int], offsets: list[int]) -> None:
    """Logits of each position decoded alone == the same position inside an r-row pass, bitwise."""
    cache = model.new_cache()
    model(torch.tensor(prompt), cache, num_logits=1)
    base = cache.length
    alone = [model(torch.tensor([tok]), cache)[0][0] for tok in seq]
    for off in offsets:
        for r in rows:
            cache.truncate(base + off)
            logits, _ = model(torch.tensor(seq[off : off + r]), cache)
            for i in range(r):
                assert torch.equal(logits[i], alone[off + i]), f"row {i} of {r} at offset {off}"


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_model_rows_are_batch_invariant(tiny: Any, name: str) -> None:
    t = tiny(name)
    check_rows_bitwise(t.model, t.ids[:5], t.ids[5:], [2, 4, 9], [0, 3])


def test_bf16_rows_are_batch_invariant(root: Path) -> None:
    """The shipped dtype for safetensors checkpoints."""
    folder = make_moe_model(root, "llama4", seed=4)
    loaded = load_model(str(folder), dtype="bfloat16", max_context=128)
    assert loaded.model.model.layers[1].mlp.experts[0].gate_proj.weight.dtype == torch.bfloat16
    ids = loaded.tokenizer.encode(TEXT)
    check_rows_bitwise(loaded.model, ids[:4], ids[4:], [3, 9], [0, 2])


def test_llama4_tree_rows_match_chains(tiny: Any) -> None:
    """A draft tree across a chunk boundary: [root] + two branches of three nodes, one pass with
    tree positions and mask. Each row's logits equal that path decoded as a chain, bitwise."""
    t = tiny("llama4")
    model, ids = t.model, t.ids
    prefix, root_tok = ids[:6], ids[6]  # root at position 6, nodes at 7, 8, 9: chunk 0 -> 1
    branches = [ids[7:10], [(x + 11) % 300 for x in ids[7:10]]]
    tokens = [root_tok, *branches[0], *branches[1]]
    positions = torch.tensor([6, 7, 8, 9, 7, 8, 9])
    parents = [-1, 0, 1, 2, 0, 4, 5]
    mask = torch.zeros(7, 6 + 7, dtype=torch.bool)
    mask[:, :6] = True
    for i in range(7):
        j = i
        while j >= 0:
            mask[i, 6 + j] = True
            j = parents[j]
    cache = model.new_cache()
    model(torch.tensor(prefix), cache)
    tree, _ = model_pass(model, torch.tensor(tokens), cache, positions, mask)
    for branch, rows in zip(branches, ([0, 1, 2, 3], [0, 4, 5, 6]), strict=True):
        cache.truncate(6)
        chain = [model(torch.tensor([tok]), cache)[0][0] for tok in [root_tok, *branch]]
        for row, logits in zip(rows, chain, strict=True):
            assert torch.equal(tree[row], logits), f"tree row {row}"


def test_moe_config_defaults_leave_dense_models_alone() -> None:
    cfg = ModelConfig.from_hf_dict(
        {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2}
    )
    dense = dataclasses.asdict(cfg)
    assert dense["num_experts"] == 0 and dense["num_experts_per_tok"] == 0 and dense["moe_intermediate_size"] == 0
    assert dense["family"] == {}  # none of Llama 4's chunked attention, NoPE layers, q/k L2 norm, temperature


# ------------------------------------------------------------------------------------ GGUF


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_gguf_moe_matches_transformers_and_keeps_expert_blocks(tmp_path: Path, name: str) -> None:
    """A Qwen MoE GGUF as llama.cpp writes it (qwen2moe / qwen3moe: stacked ffn_*_exps, router,
    shared expert and its gate, expert_* keys; a layer with a plain MLP stays dense) gives
    transformers' logits; with Q8_0 experts every expert stays in its blocks and speculation
    equals plain decoding."""
    folder = make_moe_model(tmp_path, name, seed=4)
    path = hf_to_gguf(folder, tmp_path / f"{name}.gguf")
    loaded = load_model(str(path), dtype="float32", max_context=256)
    want = load_model(str(folder), dtype="float32", max_context=256).config
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "mlp_only_layers"):
        assert getattr(loaded.config, field) == getattr(want, field), field
    ids = loaded.tokenizer.encode(TEXT)
    got, _ = loaded.model(torch.tensor(ids), loaded.model.new_cache())
    assert_close(got, reference_logits(load_reference(folder), ids))
    path = hf_to_gguf(folder, tmp_path / f"{name}-q8.gguf", {"exps.weight": "Q8_0", "shexp.weight": "Q8_0"})
    quant = load_model(str(path), dtype="auto", max_context=256)
    moe = quant.model.model.layers[0].mlp
    assert all(isinstance(getattr(e, p), GGMLLinear) for e in moe.experts for p in ("gate_proj", "up_proj", "down_proj"))
    case = make_case(quant, TEXT[:60], 20)
    check_scripted(case, "partly", 4)
